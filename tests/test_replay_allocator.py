"""The plan-replaying allocator core (csrc/replay_allocator.h) on host memory: record a step,
plan it, replay it at fixed offsets; divergence falls back and is counted, never overlaps."""

import random

import pytest
import torch

import actoff
from actoff.planner import Buffer, solve

if not actoff.HAS_EXTENSION:
    pytest.skip("the C++ extension is not built (ACTOFF_BUILD_EXT=0)", allow_module_level=True)

from actoff._C import HostReplayAllocator


def synthetic_sequence(seed=0, count=40):
    """A step-like sequence: allocations in forward order, frees mostly in reverse, some early."""
    rng = random.Random(seed)
    events, live = [], []
    for k in range(count):
        events.append(("alloc", k, rng.randint(1, 64) * 512))
        live.append(k)
        if rng.random() < 0.3 and len(live) > 1:
            events.append(("free", live.pop(rng.randrange(len(live) - 1)), None))
    events += [("free", k, None) for k in reversed(live)]
    return events


def run(allocator, events, arena=None, sizes_override=None, check=True):
    """Play ``events``; fill each buffer with its id and check none was overwritten."""
    addresses, sizes = {}, {}
    for kind, k, size in events:
        if kind == "alloc":
            size = (sizes_override or {}).get(k, size)
            address = allocator.allocate(size)
            addresses[k], sizes[k] = address, size
            if check:
                _view(address, size).fill_(k % 251)
        else:
            if check:
                assert bool((_view(addresses[k], sizes[k]) == k % 251).all()), f"buffer {k} was overwritten"
            allocator.deallocate(addresses[k])
    return addresses


def _view(address, size):
    # A uint8 tensor over raw memory we own (arena or fallback).
    import ctypes

    buffer = (ctypes.c_uint8 * size).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def record_and_plan(events):
    allocator = HostReplayAllocator()
    allocator.begin_record()
    run(allocator, events)
    log = allocator.end_record()
    buffers = [Buffer(size, start, end) for size, start, end in log]
    layout = solve(buffers, alignment=512)
    arena = torch.empty(layout.peak, dtype=torch.uint8)
    allocator.set_plan([b.size for b in buffers], list(layout.offsets), arena.data_ptr(), arena.numel())
    return allocator, layout, arena


def test_replay_serves_every_request_at_its_planned_offset():
    events = synthetic_sequence()
    allocator, layout, arena = record_and_plan(events)
    for _ in range(3):  # three steps: the same addresses every time
        allocator.begin_step()
        addresses = run(allocator, events)
        assert [addresses[k] - arena.data_ptr() for k in sorted(addresses)] == list(layout.offsets)
    stats = allocator.stats()
    assert stats["served"] == 3 * 40 and stats["diverged"] == 0 and stats["live"] == 0
    assert stats["fallback"] == 40  # only the recorded step


@pytest.mark.sim_device  # the host arena: copies happen on a device with DMA
def test_replay_of_a_recorded_model_trace():
    # Drive the allocator with the host-arena trace of a real training step.
    from actoff._runtime import get_runtime
    from actoff.reference import Block, ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", num_layers=4))
    actoff.offload_(model, block_cls=Block, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    tokens = torch.randint(0, 256, (2, 65))
    model.loss(tokens).backward()
    arena = next(iter(get_runtime().arenas.values()))
    arena.tracing = True
    model.loss(tokens).backward()
    trace = arena.take_trace()
    assert trace
    timeline = sorted([(start, "alloc", i, size) for i, (size, start, _, _) in enumerate(trace)]
                      + [(end, "free", i, None) for i, (_, _, end, _) in enumerate(trace)])  # fmt: skip
    events = [(kind, i, size) for _, kind, i, size in timeline]
    allocator, _, _ = record_and_plan(events)
    allocator.begin_step()
    run(allocator, events)
    assert allocator.stats()["served"] == len(trace) and allocator.stats()["diverged"] == 0


def test_a_different_size_diverges_and_is_counted():
    events = synthetic_sequence(seed=1)
    allocator, _, _ = record_and_plan(events)
    allocator.begin_step()
    run(allocator, events, sizes_override={5: 12345})
    stats = allocator.stats()
    assert stats["diverged"] == 1 and stats["served"] == 39


def test_a_longer_lifetime_never_overlaps():
    # Plan: A lives [alloc A, free A), then B reuses A's place. Replay keeps A alive while B
    # comes: B must not land on A.
    events = [("alloc", 0, 4096), ("free", 0, None), ("alloc", 1, 4096), ("free", 1, None)]
    allocator, layout, _ = record_and_plan(events)
    assert layout.offsets == (0, 0)
    allocator.begin_step()
    late = [("alloc", 0, 4096), ("alloc", 1, 4096), ("free", 1, None), ("free", 0, None)]
    run(allocator, late)  # fills and checks both buffers while both are live
    assert allocator.stats()["diverged"] == 1


def test_more_requests_than_the_plan_fall_back():
    events = [("alloc", 0, 1024), ("free", 0, None)]
    allocator, _, _ = record_and_plan(events)
    allocator.begin_step()
    run(allocator, [("alloc", 0, 1024), ("alloc", 1, 2048), ("free", 1, None), ("free", 0, None)])
    assert allocator.stats()["diverged"] == 1 and allocator.stats()["served"] == 1


def test_errors_name_the_problem():
    allocator = HostReplayAllocator()
    with pytest.raises(ValueError, match="not handed out by this allocator"):
        allocator.deallocate(12345)
    arena = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 sizes but 1 offsets"):
        allocator.set_plan([1, 2], [0], arena.data_ptr(), 4096)
    with pytest.raises(ValueError, match="past the arena of 4096 bytes"):
        allocator.set_plan([4096], [512], arena.data_ptr(), 4096)
