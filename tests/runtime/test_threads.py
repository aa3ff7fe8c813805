"""Threads that train models of their own side by side, under every policy, on the plain CPU
device and on the simulated one (whose streams they share, as threads share a GPU's).

Found by a hostile-user test: two threads training under ``tokenwise`` on the simulated device
shared the runtime's step, and one died in backward (``TypeError: 'NoneType' object is not
subscriptable`` in ``scatter_rows``) in 2 to 3 runs of 3 (Note [a runtime per thread]). Each
thread's losses and gradients must equal those of the same training run alone, bit for bit;
``auto`` picks its stored fraction from timings measured in the first step, so runs alone and
side by side may pick others and are compared with the no-actoff run within float32
reassociation instead (Note [reassociation tolerance] in _helpers). Without a budget ``auto``
keeps every block and never plans; under a budget below keep's peak each thread's runtime
plans its own blocks (`test_auto_plans_under_a_budget_in_each_thread`).
"""

import threading

import pytest
import torch
from _helpers import assert_close_history, assert_same_history, make_model, train

import actoff
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime
from actoff.testing import simulated_device

POLICIES = ["keep", "cpu", "nvme", "tokenwise", "recompute", "auto"]
DEVICES = [
    pytest.param("plain", marks=pytest.mark.no_sim_device),
    pytest.param("sim", marks=pytest.mark.sim_device),
]
SEEDS = (0, 1)


@pytest.fixture
def one_intra_op_thread():
    """Two Python threads each running OpenMP-parallel kernels would leave how many threads a
    reduction is split over (and so its rounding) to timing: kernels run on one thread each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _offloaded(seed: int, policy: str, nvme_dir: str, device: str = "cpu") -> torch.nn.Module:
    # Built in the calling thread: torch's default generator is the process's, shared by threads.
    model = make_model(seed).to(device)
    fractions = {"cpu_fraction": 0.25, "nvme_fraction": 0.25} if policy == "tokenwise" else {}
    actoff.offload_(model, block_cls=Block, policy=policy, nvme_dir=nvme_dir, min_bytes=0, **fractions)
    return model


def _side_by_side(models: list[torch.nn.Module], run=lambda model: train(model, 2)) -> list:
    """``run(model)`` of each model in a thread of its own, at once; their results in order."""
    histories: list = [None] * len(models)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            histories[index] = run(models[index])
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a training thread hangs"
    if errors:
        raise errors[0]
    return histories


@pytest.mark.parametrize(
    "repeats", [pytest.param(5, id="5x"), pytest.param(50, id="50x", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
def test_two_threads_train_as_each_would_alone(nvme_dir, one_intra_op_thread, device, policy, repeats):
    if policy == "auto":
        expected = [train(make_model(seed), 2) for seed in SEEDS]  # without actoff
    else:
        expected = [train(_offloaded(seed, policy, nvme_dir), 2) for seed in SEEDS]
    for _ in range(repeats):
        actoff.reset()
        actual = _side_by_side([_offloaded(seed, policy, nvme_dir) for seed in SEEDS])
        for alone, beside in zip(expected, actual, strict=True):
            if policy == "auto":
                assert_close_history(alone, beside)
            else:
                assert_same_history(alone, beside)


@pytest.mark.sim_device
@pytest.mark.no_sim_memory
def test_auto_plans_under_a_budget_in_each_thread(one_intra_op_thread):
    # Half of one model's device peak under keep: keep does not fit, so each thread's planner
    # must place its blocks (the first two steps measure, the next ones run the plan). The
    # shared device does not count memory: counted, each thread's peaks would hold the other's
    # activations too, as on one GPU, and what the other holds at a moment is timing.
    seq, steps = 257, 4
    model = make_model(0)
    actoff.offload_(model, block_cls=Block, policy="keep", min_bytes=0)
    with simulated_device(seed=0) as device:
        train(model, 1, seq=seq)
    budget = device.memory.peak // 2
    actoff.reset()
    expected = [train(make_model(seed), steps, seq=seq) for seed in SEEDS]  # without actoff
    models = [make_model(seed) for seed in SEEDS]
    for model in models:
        actoff.offload_(model, block_cls=Block, policy="auto", min_bytes=0, gpu_budget=budget)

    def run(model: torch.nn.Module) -> tuple:
        history = train(model, steps, seq=seq)
        stats = actoff.stats()  # this thread's runtime
        return history, stats, [block.placement for block in stats.blocks.values()]

    for alone, (beside, stats, placements) in zip(expected, _side_by_side(models, run), strict=True):
        assert_close_history(alone, beside)
        assert stats.plan != "none" and stats.budget_bytes == budget, stats.plan
        assert stats.predicted_peak_bytes <= budget
        assert placements != ["keep"] * len(placements) and "measuring (recompute)" not in placements


def test_each_thread_has_its_own_runtime_and_reset_closes_them_all(nvme_dir):
    runtimes, models = [], [_offloaded(seed, "nvme", nvme_dir) for seed in SEEDS]

    def work(model: torch.nn.Module) -> None:
        train(model, 1)
        runtime = get_runtime()
        runtimes.append((runtime, runtime.stores.stores()[0], actoff.stats().total_bytes_offloaded))

    threads = [threading.Thread(target=work, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    (first, first_store, first_bytes), (second, second_store, second_bytes) = runtimes
    assert first is not second and first is not get_runtime() and first_store is not second_store
    assert first_bytes > 0 and second_bytes > 0  # each thread's figures, in that thread
    assert actoff.stats().steps == 0  # this thread trained nothing
    actoff.reset()
    assert first_store.file.fd == -1 and second_store.file.fd == -1


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "nvme", "tokenwise"])
def test_two_threads_on_a_gpu_train_as_each_would_alone(nvme_dir, policy):
    # One GPU, actoff's copy streams shared by both threads, each thread's own runtime.
    expected = [train(_offloaded(seed, policy, nvme_dir, "cuda"), 2) for seed in SEEDS]
    for _ in range(5):
        actoff.reset()
        actual = _side_by_side([_offloaded(seed, policy, nvme_dir, "cuda") for seed in SEEDS])
        for alone, beside in zip(expected, actual, strict=True):
            assert_same_history(alone, beside)
