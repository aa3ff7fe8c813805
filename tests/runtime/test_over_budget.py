"""The auto policy keeps its budget in the training loops users write (Note [every step over the
budget is said], Note [other lengths planned ahead], Note [settled plans]): a longer sequence
later, a new length every step, accumulated forwards, a retained graph, eval mode with gradients,
two models, a full host budget; and where it cannot, every step over it is counted and said.

On the simulated device, its memory counted but not capped (``ACTOFF_GPU_BUDGET`` is the
budget): each step's peak is compared with the budget. Forward and attention times are injected
(1 ms and 0.3 ms a block), as in test_auto.py: measured on a loaded machine they would change
the plans from run to run.
"""

import random
import warnings

import pytest
import torch
from _helpers import inject_times, keep_peak_of, make_model

import actoff
import actoff.runtime.measured
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime
from actoff.testing import simulated_device

# Every test enters a simulated device of its own (or none): once, in the plain pass.
pytestmark = pytest.mark.plain_pass_only

SEQ = 257


@pytest.fixture(autouse=True)
def _times(monkeypatch):
    inject_times(monkeypatch)


@pytest.fixture(scope="module")
def keep_peak() -> int:
    """The device peak of a step at ``SEQ`` under keep."""
    return keep_peak_of(SEQ)


def _auto(budget: int, model=None, **settings):
    model = model if model is not None else make_model(num_layers=4)
    actoff.offload_(
        model,
        block_cls=Block,
        policy="auto",
        min_bytes=0,
        host_bandwidth="10GB",
        gpu_budget=budget,
        **settings,
    )
    return model


def _run(step, steps: int) -> list[tuple[int, list[str], int]]:
    """``steps`` calls of ``step(i)`` on a fresh simulated device: per step its device peak, the
    blocks' placements and the replans so far."""
    out = []
    with simulated_device(seed=0) as device:
        for index in range(steps):
            device.memory.reset_peak()
            step(index)
            stats = actoff.stats()
            out.append((device.memory.peak, [b.placement for b in stats.blocks.values()], stats.replans))
    return out


def _tokens(length: int, generator: torch.Generator, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=generator)


def test_every_step_over_the_budget_is_counted_and_said(keep_peak):
    # A budget below the least any plan holds: every step is over it. Each is counted; the
    # warnings come at the 1st, 10th, 100th... step of each cause, not once per thread.
    budget = int(keep_peak * 0.1)
    model = _auto(budget)
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = _run(lambda i: model.loss(_tokens(SEQ, generator)).backward(), 12)
    assert all(peak > budget for peak, _, _ in steps)
    stats = actoff.stats()
    assert stats.steps_over_budget == 12 and sum(stats.over_budget_causes.values()) == 12
    assert set(stats.over_budget_causes) <= {"measuring", "floor", "probing", "planned"}
    assert stats.over_budget_peak_bytes == max(peak for peak, _, _ in steps)
    said = [w for w in caught if issubclass(w.category, actoff.BudgetWarning) and "peaked" in str(w.message)]
    expected = sum(
        sum(1 for power in (1, 10) if count >= power) for count in stats.over_budget_causes.values()
    )
    assert len(said) == expected
    floor = [w for w in caught if str(w.message).startswith("actoff: auto: no placement fits")]
    assert len(floor) == 1  # said before the step at the floor runs, once for these blocks
    assert "step(s) over the budget" in str(stats)
    assert stats.replans <= 1  # the same plan at the floor again is not a replan


def test_a_longer_sequence_later_is_planned_before_it_runs(keep_peak):
    budget = int(keep_peak * 0.5)
    model = _auto(budget)
    generator = torch.Generator().manual_seed(0)
    steps = _run(lambda i: model.loss(_tokens(SEQ if i < 5 else 2 * SEQ - 1, generator)).backward(), 8)
    for peak, _, _ in steps:  # it ran 1.2-1.3 times over the budget at the new length
        assert peak <= budget
    assert not any(p.startswith("measuring") for p in steps[5][1])  # the new length's first step ran a plan
    assert actoff.stats().steps_over_budget == 0


