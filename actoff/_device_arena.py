"""Device arena: the device buffers actoff allocates in backward, served at planned offsets from
a few buffers of planned sizes.

What it serves, on backends with streams (CUDA, the simulated device): the destinations of
copies back (actoff._tiers, actoff._tier_nvme; packed token rows included) and the tensors a
token-wise run rebuilds (actoff._tokenwise). Every step is traced: each request's key (which
run, what, which record), size, and lifetime on a logical clock that ticks at every request and
every death. After a step the planner lays the trace out (actoff._layout); from then on a
request whose key the plan knows, at the planned size, is served at its offset in its run's
buffer, held only while that run needs it (Note [a buffer per run]).

A request the plan does not know (another key or size: a new length or batch) is a divergence,
and the step it happened in becomes the next plan. A planned range still held (a tenant that
lives longer than in the traced step: an NVMe read that landed late), or a request that is
usually not made (`expect`), is a fallback: served from a free gap of its run's buffer, else by a new
allocation; two steps in a row with fallbacks are planned again. Either way a request never
gets bytes that a live tenant holds.

Note [device tenants]: a request gets a tensor with a storage of its own that points into the
buffer (a DLPack round trip of a view of it). Its range is free again when that storage dies:
the record, autograd and anyone else are done with it. A plain view would share the buffer's
storage, whose death says nothing about the view's.

Note [device arena reuse]: a range whose tenant died is handed out again only on the stream the
buffer was allocated on (the compute stream). Every use of the old tenant was queued on that
stream before it died, or on a copy stream that stream waited for (Note [no record_stream]); the
new tenant is written by that stream, or by the host-to-device stream after it waits for the
compute stream. So a range is reused only after its previous tenant is dead and ordered. A
request on another stream is a fallback with a new allocation. Tensors of the arena ignore
``record_stream`` (their memory is not the caching allocator's): code that hands a fetched
activation to another stream must keep it referenced until that stream is done with it.

Note [a buffer per run]: the plan is MEMO's bi-level one, with a run's (block's) fetches and its
rebuilds as the groups: each laid out together, then placed as rectangles in one address space.
Each group's range (its hull) is a buffer of its own, taken from the device's allocator at the
group's first planned request (fetches at the prefetch, rebuilds at the run's first unpack) and
given back when the run's records are all released (`run_done`), when every planned request of it
was made and its tenants are dead, or at the step's end. The first design took one buffer of the
whole plan at the step's first request and held it through backward: at the step's peak it held
the ranges of runs not fetched yet. That peak is often early in backward (the last block, where
the gradients are largest) while the plan's own peak comes later (two whole blocks at once): on
the simulated device at 2048 tokens (cpu, tiles, chunked loss) the one buffer held 6-14 MiB more
than the tenants alive at the step's peak, and the longest sequence was 3200 tokens against 3968
with the planner off (3840 per run); held through forward too, the peak was 15-47% over the
unplanned run's. Per run, the arena holds what the runs being worked on need: a fixed set of
sizes allocated in the same order every step, which the caching allocator serves from the same
cached blocks (MEMO's two buffers alternating between even and odd blocks, where blocks are
alike). A buffer's tenants still alive keep it through their storages (Note [device tenants]),
so giving it back never frees bytes in use.

A buffer's start has the alignment of any fresh allocation of the device (512 bytes on CUDA, 64
on the CPU) and offsets in it are multiples of ALIGNMENT, so a tenant is aligned as well as a
tensor of its own would be, and kernels that pick a path by alignment pick the same one.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from ._arena import align_up
from .planner import Layout

__all__ = ["ALIGNMENT", "DeviceArena", "first_fit"]

#: Offsets and sizes are multiples of this: the caching allocator's granularity, which keeps the
#: 256-byte alignment a rebuilt tensor needs (actoff._record.TensorLayout).
ALIGNMENT = 512
_GENERATIONS = itertools.count()  # trace generations, unique in the process


class _RunBuffer:
    """The buffer of one group's hull (a run's fetches or its rebuilds: Note [a buffer per run])
    and its tenants alive."""

    __slots__ = ("buffer", "ident", "live", "low", "pending", "stream")

    def __init__(self, buffer: torch.Tensor, ident: int, low: int, pending: int, stream: Any) -> None:
        self.buffer = buffer  # (hull size,) uint8
        self.ident = ident  # unique in the process: deaths of an older buffer's tenants are ignored
        self.low = low  # the hull's start in the plan's address space
        self.pending = pending  # planned requests of the group not made yet this step
        self.stream = stream  # the stream it was allocated on (Note [device arena reuse])
        self.live: dict[int, int] = {}  # offset -> end (in the buffer) of its tenants alive


class DeviceArena:
    """Buffers of the planned sizes, one per run being worked on (Note [a buffer per run]),
    handed out as tenants at planned offsets.

    Thread-safe: tenants die on autograd's threads and in the garbage collector.

    >>> import torch
    >>> from actoff._device import StreamBackend
    >>> from actoff._simdevice import SimSettings, SimStreams
    >>> from actoff.planner import Buffer, solve
    >>> streams = SimStreams(SimSettings())
    >>> arena = DeviceArena(StreamBackend(torch.device("cpu"), streams))
    >>> x = arena.empty(256, torch.float32, key=(0, "fetch", 0), tag=0)  # no plan: a new tensor
    >>> del x
    >>> trace = arena.take_trace(); trace
    [(1024, 1, 2, (0, 'fetch', 0, 0), 0)]
    >>> layout = solve([Buffer(*entry[:3]) for entry in trace])
    >>> arena.install_plan([entry[3] for entry in trace], [entry[0] for entry in trace], layout)
    >>> arena.begin_step()
    >>> y = arena.empty(256, torch.float32, key=(0, "fetch", 0), tag=0)  # at its planned offset
    >>> arena.served, arena.num_allocations, arena.capacity
    (1, 1, 1024)
    >>> del y; streams.close()
    """

    kind = "device-arena"
    alignment = ALIGNMENT

    def __init__(self, backend: Any) -> None:
        self.backend = backend  # an actoff._device.StreamBackend
        self.streams = backend.streams
        self.buffers: dict[tuple, _RunBuffer] = {}  # part (see `hulls`) -> its buffer now
        self.num_allocations = 0  # buffers ever taken (Note [a buffer per run])
        self.size = 0  # most bytes of buffers held at once in the last step (shown in stats)
        # The plan: key -> (size, offset), each group's hull in the plan's address space (part ->
        # (low, high); a part is a run's fetches or its rebuilds: a key's first two items) and
        # how many planned requests it has, and the layout (in stats).
        self.plan: dict[tuple, tuple[int, int]] | None = None
        self.hulls: dict[tuple, tuple[int, int]] = {}
        self._planned: dict[tuple, int] = {}
        self.layout: Layout | None = None
        # This step: requests by key (a key asked twice gets an occurrence number), those served
        # as planned, divergences and fallbacks (see the module docstring); over the process.
        self.seen: dict[tuple, int] = {}
        self.expected: set[tuple] = set()  # keys `expect`ed in a step so far
        self.requests = self.served = self.divergences = self.fallbacks = 0
        self.last_fallbacks = 0  # the previous step's, under the same plan
        self._new_plan = False
        self.total_divergences = self.total_fallbacks = 0
        self._lock = threading.Lock()
        # Note [frees from the collector] (actoff._arena): a tenant dies on any thread, inside
        # any allocation; its death is only queued, and handled under the lock before the next
        # request, so the trace keeps the order of deaths and requests.
        self._returned: collections.deque[tuple] = collections.deque()
        # The trace: [size, start, end or None, key, tag] on the clock (`take_trace`).
        self.clock = 0
        self.trace: list[list] = []
        self.trace_generation = next(_GENERATIONS)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            while self._returned:
                self._died(*self._returned.popleft())
            yield

    @property
    def capacity(self) -> int:
        """Bytes of the buffers held now."""
        return sum(held.buffer.numel() for held in list(self.buffers.values()))

    def give_back(self) -> None:
        """The step's backward is over: drop the buffers still held (Note [a buffer per run]);
        the next planned requests take them again."""
        with self._locked():
            self.buffers = {}

    def run_done(self, run: Any) -> None:
        """``run``'s records are all released: its buffer is given back (its tenants still alive
        keep it until they die, Note [device tenants]); a planned request it did not make (a
        record served from the device this step) will not come now."""
        with self._locked():
            for part in [part for part in self.buffers if part[0] == run]:
                del self.buffers[part]

    def begin_step(self) -> None:
        """A new step: keys count from zero and a new trace starts; buffers still held (a step
        whose records did not all come back) are given back."""
        self.give_back()
        with self._locked():
            self.seen.clear()
            self.last_fallbacks = 0 if self._new_plan else self.fallbacks
            self._new_plan = False
            self.requests = self.served = self.divergences = self.fallbacks = 0
            self.size = 0
            self._new_trace()

    def wants_plan(self) -> bool:
        """After a step: no plan yet, a divergence, or fallbacks two steps in a row."""
        return self.plan is None or bool(self.divergences) or bool(self.fallbacks and self.last_fallbacks)

    def install_plan(self, keys: Sequence[tuple], sizes: Sequence[int], layout: Layout) -> None:
        """Serve the next steps' requests for ``keys`` (of ``sizes``; a key's first item is its
        run, its first two items its group) at ``layout.offsets``, each group's from a buffer of
        its hull."""
        with self._locked():
            # Buffers still held were cut to the old plan's hulls, which the new offsets do not
            # fit: let them go (their tenants keep them, Note [device tenants]).
            self.buffers = {}
            self.plan, self.hulls, self._planned = {}, {}, collections.Counter()
            for key, size, offset in zip(keys, sizes, layout.offsets, strict=True):
                self.plan[key] = (size, offset)
                low, high = self.hulls.get(key[:2], (offset, offset + size))
                self.hulls[key[:2]] = (min(low, offset), max(high, offset + size))
                self._planned[key[:2]] += 1
            self.layout = layout
            self._new_plan = True

    def empty(self, numel: int, dtype: torch.dtype, key: tuple, tag: Any = None) -> torch.Tensor:
        """A 1-D device tensor of ``numel`` elements of ``dtype`` for the request ``key`` (the same
        in every step: run, what, record); ``tag`` (the run) groups requests for the planner."""
        nbytes = numel * dtype.itemsize
        size = align_up(max(nbytes, 1), ALIGNMENT)
        with self._locked():
            key = self._occurrence(key)
            self.requests += 1
            held, offset = self._place(key, size)
            if held is None:
                tenant = self.backend.device_empty(numel, dtype)  # on the compute stream
            else:  # Note [device tenants]
                held.live[offset] = offset + size
                tenant = from_dlpack(to_dlpack(held.buffer[offset : offset + nbytes])).view(dtype)
            self._trace(size, key, tag, tenant.untyped_storage(), held, offset)
        return tenant

    def expect(self, key: tuple) -> None:
        """A request this step does not make but another may: a record still on the device at
        backward is served from it (Note [forward what is still on the device]), but in another
        step its copy may be over by then and it is fetched. That request is a fallback, not a
        divergence: the plan keeps no room for what is rarely fetched."""
        with self._locked():
            self.expected.add(self._occurrence(key))

    def _occurrence(self, key: tuple) -> tuple:
        occurrence = self.seen.get(key, 0)
        self.seen[key] = occurrence + 1
        return (*key, occurrence)

    def _trace(
        self, size: int, key: tuple, tag: Any, holder: object, held: _RunBuffer | None, offset: int
    ) -> None:
        self.clock += 1
        self.trace.append([size, self.clock, None, key, tag])
        death = (
            key[:2],
            held.ident if held is not None else -1,
            offset,
            len(self.trace) - 1,
            self.trace_generation,
        )
        weakref.finalize(holder, self._returned.append, death)

    def _place(self, key: tuple, size: int) -> tuple[_RunBuffer | None, int]:
        """The buffer and offset of a request, or (None, 0) for a new allocation."""
        planned = self.plan.get(key) if self.plan is not None else None
        if planned is not None and planned[0] == size:
            held = self._buffer(key[:2])
            if held is not None:
                held.pending -= 1
                offset = planned[1] - held.low
                if 0 <= offset <= held.buffer.numel() - size and _free(held.live, offset, size):
                    self.served += 1
                    return held, offset
        if (planned is not None and planned[0] == size) or key in self.expected:
            self.fallbacks += 1
            self.total_fallbacks += 1
        elif self.plan is not None:
            self.divergences += 1
            self.total_divergences += 1
        # Not as planned: a free gap of the run's buffer, if it holds one, rather than more memory.
        held = self.buffers.get(key[:2])
        if held is not None and held.stream == self.streams.current():
            offset = first_fit(held.live, size, held.buffer.numel())
            if offset is not None:
                return held, offset
        return None, 0

    def _buffer(self, part: tuple) -> _RunBuffer | None:
        """The buffer of ``run``'s hull for the current stream, taken if need be (None: it is
        held for another stream)."""
        current = self.streams.current()
        held = self.buffers.get(part)
        if held is not None:
            return held if held.stream == current else None
        low, high = self.hulls[part]
        # The previous buffer's tenants keep it alive through their storages until they die.
        buffer = self.backend.device_empty(high - low, torch.uint8)
        held = self.buffers[part] = _RunBuffer(buffer, next(_GENERATIONS), low, self._planned[part], current)
        self.num_allocations += 1
        self.size = max(self.size, self.capacity)
        return held

    def _died(self, part: tuple, ident: int, offset: int, index: int, generation: int) -> None:
        held = self.buffers.get(part)
        if held is not None and held.ident == ident:
            held.live.pop(offset, None)
            if held.pending <= 0 and not held.live:  # the run is done with it: give it back
                del self.buffers[part]
        if generation == self.trace_generation:
            self.clock += 1
            self.trace[index][2] = self.clock

    def take_trace(self) -> list[tuple[int, int, int, tuple, Any]]:
        """The requests traced since the step began whose tenants have died, as ``(size, start,
        end, key, tag)``; starts a new trace."""
        with self._locked():
            done = [
                (size, start, end, key, tag) for size, start, end, key, tag in self.trace if end is not None
            ]
            self._new_trace()
            return done

    def _new_trace(self) -> None:
        self.trace = []  # tenants still live belong to the old generation: not traced on
        self.trace_generation = next(_GENERATIONS)

    def stats(self) -> dict[str, Any]:
        """Figures for ``actoff.stats()``: the most buffer bytes held at once, the plan's peak and
        lower bound, solve time, method, buffers allocated, divergences and fallbacks."""
        layout = self.layout
        return {
            "bytes": self.size,
            "plan_bytes": layout.peak if layout is not None else 0,
            "lower_bound": layout.lower_bound if layout is not None else 0,
            "solve_s": layout.solve_s if layout is not None else 0.0,
            "method": layout.method if layout is not None else "none",
            "allocations": self.num_allocations,
            "divergences": self.total_divergences,
            "fallbacks": self.total_fallbacks,
        }


def _free(live: dict[int, int], offset: int, size: int) -> bool:
    end = offset + size
    return all(end <= low or high <= offset for low, high in live.items())


def first_fit(live: dict[int, int], size: int, capacity: int) -> int | None:
    """The lowest offset where ``size`` bytes fit between the ``live`` ranges (offset -> end)
    below ``capacity``, or None.

    >>> first_fit({0: 512, 1024: 2048}, 512, 4096)
    512
    >>> first_fit({0: 4096}, 512, 4096) is None
    True
    """
    cursor = 0
    for low in sorted(live):
        if low - cursor >= size:
            return cursor
        cursor = max(cursor, live[low])
    return cursor if capacity - cursor >= size else None
