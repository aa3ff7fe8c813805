"""Host arena: aligned slots, rewinding chunks, budget, consolidation into one allocation."""

import itertools

import torch

from actoff._arena import ALIGNMENT, HostArena
from actoff._device import CpuBackend


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
    arena = HostArena(CpuBackend(), budget=3 * ALIGNMENT)
    assert arena.alloc(ALIGNMENT) is not None
    assert arena.alloc(2 * ALIGNMENT) is not None
    assert arena.alloc(1) is None
    assert arena.capacity <= 3 * ALIGNMENT


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
    assert arena.alloc(5000).chunk is not arena.planned  # another size than planned
    assert arena.divergences == 1 and arena.total_divergences == 2