def test_a_new_length_every_step_runs_plans(keep_peak):
    # Dynamic padding: no length comes twice. Every step used to measure; now the second length
    # measures warm and the rest are planned ahead from the scaled figures.
    budget = int(keep_peak * 0.5)
    model = _auto(budget)
    generator, lengths = torch.Generator().manual_seed(0), random.Random(0).sample(range(150, 350), 7)
    steps = _run(lambda i: model.loss(_tokens(lengths[i], generator)).backward(), 7)
    assert all(peak <= budget for peak, _, _ in steps)
    for _, placements, _ in steps[2:]:
        assert not any(p.startswith("measuring") for p in placements), placements


def test_accumulated_forwards_are_one_step_planned_together(keep_peak):
    # Two forwards summed, one backward: one step of twice the blocks (the second forward used
    # to begin a new step: the plans of the two halves took turns, replanned every step).
    budget = int(keep_peak * 0.6)
    model = _auto(budget)
    generator = torch.Generator().manual_seed(0)

    def step(_):
        loss = model.loss(_tokens(SEQ, generator)) + model.loss(_tokens(SEQ, generator))
        loss.backward()

    steps = _run(step, 8)
    assert len(get_runtime().step.runs) == 8  # one step of both forwards
    assert all(peak <= budget for peak, _, _ in steps[2:])
    assert steps[-1][2] == steps[-3][2]  # the plan settled: no replans in the last steps


def test_accumulated_forwards_are_exact():
    # The one step holding both forwards gives the same gradients, bit for bit (cpu: stored whole).
    reference = make_model(num_layers=2)
    model = make_model(num_layers=2)
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    generator = torch.Generator().manual_seed(0)
    with simulated_device(seed=0):
        for _ in range(2):
            batches = [_tokens(33, generator) for _ in range(2)]
            (reference.loss(batches[0]) + reference.loss(batches[1])).backward()
            loss = model.loss(batches[0]) + model.loss(batches[1])
            assert len(get_runtime().step.runs) == 4  # both forwards in one step
            loss.backward()
    for (name, actual), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=0, atol=0, msg=name)


def test_a_retained_graph_is_planned_once_a_step(keep_peak):
    budget = int(keep_peak * 0.5)
    model = _auto(budget)
    generator = torch.Generator().manual_seed(0)

    def step(_):
        loss = model.loss(_tokens(SEQ, generator))
        loss.backward(retain_graph=True)
        loss.backward()

    steps = _run(step, 7)
    assert all(peak <= budget for peak, _, _ in steps[3:])  # 2-3x over during measuring before
    assert steps[-1][2] == steps[-3][2]  # replanned every step before, twice


def test_eval_mode_with_gradients_is_placed(keep_peak):
    # RL and distillation loops train in eval mode (dropout off): nothing was offloaded, 1.8x over.
    budget = int(keep_peak * 0.5)
    model = _auto(budget)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    steps = _run(lambda i: model.loss(_tokens(SEQ, generator)).backward(), 5)
    assert all(peak <= budget for peak, _, _ in steps)
    assert actoff.stats().total_bytes_offloaded > 0


def test_two_models_in_one_process_each_keep_the_budget(keep_peak):
    budget = int(keep_peak * 0.5)
    models = [_auto(budget, make_model(seed, num_layers=4)) for seed in (0, 1)]
    generator = torch.Generator().manual_seed(0)

    def step(_):
        for model in models:
            model.loss(_tokens(SEQ, generator)).backward()

    steps = _run(step, 5)
    assert all(peak <= budget for peak, _, _ in steps)


def test_a_full_host_budget_is_said(keep_peak):
    # Saves the host budget cannot take stay on the device (the blocks' inputs, under a budget
    # below even the checkpoint floor's): said once by the tier, and every step over the device
    # budget for it is said with that cause.
    budget = int(keep_peak * 0.25)
    model = _auto(budget, host_budget="64KiB")
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(lambda i: model.loss(_tokens(SEQ, generator)).backward(), 4)
    assert len([w for w in caught if "the host budget (ACTOFF_HOST_BUDGET) is full" in str(w.message)]) == 1
    assert actoff.stats().over_budget_causes.get("host budget", 0) >= 1
