"""The simulated asynchronous device: CUDA's stream semantics on a CPU, with a race checker.

A debugging aid like ``CUDA_LAUNCH_BLOCKING``, the other way round: it makes a CPU run as
asynchronous as a GPU, so that CI sees what a GPU would (``ACTOFF_SIM_DEVICE=1``, or
`actoff.testing.simulated_device`). Tensors stay CPU tensors; what is simulated is time:

- side streams are queues that worker threads run later, each item after a seeded random
  delay; events recorded on the compute stream (the calling thread) complete late too, as a
  GPU lags behind its host; ``elapsed_time`` on an unfinished event raises as CUDA's does;
- a copy's destination holds poison (0xFF bytes: NaN for floats, -1 for integers) from the
  moment the copy is queued until it runs, so a read without the right wait sees garbage;
- only a compute-stream wait on a copy's event (``backend.wait``) or a host observation of
  it (``query()`` true, ``synchronize()``) orders later work after the copy;
- the caching allocator's hazard: a device storage that a copy in flight reads or writes,
  dying before the copy is ordered, is a race; so is host memory freed or handed out while
  a copy the host has not seen finish still touches it. Races raise `RaceError`, naming the
  copy's record, at the next copy or wait in the training thread (a race found while autograd
  frees a graph cannot raise there), and are listed in ``races``;
- host buffers are pinned unless asked for pageable (``host_empty(nbytes, pinned=False)``): a
  copy to or from pageable memory is synchronous, as CUDA's ``cudaMemcpyAsync`` is there: the
  host blocks until it has run, at ``pageable_rate`` of the link.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._mode_utils import no_dispatch

from .link import Link, sleep_until
from .memory import DeviceMemory, PeakWatch, poison
from .streams import ComputeStream, Gate, SideStream

__all__ = [
    "RaceError",
    "SimEvent",
    "SimSettings",
    "SimStreams",
    "poison",
    "settings_for",
]


class RaceError(RuntimeError):
    """Work on the simulated device that a real GPU could run in the wrong order."""


@dataclass(frozen=True)
class SimSettings:
    """How the simulated device behaves: ``seed`` of its delays, the longest delay of one
    queued item (seconds), and the compute stream's longest lag behind the host."""

    seed: int = 0
    max_delay_s: float = 0.001
    max_lag_s: float = 0.001
    #: Device memory in bytes (``None``: unlimited); an allocation past it raises
    #: ``torch.OutOfMemoryError`` as CUDA's allocator does.
    capacity: int | None = None
    #: Host link rate in bytes per second, each direction (``None``: copies run at memcpy
    #: speed). Note [the wind tunnel] in actoff.device.sim.link.
    bandwidth: float | None = None
    #: A copy from or to pageable host memory (`SimStreams.transfer`, or a stream's copy of a
    #: pageable host buffer) runs at this share of the link: the driver stages it through a
    #: pinned bounce buffer.
    pageable_rate: float = 0.5
    #: What the link, the copies' ends and the events are timed by (Note [the device's clock]
    #: in actoff.device.sim.link).
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)
    #: Tells apart the devices of two `actoff.testing.simulated_device` blocks.
    generation: int = field(default=0, repr=False)


def _inside(tensor: torch.Tensor, ranges: dict[int, int]) -> bool:
    """``tensor`` starts inside one of ``ranges`` (start -> bytes)."""
    address = tensor.data_ptr()
    return any(start <= address < start + size for start, size in list(ranges.items()))


