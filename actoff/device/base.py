"""Device interface: host buffers, copies off the compute stream, and their completion tickets.

One small interface, so nothing else in actoff asks "is this CUDA?":
- `CpuBackend`: plain host buffers, synchronous copies (CI, laptops, CPU training). On a
  host-resident device there is nothing to copy: the host tier keeps tensors where they are.
- `StreamBackend`: host staging buffers, one device-to-host and one host-to-device stream,
  copies ordered after the compute stream by events. It runs over a stream API: CUDA's
  (actoff.device.cuda) or the simulated asynchronous device's (actoff.device.sim.device), which takes
  the same code paths on a CPU so that CI sees ordering and lifetime bugs.

Note [capture the compute stream]: the caller's current stream is read *before* work is put
on a side stream; read inside ``torch.cuda.stream(side)`` it is the side stream, and the side
stream's wait for the compute stream becomes a wait for itself: a no-op.

Note [no record_stream]: memory a side-stream copy touches is kept from reuse by references
and stream order, never by ``record_stream``. Sources of device-to-host copies stay referenced
by their record until the copy's event has completed or the compute stream has waited on it;
destinations of host-to-device copies are allocated on the compute stream (by the caching
allocator, or by the device arena, actoff.memory.device_arena) and the H2D stream waits for the
compute stream first. So no allocator hands that memory to anyone while a copy still touches it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .sim.device import SimSettings

__all__ = [
    "CpuBackend",
    "DeviceBackend",
    "Stopwatch",
    "StreamBackend",
    "Ticket",
    "backend_for",
    "forget_backend",
]


class Ticket:
    """Completion of one copy. The CPU flavour is complete on creation."""

    __slots__ = ("elapsed_s",)

    def __init__(self, elapsed_s: float = 0.0) -> None:
        self.elapsed_s = elapsed_s

    def query(self) -> bool:
        """True once the copy has finished (never blocks)."""
        return True

    def synchronize(self) -> None:
        """Block the calling host thread until the copy has finished."""

    def elapsed_ms(self) -> float:
        """Copy time in milliseconds; call only once `query()` is true."""
        return self.elapsed_s * 1e3


class Stopwatch(Ticket):
    """Wall time of work between ``start()`` and ``stop()`` (the CPU flavour)."""

    __slots__ = ("_start",)

    def start(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def stop(self) -> Stopwatch:
        self.elapsed_s = time.perf_counter() - self._start
        return self


class DeviceBackend:
    """What actoff needs from a device. Subclasses implement every method.

    ``what`` arguments name the copied record (``block 'layers.3' record 5``) in the errors a
    checking backend raises.
    """

    device: torch.device
    #: Copies go through host staging buffers with asynchronous tickets (a device with DMA),
    #: rather than straight from the tensors (a host-resident device).
    staged: bool
    #: The device's memory is host memory (a plain CPU device): the host tier has nothing
    #: to copy (Note [nothing to copy on the host]).
    host_resident: bool = False
    #: Host buffers come from torch's caching pinned allocator, which rounds every request up
    #: to a power of two and caches freed blocks (Note [pinned footprint] in actoff.memory.host_arena).
    pinned: bool = False
    #: The device buffers actoff allocates in backward come from a planned device arena
    #: (actoff.memory.device_arena): a device whose copies are ordered by streams and events, which
    #: the arena's reuse relies on (Note [device arena reuse]).
    device_arena: bool = False

    @property
    def pins_host(self) -> bool:
        """`host_empty` gives pinned (page-locked) memory: the device has DMA (``staged``), or
        the buffers come from torch's caching pinned allocator (``pinned``). Pinned memory is
        what ``ACTOFF_PINNED_BUDGET`` caps (Note [pageable fallback] in actoff.memory.host_chunks)."""
        return self.staged or self.pinned

    def host_empty(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        """A fresh uint8 host buffer of ``nbytes``: pinned where `pins_host` (a ``RuntimeError``
        if it cannot be had), else or with ``pinned=False`` pageable: copies to and from it are
        synchronous and slower (Note [pageable fallback] in actoff.memory.host_chunks)."""
        raise NotImplementedError

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh 1-D device tensor of ``numel`` elements (on the compute stream)."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> Ticket:
        """Start copying device ``src`` into host ``dst`` after the work queued so far."""
        raise NotImplementedError

    def release_host_cache(self) -> None:
        """Give host buffers freed so far back to the system (no cache to empty on the CPU)."""

    def copy_to_device(
        self, src: torch.Tensor, *, pad: int = 0, what: str = "", out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Ticket]:
        """Start copying host ``src`` (1-D) into a device buffer, ``pad`` elements in: ``out``
        (1-D, ``pad + src.numel()`` elements of ``src``'s dtype, from the device arena) or a
        new one."""
        raise NotImplementedError

    def wait(self, ticket: Ticket | None) -> None:
        """Make the caller's current stream wait for ``ticket`` (no host blocking)."""
        raise NotImplementedError

    def stopwatch(self) -> Stopwatch:
        """Time work queued on the current stream between ``start()`` and ``stop()``."""
        return Stopwatch()

    def stall(self, ticket: Ticket | None) -> Ticket:
        """How long the current stream will wait for ``ticket`` from now (0 on the CPU, where
        a prefetched copy has already happened)."""
        return Ticket(0.0)

    def mark(self) -> Ticket:
        """A ticket that completes once the current (compute) stream has run everything queued
        on it so far: what a host thread waits for before it lets a DMA engine outside the
        streams (GPUDirect Storage) touch device memory (Note [direct device I/O] in
        actoff.tiers.nvme.tier). Complete at once on the CPU, where work runs as it is queued."""
        return Ticket(0.0)

    def check_host_reuse(self, buffer: torch.Tensor, action: str) -> None:
        """Raise if a copy still in flight touches ``buffer`` (host memory about to be freed
        or handed out): the simulated device checks; real devices trust the caller."""

    def default_budget(self) -> int | None:
        """The device memory the ``auto`` policy plans under when ``ACTOFF_GPU_BUDGET`` is not
        set: a CUDA device's total memory less Note [the CUDA margin] (actoff.budget), the
        simulated device's capacity; ``None`` where the device has none (a plain CPU device:
        ``auto`` then keeps everything)."""
        return None

    def memory_watch(self) -> Any | None:
        """A watch of the device's bytes in use over a window (``counted()``, ``live()``,
        ``sample()``, ``reset()`` and ``peak``, as `actoff.device.sim.memory.PeakWatch`), or
        ``None`` where the device's memory is not counted (a plain CPU device)."""
        return None

    def memory_peak(self, reset: bool = False) -> int | None:
        """The most bytes the device held at once since the program last reset its peak (CUDA's
        allocator peak, carried across the restarts of ``auto``'s watch: Note [one peak counter,
        two readers] in actoff.device.cuda; the simulated device's ``memory.peak``, which its
        watch leaves alone), the figure then started again if ``reset``; ``None`` where the
        device's memory is not counted (a plain CPU device, an allocator without statistics).
        `actoff.report` reads it."""
        return None

    def host_bandwidth(self, nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
        """Measured device-to-host copy bandwidth in bytes per second: the best of ``repeats``
        timed copies (Note [timing the link]).

        >>> backend_for(torch.device("cpu")).host_bandwidth(2**20, 1) > 0
        True
        """
        asked = min(nbytes, LINK_PROBE_START)
        while True:
            seconds, size = self._copy_seconds(asked, repeats)
            # Long enough to read, all asked for, or all the device's memory allows.
            if seconds >= LINK_PROBE_S or size >= nbytes or size < asked:
                return size / seconds
            asked = min(nbytes, size * 4)

    def _copy_seconds(self, nbytes: int, repeats: int) -> tuple[float, int]:
        """The least seconds of ``repeats`` copies of ``nbytes`` to the host (after one warm-up),
        and the bytes copied: half as many, down to 1 MiB, on a device short of memory (the auto
        policy measures at the end of a step, under its budget)."""
        while True:
            try:
                src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                break
            except torch.OutOfMemoryError:
                if nbytes <= 2**20:
                    raise
                nbytes //= 2
        dst = self.host_empty(nbytes)
        self.copy_to_host(dst, src).synchronize()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            ticket = self.copy_to_host(dst, src)
            ticket.synchronize()
            best = min(best, ticket.elapsed_ms())
        return max(best, 1e-6) / 1e3, nbytes


#: Note [timing the link]: the host link is timed on copies that take long enough to read
#: (`LINK_PROBE_S`): from `LINK_PROBE_START` bytes, four times more each round, up to the size
#: asked. A fast link (CUDA's, ~50 GB/s) is timed on 64 MiB as before; a slow one (the wind
#: tunnel's simulated link, a few hundred MB/s) on a few MiB, not on a second of copies. The
#: simulated device is timed the same way, not asked for its modelled rate: what auto plans
#: with is what it measured, on every device.
LINK_PROBE_START = 4 * 2**20
LINK_PROBE_S = 0.010


class CpuBackend(DeviceBackend):
    """No pinning, no streams: copies run at once in the calling thread.

    Serves the CPU and any device without CUDA streams (copies there are synchronous).
    """

    staged = False

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.host_resident = self.device.type == "cpu"

    def host_empty(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)  # no DMA: nothing to pin

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> Ticket:
        start = time.perf_counter()
        dst.copy_(src)
        return Ticket(time.perf_counter() - start)

    def copy_to_device(
        self, src: torch.Tensor, *, pad: int = 0, what: str = "", out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Ticket]:
        start = time.perf_counter()
        if out is None:
            out = torch.empty(src.numel() + pad, dtype=src.dtype, device=self.device)
        out[pad:].copy_(src)
        return out, Ticket(time.perf_counter() - start)

    def wait(self, ticket: Ticket | None) -> None:
        pass


class StreamTicket(Ticket):
    """A copy between two events on a side stream."""

    __slots__ = ("end", "start")

    def __init__(self, start: Any, end: Any) -> None:
        super().__init__()
        self.start, self.end = start, end

    def query(self) -> bool:
        return self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def elapsed_ms(self) -> float:
        return self.start.elapsed_time(self.end)


class _Stall(StreamTicket):
    """From a point on the compute stream to the end of a copy; negative means no wait.

    Both events must have completed before the time between them can be read: the marker on
    the compute stream usually completes after the copy did (the host runs ahead).
    """

    __slots__ = ()

    def query(self) -> bool:
        return self.start.query() and self.end.query()

    def synchronize(self) -> None:
        self.start.synchronize()
        self.end.synchronize()

    def elapsed_ms(self) -> float:
        return max(0.0, self.start.elapsed_time(self.end))


class _StreamStopwatch(Stopwatch):
    __slots__ = ("end", "start_event", "streams")

    def __init__(self, streams: Any) -> None:
        super().__init__()
        self.streams = streams
        self.start_event = streams.event()
        self.end = streams.event()

    def start(self) -> Stopwatch:
        self.start_event.record(self.streams.current())
        return self

    def stop(self) -> Stopwatch:
        self.end.record(self.streams.current())
        return self

    def query(self) -> bool:
        return self.start_event.query() and self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def elapsed_ms(self) -> float:
        return self.start_event.elapsed_time(self.end)


class StreamBackend(DeviceBackend):
    """Staging buffers, a D2H and an H2D stream, event-ordered copies
    (Note [capture the compute stream], Note [no record_stream]).

    ``streams`` is the stream API: ``current()``, ``new_stream()``, ``event()``,
    ``copy(stream, dst, src, what)``, ``device_empty(numel, dtype)``, ``host_empty(nbytes, pinned=True)``,
    ``check_host_reuse(buffer, action)``, ``default_budget()``, ``memory_watch()`` and ``memory_peak(reset)``; its streams have ``wait_stream`` and
    ``wait_event``, its events ``record``, ``query``, ``synchronize`` and ``elapsed_time``,
    as ``torch.cuda``'s do. Optional: ``pinned`` (host buffers from torch's caching pinned
    allocator) and ``release_host_cache()``.
    """

    staged = True
    device_arena = True

    def __init__(self, device: torch.device, streams: Any) -> None:
        self.device = device
        self.streams = streams
        self.d2h_stream = streams.new_stream()
        self.h2d_stream = streams.new_stream()
        self.pinned = bool(getattr(streams, "pinned", False))

    def host_empty(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        return self.streams.host_empty(nbytes) if pinned else self.streams.host_empty(nbytes, pinned=False)

    def release_host_cache(self) -> None:
        release = getattr(self.streams, "release_host_cache", None)
        if release is not None:
            release()

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.streams.device_empty(numel, dtype)

    def _copy_on(self, side: Any, dst: torch.Tensor, src: torch.Tensor, what: str) -> StreamTicket:
        compute = self.streams.current()  # Note [capture the compute stream]
        side.wait_stream(compute)
        start, end = self.streams.event(), self.streams.event()
        start.record(side)
        self.streams.copy(side, dst, src, what)
        end.record(side)
        return StreamTicket(start, end)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> Ticket:
        return self._copy_on(self.d2h_stream, dst, src, what)

    def copy_to_device(
        self, src: torch.Tensor, *, pad: int = 0, what: str = "", out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Ticket]:
        if out is None:
            out = self.device_empty(src.numel() + pad, src.dtype)  # on the compute stream
        return out, self._copy_on(self.h2d_stream, out[pad:], src, what)

    def wait(self, ticket: Ticket | None) -> None:
        if isinstance(ticket, StreamTicket):
            self.streams.current().wait_event(ticket.end)

    def stopwatch(self) -> Stopwatch:
        return _StreamStopwatch(self.streams)

    def stall(self, ticket: Ticket | None) -> Ticket:
        if not isinstance(ticket, StreamTicket):
            return Ticket(0.0)
        marker = self.streams.event()
        marker.record(self.streams.current())
        return _Stall(marker, ticket.end)

    def mark(self) -> Ticket:
        marker = self.streams.event()
        marker.record(self.streams.current())  # Note [capture the compute stream]
        return StreamTicket(marker, marker)

    def check_host_reuse(self, buffer: torch.Tensor, action: str) -> None:
        self.streams.check_host_reuse(buffer, action)

    def default_budget(self) -> int | None:
        return self.streams.default_budget()

    def memory_watch(self) -> Any | None:
        return self.streams.memory_watch()

    def memory_peak(self, reset: bool = False) -> int | None:
        return self.streams.memory_peak(reset)


_backends: dict[tuple, DeviceBackend] = {}


def backend_for(device: torch.device, simulated: SimSettings | None = None) -> DeviceBackend:
    """The (cached) backend of ``device``: streams for ``cuda`` devices; for a CPU device the
    simulated asynchronous device when ``simulated`` settings are given, else plain CPU copies.

    >>> backend_for(torch.device("cpu")).staged
    False
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, simulated if device.type == "cpu" else None)
    backend = _backends.get(key)
    if backend is None:
        if device.type == "cuda":
            from .cuda import CudaStreams

            backend = StreamBackend(device, CudaStreams(device))
        elif simulated is not None:
            from actoff.device.sim.device import SimStreams

            backend = StreamBackend(device, SimStreams(simulated))
        else:
            backend = CpuBackend(device)
        _backends[key] = backend
    return backend


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: the parent's backends run streams and worker threads
    the child does not have (the simulated device's queues would never run). The child makes
    its own on first use; CUDA refuses a forked child anyway."""
    _backends.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def forget_backend(device: torch.device, simulated: SimSettings | None = None) -> None:
    """Drop the cached backend of ``device`` (and ``simulated`` settings), if any."""
    _backends.pop((device, simulated if device.type == "cpu" else None), None)
