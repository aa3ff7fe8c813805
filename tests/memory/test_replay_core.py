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
    from actoff.reference import Block, ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", num_layers=4))
    actoff.offload_(model, block_cls=Block, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    tokens = torch.randint(0, 256, (2, 65))
    model.loss(tokens).backward()
    with actoff.trace_arenas() as traces:
        model.loss(tokens).backward()
    (trace,) = traces["host"]  # the second step's
    assert trace
    timeline = sorted(
        [(start, "alloc", i, size) for i, (size, start, _, _) in enumerate(trace)]
        + [(end, "free", i, None) for i, (_, _, end, _) in enumerate(trace)]
    )
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
    stats = allocator.stats()
    assert stats["occupied"] == 1 and stats["diverged"] == 0 and stats["served"] == 1


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


def test_requests_outside_a_window_fall_back_unnumbered():
    events = [("alloc", 0, 1024), ("free", 0, None)]
    allocator, _, _ = record_and_plan(events)
    allocator.end_step()
    run(allocator, [("alloc", 9, 4096), ("free", 9, None)])  # e.g. the optimizer, between steps
    allocator.begin_step()
    run(allocator, events)
    stats = allocator.stats()
    assert stats["outside"] == 1 and stats["served"] == 1 and stats["diverged"] == 0


def test_buffers_that_outlive_the_window_are_unplanned_and_one_time_ones_skipped():
    # Window 1: a workspace made on first use (lives on), a transient, a gradient (lives on).
    allocator = HostReplayAllocator()
    allocator.begin_record()
    workspace, transient, grad = allocator.allocate(8192), allocator.allocate(1024), allocator.allocate(2048)
    allocator.deallocate(transient)
    log = allocator.end_record()
    assert [end for _, _, end in log] == [-1, 4, -1]
    unplanned = HostReplayAllocator.UNPLANNED  # what actoff.memory.replay_steps.plan_window gives
    arena = torch.empty(1024, dtype=torch.uint8)
    allocator.set_plan([8192, 1024, 2048], [unplanned, 0, unplanned], arena.data_ptr(), arena.numel())
    allocator.deallocate(grad)  # zero_grad(set_to_none=True)
    # Window 2: no workspace this time (Note [skippable]), the same transient and gradient.
    allocator.begin_step()
    transient = allocator.allocate(1024)
    assert transient == arena.data_ptr()
    allocator.deallocate(transient)
    allocator.deallocate(allocator.allocate(2048))
    allocator.deallocate(workspace)
    stats = allocator.stats()
    assert (stats["served"], stats["unplanned"], stats["diverged"], stats["live"]) == (1, 1, 0, 0)


class FakeStreams:
    """Streams as counters: a fence passes once its stream has run past it (``run``)."""

    def __init__(self):
        self.queued, self.done, self.fences, self.waits, self.released = {}, {}, {}, [], []

    def record(self, stream):
        self.queued[stream] = self.queued.get(stream, 0) + 1
        fence = len(self.fences) + 1
        self.fences[fence] = (stream, self.queued[stream])
        return fence

    def passed(self, fence):
        stream, mark = self.fences[fence]
        return self.done.get(stream, 0) >= mark

    def wait(self, stream, fence):
        self.waits.append((stream, fence))

    def release(self, fence):
        self.released.append(fence)

    def run(self, stream):
        self.done[stream] = self.queued.get(stream, 0)

    def install(self, allocator):
        allocator.set_fences(self.record, self.passed, self.wait, self.release)


def test_a_range_freed_on_one_stream_is_reused_by_another_only_after_its_fence():
    # Plan: A then B at offset 0. A lives on stream 1; B comes on stream 2.
    events = [("alloc", 0, 4096), ("free", 0, None), ("alloc", 1, 4096), ("free", 1, None)]
    allocator, layout, _ = record_and_plan(events)
    assert layout.offsets == (0, 0)
    streams = FakeStreams()
    streams.install(allocator)
    allocator.begin_step()
    a = allocator.allocate(4096, stream=1)
    allocator.deallocate(a)  # stream 1 may still be using A: a fence on stream 1
    b = allocator.allocate(4096, stream=2)
    assert b == a and streams.waits == [(2, 1)]  # stream 2 waits for stream 1's fence
    assert allocator.stats()["waits"] == 1
    allocator.deallocate(b)


def test_the_same_stream_reuses_at_once_and_passed_fences_cost_nothing():
    events = [("alloc", 0, 4096), ("free", 0, None), ("alloc", 1, 4096), ("free", 1, None)]
    allocator, _, _ = record_and_plan(events)
    streams = FakeStreams()
    streams.install(allocator)
    allocator.begin_step()
    allocator.deallocate(allocator.allocate(4096, stream=1))
    allocator.deallocate(allocator.allocate(4096, stream=1))  # same stream: in order, no wait
    assert streams.waits == []
    allocator.begin_step()
    allocator.deallocate(allocator.allocate(4096, stream=1))
    streams.run(1)  # stream 1 has passed every fence
    allocator.deallocate(allocator.allocate(4096, stream=2))
    assert streams.waits == [] and allocator.stats()["waits"] == 0
    assert streams.released  # passed fences are given back


def test_a_new_arena_retires_the_old_one_until_its_last_buffer_is_freed():
    released = []
    events = [("alloc", 0, 4096), ("free", 0, None)]
    allocator, _, first = record_and_plan(events)
    allocator.set_arena_released(released.append)
    allocator.begin_step()
    held = allocator.allocate(4096)  # lives in the first arena across the re-plan
    second = torch.empty(8192, dtype=torch.uint8)
    allocator.set_plan([8192], [0], second.data_ptr(), second.numel())
    assert released == [] and allocator.stats()["arena_bytes"] == first.numel() + 8192
    allocator.deallocate(held)
    assert released == [first.data_ptr()] and allocator.stats()["arena_bytes"] == 8192
    allocator.begin_step()
    assert allocator.allocate(8192) == second.data_ptr()


def test_figures_count_bytes_and_peaks():
    allocator = HostReplayAllocator()
    allocator.begin_record()
    a, b = allocator.allocate(1000), allocator.allocate(3000)
    allocator.deallocate(a)
    stats = allocator.stats()
    assert (stats["live_bytes"], stats["peak_bytes"], stats["fallback_bytes"]) == (3000, 4000, 3000)
    assert stats["peak_reserved_bytes"] == 4000
    allocator.reset_peak()
    assert allocator.stats()["peak_bytes"] == 3000
    allocator.deallocate(b)
