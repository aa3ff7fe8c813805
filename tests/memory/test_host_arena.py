"""Host arena: aligned slots, rewinding chunks, budget, consolidation into one allocation, and
a footprint that is what the host allocator really holds (powers of two when pinned)."""

import gc
import itertools
import mmap
import weakref

import pytest
import torch
from _helpers import assert_same_history, make_model, train
from torch.utils._mode_utils import no_dispatch

import actoff
from actoff.device.base import CpuBackend, StreamBackend, backend_for
from actoff.device.sim.device import SimSettings, SimStreams
from actoff.memory.host_arena import ALIGNMENT, HostArena
from actoff.reference import Block
from actoff.testing import simulated_device


class CountingCpuBackend(CpuBackend):
    """The CPU backend, counting bytes requested and cache releases."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[int] = []
        self.releases = 0

    def host_empty(self, nbytes: int) -> torch.Tensor:
        self.requests.append(nbytes)
        return super().host_empty(nbytes)

    def release_host_cache(self) -> None:
        self.releases += 1


class CachingPinnedBackend(CountingCpuBackend):
    """Models torch's caching host allocator on the CPU: every request is rounded up to a power
    of two, blocks are page-aligned (mmap), and a freed block stays held (cached) until
    `release_host_cache()`. ``held_bytes`` is what such an allocator would hold."""

    pinned = True

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.cached_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self.live_bytes + self.cached_bytes

    def host_empty(self, nbytes: int) -> torch.Tensor:
        self.requests.append(nbytes)
        block = 1 << (nbytes - 1).bit_length()
        memory = mmap.mmap(-1, block)
        self.live_bytes += block
        weakref.finalize(memory, self._freed, block)  # the tensor and its views keep it alive
        return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)

    def _freed(self, block: int) -> None:
        self.live_bytes -= block
        self.cached_bytes += block

    def release_host_cache(self) -> None:
        super().release_host_cache()
        self.cached_bytes = 0


def test_slots_are_aligned_and_disjoint():
    arena = HostArena(CpuBackend())
    slots = [arena.alloc(n) for n in (1, 5000, 4096, 123457)]
    starts = [s.raw().data_ptr() for s in slots]
    assert all(p % ALIGNMENT == 0 for p in starts)
    spans = sorted((s.raw().data_ptr(), s.raw().data_ptr() + s.capacity) for s in slots)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_slot_view_holds_values():
    arena = HostArena(CpuBackend())
    slot = arena.alloc(40)
    view = slot.view(torch.float32, 10)
    view.copy_(torch.arange(10.0))
    assert torch.equal(slot.view(torch.float32, 10), torch.arange(10.0))


def test_chunk_rewinds_when_empty():
    arena = HostArena(CpuBackend())
    first = arena.alloc(1000)
    second = arena.alloc(1000)
    arena.free(first)
    arena.free(second)
    assert arena.used == 0
    again = arena.alloc(1000)
    assert again.offset == 0 and again.chunk is first.chunk


def test_budget_refuses_past_it():
    # Pinned: a 4-page budget is one 4-page block, all of it usable.
    arena = HostArena(CachingPinnedBackend(), budget=4 * ALIGNMENT)
    assert arena.alloc(ALIGNMENT) is not None
    assert arena.alloc(2 * ALIGNMENT) is not None
    assert arena.alloc(2 * ALIGNMENT) is None
    assert arena.alloc(1) is not None
    assert arena.capacity == 4 * ALIGNMENT
    # Elsewhere one page of the budget pays for aligning the chunk's start.
    arena = HostArena(CpuBackend(), budget=4 * ALIGNMENT)
    assert arena.alloc(ALIGNMENT) is not None and arena.alloc(2 * ALIGNMENT) is not None
    assert arena.alloc(1) is None
    assert arena.capacity == 4 * ALIGNMENT


def _a_step(arena: HostArena, sizes) -> None:
    slots = [arena.alloc(size) for size in sizes]
    for slot in reversed(slots):
        if slot is not None:
            arena.free(slot)


@pytest.mark.parametrize("backend_cls", [CountingCpuBackend, CachingPinnedBackend], ids=["cpu", "pinned"])
def test_capacity_is_what_was_allocated_and_never_exceeds_the_budget(backend_cls):
    backend = backend_cls()
    budget = 100 * 2**20 + 12345  # not a power of two
    arena = HostArena(backend, budget=budget)
    sizes = [7 * 2**20, 20 * 2**20, 3 * 2**20 + 5, 30 * 2**20, 1000]
    for _ in range(3):
        _a_step(arena, sizes)
        footprint = sum(1 << (n - 1).bit_length() for n in backend.requests[-len(arena._chunks) :])
        assert arena.capacity <= budget
        if backend.pinned:
            # Every request is a power of two, used whole; what the allocator holds (live and
            # cached) is exactly the arena's capacity once dropped chunks were released.
            assert all(n & (n - 1) == 0 for n in backend.requests)
            assert all(chunk.usable == chunk.capacity for chunk in arena._chunks)
            gc.collect()
            assert backend.live_bytes == arena.capacity == footprint
            assert backend.held_bytes == arena.capacity
        else:
            assert arena.capacity == sum(backend.requests[-len(arena._chunks) :])
        arena.consolidate()
    assert len(arena._chunks) == 1 and arena._chunks[0].usable >= sum(
        (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT for n in sizes
    )


def test_dropped_chunks_trigger_the_release_hook():
    backend = CachingPinnedBackend()
    arena = HostArena(backend)
    _a_step(arena, [20 * 2**20, 20 * 2**20])  # two chunks
    assert len(arena._chunks) == 2 and backend.releases == 0
    arena.consolidate()  # two dropped, one made
    assert backend.releases == 1 and len(arena._chunks) == 1
    gc.collect()
    assert backend.cached_bytes == 0 and backend.held_bytes == arena.capacity
    arena.consolidate()  # one chunk: nothing to do, nothing released
    assert backend.releases == 1
    arena.install_plan((4096, 8192), (0, 4096), 12288)  # the bump chunk is dropped
    assert backend.releases == 2 and arena._chunks == [] and arena.planned.capacity == 16384
    gc.collect()
    assert backend.held_bytes == arena.capacity == 16384
    arena.install_plan((4096,), (0,), 4096)  # the planned chunk is reused: nothing dropped
    assert backend.releases == 2 and arena.capacity == 16384
    arena.install_plan((2**20,), (0,), 2**20)  # a bigger plan replaces the planned chunk
    assert backend.releases == 3 and arena.capacity == 2**20
    gc.collect()
    assert backend.held_bytes == 2**20


def test_a_plan_that_would_break_the_budget_is_not_installed():
    backend = CachingPinnedBackend()
    arena = HostArena(backend, budget=96 * 1024)  # the plan's block would be 128 KiB
    arena.install_plan((70 * 1024,), (0,), 70 * 1024)
    assert arena.plan is None and arena.planned is None and arena.capacity == 0
    assert "budget" in arena.plan_method
    # Bump chunks still serve, within the budget: 64 KiB is the largest block that fits.
    assert arena.alloc(70 * 1024) is None
    assert arena.alloc(60 * 1024) is not None and arena.capacity == 64 * 1024


@pytest.mark.gpu
def test_pinned_memory_held_stays_within_the_arenas_capacity():
    """What torch's host allocator holds (its rounded blocks, cached ones included) stays
    within 1.1x of the capacity the arena reports, through growth, consolidation and a plan."""
    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    backend = backend_for(torch.device("cuda", 0))
    assert backend.pinned
    backend.release_host_cache()
    held = lambda: torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)  # noqa: E731
    baseline = held()
    arena = HostArena(backend, budget=3 * 2**30)
    sizes = [100 * 2**20 + 3, 300 * 2**20, 50 * 2**20, 700 * 2**20 + 4096]
    for step in range(3):
        _a_step(arena, sizes)
        gc.collect()
        assert arena.capacity <= 3 * 2**30
        assert held() - baseline <= 1.1 * arena.capacity, (step, held() - baseline, arena.capacity)
        arena.consolidate()
    arena.install_plan((256 * 2**20,), (0,), 256 * 2**20)
    gc.collect()
    assert held() - baseline <= 1.1 * arena.capacity


def test_consolidation_makes_one_chunk_of_the_high_water_size():
    arena = HostArena(CpuBackend())
    big = 20 * 2**20  # larger than the first chunk: forces a second
    slots = [arena.alloc(big), arena.alloc(big)]
    assert arena.num_allocations == 2
    for slot in slots:
        arena.free(slot)
    arena.consolidate()
    assert arena.num_allocations == 3 and len(arena._chunks) == 1
    assert arena.capacity >= arena.high_water
    # The same step again fits without allocating.
    slots = [arena.alloc(big), arena.alloc(big)]
    assert arena.num_allocations == 3


def test_planned_requests_get_their_offsets_and_divergence_falls_back():
    arena = HostArena(CpuBackend())
    arena.install_plan((4096, 8192, 4096), (0, 4096, 0), 12288)
    arena.begin_step()
    a = arena.alloc(4000)  # request 0: planned at 0
    b = arena.alloc(8192)  # request 1: planned at 4096
    assert (a.chunk, a.offset, b.chunk, b.offset) == (arena.planned, 0, arena.planned, 4096)
    c = arena.alloc(100)  # request 2: planned at 0, but a still lives there: falls back
    assert c.chunk is not arena.planned and arena.divergences == 1
    for slot in (a, b, c):
        arena.free(slot)
    arena.begin_step()
    other = arena.alloc(5000)  # another size than planned: a divergence, in the chunk's free room
    assert (other.chunk, other.offset) == (arena.planned, 0)
    assert arena.divergences == 1 and arena.total_divergences == 2


def test_installing_a_plan_never_waits_for_the_copies_of_returned_slots():
    """(CI, 2026-11-26: test_backward_never_blocks_the_host_on_a_copy under load) A plan is
    installed at the end of backward; it synchronized the host on every copy still touching a
    returned slot, the step's last fetch often among them. Such a slot stays deferred now."""
    streams = SimStreams(SimSettings(max_delay_s=0.0, max_lag_s=0.0))
    backend = StreamBackend(torch.device("cpu"), streams)
    arena = HostArena(backend)
    slot = arena.alloc(4096)
    with streams.hold():
        ticket = backend.copy_to_host(slot.view(torch.float32, 1024), torch.randn(1024), "out")
        arena.free(slot, after=(ticket,))
        arena.install_plan((4096,), (0,), 4096)
        assert streams.host_syncs == 0 and arena.deferred == 1
        assert slot.chunk in arena._chunks  # held by the copy: not dropped under it
    ticket.synchronize()
    arena.begin_step()
    planned = arena.alloc(4096)
    assert planned.chunk is arena.planned and arena.deferred == 0  # reaped on the next alloc
    assert slot.chunk.live == 0 and slot.chunk.top == 0


