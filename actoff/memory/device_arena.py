"""Device arena: the device buffers actoff allocates in backward, served at planned offsets from
a few buffers of planned sizes.

What it serves, on backends with streams (CUDA, the simulated device): the destinations of
copies back (actoff.tiers.base, actoff.tiers.nvme.tier; packed token rows included) and the tensors a
token-wise run rebuilds (actoff.tiers.tokenwise.tier). Every step is traced: each request's key (which
run, what, which record), size, and lifetime on a logical clock that ticks at every request and
every death. After a step the planner lays the trace out (actoff.memory.arenas); from then on a
request whose key the plan knows, at the planned size, is served at its offset in its part's
buffer, held only while its tenants live (Note [a buffer per wave]).

A request the plan does not know (another key or size: a new length or batch) is a divergence,
and its step becomes the next plan; plans of the last shapes are kept, and a shape that comes
back is served by its own (Note [a plan per shape], actoff.memory.device_plans). A planned range still
held (a tenant that lives longer than in the traced step: an NVMe read that landed late), or a
request usually not made (`expect`), is a fallback: a new allocation, as PyTorch would make (a
free gap of a part's buffer is kept for the part's requests to come, and a tenant there would
keep the buffer alive past its wave); two steps in a row with fallbacks are planned again.
Either way a request never gets bytes that a live tenant holds.

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

Note [a buffer per wave]: each part of the plan has a buffer of its own, taken from the device's
allocator at the part's first planned request (fetches at the prefetch, rebuilds at the run's
first unpack) and let go at its last; from then on only its tenants hold it
(Note [device tenants]) and it goes with the last of them, as the tensors would in PyTorch. The plan is
MEMO's bi-level one with parts as its groups: a part is a wave of one run's fetches or of its
rebuilds, the requests whose tenants die between the same two unpacks of the traced step
(autograd frees what a node saved together after the node's backward; `DeviceArena.unpacked`
counts them). A wave is as coarse as a part gets without holding a dead byte: one buffer for the
whole plan would hold, at the step's early peak, the ranges of runs not fetched yet, and a
buffer per run would hold each fetched tensor until the run's last one died.

A part with requests still to come is let go when the run's records are all released
(`run_done`) or at the step's end. Beyond PyTorch allocating each tensor alone, a part holds only
the ranges of its requests still to come and its layout's gap over its lower bound; what it
changes is that a step's device buffers are a fixed list of sizes, taken in the same order
every step and each returned whole.

Note [skipped requests]: a part's buffer spans only the requests the step will make. Records
still being copied out when backward starts are served from the device
(Note [forward what is still on the device], actoff.runtime.step), and how many of the last
block's varies with the copies' timing; the prefetch `expect`s those before it fetches the rest, and they are left out
of the buffer. The planner stacks requests live at once in the order they came, so the records
forwarded (the last placed) are the top of a range and the buffer is as short as what is
fetched; spanning the whole range would hold device memory no tenant uses.

A buffer starts aligned as any fresh allocation (512 bytes on CUDA, 64 on the CPU), offsets are
multiples of ALIGNMENT: kernels that pick a path by alignment pick the one a tensor's would.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from actoff.planner import Layout

from .device_plans import DevicePlan, DevicePlans
from .host_arena import align_up

if TYPE_CHECKING:
    from actoff.device.base import StreamBackend

__all__ = ["ALIGNMENT", "DeviceArena"]

#: Offsets and sizes are multiples of this: the caching allocator's granularity, which keeps the
#: 256-byte alignment a rebuilt tensor needs (actoff.tiers.record.TensorGeometry).
ALIGNMENT = 512
_GENERATIONS = itertools.count()  # trace generations, unique in the process


class _PartBuffer:
    """The buffer of one part's range (Note [a buffer per wave]) and its tenants alive."""

    __slots__ = ("buffer", "ident", "live", "low", "nbytes", "part", "pending", "stream")

    def __init__(self, buffer: torch.Tensor, part: tuple, low: int, pending: int, stream: Any) -> None:
        self.buffer: torch.Tensor | None = buffer  # (range size,) uint8; None once let go
        self.nbytes = buffer.numel()
        self.part = part
        self.ident = next(_GENERATIONS)  # unique in the process: tells buffers of a part apart
        self.low = low  # the range's start in the plan's address space
        self.pending = pending  # planned requests of the part not made yet this step
        self.stream = stream  # the stream it was allocated on (Note [device arena reuse])
        self.live: dict[int, int] = {}  # offset -> end (in the buffer) of its tenants alive


