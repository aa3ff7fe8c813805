"""Host arena: host (pinned on CUDA) memory allocated once and handed out as aligned slots.

With a plan (`install_plan`, from `actoff.planner`), request k of a step gets its planned
offset in one chunk; a request that differs from the plan (size, count, or a planned range
still occupied) is a divergence and falls back to the bump chunks below.

A step's offloads are allocated in forward order and freed in backward order, so a bump
allocator over a few chunks fits: a chunk rewinds when its last slot is freed. The first
step may need several chunks; when a step ends with every chunk empty, they are replaced by
one chunk as large as the step's high-water mark, so later steps of the same shape allocate
nothing (`num_allocations` stays put: the tests count it).

Note [pinned footprint]: torch's caching host allocator rounds every pinned allocation up to
a power of two and keeps freed blocks cached until told to empty its cache. So on a pinned
backend chunks are requested as powers of two and used whole (pinned blocks are page-aligned:
no alignment slack), `capacity` counts what the allocator really holds, and whenever chunks
are dropped the backend's `release_host_cache()` gives their blocks back. Otherwise a budget
of B could hold 2 B (rounding) plus every chunk ever dropped (caching). Other backends get
exactly what they ask for, with one page of slack to align the chunk's start.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from actoff.device.base import DeviceBackend

# Trace generations are unique in the process: a slot freed after actoff.reset() (a graph that
# outlived it) never matches the new arena's trace.
_GENERATIONS = itertools.count()

__all__ = ["ALIGNMENT", "HostArena", "Slot"]

#: Slot alignment in bytes: O_DIRECT-ready (4 KiB) for the NVMe path's staging buffers.
ALIGNMENT = 4096
_MIN_CHUNK = 16 * 2**20


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment``: ``align_up(1) == 4096``."""
    return (value + alignment - 1) // alignment * alignment


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def _prev_pow2(value: int) -> int:
    return 1 << (value.bit_length() - 1) if value > 0 else 0


class _Chunk:
    __slots__ = ("buffer", "capacity", "live", "planned", "top", "usable")

    def __init__(self, buffer: torch.Tensor, usable: int, capacity: int) -> None:
        self.buffer = buffer  # (usable,) uint8, ALIGNMENT-aligned start
        self.usable = usable  # bytes slots can use
        self.capacity = capacity  # bytes the host allocator really holds for it
        self.top = 0
        self.live = 0  # bump slots not yet freed
        self.planned = False  # a plan's chunk: its slots are counted in _live_planned


@dataclass(frozen=True)
class Slot:
    """``nbytes`` bytes of host memory inside an arena chunk."""

    chunk: _Chunk
    offset: int
    nbytes: int
    trace_index: int = -1  # its entry in the arena's trace, when tracing ...
    trace_generation: int = -1  # ... of this trace (take_trace starts a new one)

    @property
    def capacity(self) -> int:
        """Bytes usable in the slot: ``nbytes`` rounded up to the alignment."""
        return align_up(max(self.nbytes, 1))

    def raw(self) -> torch.Tensor:
        """The whole slot as uint8 (aligned start and size: O_DIRECT-ready)."""
        return self.chunk.buffer[self.offset : self.offset + self.capacity]

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The slot's first ``numel`` elements as a 1-D tensor of ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = self.chunk.buffer[self.offset : self.offset + numel * itemsize]
        return raw.view(dtype)