def test_a_slot_of_a_replaced_plan_is_freed_without_touching_the_bump_counts():
    arena = HostArena(CpuBackend())
    arena.install_plan((4096,), (0,), 4096)
    arena.begin_step()
    old = arena.alloc(4096)
    arena.install_plan((8192,), (0,), 8192)  # the old chunk is live: a new one replaces it
    assert old.chunk is not arena.planned
    arena.free(old)
    assert old.chunk.live == 0 and arena.used == 0


@pytest.mark.sim_device  # the host arena: copies on a device with DMA
def test_cycling_lengths_settle_into_one_chunk_reused_by_every_length():
    """(issue 35) Dynamic padding cycles a few sequence lengths. Each length diverged from the
    one plan in force, allocated a bump chunk, and the next plan dropped it: here a host
    allocation every two steps, and a capacity of 17.8 MB against a high-water mark of 1.35 MB.
    Once each length has come round, the arena must allocate nothing, and hold one chunk near
    the most bytes ever in use at once (Note [a host plan per shape]).

    The bound, 2x: the chunk is the largest length's planned peak plus one page of alignment
    slack (the simulated device's host buffers are not rounded to powers of two), and a planned
    peak exceeds the planner's lower bound, the most bytes live at once in that step, which the
    high-water mark counts, only by the layout's gap: none on this trace (a stack of offloads
    freed in reverse), a few percent on others. A 16 MiB bump chunk beside it alone is 12 times
    the high-water mark."""
    lengths = [33, 65, 49, 17]
    model = make_model()
    reference = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    allocations, expected, actual = [], [], []
    for step in range(6 * len(lengths)):
        seq = lengths[step % len(lengths)]
        expected += train(reference, 1, seq=seq, seed=step)
        actual += train(model, 1, seq=seq, seed=step)
        allocations.append(actoff.stats().host_allocations)
    assert_same_history(expected, actual)  # slots reused across lengths hold the right bytes
    settled = allocations[2 * len(lengths) - 1]
    assert allocations[2 * len(lengths) :] == [settled] * (len(allocations) - 2 * len(lengths)), allocations
    stats = actoff.stats()
    assert stats.host_capacity <= 2 * stats.host_high_water, (stats.host_capacity, stats.host_high_water)


