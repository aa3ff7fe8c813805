"""Device arena: the device buffers actoff allocates in backward, served from one buffer at
planned offsets.

What it serves, on backends with streams (CUDA, the simulated device): the destinations of
copies back (actoff._tiers, actoff._tier_nvme; packed token rows included) and the tensors a
token-wise run rebuilds (actoff._tokenwise). Every step is traced: each request's key (which
run, what, which record), size, and lifetime on a logical clock that ticks at every request and
every death. After a step the planner lays the trace out (actoff._layout); from then on a
request whose key the plan knows, at the planned size, is served at its offset in one buffer,
held only while backward needs it (Note [the arena between backwards]).

A request the plan does not know (another key or size: a new length or batch) is a divergence,
and the step it happened in becomes the next plan. A planned range still held (a tenant that
lives longer than in the traced step: an NVMe read that landed late), or a request that is
usually not made (`expect`), is a fallback: served from a free gap of the buffer, else by a new
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

Note [the arena between backwards]: the buffer is taken from the device's allocator at a step's
first planned request and given back (`give_back`) when the step's last record is released, or
at the next step's start. Held through forward, the loss and the optimizer step, it would add its
whole size to their peaks, where actoff needs none of it (per-request tensors, the planner off,
come and go): on the simulated device that made the planned run's peak 15-47% higher than the
unplanned one's. Given back, it is one allocation of one size per step, not one per request: on
CUDA the caching allocator hands the same cached block back. Its tenants still alive keep it
through their storages (Note [device tenants]), so giving it back never frees bytes in use.

Its start has the alignment of any fresh allocation of the device (512 bytes on CUDA, 64 on the
CPU) and offsets are multiples of ALIGNMENT, so a tenant is aligned as well as a tensor of its
own would be, and kernels that pick a path by alignment pick the same one.
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


class DeviceArena:
    """One device buffer of a step's planned size, handed out as tenants at planned offsets, held
    through backward only.

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
        self.buffer: torch.Tensor | None = None  # (capacity,) uint8, held through backward only
        self.buffer_id = 0  # tells tenants of a replaced buffer apart
        self.stream: Any = None  # the stream the buffer was allocated on (Note [device arena reuse])
        self.num_allocations = 0  # buffers ever taken (one per step: Note [the arena between backwards])
        self.size = 0  # bytes of the last buffer taken (shown in stats)
        # The plan: key -> (size, offset), and the layout it came from (shown in stats).
        self.plan: dict[tuple, tuple[int, int]] | None = None
        self.layout: Layout | None = None
        # This step: requests by key (a key asked twice gets an occurrence number), those served
        # as planned, divergences and fallbacks (see the module docstring); over the process.
        self.seen: dict[tuple, int] = {}
        self.expected: set[tuple] = set()  # keys `expect`ed in a step so far
        self.requests = self.served = self.divergences = self.fallbacks = 0
        self.last_fallbacks = 0  # the previous step's, under the same plan
        self._new_plan = False
        self.total_divergences = self.total_fallbacks = 0
        self._live: dict[int, int] = {}  # offset -> end of tenants in the current buffer
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
        """Bytes of the device buffer (0 before the first plan is used)."""
        return 0 if self.buffer is None else self.buffer.numel()

    @property
    def live_ranges(self) -> dict[int, int]:
        """Offset -> end of the tenants alive in the buffer now."""
        with self._locked():
            return dict(self._live)

    def give_back(self) -> None:
        """The step's backward is over: drop the buffer (Note [the arena between backwards]); the
        next planned request takes one again."""
        with self._locked():
            self.buffer = None
            self.buffer_id += 1  # deaths of its tenants no longer concern the ranges handed out
            self._live = {}
            self.stream = None

    def begin_step(self) -> None:
        """A new step: keys count from zero and a new trace starts; a buffer still held (a step
        whose records did not all come back) is given back."""
        self.give_back()
        with self._locked():
            self.seen.clear()
            self.last_fallbacks = 0 if self._new_plan else self.fallbacks
            self._new_plan = False
            self.requests = self.served = self.divergences = self.fallbacks = 0
            self._new_trace()

    def wants_plan(self) -> bool:
        """After a step: no plan yet, a divergence, or fallbacks two steps in a row."""
        return self.plan is None or bool(self.divergences) or bool(self.fallbacks and self.last_fallbacks)

    def install_plan(self, keys: Sequence[tuple], sizes: Sequence[int], layout: Layout) -> None:
        """Serve the next steps' requests for ``keys`` (of ``sizes``) at ``layout.offsets``; the
        buffer is (re)allocated at the first request that needs more than it has."""
        with self._locked():
            self.plan = {
                key: (size, offset) for key, size, offset in zip(keys, sizes, layout.offsets, strict=True)
            }
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
            offset = self._place(key, size)
            if offset is None:
                tenant = self.backend.device_empty(numel, dtype)  # on the compute stream
            else:  # Note [device tenants]
                self._live[offset] = offset + size
                tenant = from_dlpack(to_dlpack(self.buffer[offset : offset + nbytes])).view(dtype)
            self._trace(size, key, tag, tenant.untyped_storage(), offset)
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

    def _trace(self, size: int, key: tuple, tag: Any, holder: object, offset: int | None) -> None:
        self.clock += 1
        self.trace.append([size, self.clock, None, key, tag])
        death = (
            self.buffer_id if offset is not None else -1,
            offset,
            len(self.trace) - 1,
            self.trace_generation,
        )
        weakref.finalize(holder, self._returned.append, death)

    def _place(self, key: tuple, size: int) -> int | None:
        """The offset of a request in the buffer, or None for a new allocation."""
        planned = self.plan.get(key) if self.plan is not None else None
        if planned is not None and planned[0] == size and self._usable() and self._free(planned[1], size):
            self.served += 1
            return planned[1]
        if (planned is not None and planned[0] == size) or key in self.expected:
            self.fallbacks += 1
            self.total_fallbacks += 1
        elif self.plan is not None:
            self.divergences += 1
            self.total_divergences += 1
        # Not as planned: a free gap of the buffer, if any, rather than more memory.
        if self.buffer is not None and self.streams.current() == self.stream:
            return first_fit(self._live, size, self.capacity)
        return None

    def _usable(self) -> bool:
        """The buffer holds the plan and serves the current stream; taken if need be."""
        current, peak = self.streams.current(), self.layout.peak
        if self.buffer is not None and self.capacity >= peak:
            return current == self.stream
        # Tenants of the old buffer keep it alive through their storages until they die.
        self.buffer = self.backend.device_empty(peak, torch.uint8)
        self.size = peak
        self.buffer_id += 1
        self.num_allocations += 1
        self.stream = current
        self._live = {}
        return True

    def _free(self, offset: int, size: int) -> bool:
        end = offset + size
        return all(end <= low or high <= offset for low, high in self._live.items())

    def _died(self, buffer_id: int, offset: int | None, index: int, generation: int) -> None:
        if offset is not None and buffer_id == self.buffer_id:
            self._live.pop(offset, None)
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
        """Figures for ``actoff.stats()``: buffer bytes, the plan's peak and lower bound, solve
        time, method, buffers allocated, divergences and fallbacks."""
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
