"""Host chunks: the long-lived host buffers a host arena cuts its slots from, sized as the host
allocator really holds them, pinned while pinned memory can be had (`HostMemory`).

Note [pinned footprint]: torch's caching host allocator rounds every pinned allocation up to
a power of two and keeps freed blocks cached until told to empty its cache. So on a pinned
backend chunks are requested as powers of two and used whole (pinned blocks are page-aligned:
no alignment slack), a chunk's `capacity` counts what the allocator really holds, and whenever
chunks are dropped the backend's `release_host_cache()` gives their blocks back. Otherwise a
budget of B could hold 2 B (rounding) plus every chunk ever dropped (caching). Other backends
get exactly what they ask for, with one page of slack to align the chunk's start.

Note [pageable fallback]: pinned (page-locked) host memory is what lets a copy run on a copy
stream while the host goes on, and some systems cap it (WSL2 at 1-2 GB; a popular trainer broke
for four releases there until it fell back to pageable memory). A chunk that would take the
arena's pinned chunks past ``ACTOFF_PINNED_BUDGET``, or whose pinned allocation raises, is
allocated pageable instead, and so is every chunk after it: one warning says why and what to
set, and the arena counts its pageable bytes (``actoff.stats().host_pageable_bytes``). Training
still gives the same gradients, as copies to and from pageable memory are ordered as any copy;
they are synchronous instead (CUDA returns from one once it has run, or been staged: the host
waits for the copy stream, which waited for compute) and slower (staged through the driver's
own pinned buffer). Pinned chunks already held stay: the budget caps what is pinned, not what
is offloaded (``ACTOFF_HOST_BUDGET`` does). Asking for pinned memory again after a failure would
try, and maybe fail, a pinned allocation at every growth, and a fresh pinned allocation is slow
in itself (11 GB/s copies against 53 GB/s into a reused buffer).
"""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch

from actoff.device.base import DeviceBackend
from actoff.units import format_bytes

__all__ = ["ALIGNMENT", "Chunk", "HostMemory", "align_up", "chunk_of", "chunk_request", "lowest_fit"]

