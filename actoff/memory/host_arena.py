"""Host arena: host (pinned on CUDA) memory allocated once and handed out as aligned slots.

With plans (`install_plan`, from `actoff.planner`), request k of a step gets the offset its
step's shape planned for it, in one chunk that every shape shares (Note [a host plan per
shape], actoff.memory.host_plans). A request no plan kept knows (another size or count), or
whose planned range is still occupied, is a divergence: it goes to the lowest free room of that
chunk that fits, else to the bump chunks below; the step's trace then becomes the plan of its
shape.

Before the first plan (and with the planner off), a step's offloads are allocated in forward
order and freed in backward order, so a bump allocator over a few chunks fits: a chunk rewinds
when its last slot is freed. The first step may need several chunks; when a step ends with every
chunk empty, they are replaced by one chunk as large as the step's high-water mark, so later
steps of the same shape allocate nothing (`num_allocations` stays put: the tests count it).

Chunks come from `HostMemory` (actoff.memory.host_chunks), sized as the host allocator really
holds them (Note [pinned footprint]), pinned until the pinned budget or the system refuses, then
pageable (Note [pageable fallback]).
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

from .host_chunks import ALIGNMENT, Chunk, HostMemory, align_up, lowest_fit
from .host_plans import HostPlan, HostPlans

# Trace generations are unique in the process: a slot freed after actoff.reset() (a graph that
# outlived it) never matches the new arena's trace.
_GENERATIONS = itertools.count()

__all__ = ["ALIGNMENT", "HostArena", "Slot", "align_up"]

_MIN_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Slot:
    """``nbytes`` bytes of host memory inside an arena chunk."""

    chunk: Chunk
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


#: Steps in a row without host memory after which an arena gives its memory back.
IDLE_STEPS = 2

# Note [an idle arena lets go]: a step that takes no host memory (auto's plan keeps every block
# after its measuring steps streamed them all) leaves the arena's chunks to nobody: the 8B run on
# the H200 held 17 to 33 GiB of pinned host memory that way. After `IDLE_STEPS` such steps in a
# row with nothing live, every chunk goes and so do the plans laid out on them; a step that takes
# host memory again is traced and planned afresh (its layout, solved once, is cached by
# signature: actoff.memory.arenas).


# Note [host slot reuse]: a returned slot is handed out again only once every copy
# into or out of it (their tickets, given to `free`) is done, and `free` never waits
# for them. The compute stream waited for those copies, the host did not: a slot
# reused at once could be refilled by an NVMe read on a host thread while a DMA still
# touches it. The host must not wait either: the autograd thread runs ahead of the
# copy streams. Slots returned early wait in the arena's `_deferred`, with their tickets.
#
# An arena dropped (`actoff.reset`, a thread's runtime collected after the thread ended)
# with such slots would free their chunks while the copies run, and another thread's
# arena could be handed that memory: its last act (`_settle`) is to wait for them.

# Note [frees from the collector]: `free` runs from autograd's release of a handle, which
# the garbage collector can start inside any allocation, this arena's own included. It
# only queues the slot (atomic append, no lock); the next lock holder returns it first.


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
        self.memory = HostMemory(backend)  # pinned, or pageable past `memory.pinned_budget`
        self.high_water = 0  # most bytes in use at once since the last consolidation
        self._chunks: list[Chunk] = []
        self._lock = threading.Lock()
        # Planner trace while ``tracing``: [size, alloc, free or None, tag] on a logical clock.
        self.tracing = False
        self.clock = 0
        self.trace: list[list] = []
        self.trace_generation = next(_GENERATIONS)
        # Plans of the last shapes of step, all laying out the planned chunk (Note [a host plan
        # per shape], actoff.memory.host_plans).
        self.plans = HostPlans()
        self.plan_method = "none"  # where the plan in force came from: shown in stats
        self.planned: Chunk | None = None
        self.divergences = self.total_divergences = 0  # since the last begin_step; ever
        self._live_planned: dict[int, int] = {}  # offset -> end, in the planned chunk
        self.idle_steps = 0  # steps in a row that took no host memory (Note [an idle arena lets go])
        self._deferred: list[tuple[Slot, tuple]] = []  # Note [host slot reuse]
        weakref.finalize(self, _settle, self._deferred, os.getpid()).atexit = False
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
    def num_allocations(self) -> int:
        """Host buffers ever allocated (cudaHostAlloc on CUDA)."""
        return self.memory.num_allocations

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

    @property
    def plan(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The plan in force as ``(sizes, offsets)``, or ``None``."""
        current = self.plans.current
        return None if current is None else (current.sizes, current.offsets)

    def begin_step(self) -> None:
        """A new step: the next request is request 0 of the plan. A trace the last step left
        unplanned (its records outlived it) is dropped: a plan is one step's."""
        with self._locked():
            self.plans.begin_step()
            self.divergences = 0
            if self.trace:
                self.trace = []
                self.trace_generation = next(_GENERATIONS)

    def install_plan(
        self, sizes: tuple[int, ...], offsets: tuple[int, ...], peak: int, method: str = "none"
    ) -> None:
        """Serve later steps of this shape at these offsets, in the planned chunk, grown to
        ``peak`` bytes if smaller; the plan is kept beside those of other shapes (Note [a host
        plan per shape]). Not installed (no plan in force) when that chunk would not fit in the
        budget.
        """
        with self._locked():
            # A step boundary, once per plan: the old chunks whose copies are done can go. It
            # runs at the end of backward, so never wait: a chunk with copies still touching a
            # returned slot stays (live) until they end.
            self._reap(wait=False)
            # Bump chunks with nothing live are no longer needed, nor a planned chunk too small
            # for this plan: give their memory back before a new chunk adds to it.
            dropped = not all(chunk.live for chunk in self._chunks)
            self._chunks = [chunk for chunk in self._chunks if chunk.live]
            need = align_up(max(peak, 1))
            grow = self.planned is None or self.planned.usable < need
            if grow and self.planned is not None:
                # Live slots of the old chunk keep it alive; the arena stops counting it.
                dropped = dropped or not self._live_planned
                self.planned, self._live_planned = None, {}
            if dropped:
                self.backend.release_host_cache()
            if grow:
                held = sum(chunk.capacity for chunk in self._chunks)
                room = None if self.budget is None else self.budget - held
                self.planned = self.memory.allocate(need, need, room)
                if self.planned is None:
                    self.plans.current = None
                    self.plan_method = "none (the plan does not fit the host budget)"
                    return
                self.planned.planned = True
            self.plans.add(HostPlan(tuple(sizes), tuple(offsets), peak, method))
            self.plan_method = method

    def idle_step(self) -> None:
        """A step that took no host memory ended (Note [an idle arena lets go])."""
        with self._locked():
            self._reap(wait=False)
            self.idle_steps += 1
            busy = self._live_planned or self._deferred or any(chunk.live for chunk in self._chunks)
            if self.idle_steps >= IDLE_STEPS and not busy and (self.planned is not None or self._chunks):
                self.planned, self._chunks, self.plans, self.plan_method = None, [], HostPlans(), "none"
                self.backend.release_host_cache()

    def drop_spare_chunks(self) -> None:
        """After a step that kept to its plans: its empty bump chunks are not needed (one that
        copies held at the last plan's install goes once they end)."""
        with self._locked():
            self._reap(wait=False)
            if not all(chunk.live for chunk in self._chunks):
                self._chunks = [chunk for chunk in self._chunks if chunk.live]
                self.backend.release_host_cache()

    def _take_planned(self, size: int) -> tuple[Chunk, int] | None:
        offset = self.plans.place(size, room=self.planned.usable)
        if offset is not None:
            self.plan_method = self.plans.current.method
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

    def _fit(self, size: int) -> tuple[Chunk, int] | None:
        """The lowest free room of ``size`` bytes in the planned chunk."""
        offset = None if self.planned is None else lowest_fit(self._live_planned, self.planned.usable, size)
        if offset is None:
            return None
        self._live_planned[offset] = offset + size
        return self.planned, offset

    def alloc(self, nbytes: int, tag: object = None) -> Slot | None:
        """A slot of ``nbytes``, or ``None`` when the budget does not allow it. ``tag`` (the
        block, say) goes into the trace."""
        size = align_up(max(nbytes, 1))
        with self._locked():
            self._reap(wait=False)
            place = self._take_planned(size) if len(self.plans) and self.planned is not None else None
            if place is None:
                place = self._fit(size) or self._bump(size, grow=False)
            if place is None and self._deferred:  # the room is held by copies still running:
                self._reap(wait=True)  # wait for them rather than hold more memory
                place = self._fit(size) or self._bump(size, grow=False)
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

    def _bump(self, size: int, *, grow: bool) -> tuple[Chunk, int] | None:
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
            want = align_up(need, _MIN_CHUNK)
            if self.memory.request(need, want, self.budget, fall_back=False) is None:
                return  # one chunk of that size would break the host or the pinned budget: keep these
            self._chunks = []
            self.backend.release_host_cache()  # before the new chunk: never both held at once
            chunk = self.memory.allocate(need, want, self.budget)
            self._chunks = [chunk] if chunk is not None else []

    def _grow(self, size: int) -> Chunk | None:
        # Grow geometrically so a first step needs few chunks; never past the budget.
        want = max(size, _MIN_CHUNK, self.capacity)
        room = None if self.budget is None else self.budget - self.capacity
        chunk = self.memory.allocate(size, want, room)
        if chunk is not None:
            self._chunks.append(chunk)
        return chunk if chunk is not None and chunk.usable >= size else None


def _settle(deferred: list[tuple[Slot, tuple]], pid: int) -> None:
    """A dropped arena's returned slots: their chunks live until the copies touching them end
    (not at exit, nor in a forked child, where the copies are the parent's)."""
    if os.getpid() != pid:
        return
    for _, tickets in deferred:
        for ticket in tickets:
            ticket.synchronize()
    deferred.clear()
