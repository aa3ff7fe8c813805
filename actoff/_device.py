"""Device interface: host buffers, copies off the compute stream, and their completion tickets.

One small interface with two implementations, so nothing else in actoff asks "is this CUDA?":
- `CpuBackend`: plain host buffers, synchronous copies (CI, laptops, CPU training).
- `CudaBackend`: pinned host buffers, separate device-to-host and host-to-device streams,
  copies ordered after the compute stream by events.
"""

from __future__ import annotations

import time

import torch

__all__ = ["CpuBackend", "CudaBackend", "DeviceBackend", "Stopwatch", "Ticket", "backend_for"]


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


class DeviceBackend:
    """What actoff needs from a device. Subclasses implement every method."""

    device: torch.device
    pinned: bool

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 host buffer of ``nbytes`` (pinned where the device has DMA)."""
        raise NotImplementedError

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Start copying device ``src`` into host ``dst`` after the work queued so far."""
        raise NotImplementedError

    def release_host_cache(self) -> None:
        """Give host buffers freed so far back to the system (no cache to empty on the CPU)."""

    def copy_to_device(self, src: torch.Tensor, *, pad: int = 0) -> tuple[torch.Tensor, Ticket]:
        """Start copying host ``src`` (1-D) into a new device buffer, ``pad`` elements in."""
        raise NotImplementedError

    def wait(self, ticket: Ticket) -> None:
        """Make the caller's current stream wait for ``ticket`` (no host blocking)."""
        raise NotImplementedError

    def stopwatch(self) -> Stopwatch:
        """Time work queued on the current stream between ``start()`` and ``stop()``."""
        return Stopwatch()

    def stall(self, ticket: Ticket) -> Ticket:
        """How long the current stream will wait for ``ticket`` from now (0 on the CPU, where
        a prefetched copy has already happened)."""
        return Ticket(0.0)

    def host_bandwidth(self, nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
        """Measured device-to-host copy bandwidth in bytes per second (memcpy on the CPU)."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = self.host_empty(nbytes)
        self.copy_to_host(dst, src).synchronize()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            ticket = self.copy_to_host(dst, src)
            ticket.synchronize()
            best = min(best, ticket.elapsed_ms())
        return nbytes / max(best, 1e-6) * 1e3


class Stopwatch(Ticket):
    """Wall time on the CPU; a pair of events on CUDA (see `CudaBackend.stopwatch`)."""

    __slots__ = ("_start",)

    def start(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def stop(self) -> Stopwatch:
        self.elapsed_s = time.perf_counter() - self._start
        return self


class CpuBackend(DeviceBackend):
    """No pinning, no streams: copies run at once in the calling thread.

    Serves the CPU and any device without CUDA streams (copies there are synchronous).
    """

    pinned = False

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        start = time.perf_counter()
        dst.copy_(src)
        return Ticket(time.perf_counter() - start)

    def copy_to_device(self, src: torch.Tensor, *, pad: int = 0) -> tuple[torch.Tensor, Ticket]:
        start = time.perf_counter()
        out = torch.empty(src.numel() + pad, dtype=src.dtype, device=self.device)
        out[pad:].copy_(src)
        return out, Ticket(time.perf_counter() - start)

    def wait(self, ticket: Ticket) -> None:
        pass


class _CudaTicket(Ticket):
    __slots__ = ("end", "start")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        super().__init__()
        self.start, self.end = start, end

    def query(self) -> bool:
        return self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def elapsed_ms(self) -> float:
        return self.start.elapsed_time(self.end)


class CudaBackend(DeviceBackend):
    """CUDA: pinned host buffers, one D2H and one H2D stream, event-ordered copies.

    Note [capture the compute stream]: the caller's current stream is read *before* entering
    a side stream; reading it inside ``torch.cuda.stream(side)`` returns the side stream and
    turns the wait into a no-op (the torchtitan bug).

    Note [no record_stream]: sources of device-to-host copies stay referenced by their record
    until the copy's event has completed or the compute stream has waited on it; destinations
    of host-to-device copies are allocated on the compute stream and the H2D stream waits for
    the compute stream first, so the caching allocator never hands their memory to anyone
    while a copy still touches it.
    """

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release_host_cache(self) -> None:
        # torch's caching host allocator keeps freed pinned blocks until asked to let go.
        empty = getattr(torch._C, "_host_emptyCache", None) or getattr(
            torch.accelerator, "empty_host_cache", None
        )
        if empty is not None:
            empty()

    def _copy_on(self, side: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        compute = torch.cuda.current_stream(self.device)  # Note [capture the compute stream]
        side.wait_stream(compute)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            dst.copy_(src, non_blocking=True)
            end.record(side)
        return _CudaTicket(start, end)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        return self._copy_on(self.d2h_stream, dst, src)

    def copy_to_device(self, src: torch.Tensor, *, pad: int = 0) -> tuple[torch.Tensor, Ticket]:
        out = torch.empty(src.numel() + pad, dtype=src.dtype, device=self.device)
        return out, self._copy_on(self.h2d_stream, out[pad:], src)

    def wait(self, ticket: Ticket) -> None:
        if isinstance(ticket, _CudaTicket):
            torch.cuda.current_stream(self.device).wait_event(ticket.end)

    def stopwatch(self) -> Stopwatch:
        return _CudaStopwatch(self.device)

    def stall(self, ticket: Ticket) -> Ticket:
        if not isinstance(ticket, _CudaTicket):
            return Ticket(0.0)
        marker = torch.cuda.Event(enable_timing=True)
        marker.record(torch.cuda.current_stream(self.device))
        return _Stall(marker, ticket.end)


class _Stall(_CudaTicket):
    """From a point on the compute stream to the end of a copy; negative means no wait."""

    def elapsed_ms(self) -> float:
        return max(0.0, self.start.elapsed_time(self.end))


class _CudaStopwatch(Stopwatch):
    __slots__ = ("device", "end", "start_event")

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.start_event = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> Stopwatch:
        self.start_event.record(torch.cuda.current_stream(self.device))
        return self

    def stop(self) -> Stopwatch:
        self.end.record(torch.cuda.current_stream(self.device))
        return self

    def query(self) -> bool:
        return self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def elapsed_ms(self) -> float:
        return self.start_event.elapsed_time(self.end)


_backends: dict[torch.device, DeviceBackend] = {}


def backend_for(device: torch.device) -> DeviceBackend:
    """The (cached) backend of ``device``: CUDA for ``cuda`` devices, CPU otherwise.

    >>> backend_for(torch.device("cpu")).pinned
    False
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = _backends.get(device)
    if backend is None:
        backend = CudaBackend(device) if device.type == "cuda" else CpuBackend(device)
        _backends[device] = backend
    return backend
