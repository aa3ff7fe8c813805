"""Pinned memory as its own budget (issue 38): where pinned host memory is capped
(``ACTOFF_PINNED_BUDGET``) or cannot be had (the allocation raises), the host arena falls back to
pageable memory with one warning, training gives the same gradients, and stats count the bytes."""

import copy
import gc

import pytest
import torch
from _helpers import assert_same_history, make_model, train
from test_host_arena import CachingPinnedBackend

import actoff
from actoff.device.base import StreamBackend
from actoff.memory.host_arena import HostArena
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime
from actoff.testing import active_device


def _train_with_and_without_actoff(steps: int = 3, **overrides):
    """Per step the losses and gradients without actoff, then with it, and the warnings the
    offloaded run gave."""
    model = make_model()
    expected = train(copy.deepcopy(model), steps)
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0, **overrides)
    with pytest.warns(RuntimeWarning) as warned:
        actual = train(model, steps)
    return expected, actual, [str(warning.message) for warning in warned]


@pytest.mark.sim_device  # the host arena: copies on a device with DMA, from pinned buffers
def test_pinning_that_fails_falls_back_to_pageable_memory_with_one_warning(monkeypatch):
    real = StreamBackend.host_empty

    def capped(self, nbytes, *, pinned=True):
        if pinned:  # as cudaHostAlloc past WSL2's cap
            raise RuntimeError("CUDA error: out of memory")
        return real(self, nbytes, pinned=False)

    monkeypatch.setattr(StreamBackend, "host_empty", capped)
    expected, actual, warned = _train_with_and_without_actoff()
    assert_same_history(expected, actual)  # synchronous copies, the same bytes back
    (message,) = warned  # one warning, however many chunks came after
    assert "pinned host memory could not be allocated" in message and "CUDA error: out of memory" in message
    assert "ACTOFF_PINNED_BUDGET" in message and "pageable" in message
    stats = actoff.stats()
    assert stats.host_pageable_bytes == stats.host_capacity > 0  # nothing of it pinned
    assert "pageable" in str(stats)
    assert active_device().pageable_copies > 0  # each of them blocked the host, as on CUDA


@pytest.mark.sim_device  # the host arena: copies on a device with DMA, from pinned buffers
def test_a_pinned_budget_keeps_pinned_chunks_under_it_and_the_rest_pageable():
    budget = 64 * 1024  # one pinned chunk for the first tensors, then pageable
    expected, actual, warned = _train_with_and_without_actoff(pinned_budget="64KiB")
    assert_same_history(expected, actual)
    (message,) = warned
    assert "past ACTOFF_PINNED_BUDGET (Config.pinned_budget) = 64.00 KiB" in message
    (arena,) = get_runtime().arenas.values()
    gc.collect()
    assert arena.memory.pinned_bytes <= budget
    stats = actoff.stats()
    assert stats.host_pageable_bytes == arena.memory.pageable_bytes > 0
    assert stats.host_capacity <= stats.host_pageable_bytes + budget


class PageableCachingBackend(CachingPinnedBackend):
    """The caching pinned allocator's model, and pageable buffers (exactly the bytes asked)."""

    def __init__(self) -> None:
        super().__init__()
        self.pageable_requests: list[int] = []

    def host_empty(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        if pinned:
            return super().host_empty(nbytes)
        self.pageable_requests.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def test_pinned_chunks_stay_powers_of_two_within_the_budget_and_pageable_ones_are_exact():
    backend = PageableCachingBackend()
    arena = HostArena(backend)
    arena.memory.pinned_budget = 40 * 2**20  # a 32 MiB block fits, another 16 MiB does not
    slots = [arena.alloc(20 * 2**20)]  # one 32 MiB pinned chunk (not 16 MiB: it needs 20)
    assert backend.requests == [32 * 2**20] and backend.pageable_requests == []
    with pytest.warns(RuntimeWarning, match=r"past ACTOFF_PINNED_BUDGET .* = 40.00 MiB") as warned:
        slots += [arena.alloc(20 * 2**20), arena.alloc(30 * 2**20)]  # past the budget: pageable
    assert len(warned) == 1 and backend.requests == [32 * 2**20]  # nothing pinned since
    assert all(n & (n - 1) for n in backend.pageable_requests)  # exact sizes, page slack
    gc.collect()
    assert backend.live_bytes == arena.memory.pinned_bytes == 32 * 2**20
    assert arena.memory.pageable_bytes == sum(backend.pageable_requests)
    assert arena.capacity == arena.memory.pinned_bytes + arena.memory.pageable_bytes
    for slot in reversed(slots):
        arena.free(slot)
    del slot, slots  # a slot held keeps its chunk alive, pinned
    arena.consolidate()  # one chunk for the high water: pageable now, the pinned one gone
    gc.collect()
    assert arena.memory.pinned_bytes == backend.live_bytes == 0
    assert arena.capacity == arena.memory.pageable_bytes >= arena.high_water


def test_a_plan_past_the_pinned_budget_is_served_from_pageable_memory():
    backend = PageableCachingBackend()
    arena = HostArena(backend)
    arena.memory.pinned_budget = 64 * 1024
    with pytest.warns(RuntimeWarning, match="ACTOFF_PINNED_BUDGET"):
        arena.install_plan((128 * 1024,), (0,), 128 * 1024)
    assert arena.plan is not None and arena.planned.pageable and backend.requests == []
    arena.begin_step()
    slot = arena.alloc(128 * 1024)
    assert slot.chunk is arena.planned and slot.offset == 0


def test_no_pinned_budget_on_a_device_without_dma():
    # A plain CPU device pins nothing: its chunks are what they are, the budget has nothing to cap.
    from actoff.device.base import CpuBackend

    arena = HostArena(CpuBackend())
    arena.memory.pinned_budget = 0
    assert arena.alloc(20 * 2**20) is not None
    assert arena.memory.pageable_bytes == 0 and arena.memory.fallback is None