def test_an_arena_steps_without_host_memory_give_back_and_a_later_offload_plans_again():
    """(Note [an idle arena lets go]) auto's plan kept every block after its measuring steps had
    streamed them all, and the 8B run on the H200 held 17 to 33 GiB of pinned host memory for
    nothing. Here short steps (every saved tensor under ``min_bytes``: nothing leaves the device)
    follow long ones: after two of them the arena holds nothing; long steps again take host memory
    and are planned again, gradients as without actoff throughout. (How soon the new plan's
    allocations settle depends on the copies' timing on the simulated device: not asserted.)"""
    model, reference = make_model(), make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu")  # min_bytes 64 KiB: short steps keep all
    expected, actual, capacity, allocations = [], [], [], []
    with simulated_device(seed=0):  # a device with copies: a host arena
        for step, seq in enumerate([513] * 3 + [9] * 3 + [513] * 5):
            with no_dispatch():  # the reference is not the device's
                expected += train(reference, 1, seq=seq, seed=step)
            actual += train(model, 1, seq=seq, seed=step)
            stats = actoff.stats()
            capacity.append(stats.host_capacity)
            allocations.append(stats.host_allocations)
    assert_same_history(expected, actual)
    assert all(capacity[:4]) and capacity[4:6] == [0, 0], capacity  # the 2nd idle step lets go
    assert all(capacity[6:]), capacity  # offloading again: host memory again
    assert allocations[6] > allocations[5] and actoff.stats().host_layout != "none"  # planned again
