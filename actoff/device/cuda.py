"""CUDA's stream API for actoff.device.base.StreamBackend: torch.cuda streams, events, pinned memory."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable

import torch
from torch.cuda._utils import _get_device_index

from actoff.budget import cuda_budget

__all__ = [
    "AllocatorPeak",
    "CudaStreams",
    "PeakCounters",
    "count_with",
    "peak_counters",
    "watch_program_resets",
]


class CudaStreams:
    """Streams and events of one CUDA device, in the shape StreamBackend expects."""

    #: Host buffers come from torch's caching pinned allocator (Note [pinned footprint]).
    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_empty(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        # A failed cudaHostAlloc (pinned memory capped, as on WSL2) raises a RuntimeError; the
        # host arena then asks for pageable memory (Note [pageable fallback]).
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def release_host_cache(self) -> None:
        # torch's caching host allocator keeps freed pinned blocks until asked to let go.
        empty = getattr(torch._C, "_host_emptyCache", None) or getattr(
            torch.accelerator, "empty_host_cache", None
        )
        if empty is not None:
            empty()

    def check_host_reuse(self, buffer: torch.Tensor, action: str) -> None:
        pass  # the runtime orders host reuse itself (Note [host slot reuse])

    def default_budget(self) -> int:
        return cuda_budget(torch.cuda.get_device_properties(self.device).total_memory)

    def memory_watch(self) -> AllocatorPeak:
        return AllocatorPeak(peak_counters(self.device))

    def memory_peak(self, reset: bool = False) -> int | None:
        try:
            return peak_counters(self.device).program_peaks(reset)[0]
        except RuntimeError:  # an allocator that keeps no statistics (a pluggable one not actoff's)
            return None


class PeakCounters:
    """The peak counters of one CUDA device's allocator (torch's caching allocator, or actoff's
    replay allocator where it is installed), read by the program and by the ``auto`` policy's
    memory watch.

    Note [one peak counter, two readers]: the allocator keeps one peak per device, and only its
    peak sees what a block or the loss allocates and frees between two moments actoff looks
    (sampling the bytes live at block boundaries missed them, so a plan could exceed its budget
    while its figures said it fit). So ``auto``'s watch restarts the counter at each window (a
    block's forward, the head, backward) and reads it at the window's end; the program's peak
    across those restarts is carried here, and actoff's readers of it (`actoff.report`, the
    benchmarks' `memory_peak`) take the larger. A reset of the program's own starts the carried
    peak again: torch's resets are wrapped to say so (`watch_program_resets`); one by another
    path is seen only where the counter's peak goes down. Read directly, torch's
    ``max_memory_allocated`` covers only the time since auto's last window began: read a step's
    peak with `actoff.report` where ``auto`` runs.

    >>> counters = PeakCounters(torch.device("cuda", 0))
    >>> counters.carried
    (0, 0)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.carried = (0, 0)  # the program's allocated and reserved peaks before the last restart
        self.seen = 0  # the counter's peak when last read: lower later only if the program reset it
        # Every watch of the device (a runtime's per thread): each restart gives them the peak
        # it ends, so that one watch's window never cuts another's short. Added and copied under
        # the lock (a thread making its first watch while another restarts).
        self.watches: weakref.WeakSet[AllocatorPeak] = weakref.WeakSet()
        self.lock = threading.Lock()

    def read(self) -> tuple[int, int, int]:
        """Bytes allocated now, and the most allocated and reserved since the counter's restart."""
        live, peak, reserved = self._counters()
        if peak < self.seen:  # the program reset the counter itself: its figures start again
            self._hand_over(self.seen)
            self.carried = (0, 0)
        self.seen = peak
        return live, peak, reserved

    def restart(self) -> int:
        """A new window: the program's peaks so far are carried, the counter starts from now.
        Returns the bytes allocated now."""
        _, peak, reserved = self.read()
        self.carried = (max(self.carried[0], peak), max(self.carried[1], reserved))
        return self._reset(peak)

    def program_peaks(self, reset: bool = False) -> tuple[int, int]:
        """The most bytes allocated and reserved since the program's last reset (this call's with
        ``reset``, or torch's own), across the watch's restarts; the figures then start again if
        ``reset``."""
        _, peak, reserved = self.read()
        peaks = (max(self.carried[0], peak), max(self.carried[1], reserved))
        if reset:
            self.carried = (0, 0)
            self._reset(peak)
        return peaks

    def _counters(self) -> tuple[int, int, int]:
        if _other_allocator is not None:
            return _other_allocator[0](self.device)
        # Unflattened (torch.cuda.memory_stats flattens it in Python): read at every window's edge.
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        if not stats:  # CUDA not initialised in this process: nothing allocated yet
            return 0, 0, 0
        allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
        return allocated["current"], allocated["peak"], reserved["peak"]

    def watch(self, watch: AllocatorPeak) -> None:
        """Hand ``watch`` the peak of every restart from now on."""
        with self.lock:
            self.watches.add(watch)

    def _hand_over(self, peak: int) -> None:
        with self.lock:
            watches = list(self.watches)
        for watch in watches:
            watch.peak = max(watch.peak, peak)

    def _reset(self, peak: int) -> int:
        """The counter starts from now, the watches keeping the peak it held (``peak``); returns
        the bytes allocated now."""
        self._hand_over(peak)
        if _other_allocator is not None:
            _other_allocator[1](self.device)
        else:
            (_torch_reset or torch.cuda.reset_peak_memory_stats)(self.device)
        live, self.seen, _ = self._counters()
        return live

    def program_reset(self) -> None:
        """The program reset the counter (`watch_program_resets`): its figures start again, the
        watches keeping the peak it ended."""
        self._hand_over(self.seen)
        self.carried, self.seen = (0, 0), 0


