"""Host chunks: the long-lived host buffers a host arena cuts its slots from, sized as the host
allocator really holds them.

Note [pinned footprint]: torch's caching host allocator rounds every pinned allocation up to
a power of two and keeps freed blocks cached until told to empty its cache. So on a pinned
backend chunks are requested as powers of two and used whole (pinned blocks are page-aligned:
no alignment slack), a chunk's `capacity` counts what the allocator really holds, and whenever
chunks are dropped the backend's `release_host_cache()` gives their blocks back. Otherwise a
budget of B could hold 2 B (rounding) plus every chunk ever dropped (caching). Other backends
get exactly what they ask for, with one page of slack to align the chunk's start.
"""

from __future__ import annotations

import torch

__all__ = ["ALIGNMENT", "Chunk", "align_up", "chunk_of", "chunk_request", "lowest_fit"]

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

    __slots__ = ("buffer", "capacity", "live", "planned", "top", "usable")

    def __init__(self, buffer: torch.Tensor, usable: int, capacity: int) -> None:
        self.buffer = buffer  # (usable,) uint8, ALIGNMENT-aligned start
        self.usable = usable  # bytes slots can use
        self.capacity = capacity  # bytes the host allocator really holds for it
        self.top = 0
        self.live = 0  # bump slots not yet freed
        self.planned = False  # a plan's chunk: its slots are counted in the arena's planned ranges


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
