"""Soak: 160 steps under each policy; memory, descriptors, threads, arenas and the NVMe file
stay flat after warm-up, and the last step's gradients still match a run without actoff."""

import copy
import os
import threading

import pytest
import torch
from _helpers import make_model

import actoff
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime

STEPS = 160  # a leak shows in the counts compared exactly 140 steps apart as well as 280
WARMUP = 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _resources():
    runtime = get_runtime()
    return {
        "rss": _rss_bytes(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "arena": sum(a.capacity for a in runtime.arenas.values()),
        "arena_allocations": sum(a.num_allocations for a in runtime.arenas.values()),
        "nvme_file": runtime.stores.file_bytes(),
    }


def _last_step(model, steps, on_step=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(3)
    for step in range(steps):
        tokens = torch.randint(0, 256, (2, 33), generator=generator)
        loss = model.loss(tokens)
        loss.backward()
        if step == steps - 1:
            return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def baseline():
    model = make_model()
    initial = copy.deepcopy(model)
    return initial, _last_step(model, STEPS)


@pytest.mark.parametrize(
    ("policy", "extra"),
    [
        ("keep", {}),
        ("cpu", {}),
        ("nvme", {}),
        ("tokenwise", {"cpu_fraction": 0.25, "nvme_fraction": 0.25}),
        ("recompute", {}),
        # Under 2 blocks: offloads. The budget is for the blocks' bytes, as on a plain CPU device
        # (the simulated device would count the weights and logits against it too).
        pytest.param(
            "auto", {"host_bandwidth": "50MB", "gpu_budget": "560KiB"}, marks=pytest.mark.no_sim_device
        ),
    ],
)
def test_soak(policy, extra, baseline, nvme_dir):
    initial, (expected_loss, expected_grads) = baseline
    model = copy.deepcopy(initial)
    actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0, nvme_dir=nvme_dir, **extra)
    samples = {}

    def on_step(step):
        if step in (WARMUP, STEPS - 2):
            samples[step] = _resources()

    loss, grads = _last_step(model, STEPS, on_step)
    before, after = samples[WARMUP], samples[STEPS - 2]
    assert after["fds"] == before["fds"], (before, after)
    assert after["threads"] == before["threads"], (before, after)
    if os.environ.get("ACTOFF_SIM_DEVICE") == "1" and policy in ("nvme", "tokenwise"):
        # Known gap: on a device with DMA the host arena's plan counts on backward's NVMe read
        # slots and write-slot lifetimes, which depend on copy and disk timing; a step that
        # differs replans and allocates a new planned chunk. Memory stays bounded (checked).
        assert after["arena"] <= 2 * before["arena"], (before, after)
    else:
        assert after["arena"] == before["arena"]
        assert after["arena_allocations"] == before["arena_allocations"]
    assert after["nvme_file"] == before["nvme_file"]
    assert after["rss"] - before["rss"] < 48 * 2**20, (before, after)  # allocator noise, not a leak
    if policy in ("keep", "cpu", "nvme"):
        torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
        for name in grads:
            torch.testing.assert_close(grads[name], expected_grads[name], rtol=0, atol=0)
    else:  # recompute: float32 reassociation allowed (on this CPU it is exact)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        for name in grads:
            torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6)
    if policy in ("nvme", "tokenwise"):
        assert get_runtime().stores.stores()[0].extents.live_bytes == 0