_COUNTERS: dict[int, PeakCounters] = {}
_LOCK = threading.Lock()  # the counters' creation, the wrappers' installation
#: torch's own reset of the counters, once `watch_program_resets` has wrapped it.
_torch_reset: Callable[..., None] | None = None


def watch_program_resets() -> None:
    """Wrap torch's resets of the peak counters (``torch.cuda.reset_peak_memory_stats``, both
    names it is exported under, and ``torch.accelerator.reset_peak_memory_stats``) so that a
    reset of the program's own (a logger's, a benchmark's) also starts the carried peaks again
    (Note [one peak counter, two readers]); done once, when ``auto`` first watches a CUDA device.
    The wrappers call torch's. A reset by another path (a reference to torch's function taken
    before, ``torch._C``) is caught only where the counter's peak goes down."""
    global _torch_reset
    with _LOCK:
        if _torch_reset is not None:
            return
        original = torch.cuda.reset_peak_memory_stats
        _torch_reset = getattr(original, "__wrapped__", original) if _is_ours(original) else original
        wrapper = _reporting_resets(_torch_reset, lambda device: _get_device_index(device, optional=True))
        torch.cuda.reset_peak_memory_stats = torch.cuda.memory.reset_peak_memory_stats = wrapper
        accelerator = getattr(getattr(torch, "accelerator", None), "reset_peak_memory_stats", None)
        if accelerator is not None and not _is_ours(accelerator):
            torch.accelerator.reset_peak_memory_stats = _reporting_resets(
                accelerator, lambda index: _get_device_index(index, optional=True)
            )


def _is_ours(function: Callable[..., None]) -> bool:
    return getattr(function, "_actoff_resets", False)


def _reporting_resets(
    original: Callable[..., None], index_of: Callable[[object], int | None]
) -> Callable[..., None]:
    """``original`` (a reset of the peak counters), telling the device's counters of it."""

    @functools.wraps(original)
    def reset_peak_memory_stats(device: torch.device | int | str | None = None) -> None:
        counters = _COUNTERS.get(index_of(device))
        if counters is not None:
            counters.read()  # the peak it ends, for the watches
        original(device)
        if counters is not None:
            counters.program_reset()

    reset_peak_memory_stats._actoff_resets = True  # type: ignore[attr-defined]
    return reset_peak_memory_stats


#: The counters of an allocator that is not torch's (actoff's replay allocator, which registers
#: them when it is installed: torch's own read nothing under a pluggable allocator): a reader
#: of (live, peak, reserved peak) bytes and a reset, each given the device.
_other_allocator: (
    tuple[Callable[[torch.device], tuple[int, int, int]], Callable[[torch.device], None]] | None
) = None


def count_with(
    read: Callable[[torch.device], tuple[int, int, int]], reset: Callable[[torch.device], None]
) -> None:
    """Read the devices' peaks from another allocator than torch's: ``read(device)`` gives the
    bytes live, the most allocated and the most reserved since ``reset(device)``.

    >>> count_with(lambda device: (0, 0, 0), lambda device: None)
    >>> PeakCounters(torch.device("cuda", 0)).read()
    (0, 0, 0)
    >>> import actoff.device.cuda as cuda; cuda._other_allocator = None
    """
    global _other_allocator
    _other_allocator = (read, reset)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def peak_counters(device: torch.device) -> PeakCounters:
    """The one `PeakCounters` of a CUDA device (its index; the current device without one)."""
    index = _index(device)
    with _LOCK:
        if index not in _COUNTERS:
            _COUNTERS[index] = PeakCounters(torch.device("cuda", index))
        return _COUNTERS[index]


class AllocatorPeak:
    """The most bytes the device's allocator held at once since `reset`, read from its own peak
    counter (Note [one peak counter, two readers]): a block's transients and the loss's peak
    count, as every allocation does on the simulated device (`actoff.device.sim.memory.PeakWatch`)."""

    def __init__(self, counters: PeakCounters) -> None:
        self.counters = counters
        self.peak = 0
        self.reset()
        counters.watch(self)
        watch_program_resets()

    def counted(self) -> bool:
        return True

    def live(self) -> int:
        return self.counters.read()[0]

    def sample(self) -> None:
        self.peak = max(self.peak, self.counters.read()[1])

    def reset(self) -> None:
        """Start a new window from the bytes live now."""
        self.peak = self.counters.restart()