def _use_count(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s storage (tensors, views and storage objects), this call's own
    temporary storage object included."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class SimEvent:
    """A CUDA-like event: complete once its stream reaches it."""

    def __init__(self, streams: SimStreams) -> None:
        self.streams = streams
        self.done = threading.Event()
        self.done.set()  # an event never recorded counts as complete, as in CUDA
        self.time: float | None = None
        self.stream: SideStream | ComputeStream | None = None
        self.seq = -1  # the stream's copy count when recorded

    def record(self, stream: SideStream | ComputeStream) -> None:
        stream.record(self)

    def query(self) -> bool:
        if not self.done.is_set():
            return False
        self.streams.observed(self)
        return True

    def synchronize(self) -> None:
        self.streams.host_syncs += 1
        self.streams.reach(self)
        self.streams.observed(self)

    def elapsed_time(self, end: SimEvent) -> float:
        if not (self.done.is_set() and end.done.is_set()) or self.time is None or end.time is None:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.time - self.time) * 1e3


class SimStreams:
    """The simulated device's stream API (see actoff.device.base.StreamBackend)."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        # Re-entrant: the collector may release a graph (ordering its copies) inside any
        # allocation, one made holding this lock included.
        self.lock = threading.RLock()
        # Live host buffers, start -> bytes.
        # Note [host ranges die with their buffer]: a host buffer's range is forgotten when its
        # storage dies (a weakref finalizer), not when its first tensor does: a view still reads
        # host memory. The CPU allocator hands a freed chunk's addresses to the next tensor, a
        # "device" tensor whose copies compute must wait for; a range kept past its buffer would
        # take a copy into that tensor for a copy to the host, and check the wrong side of it.
        self._host_ranges: dict[int, int] = {}
        self._pageable: dict[int, int] = {}  # the live host buffers that are not pinned
        self.pageable_copies = 0  # copies of pageable host memory: each blocked the host
        self._side: list[SideStream] = []
        self.compute = ComputeStream(self, settings.seed)
        self._streams = 0
        self.races: list[RaceError] = []
        self._undelivered: list[BaseException] = []
        self.host_syncs = 0  # host synchronize calls on events (each blocks on a real GPU)
        self.blocking_syncs = 0  # host waits on events not yet complete
        self.copies_gate, self.compute_gate = Gate(), Gate()
        self.forced = 0  # holds the host had to break (a wait on work not yet run)
        self.memory = DeviceMemory(settings.capacity)
        #: The host link's two directions when the settings give it a rate, else ``None``.
        self.links: dict[str, Link] | None = None
        if settings.bandwidth is not None:
            self.links = {
                d: Link(d, settings.bandwidth, clock=settings.clock)
                for d in ("device-to-host", "host-to-device")
            }
        _running.add(self)

    # ------------------------------------------------------------------ the stream API
    def current(self) -> ComputeStream:
        return self.compute

    def new_stream(self) -> SideStream:
        self._streams += 1
        stream = SideStream(self, self.settings.seed * 1000 + self._streams)
        self._side.append(stream)
        return stream

    def event(self) -> SimEvent:
        return SimEvent(self)

    def copy(self, stream: SideStream, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        self.surface()
        stream.copy(dst, src, what)
        if self.is_pageable(dst) or self.is_pageable(src):
            # CUDA returns from a copy of pageable memory once it has run (to the host) or been
            # staged (to the device): the host waits for the stream, and sees the copy done.
            self.pageable_copies += 1
            done = SimEvent(self)
            stream.record(done)
            self.reach(done, by="pageable copy")
            self.observed(done)

    def transfer(self, nbytes: int, direction: str, *, pageable: bool = False) -> float:
        """Block the calling thread for a synchronous copy of ``nbytes`` over the link (a
        ``cudaMemcpy``; from pageable memory at the settings' ``pageable_rate``), queued behind
        the copies already on that direction. Returns the modelled seconds; 0 without a link."""
        if self.links is None:
            return 0.0
        rate = self.settings.pageable_rate if pageable else 1.0
        moved = self.links[direction].reserve(nbytes, rate=rate)
        sleep_until(moved.end, self.settings.clock)
        return moved.end - moved.start

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def link_rate(self) -> float | None:
        """The link's modelled rate in bytes per second each way (None: copies at memcpy speed)."""
        return self.settings.bandwidth

    def default_budget(self) -> int | None:
        return self.memory.capacity  # the whole of it: no context, no fragmentation here

    def memory_watch(self) -> PeakWatch:
        return self.memory.watch()

    def memory_peak(self, reset: bool = False) -> int | None:
        peak = self.memory.peak
        if self.memory.entered == 0 and peak == 0:
            return None  # never counted (track_memory=False, or outside device_memory())
        if reset:
            self.memory.reset_peak()
        return peak

    def host_empty(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        """A host buffer: pinned, or pageable (its copies block the host) unless ``pinned``."""
        with no_dispatch():  # host memory: not the device's
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        start = buffer.data_ptr()  # no lock: the finalizer may run inside any allocation
        self._host_ranges[start] = nbytes
        weakref.finalize(buffer.untyped_storage(), self._host_ranges.pop, start, None)
        if not pinned:
            self._pageable[start] = nbytes
            weakref.finalize(buffer.untyped_storage(), self._pageable.pop, start, None)
        return buffer

    def is_host(self, tensor: torch.Tensor) -> bool:
        return _inside(tensor, self._host_ranges)

    def is_pageable(self, tensor: torch.Tensor) -> bool:
        """``tensor`` lies in a pageable host buffer (`host_empty` with ``pinned=False``)."""
        return _inside(tensor, self._pageable)

    # ------------------------------------------------------------------ ordering and races
    def ordered(self, event: SimEvent, *, by_host: bool) -> None:
        """Every copy of ``event``'s stream up to it is ordered: for the device's allocator
        (a compute wait or a host observation) and, ``by_host``, for host memory too."""
        stream = event.stream
        if not isinstance(stream, SideStream):
            return
        with self.lock:
            keep = []
            for entry in stream.copies:
                if entry.seq <= event.seq:
                    if entry.device_alias is not None:
                        # Nobody else holds the storage: only the alias, this call's storage
                        # object and, until a copy to the device runs, its queued destination
                        # (a copy to the host reads a snapshot:
                        # Note [copy sources and the allocator], actoff.device.sim.memory).
                        # Counted before the alias goes: the collector may release a graph
                        # inside this call, whose own ordering of the copy comes first.
                        queued = not entry.ran and entry.direction == "host-to-device"
                        users = _use_count(entry.device_alias)
                        if entry.device_alias is not None and users <= (3 if queued else 2):
                            self._race(
                                f"{entry.what}: the device {'source' if entry.direction == 'device-to-host' else 'destination'} "
                                f"of a {entry.direction} copy was freed before the copy was waited for; the "
                                "caching allocator could have handed its memory to new work while the copy "
                                "still used it (hold the tensor until the compute stream waits on the copy)"
                            )
                        entry.device_alias = None
                    if by_host:
                        entry.host_range = None
                if entry.device_alias is not None or entry.host_range is not None:
                    keep.append(entry)
            stream.copies = keep

    def observed(self, event: SimEvent) -> None:
        self.ordered(event, by_host=True)

    def check_host_reuse(self, buffer: torch.Tensor, action: str) -> None:
        """Raise (later) if a copy the host has not seen finish touches ``buffer``."""
        start, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        with self.lock:
            for stream in self._side:
                for entry in stream.copies:
                    if entry.host_range is None:
                        continue
                    other, length = entry.host_range
                    if other < start + size and start < other + length:
                        self._race(
                            f"{entry.what}: host memory was {action} while a {entry.direction} copy "
                            "that the host had not seen finish still touches it (query or synchronize "
                            "the copy's ticket before reusing its host buffer)"
                        )
                        return

    @contextlib.contextmanager
    def hold(self, *, copies: bool = True, compute: bool = False) -> Iterator[None]:
        """A device as slow as it may be: inside the block the side streams (``copies``) and
        the completion of compute events (``compute``) stop until the host forces them (a
        host synchronize, or compute waiting on a copy it must read); forcing opens the hold
        for the rest of the block. Turns timing-dependent races into certain ones.
        """
        gates = [gate for gate, held in ((self.copies_gate, copies), (self.compute_gate, compute)) if held]
        for gate in gates:
            gate.open.clear()
        try:
            yield
        finally:
            for gate in gates:
                gate.open.set()

    def reach(self, event: SimEvent, by: str = "host") -> None:
        """Block the calling thread until ``event`` completes, breaking a hold that stops it."""
        if event.done.is_set():
            return
        if by == "host":
            self.blocking_syncs += 1
        for gate in (self.copies_gate, self.compute_gate):
            if not gate.open.is_set():
                self.forced += 1
                gate.open.set()
        event.done.wait()

    def h2d_pending(self, event: SimEvent) -> bool:
        """A copy to the device up to ``event`` on its stream has not run yet."""
        stream = event.stream
        if not isinstance(stream, SideStream):
            return True
        with self.lock:
            return any(
                entry.direction == "host-to-device" and entry.seq <= event.seq and not entry.ran
                for entry in stream.copies
            )

    def drain(self) -> None:
        """Block until every stream has run what was queued so far (a device synchronize)."""
        events = []
        for stream in (*self._side, self.compute):
            event = SimEvent(self)
            stream.record(event)
            events.append(event)
        for event in events:
            self.reach(event, by="drain")
            self.ordered(event, by_host=True)

    def close(self) -> None:
        """Drain, then stop the worker threads."""
        self.drain()
        self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the workers run what is queued (holds opened), then end them and wait."""
        for gate in (self.copies_gate, self.compute_gate):
            gate.open.set()
        for stream in self._side:
            stream.items.put(("stop", None))
        self.compute.lagging.put((None, 0.0, (), 0.0))
        for worker in (*(stream.thread for stream in self._side), self.compute.thread):
            if worker is not threading.current_thread():
                worker.join(timeout_s)
        _running.discard(self)

    def _race(self, message: str) -> None:
        error = RaceError("actoff (simulated device): race: " + message)
        self.races.append(error)
        self._undelivered.append(error)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self._undelivered.append(error)

    def surface(self) -> None:
        """Raise the first error found since the last call (in the training thread)."""
        if self._undelivered:
            with self.lock:
                errors, self._undelivered = self._undelivered, []
            raise errors[0]


# Note [stop before the interpreter exits]: at exit every simulated device still running lets
# its workers finish and end first. The workers are daemon threads that run torch ops (a copy)
# without the GIL; one still inside such an op when the interpreter finalizes is ended
# (pthread_exit) as it takes the GIL back, unwinding C++ frames that must not be: the process
# aborts ("terminate called without an active exception"), a script run with
# ACTOFF_SIM_DEVICE=1 that exits or is stopped with copies in flight included.
_running: weakref.WeakSet[SimStreams] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for streams in list(_running):
        streams.stop()


def _forget_in_child() -> None:
    # After os.fork(), the parent's workers are not in the child: nothing to stop there.
    _running.clear()


os.register_at_fork(after_in_child=_forget_in_child)


_override: list[SimSettings] = []  # actoff.testing.simulated_device, innermost last


def settings_for(
    sim_device: bool, capacity: int | None = None, bandwidth: float | None = None
) -> SimSettings | None:
    """The settings of the innermost `actoff.testing.simulated_device`, else, with
    ``ACTOFF_SIM_DEVICE`` on, the defaults with ``ACTOFF_SIM_DEVICE_MEMORY`` as ``capacity``
    and ``ACTOFF_SIM_DEVICE_BANDWIDTH`` as ``bandwidth``."""
    if _override:
        return _override[-1]
    if not sim_device:
        return None
    if bandwidth is not None:  # the wind tunnel times copies by the link alone: no random delays
        return SimSettings(max_delay_s=0.0, max_lag_s=0.0, capacity=capacity, bandwidth=bandwidth)
    return SimSettings(capacity=capacity)
