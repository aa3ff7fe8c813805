"""Processes forked from a process that offloads: they exit at once however they exit, never
touch the parent's I/O threads or files, and get a runtime of their own if they offload.

Found by a hostile-user test: after the nvme tier had been used, a child made by ``os.fork()``
that left through ``sys.exit`` hung in the I/O engine's close (1 to 3 children in 3), and so
did children sent SIGTERM, as ``multiprocessing``'s ``terminate()`` does (2 in 2, until
SIGKILL). Each case runs in a fresh interpreter (a child of the test process itself would go
on running the test session), 20 times, with 5 s per child before it counts as hung; on the
plain CPU device and on the simulated one, whose worker threads the child does not have either.
Children set ``torch.set_num_threads(1)`` first, as DataLoader workers do: OpenMP's thread pool
does not survive a fork, with or without actoff.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from _helpers import ROOT

# Each case runs its subprocess on both devices itself (DEVICES): once, in the plain pass.
pytestmark = [pytest.mark.nvme, pytest.mark.plain_pass_only]

REPEATS = 10  # forks per case: 60 children over the cases on each device
HANG_S = 5.0

DEVICES = [pytest.param("0", id="plain"), pytest.param("1", id="sim")]

# The parent trains a step under nvme, then leaves a forward's writes in flight while it forks.
_PARENT = """
import copy, os, signal, sys, time
sys.path.insert(0, {tests!r})
import torch
import actoff
from _helpers import assert_same_history, make_model, train
from actoff.reference import Block

NVME_DIR, REPEATS, HANG_S = {nvme_dir!r}, {repeats}, {hang_s}
model = make_model()
reference = copy.deepcopy(model)
actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=NVME_DIR, min_bytes=0)
expected = train(reference, 1) + train(reference, 1)  # train() draws the same tokens per call
actual = train(model, 1)


def wait_for(pid):
    # Seconds until the child exited (HANG_S and a SIGKILL when it did not).
    start = time.monotonic()
    while time.monotonic() - start < HANG_S:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return time.monotonic() - start, os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return HANG_S, None
"""


def _run(body: str, nvme_dir: str, sim_device: str, timeout: float = 300.0) -> str:
    script = textwrap.dedent(_PARENT).format(
        tests=os.path.join(ROOT, "tests"), nvme_dir=nvme_dir, repeats=REPEATS, hang_s=HANG_S
    ) + textwrap.dedent(body)
    env = {**os.environ, "ACTOFF_SIM_DEVICE": sim_device}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _report(stdout: str) -> tuple[int, float]:
    line = next(line for line in stdout.splitlines() if line.startswith("HUNG"))
    _, hung, _, slowest = line.split()
    print(line)  # in the test log: the slowest child
    return int(hung), float(slowest)


@pytest.mark.parametrize("sim_device", DEVICES)
@pytest.mark.parametrize("how", ["sys.exit", "os._exit", "SIGTERM"])
def test_forked_children_exit_at_once(nvme_dir, sim_device, how):
    stdout = _run(
        f"""
        loss = model.loss(torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1)))
        times, hung = [], 0
        for _ in range(REPEATS):
            pid = os.fork()
            if pid == 0:
                torch.set_num_threads(1)
                if {how!r} == "sys.exit":
                    sys.exit(0)  # exit handlers run
                if {how!r} == "os._exit":
                    os._exit(0)
                time.sleep(60)  # SIGTERM ends it
                os._exit(3)
            if {how!r} == "SIGTERM":
                time.sleep(0.02)
                os.kill(pid, signal.SIGTERM)
            seconds, code = wait_for(pid)
            hung += code is None
            times.append(seconds)
        loss.backward()  # the children touched nothing of the parent's (reads are sealed)
        print("HUNG", hung, "SLOWEST", max(times))
        """,
        nvme_dir,
        sim_device,
    )
    hung, slowest = _report(stdout)
    assert hung == 0 and slowest < HANG_S


@pytest.mark.parametrize("sim_device", DEVICES)
def test_a_child_offloads_with_a_runtime_of_its_own(nvme_dir, sim_device):
    stdout = _run(
        """
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            try:
                child_model = make_model()
                child_reference = copy.deepcopy(child_model)
                actoff.offload_(child_model, block_cls=Block, policy="nvme", nvme_dir=NVME_DIR, min_bytes=0)
                assert_same_history(train(child_reference, 2), train(child_model, 2))
                assert actoff.stats().total_bytes_offloaded > 0
                os.write(write, b"exact")
            finally:
                os.close(write)
            sys.exit(0)
        os.close(write)
        seconds, code = wait_for(pid)
        print("CHILD", os.read(read, 100).decode() or "failed", code)
        actual += train(model, 1)  # the parent goes on, exactly
        assert_same_history(expected, actual)
        print("PARENT exact")
        """,
        nvme_dir,
        sim_device,
    )
    assert "CHILD exact 0" in stdout and "PARENT exact" in stdout


def test_a_child_cannot_use_the_parents_activations(nvme_dir):
    stdout = _run(
        """
        loss = model.loss(torch.randint(0, 256, (2, 33)))
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            try:
                loss.backward()
            except RuntimeError as error:
                print("ERROR", error, flush=True)
            os._exit(0)
        wait_for(pid)
        loss.backward()
        """,
        nvme_dir,
        "0",
    )
    assert "was made by the parent process before os.fork()" in stdout


_POOL = """
import multiprocessing


def task(seed):  # trains a model of its own under nvme in the worker
    child_model = make_model(seed)
    actoff.offload_(child_model, block_cls=Block, policy="nvme", nvme_dir=NVME_DIR, min_bytes=0)
    return [loss.item() for loss, _ in train(child_model, 1)]


def forever(_):
    time.sleep(60)


want = {seed: [loss.item() for loss, _ in train(make_model(seed), 1)] for seed in (0, 1)}
context = multiprocessing.get_context("fork")
times, hung = [], 0
for _ in range(REPEATS):
    pool = context.Pool(2, initializer=torch.set_num_threads, initargs=(1,))
    got = pool.map_async(task, [0, 1]).get(60)
    assert got == [want[0], want[1]], (got, want)
    pool.map_async(forever, [0, 1])
    time.sleep(0.05)
    start = time.monotonic()
    pool.terminate()  # SIGTERM to every worker
    pool.join()
    times.append(time.monotonic() - start)
    hung += times[-1] >= HANG_S
print("HUNG", hung, "SLOWEST", max(times))
"""


@pytest.mark.parametrize("sim_device", DEVICES)
def test_a_fork_pool_trains_and_terminates_at_once(nvme_dir, sim_device):
    hung, slowest = _report(_run(_POOL, nvme_dir, sim_device, timeout=600.0))
    assert hung == 0 and slowest < HANG_S