class HostArena:
    """Aligned host slots from a few long-lived chunks, under an optional byte budget.

    Thread-safe: slots are freed from autograd's backward threads.

    >>> from actoff.device.base import CpuBackend
    >>> arena = HostArena(CpuBackend())
    >>> slot = arena.alloc(1000)
    >>> slot.nbytes, arena.used
    (1000, 4096)
    >>> arena.free(slot); arena.used
    0
    """

    def __init__(self, backend: DeviceBackend, budget: int | None = None) -> None:
        self.backend = backend
        self.budget = budget
        self.num_allocations = 0  # host buffers ever allocated (cudaHostAlloc on CUDA)
        self.high_water = 0  # most bytes in use at once since the last consolidation
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        # Planner trace while ``tracing``: [size, alloc, free or None, tag] on a logical clock.
        self.tracing = False
        self.clock = 0
        self.trace: list[list] = []
        self.trace_generation = next(_GENERATIONS)
        # Planned offsets (see the module docstring).
        self.plan: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # sizes, offsets
        self.plan_method = "none"  # where the plan came from (Layout.method): shown in stats
        self.planned: _Chunk | None = None
        self.request = 0  # request index within the step
        self.divergences = self.total_divergences = 0  # since the last begin_step; ever
        self._live_planned: dict[int, int] = {}  # offset -> end, in the planned chunk
        # Note [host slot reuse]: a returned slot is handed out again only once every copy
        # into or out of it (their tickets, given to `free`) is done, and `free` never waits
        # for them. The compute stream waited for those copies, the host did not: a slot
        # reused at once could be refilled by an NVMe read on a host thread while a DMA still
        # touches it. The host must not wait either: the autograd thread runs ahead of the
        # copy streams. Slots returned early wait here, with their tickets.
        self._deferred: list[tuple[Slot, tuple]] = []
        # An arena dropped (`actoff.reset`, a thread's runtime collected after the thread ended)
        # with such slots would free their chunks while the copies run, and another thread's
        # arena could be handed that memory: its last act is to wait for them.
        weakref.finalize(self, _settle, self._deferred, os.getpid()).atexit = False
        # Note [frees from the collector]: `free` runs from autograd's release of a handle, which
        # the garbage collector can start inside any allocation, this arena's own included. It
        # only queues the slot (atomic append, no lock); the next lock holder returns it first.
        self._returned: collections.deque[tuple[Slot, tuple]] = collections.deque()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            while self._returned:
                self._return(*self._returned.popleft())
            yield

    @property
    def capacity(self) -> int:
        """Bytes of host memory the allocator really holds for the arena (Note [pinned footprint])."""
        planned = self.planned.capacity if self.planned is not None else 0
        return planned + sum(chunk.capacity for chunk in self._chunks)

    @property
    def used(self) -> int:
        """Bytes currently handed out (including alignment padding); waits for the copies
        that still touch returned slots (Note [host slot reuse])."""
        with self._locked():
            self._reap(wait=True)  # a figure for people: the copies in flight finish first
            return self._used()

    def _used(self) -> int:
        planned = sum(end - offset for offset, end in self._live_planned.items())
        return planned + sum(chunk.top for chunk in self._chunks if chunk.live)

    def begin_step(self) -> None:
        """A new step: the next request is request 0 of the plan."""
        with self._locked():
            self.request = 0
            self.divergences = 0

    def install_plan(self, sizes: tuple[int, ...], offsets: tuple[int, ...], peak: int) -> None:
        """Serve later steps at these offsets, in one chunk of ``peak`` bytes.

        Not installed (``plan`` stays ``None``) when that chunk would not fit in the budget.
        """
        with self._locked():
            # A step boundary, once per plan: the old chunks whose copies are done can go. It
            # runs at the end of backward, so never wait: a chunk with copies still touching a
            # returned slot stays (live) until they end.
            self._reap(wait=False)
            # Bump chunks with nothing live are no longer needed, nor an unused planned chunk
            # too small for this plan: give their memory back before a new chunk adds to it.
            dropped = not all(chunk.live for chunk in self._chunks)
            self._chunks = [chunk for chunk in self._chunks if chunk.live]
            need = align_up(max(peak, 1))
            replace = self.planned is None or self.planned.usable < need or self._live_planned
            if replace and self.planned is not None and not self._live_planned:
                self.planned, dropped = None, True
            if dropped:
                self.backend.release_host_cache()
            if replace:
                # Live slots of an older plan keep its chunk alive; the arena stops counting it.
                held = sum(chunk.capacity for chunk in self._chunks)
                room = None if self.budget is None else self.budget - held
                request = chunk_request(self.backend.pinned, need, need, room)
                if request is None:
                    self.planned, self._live_planned, self.plan = None, {}, None
                    self.plan_method = "none (the plan does not fit the host budget)"
                    return
                self.planned, self._live_planned = self._new_chunk(request), {}
                self.planned.planned = True
            self.plan = (tuple(sizes), tuple(offsets))

    def drop_plan(self) -> None:
        with self._locked():
            self.plan = None

    def _take_planned(self, size: int) -> tuple[_Chunk, int] | None:
        k = self.request
        self.request += 1
        sizes, offsets = self.plan
        if k < len(sizes) and sizes[k] == size:
            offset = offsets[k]
            end = offset + size
            for attempt in range(2):
                if all(end <= low or high <= offset for low, high in self._live_planned.items()):
                    self._live_planned[offset] = end
                    return self.planned, offset
                if attempt or not self._deferred:
                    break
                self._reap(wait=True)  # its range is held by copies still running: wait
        self.divergences += 1
        self.total_divergences += 1
        return None

    def alloc(self, nbytes: int, tag: object = None) -> Slot | None:
        """A slot of ``nbytes``, or ``None`` when the budget does not allow it. ``tag`` (the
        block, say) goes into the trace."""
        size = align_up(max(nbytes, 1))
        with self._locked():
            self._reap(wait=False)
            place = self._take_planned(size) if self.plan is not None else None
            if place is None:
                place = self._bump(size, grow=False)
            if place is None and self._deferred:  # the room is held by copies still running:
                self._reap(wait=True)  # wait for them rather than hold more memory
                place = self._bump(size, grow=False)
            if place is None:
                place = self._bump(size, grow=True)
            if place is None:
                return None
            chunk, offset = place
            index = -1
            if self.tracing:
                self.clock += 1
                self.trace.append([size, self.clock, None, tag])
                index = len(self.trace) - 1
            slot = Slot(chunk, offset, nbytes, index, self.trace_generation)
            self.backend.check_host_reuse(slot.raw(), "handed out")
            self.high_water = max(self.high_water, self._used())
            return slot

    def _bump(self, size: int, *, grow: bool) -> tuple[_Chunk, int] | None:
        chunk = next((c for c in self._chunks if c.usable - c.top >= size), None)
        if chunk is None:
            chunk = self._grow(size) if grow else None
            if chunk is None:
                return None
        offset = chunk.top
        chunk.top += size
        chunk.live += 1
        return chunk, offset

    def free(self, slot: Slot, after: tuple = ()) -> None:
        """Return ``slot``; its chunk rewinds when its last slot comes back.

        ``after``: tickets of copies that may still touch the slot (Note [host slot reuse]);
        the slot is freed once every one of them has completed, never blocking the caller.
        Safe from a garbage collector's callback (Note [frees from the collector]).
        """
        self._returned.append((slot, after))
        if self._lock.acquire(blocking=False):  # else the holder returns it
            try:
                while self._returned:
                    self._return(*self._returned.popleft())
            finally:
                self._lock.release()

    def _return(self, slot: Slot, after: tuple) -> None:
        # The trace ends the buffer here, where the step returned it, not when its copies
        # end: that moment depends on the copy stream's timing, and a plan must not.
        if self.tracing and slot.trace_generation == self.trace_generation and slot.trace_index >= 0:
            self.clock += 1
            self.trace[slot.trace_index][2] = self.clock
        pending = tuple(ticket for ticket in after if ticket is not None and not ticket.query())
        if pending:
            self._deferred.append((slot, pending))
        else:
            self._free(slot)

    @property
    def deferred(self) -> int:
        """Slots returned whose copies have not finished yet."""
        with self._locked():
            return len(self._deferred)

    def _reap(self, *, wait: bool) -> None:
        """Free the deferred slots whose copies are done (``wait``: all of them, blocking)."""
        still = []
        for slot, tickets in self._deferred:
            if wait:
                for ticket in tickets:
                    ticket.synchronize()
            elif not all(ticket.query() for ticket in tickets):
                still.append((slot, tickets))
                continue
            self._free(slot)
        self._deferred[:] = still  # in place: the finalizer holds this list

    def _free(self, slot: Slot) -> None:
        self.backend.check_host_reuse(slot.raw(), "freed")
        chunk = slot.chunk
        if chunk is self.planned and slot.offset in self._live_planned:
            del self._live_planned[slot.offset]
            return
        if chunk.planned:
            return  # a slot of an older plan's chunk: the slot held that chunk alive, no more
        chunk.live -= 1
        if chunk.live == 0:
            chunk.top = 0

    def take_trace(self) -> list[tuple[int, int, int, object]]:
        """The finished buffers traced so far as ``(size, start, end, tag)``; starts a new trace.

        >>> from actoff.device.base import CpuBackend
        >>> arena = HostArena(CpuBackend())
        >>> arena.tracing = True
        >>> a = arena.alloc(10, tag="block0"); arena.free(a)
        >>> arena.take_trace()
        [(4096, 1, 2, 'block0')]
        """
        with self._locked():
            done = [(size, start, end, tag) for size, start, end, tag in self.trace if end is not None]
            self.trace = []  # slots still live belong to the old generation: not traced on
            self.trace_generation = next(_GENERATIONS)
            return done

    def consolidate(self) -> None:
        """At a step boundary: merge several empty chunks into one of the high-water size."""
        with self._locked():
            self._reap(wait=False)
            if len(self._chunks) <= 1 or any(chunk.live for chunk in self._chunks):
                return
            need = align_up(max(self.high_water, 1))
            request = chunk_request(self.backend.pinned, need, align_up(need, _MIN_CHUNK), self.budget)
            if request is None:  # one chunk of that size would break the budget: keep these
                return
            self._chunks = []
            self.backend.release_host_cache()  # before the new chunk: never both held at once
            self._chunks.append(self._new_chunk(request))

    def _grow(self, size: int) -> _Chunk | None:
        # Grow geometrically so a first step needs few chunks; never past the budget.
        want = max(size, _MIN_CHUNK, self.capacity)
        room = None if self.budget is None else self.budget - self.capacity
        request = chunk_request(self.backend.pinned, size, want, room)
        if request is not None:
            self._chunks.append(self._new_chunk(request))
            return self._chunks[-1] if self._chunks[-1].usable >= size else None
        return None

    def _new_chunk(self, request: int) -> _Chunk:
        self.num_allocations += 1
        return _chunk_of(self.backend.host_empty(request), request, self.backend.pinned)


def _settle(deferred: list[tuple[Slot, tuple]], pid: int) -> None:
    """A dropped arena's returned slots: their chunks live until the copies touching them end
    (not at exit, nor in a forked child, where the copies are the parent's)."""
    if os.getpid() != pid:
        return
    for _, tickets in deferred:
        for ticket in tickets:
            ticket.synchronize()
    deferred.clear()


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


def _chunk_of(raw: torch.Tensor, request: int, pinned: bool) -> _Chunk:
    """The aligned chunk in a fresh host buffer of ``request`` bytes."""
    pad = (-raw.data_ptr()) % ALIGNMENT
    usable = request if pinned else request - ALIGNMENT
    if pad + usable > request:  # a pinned block that is not page-aligned: lose a page
        usable = (request - pad) // ALIGNMENT * ALIGNMENT
    footprint = _next_pow2(request) if pinned else request
    return _Chunk(raw[pad : pad + usable], usable, footprint)
