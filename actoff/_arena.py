"""Host arena: host (pinned on CUDA) memory allocated once and handed out as aligned slots.

A step's offloads are allocated in forward order and freed in backward order, so a bump
allocator over a few chunks fits: a chunk rewinds when its last slot is freed. The first
step may need several chunks; when a step ends with every chunk empty, they are replaced by
one chunk as large as the step's high-water mark, so later steps of the same shape allocate
nothing (`num_allocations` stays put: the tests count it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ._device import DeviceBackend

__all__ = ["ALIGNMENT", "HostArena", "Slot"]

#: Slot alignment in bytes: O_DIRECT-ready (4 KiB) for the NVMe path's staging buffers.
ALIGNMENT = 4096
_MIN_CHUNK = 16 * 2**20


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment``: ``align_up(1) == 4096``."""
    return (value + alignment - 1) // alignment * alignment


class _Chunk:
    __slots__ = ("buffer", "capacity", "live", "top")

    def __init__(self, buffer: torch.Tensor, capacity: int) -> None:
        self.buffer = buffer  # (capacity,) uint8, ALIGNMENT-aligned start
        self.capacity = capacity
        self.top = 0
        self.live = 0


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

    >>> from actoff._device import CpuBackend
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
        # Buffer trace for the planner, only while ``tracing``: [size, alloc time, free time
        # or None, tag] on a logical clock that ticks at every alloc and free.
        self.tracing = False
        self.clock = 0
        self.trace: list[list] = []
        self.trace_generation = 0

    @property
    def capacity(self) -> int:
        """Bytes of host memory held by the arena."""
        return sum(chunk.capacity for chunk in self._chunks)

    @property
    def used(self) -> int:
        """Bytes currently handed out (including alignment padding)."""
        return sum(chunk.top for chunk in self._chunks if chunk.live)

    def alloc(self, nbytes: int, tag: object = None) -> Slot | None:
        """A slot of ``nbytes``, or ``None`` when the budget does not allow it. ``tag`` (the
        block, say) goes into the trace."""
        size = align_up(max(nbytes, 1))
        with self._lock:
            chunk = next((c for c in self._chunks if c.capacity - c.top >= size), None)
            if chunk is None:
                chunk = self._grow(size)
                if chunk is None:
                    return None
            index = -1
            if self.tracing:
                self.clock += 1
                self.trace.append([size, self.clock, None, tag])
                index = len(self.trace) - 1
            slot = Slot(chunk, chunk.top, nbytes, index, self.trace_generation)
            chunk.top += size
            chunk.live += 1
            self.high_water = max(self.high_water, self.used)
            return slot

    def free(self, slot: Slot) -> None:
        """Return ``slot``; its chunk rewinds when its last slot comes back."""
        with self._lock:
            if self.tracing and slot.trace_generation == self.trace_generation and slot.trace_index >= 0:
                self.clock += 1
                self.trace[slot.trace_index][2] = self.clock
            chunk = slot.chunk
            chunk.live -= 1
            if chunk.live == 0:
                chunk.top = 0

    def take_trace(self) -> list[tuple[int, int, int, object]]:
        """The finished buffers traced so far as ``(size, start, end, tag)``; starts a new trace.

        >>> from actoff._device import CpuBackend
        >>> arena = HostArena(CpuBackend())
        >>> arena.tracing = True
        >>> a = arena.alloc(10, tag="block0"); arena.free(a)
        >>> arena.take_trace()
        [(4096, 1, 2, 'block0')]
        """
        with self._lock:
            done = [(size, start, end, tag) for size, start, end, tag in self.trace if end is not None]
            self.trace = []  # slots still live belong to the old generation: not traced on
            self.trace_generation += 1
            return done

    def consolidate(self) -> None:
        """At a step boundary: merge several empty chunks into one of the high-water size."""
        with self._lock:
            if len(self._chunks) <= 1 or any(chunk.live for chunk in self._chunks):
                return
            size = align_up(self.high_water, _MIN_CHUNK)
            if self.budget is not None:
                size = min(size, self.budget)
            self._chunks = []
            self._chunks.append(self._new_chunk(size))

    def _grow(self, size: int) -> _Chunk | None:
        # Grow geometrically so a first step needs few chunks; never past the budget.
        want = max(size, _MIN_CHUNK, self.capacity)
        if self.budget is not None:
            room = self.budget - self.capacity
            if room < size:
                return None
            want = min(want, room)
        chunk = self._new_chunk(want)
        self._chunks.append(chunk)
        return chunk

    def _new_chunk(self, capacity: int) -> _Chunk:
        raw = self.backend.host_empty(capacity + ALIGNMENT)
        self.num_allocations += 1
        pad = (-raw.data_ptr()) % ALIGNMENT
        return _Chunk(raw[pad : pad + capacity], capacity)