class _Trace:
    """A step's requests, ``[size, start, end or None, key, tag, epoch at death, epoch at the
    request]``, on a clock that ticks at every request and every death; tenants of an older
    generation are not traced."""

    __slots__ = ("clock", "entries", "generation")

    def __init__(self) -> None:
        self.new()

    def new(self) -> None:
        self.clock, self.entries, self.generation = 0, [], next(_GENERATIONS)

    def request(self, size: int, key: tuple, tag: Any, epoch: int) -> tuple[int, int]:
        """Trace a request made at ``epoch`` (unpacks so far); its index and generation, for its death."""
        self.clock += 1
        self.entries.append([size, self.clock, None, key, tag, None, epoch])
        return len(self.entries) - 1, self.generation

    def died(self, index: int, generation: int, epoch: int) -> None:
        if generation == self.generation:
            self.clock += 1
            self.entries[index][2] = self.clock
            self.entries[index][5] = epoch

    def take(self) -> list[tuple[int, int, int, tuple, Any, int, int]]:
        """The requests whose tenants have died; starts a new generation."""
        entries = self.entries
        self.new()
        return [tuple(entry) for entry in entries if entry[2] is not None]


class DeviceArena:
    """Buffers of the planned sizes, one per part (Note [a buffer per wave]), handed out as
    tenants at planned offsets.

    Thread-safe: tenants die on autograd's threads and in the garbage collector.

    >>> import torch
    >>> from actoff.device.base import StreamBackend
    >>> from actoff.device.sim.device import SimSettings, SimStreams
    >>> from actoff.memory.device_plans import DevicePlan
    >>> from actoff.planner import Buffer, solve
    >>> streams = SimStreams(SimSettings())
    >>> arena = DeviceArena(StreamBackend(torch.device("cpu"), streams))
    >>> x = arena.empty(256, torch.float32, key=(0, "fetch", 0), tag=0)  # no plan: a new tensor
    >>> del x
    >>> trace = arena.take_trace(); trace
    [(1024, 1, 2, (0, 'fetch', 0, 0), 0, 0, 0)]
    >>> layout = solve([Buffer(*entry[:3]) for entry in trace])
    >>> arena.install_plan(DevicePlan([entry[3] for entry in trace], [entry[0] for entry in trace], layout))
    >>> arena.begin_step()
    >>> y = arena.empty(256, torch.float32, key=(0, "fetch", 0), tag=0)  # at its planned offset
    >>> arena.served, arena.num_allocations, arena.capacity
    (1, 1, 1024)
    >>> del y; streams.close()
    """

    kind = "device-arena"
    alignment = ALIGNMENT

    def __init__(self, backend: StreamBackend) -> None:
        self.backend = backend
        self.streams = backend.streams
        self.buffers: dict[tuple, _PartBuffer] = {}  # part -> its buffer, while it has requests to come
        self.draining: dict[int, _PartBuffer] = {}  # ident -> a buffer let go, its tenants alive
        self.num_allocations = 0  # buffers ever taken (Note [a buffer per wave])
        self.size = 0  # most bytes of buffers alive at once in the last step (shown in stats)
        # The plan in force: key -> (size, offset in the plan's address space, part); each part's
        # keys; the layout (in stats). A part is a wave of a run's fetches or of its rebuilds.
        # Those of the last shapes of step are kept (Note [a plan per shape]).
        self.plan: dict[tuple, tuple[int, int, tuple]] | None = None
        self.parts: dict[tuple, list[tuple]] = {}
        self.layout: Layout | None = None
        self.plans = DevicePlans()  # `plans.current` is the plan in force
        # This step: requests by key (a key asked twice gets an occurrence number), those served
        # as planned, divergences and fallbacks (see the module docstring); over the process.
        self.seen: dict[tuple, int] = {}
        self.asked: list[tuple[tuple, int]] = []  # this step's requests, (key, size)
        self.expected: set[tuple] = set()  # keys `expect`ed in a step so far
        self.skipped: set[tuple] = set()  # keys `expect`ed this step: their requests will not come
        self.requests = self.served = self.divergences = self.fallbacks = 0
        self.total_divergences = self.total_fallbacks = 0
        self._lock = threading.Lock()
        # Note [frees from the collector] (actoff.memory.host_arena): a tenant dies on any thread, inside
        # any allocation; its death is only queued, and handled under the lock before the next
        # request, so the trace keeps the order of deaths and requests.
        self._returned: collections.deque[tuple] = collections.deque()
        self.trace = _Trace()  # `take_trace`
        self._epoch = [0]  # unpacks so far (`unpacked`), read as each tenant dies

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            while self._returned:
                self._died(*self._returned.popleft())
            yield

    @property
    def capacity(self) -> int:
        """Bytes of the buffers alive now: held for requests to come, or kept by tenants."""
        held = [*self.buffers.values(), *self.draining.values()]
        return sum(part_buffer.nbytes for part_buffer in held)

    def unpacked(self) -> None:
        """Backward unpacked a saved tensor: tenants dying before the next unpack are one wave
        (Note [a buffer per wave]); a death on another thread may join two neighbouring waves."""
        self._epoch[0] += 1

    def give_back(self) -> None:
        """Backward is over: the buffers still held are let go (Note [a buffer per wave])."""
        with self._locked():
            for held in list(self.buffers.values()):
                self._let_go(held)

    def run_done(self, run: int) -> None:
        """``run``'s records are all released: its buffers are let go; a planned request it did
        not make (a record served from the device this step) will not come now."""
        with self._locked():
            for held in [held for part, held in self.buffers.items() if part[0] == run]:
                self._let_go(held)

    def _let_go(self, held: _PartBuffer) -> None:
        """The arena needs ``held`` no more: its tenants alive keep its memory until they die
        (Note [device tenants]), so it goes with the last of them."""
        if self.buffers.get(held.part) is held:
            del self.buffers[held.part]
        held.buffer = None
        if held.live:
            self.draining[held.ident] = held

    def begin_step(self) -> None:
        """A new step: keys count from zero and a new trace starts; buffers still held (a step
        whose records did not all come back) are let go."""
        self.give_back()
        with self._locked():
            self.seen.clear()
            self.asked.clear()
            self.skipped.clear()
            self.plans.begin_step(self.fallbacks)
            self.requests = self.served = self.divergences = self.fallbacks = 0
            self.size = self.capacity
            self.trace.new()

    def wants_plan(self) -> bool:
        """After a step: no plan yet, a divergence, or fallbacks in two steps in a row of its plan."""
        return self.plan is None or bool(self.divergences) or self.plans.fell_back_twice(self.fallbacks)

    def install_plan(self, plan: DevicePlan) -> None:
        """Serve the next steps' requests from ``plan``, each part's from a buffer of its range;
        the plan is kept (Note [a plan per shape])."""
        with self._locked():
            # A replan with no divergence is of the same shape: it replaces the plan in force.
            self.plans.install(plan, self.fallbacks, replaces=not self.divergences)
            self._use(plan)

    def _use(self, plan: DevicePlan) -> None:
        """Serve from ``plan`` from now on. Buffers still held were cut to the old plan's ranges,
        which the new offsets do not fit: they are let go."""
        for held in list(self.buffers.values()):
            self._let_go(held)
        self.plan, self.parts, self.layout = plan.offsets, plan.parts, plan.layout

    def empty(self, numel: int, dtype: torch.dtype, key: tuple, tag: Any = None) -> torch.Tensor:
        """A 1-D device tensor of ``numel`` elements of ``dtype`` for the request ``key`` (the same
        in every step: run, what, record); ``tag`` (the run) is kept in the trace."""
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
                if held.pending <= 0:  # the part's last planned request: its tenants keep it
                    self._let_go(held)
            self._trace(size, key, tag, tenant.untyped_storage(), held, offset)
        return tenant

    def expect(self, key: tuple) -> None:
        """A request this step does not make but another may: a record still on the device at
        backward is served from it (Note [forward what is still on the device]), but in another
        step its copy may be over by then and it is fetched. That request is a fallback, not a
        divergence: the plan keeps no room for what is rarely fetched."""
        with self._locked():
            key = self._occurrence(key)
            self.expected.add(key)
            self.skipped.add(key)

    def _occurrence(self, key: tuple) -> tuple:
        occurrence = self.seen.get(key, 0)
        self.seen[key] = occurrence + 1
        return (*key, occurrence)

    def _trace(
        self, size: int, key: tuple, tag: Any, holder: object, held: _PartBuffer | None, offset: int
    ) -> None:
        index, generation = self.trace.request(size, key, tag, self._epoch[0])
        part, ident = (held.part, held.ident) if held is not None else (None, -1)
        # Not a bound method: a tenant alive (a graph kept) must not keep the arena alive.
        weakref.finalize(
            holder, _queue_death, self._returned, self._epoch, (part, ident, offset, index, generation)
        )

    def _place(self, key: tuple, size: int) -> tuple[_PartBuffer | None, int]:
        """The buffer and offset of a request, or (None, 0) for a new allocation."""
        planned = self.plan.get(key) if self.plan is not None else None
        if (planned is None or planned[0] != size) and key not in self.expected:  # Note [a plan per shape]
            other = self.plans.pick(key, size, self.asked)
            if other is not None:  # the requests made so far will not come again this step
                self.skipped.update(asked for asked, _ in self.asked)
                self._use(other)
                planned = other.offsets[key]
        self.asked.append((key, size))
        if planned is not None and planned[0] == size:
            held = self._buffer(planned[2])
            if held is not None:
                held.pending -= 1
                offset = planned[1] - held.low
                if 0 <= offset <= held.nbytes - size and _free(held.live, offset, size):
                    self.served += 1
                    return held, offset
                if held.pending <= 0:
                    self._let_go(held)
        if (planned is not None and planned[0] == size) or key in self.expected:
            self.fallbacks += 1
            self.total_fallbacks += 1
        elif self.plan is not None:
            self.divergences += 1
            self.total_divergences += 1
        return None, 0

    def _buffer(self, part: tuple) -> _PartBuffer | None:
        """The buffer of ``part``'s range for the current stream, taken if need be (None: it is
        held for another stream). Note [skipped requests]: it spans the planned ranges of the
        requests this step will make, not those `expect`ed instead."""
        current = self.streams.current()
        held = self.buffers.get(part)
        if held is not None:
            return held if held.stream == current else None
        ranges = [self.plan[key][:2] for key in self.parts[part] if key not in self.skipped]
        low = min(offset for _, offset in ranges)
        high = max(offset + size for size, offset in ranges)
        # A buffer let go before lives on in its tenants until they die (Note [device tenants]).
        buffer = self.backend.device_empty(high - low, torch.uint8)
        held = self.buffers[part] = _PartBuffer(buffer, part, low, len(ranges), current)
        self.num_allocations += 1
        self.size = max(self.size, self.capacity)
        return held

    def _died(
        self, part: tuple | None, ident: int, offset: int, index: int, generation: int, epoch: int
    ) -> None:
        held = self.buffers.get(part) if part is not None else None
        if held is None or held.ident != ident:
            held = self.draining.get(ident)
        if held is not None:
            held.live.pop(offset, None)
            if held.buffer is None and not held.live:  # the last tenant of a buffer let go
                del self.draining[ident]
        self.trace.died(index, generation, epoch)

    def take_trace(self) -> list[tuple[int, int, int, tuple, Any, int, int]]:
        """The requests traced since the step began whose tenants have died, as ``(size, start,
        end, key, tag, epoch, asked)`` (unpacks before the death, and before the request);
        starts a new trace."""
        with self._locked():
            return self.trace.take()

    def stats(self) -> dict[str, Any]:
        """Figures for ``actoff.stats()``: the most buffer bytes alive at once, the plan's peak
        and lower bound, solve time, method, buffers allocated, divergences, fallbacks and plans
        kept."""
        layout = self.layout if self.layout is not None else Layout((), 0, 0, "none", False)
        return {
            "bytes": self.size,
            "plan_bytes": layout.peak,
            "lower_bound": layout.lower_bound,
            "solve_s": layout.solve_s,
            "method": layout.method,
            "allocations": self.num_allocations,
            "divergences": self.total_divergences,
            "fallbacks": self.total_fallbacks,
            "plans": len(self.plans),
        }


def _free(live: dict[int, int], offset: int, size: int) -> bool:
    return all(offset + size <= low or high <= offset for low, high in live.items())


def _queue_death(returned: collections.deque, epoch: list[int], death: tuple) -> None:
    """A tenant died (on any thread, maybe inside the collector): queue it with the unpacks so far."""
    returned.append((*death, epoch[0]))