#: Slot alignment in bytes: O_DIRECT-ready (4 KiB) for the NVMe path's staging buffers.
ALIGNMENT = 4096


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment``: ``align_up(1) == 4096``."""
    return (value + alignment - 1) // alignment * alignment


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def _prev_pow2(value: int) -> int:
    return 1 << (value.bit_length() - 1) if value > 0 else 0


class Chunk:
    """One host buffer of an arena: its aligned usable bytes and its bump state."""

    __slots__ = ("buffer", "capacity", "live", "pageable", "planned", "top", "usable")

    def __init__(self, buffer: torch.Tensor, usable: int, capacity: int) -> None:
        self.buffer = buffer  # (usable,) uint8, ALIGNMENT-aligned start
        self.usable = usable  # bytes slots can use
        self.capacity = capacity  # bytes the host allocator really holds for it
        self.top = 0
        self.live = 0  # bump slots not yet freed
        self.planned = False  # a plan's chunk: its slots are counted in the arena's planned ranges
        self.pageable = False  # pageable where the backend pins (Note [pageable fallback])


class HostMemory:
    """Where one arena's chunks come from: pinned host memory where the backend pins it, within
    ``pinned_budget`` bytes and while the system gives it, then pageable memory for the rest of
    the arena's life (Note [pageable fallback]).

    >>> from actoff.device.base import CpuBackend
    >>> memory = HostMemory(CpuBackend())
    >>> chunk = memory.allocate(8192, 8192, None)
    >>> chunk.usable, chunk.pageable, memory.num_allocations
    (8192, False, 1)
    """

    def __init__(self, backend: DeviceBackend, pinned_budget: int | None = None) -> None:
        self.backend = backend
        self.pinned_budget = pinned_budget  # bytes of pinned chunks alive at most (None: no cap)
        self.num_allocations = 0  # host buffers ever allocated (cudaHostAlloc on CUDA)
        self.fallback: str | None = None  # why chunks are pageable now (the warning given)
        # Its chunks alive, key -> (footprint, pageable), until their buffer dies (a weakref
        # finalizer: atomic, no lock, as the collector may run it anywhere). A chunk the arena
        # dropped still counts while slots of it live: its memory is still held.
        self._alive: dict[int, tuple[int, bool]] = {}
        self._keys = itertools.count()

    @property
    def pinned_bytes(self) -> int:
        """Bytes of its pinned chunks alive now."""
        return sum(nbytes for nbytes, pageable in list(self._alive.values()) if not pageable)

    @property
    def pageable_bytes(self) -> int:
        """Bytes of its chunks alive now in pageable memory in place of pinned (Note [pageable
        fallback]): copies to and from them are synchronous and slower."""
        return sum(nbytes for nbytes, pageable in list(self._alive.values()) if pageable)

    def request(self, need: int, want: int, room: int | None, *, fall_back: bool = True) -> int | None:
        """The footprint of the next chunk: at least ``need`` usable bytes, ``want`` if it fits,
        at most ``room`` bytes (the host budget's); pinned while it and the pinned chunks alive
        stay within the pinned budget, else pageable from now on (the warning is given here;
        ``None`` instead unless ``fall_back``); ``None`` if it does not fit in ``room``."""
        if self.backend.pins_host and self.fallback is None:
            request = chunk_request(self.backend.pinned, need, want, room)
            if request is None or self.pinned_budget is None:
                return request  # None: the host budget refuses it, pinned or not
            held = self.pinned_bytes
            capped = chunk_request(
                self.backend.pinned, need, want, min(max(self.pinned_budget - held, 0), request)
            )
            if capped is not None or not fall_back:
                return capped
            self._fall_back(
                f"a chunk of {format_bytes(need)} more would take the host arena's pinned memory "
                f"({format_bytes(held)}) past ACTOFF_PINNED_BUDGET (Config.pinned_budget) = "
                f"{format_bytes(self.pinned_budget)}",
                "raise ACTOFF_PINNED_BUDGET as far as the system lets a process pin memory",
            )
        return chunk_request(False, need, want, room)

    def allocate(self, need: int, want: int, room: int | None) -> Chunk | None:
        """A new chunk of `request`'s footprint; pageable from now on if pinning it raises."""
        while (request := self.request(need, want, room)) is not None:
            pinned = self.backend.pins_host and self.fallback is None
            pageable = self.backend.pins_host and not pinned  # in place of pinned memory
            try:
                raw = (
                    self.backend.host_empty(request, pinned=False)
                    if pageable
                    else self.backend.host_empty(request)
                )
            except RuntimeError as error:
                if not pinned:  # no pinning to give up: a real error
                    raise
                self._fall_back(
                    f"pinned host memory could not be allocated ({format_bytes(request)}: {error})",
                    "some systems cap pinned memory (WSL2: 1-2 GB): set ACTOFF_PINNED_BUDGET under the "
                    "cap to keep the pinned part without a failed allocation",
                )
                continue
            self.num_allocations += 1
            chunk = chunk_of(raw, request, pinned and self.backend.pinned)
            chunk.pageable = pageable
            key = next(self._keys)
            self._alive[key] = (chunk.capacity, chunk.pageable)
            weakref.finalize(raw.untyped_storage(), self._alive.pop, key, None)
            return chunk
        return None

    def _fall_back(self, cause: str, fix: str) -> None:
        self.fallback = cause
        warnings.warn(
            f"actoff: {cause}. The host arena falls back to pageable host memory for the rest of "
            "the run: copies to and from it are synchronous (the host waits for each) and slower; "
            f"actoff.stats().host_pageable_bytes counts it. To keep copies asynchronous, {fix}, or "
            "offload less (ACTOFF_HOST_BUDGET caps the host memory actoff holds; the rest stays on "
            "the device).",
            RuntimeWarning,
            stacklevel=2,
        )


def chunk_request(pinned: bool, need: int, want: int, room: int | None) -> int | None:
    """Bytes to ask the host allocator for: a chunk with at least ``need`` usable bytes, ``want``
    if it fits, whose real footprint is at most ``room``; ``None`` if none fits.

    >>> chunk_request(True, 5000, 5000, None), chunk_request(False, 5000, 5000, None)
    (8192, 9096)
    """
    if pinned:  # Note [pinned footprint]: powers of two, used whole
        request = _next_pow2(max(want, need))
        if room is not None and request > room:
            request = _prev_pow2(room)
        return request if request >= need else None
    request = max(want, need) + ALIGNMENT  # slack to align the start
    if room is not None and request > room:
        request = room // ALIGNMENT * ALIGNMENT
    return request if request - ALIGNMENT >= need else None


def chunk_of(raw: torch.Tensor, request: int, pinned: bool) -> Chunk:
    """The aligned chunk in a fresh host buffer of ``request`` bytes."""
    pad = (-raw.data_ptr()) % ALIGNMENT
    usable = request if pinned else request - ALIGNMENT
    if pad + usable > request:  # a pinned block that is not page-aligned: lose a page
        usable = (request - pad) // ALIGNMENT * ALIGNMENT
    footprint = _next_pow2(request) if pinned else request
    return Chunk(raw[pad : pad + usable], usable, footprint)


def lowest_fit(live: dict[int, int], usable: int, size: int) -> int | None:
    """The lowest offset where ``size`` bytes fit in ``usable`` bytes beside the ``live`` ranges
    (``start -> end``, disjoint); ``None`` if they fit nowhere.

    >>> lowest_fit({0: 4096, 12288: 16384}, 16384, 8192), lowest_fit({0: 4096}, 8192, 8192)
    (4096, None)
    """
    low = 0
    for start, end in sorted(live.items()):
        if start - low >= size:
            break
        low = max(low, end)
    return low if usable - low >= size else None
