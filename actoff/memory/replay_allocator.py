"""The replay allocator's library (``ACTOFF_ALLOCATOR=replay``): installing
libactoff_replay.so as torch's CUDA allocator, its C entry points, its errors and figures.

MEMO plans every transient allocation of a step, not only actoff's own buffers. torch asks
a custom allocator for every tensor only when it is the process's allocator
(``torch.cuda.memory.change_current_allocator``), and that swap is allowed only before the
first CUDA allocation: so the allocator is installed when actoff is imported with
``ACTOFF_ALLOCATOR=replay`` set (or by `install` called at the start of the program), and the
runtime refuses a CUDA step under ``replay`` without it. What a step does with it is
actoff.memory.replay_steps. The C side records errors and never throws; `check` raises them.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actoff.device.cuda import count_with

__all__ = [
    "AllocatorStats",
    "CudaEngine",
    "check",
    "install",
    "install_from_environment",
    "installed",
    "library",
    "library_path",
    "load_library",
    "refusal",
    "stats",
]

LIBRARY = "libactoff_replay.so"
ABI_VERSION = 1

_library: ctypes.CDLL | None = None
_pluggable: Any = None  # torch's CUDAPluggableAllocator: kept alive while it is installed
_install_failure: str | None = None  # why the install on import was refused
_plan_lower_bounds: dict[int, int] = {}  # device -> the lower bound of its last plan (bytes)


def library_path() -> str | None:
    """Path of the built libactoff_replay.so in the actoff package, or None if it was not built."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # actoff/memory/ -> actoff/
    path = os.path.join(package, LIBRARY)
    return path if os.path.exists(path) else None


def load_library(path: str) -> ctypes.CDLL:
    """The library at ``path`` with its C signatures declared (loading touches no CUDA)."""
    lib = ctypes.CDLL(path)
    c_int, c_size, c_ull, c_ll = ctypes.c_int, ctypes.c_size_t, ctypes.c_ulonglong, ctypes.c_longlong
    p_ull, p_ll = ctypes.POINTER(c_ull), ctypes.POINTER(c_ll)
    signatures = {
        "actoff_replay_malloc": (ctypes.c_void_p, [c_size, c_int, ctypes.c_void_p]),
        "actoff_replay_free": (None, [ctypes.c_void_p, c_size, c_int, ctypes.c_void_p]),
        "actoff_replay_abi_version": (c_int, []),
        "actoff_replay_stat_names": (ctypes.c_char_p, []),
        "actoff_replay_check_driver": (c_int, [ctypes.POINTER(c_int), ctypes.POINTER(c_int)]),
        "actoff_replay_begin_record": (c_int, [c_int]),
        "actoff_replay_begin_step": (c_int, [c_int]),
        "actoff_replay_end_step": (c_ll, [c_int]),
        "actoff_replay_copy_log": (c_int, [c_int, p_ull, p_ll, p_ll, c_size]),
        "actoff_replay_set_plan": (c_int, [c_int, p_ull, p_ull, c_size, c_ull]),
        "actoff_replay_clear_plan": (c_int, [c_int]),
        "actoff_replay_stats": (c_int, [c_int, p_ull, c_size]),
        "actoff_replay_reset_peak": (c_int, [c_int]),
        "actoff_replay_error": (c_size, [ctypes.c_char_p, c_size, c_int]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    version = lib.actoff_replay_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI version {version}, this actoff expects {ABI_VERSION}: rebuild it")
    return lib


_NOT_INSTALLED = (
    "ACTOFF_ALLOCATOR=replay: the allocator is not installed, and torch swaps its allocator only "
    "before the first CUDA allocation: set ACTOFF_ALLOCATOR=replay in the environment before the "
    "process starts, or call actoff.install_replay_allocator() before any CUDA tensor is created"
)


def _refuse(reason: str) -> RuntimeError:
    return RuntimeError(f"ACTOFF_ALLOCATOR=replay: {reason}")


def install() -> None:
    """Make actoff's replay allocator torch's CUDA allocator for this process.

    Must run before any CUDA tensor exists: ``ACTOFF_ALLOCATOR=replay`` in the environment
    does it when actoff is imported; call this first thing when the setting comes from
    Python. Idempotent. Raises ``RuntimeError`` naming the fix when CUDA is already in use,
    when torch has no CUDA or sees no device, or when the library was not built.

    Example:
        >>> import actoff
        >>> actoff.install_replay_allocator()  # first thing in the program  # doctest: +SKIP
    """
    global _library, _pluggable
    if _pluggable is not None:
        return
    if torch.cuda.is_initialized():
        raise _refuse(
            "CUDA is already initialised in this process, and torch swaps its allocator only "
            "before the first CUDA allocation. Set ACTOFF_ALLOCATOR=replay in the environment "
            "before the process starts (actoff installs the allocator when it is imported), or "
            "call actoff.install_replay_allocator() before any CUDA tensor is created"
        )
    if torch.version.cuda is None:
        raise _refuse(
            "this PyTorch build has no CUDA (torch.version.cuda is None); the replay allocator "
            "manages CUDA memory only. Use ACTOFF_ALLOCATOR=caching"
        )
    path = library_path()
    if path is None:
        raise _refuse(
            f"actoff/{LIBRARY} was not built (no nvcc, or its compile failed, when actoff was built). Install "
            "the CUDA toolkit, put nvcc on PATH or set CUDA_HOME, and rebuild: "
            "python setup.py build_ext --inplace (or pip install --no-build-isolation -e .)"
        )
    if not torch.cuda.is_available():
        raise _refuse("no CUDA device is visible (torch.cuda.is_available() is False)")
    try:
        library = load_library(path)
        _check_driver(library)
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            path, "actoff_replay_malloc", "actoff_replay_free"
        )
        torch.cuda.memory.change_current_allocator(pluggable)
    except (OSError, RuntimeError) as error:
        raise _refuse(f"installing {path} failed: {error}") from error
    _library, _pluggable = library, pluggable
    count_with(_peaks, reset_peak)  # torch's counters read nothing now (Note [one peak counter, two readers])


def _peaks(device: torch.device) -> tuple[int, int, int]:
    figures = stats(device)
    return figures.live_bytes, figures.peak_bytes, figures.peak_reserved_bytes


def _check_driver(library: ctypes.CDLL) -> None:
    """Refuse before swapping when the library's CUDA runtime cannot use the driver (it is
    static: built with the toolkit where actoff was built, not the one torch ships)."""
    driver, runtime = ctypes.c_int(0), ctypes.c_int(0)
    if library.actoff_replay_check_driver(ctypes.byref(driver), ctypes.byref(runtime)) > 0:
        return
    _, message = _error(library, clear=True)
    raise _refuse(
        f"{LIBRARY} (CUDA runtime {_version(runtime.value)}) cannot use this CUDA driver "
        f"({_version(driver.value)}): {message}. Update the driver, or rebuild actoff with a CUDA "
        "toolkit the driver supports"
    )


def _version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}" if number else "none"


def install_from_environment() -> None:
    """On import: install when ``ACTOFF_ALLOCATOR=replay``; a refusal waits for the first CUDA step."""
    global _install_failure
    if os.environ.get("ACTOFF_ALLOCATOR", "").strip().lower() != "replay":
        return
    try:
        install()
    except RuntimeError as error:
        _install_failure = str(error)


def installed() -> bool:
    """True once the replay allocator is torch's CUDA allocator in this process."""
    return _pluggable is not None


def library() -> ctypes.CDLL | None:
    """The installed library, or None."""
    return _library


def refusal() -> str:
    """Why a CUDA step cannot use the allocator: the refusal on import, or that it was never asked."""
    return _install_failure or _NOT_INSTALLED


def _error(library: ctypes.CDLL, clear: bool) -> tuple[int, str]:
    buffer = ctypes.create_string_buffer(1024)
    count = library.actoff_replay_error(buffer, len(buffer), int(clear))
    return count, buffer.value.decode(errors="replace")


def check(library: ctypes.CDLL | None = None) -> None:
    """Raise what the library recorded since the last check (its C entry points never throw)."""
    library = library if library is not None else _library
    if library is None:
        return
    count, message = _error(library, clear=True)
    if count:
        raise RuntimeError(f"the replay allocator recorded {count} error(s); the first: {message}")


@dataclass(frozen=True)
class AllocatorStats:
    """Figures of the replay allocator on one device: counts cumulative since the process
    started; ``peak_bytes`` and ``peak_reserved_bytes`` since their last reset (`reset_peak`:
    ``auto``'s memory watch restarts them per window, `actoff.report` per report).

    Under a pluggable allocator ``torch.cuda.max_memory_allocated`` no longer reports; these
    do. ``fallbacks`` are the requests a plan could not serve (diverged + occupied).

    Example:
        >>> import actoff
        >>> actoff.replay_allocator_stats().installed  # not installed in this process
        False
    """

    installed: bool = False
    device: int = 0
    served: int = 0  # requests served at their planned offset
    diverged: int = 0  # another size than planned, or more requests: the window is re-planned
    occupied: int = 0  # the planned range was still held by a buffer that lived longer
    unplanned: int = 0  # outlived the window they were planned from: cudaMallocAsync by plan
    outside: int = 0  # requests outside any window (before the first scope, the optimizer)
    fallback: int = 0  # all requests cudaMallocAsync served
    failed: int = 0  # requests that got no memory (null returned, error recorded)
    waits: int = 0  # reuses of a range freed on another stream that waited for its event
    plans: int = 0  # plans set (the first, and one per diverged window)
    live: int = 0  # buffers handed out now
    live_bytes: int = 0
    peak_bytes: int = 0  # most bytes handed out at once (max_memory_allocated's counterpart)
    fallback_bytes: int = 0  # live bytes from cudaMallocAsync
    arena_bytes: int = 0  # the arena (and a retired one still holding buffers)
    peak_reserved_bytes: int = 0  # most arena + fallback bytes at once
    errors: int = 0  # errors recorded and not yet raised
    last_error: str | None = None  # the first of them
    plan_lower_bound_bytes: int = 0  # most planned bytes live at once in the last plan's window

    @property
    def fallbacks(self) -> int:
        """Requests a plan could not serve: ``diverged + occupied``."""
        return self.diverged + self.occupied


class CudaEngine:
    """One device's replay core in libactoff_replay.so, driven through its C entry points."""

    def __init__(self, library: ctypes.CDLL, device: int) -> None:
        self.library = library
        self.device = device
        self.names = library.actoff_replay_stat_names().decode().split(",")
        self._logged = 0

    def _ok(self, result: int) -> int:
        if result < 0:
            check(self.library)
            raise RuntimeError("the replay allocator failed without recording why")
        return result

    def begin_record(self) -> None:
        self._ok(self.library.actoff_replay_begin_record(self.device))

    def begin_step(self) -> None:
        self._ok(self.library.actoff_replay_begin_step(self.device))

    def end_step(self) -> None:
        self._logged = self._ok(self.library.actoff_replay_end_step(self.device))

    def log(self) -> list[tuple[int, int, int]]:
        count = self._logged
        sizes = (ctypes.c_ulonglong * count)()
        starts, ends = (ctypes.c_longlong * count)(), (ctypes.c_longlong * count)()
        self._ok(self.library.actoff_replay_copy_log(self.device, sizes, starts, ends, count))
        return list(zip(sizes, starts, ends, strict=True))

    def set_plan(
        self, sizes: Sequence[int], offsets: Sequence[int], arena_bytes: int, lower_bound: int = 0
    ) -> None:
        """Serve the next windows by this plan; ``lower_bound`` (bytes no layout of the planned
        requests can undercut) is kept for `stats`, to set the arena against."""
        _plan_lower_bounds[self.device] = lower_bound
        count = len(sizes)
        c_sizes, c_offsets = (ctypes.c_ulonglong * count)(*sizes), (ctypes.c_ulonglong * count)(*offsets)
        self._ok(self.library.actoff_replay_set_plan(self.device, c_sizes, c_offsets, count, arena_bytes))

    def clear_plan(self) -> None:
        self._ok(self.library.actoff_replay_clear_plan(self.device))

    def stats(self) -> dict[str, int]:
        values = (ctypes.c_ulonglong * len(self.names))()
        self._ok(self.library.actoff_replay_stats(self.device, values, len(self.names)))
        return dict(zip(self.names, values, strict=True))


def stats(device: int | torch.device | None = None) -> AllocatorStats:
    """The replay allocator's figures on ``device`` (default: the current CUDA device).

    Example:
        >>> import actoff
        >>> actoff.replay_allocator_stats().peak_bytes  # not installed: all zero
        0
    """
    if _library is None:
        return AllocatorStats()
    if isinstance(device, torch.device):
        device = device.index
    index = torch.cuda.current_device() if device is None else int(device)
    figures = CudaEngine(_library, index).stats()
    errors, message = _error(_library, clear=False)
    return AllocatorStats(
        True,
        index,
        **figures,
        errors=errors,
        last_error=message or None,
        plan_lower_bound_bytes=_plan_lower_bounds.get(index, 0),
    )


def reset_peak(device: int | torch.device | None = None) -> None:
    """Start the replay allocator's peaks on ``device`` (default: the current CUDA device) again
    from its figures now, as ``torch.cuda.reset_peak_memory_stats`` does for torch's allocator;
    nothing where the allocator is not installed.

    Example:
        >>> import actoff.memory.replay_allocator as replay
        >>> replay.reset_peak()  # not installed: nothing to reset
    """
    if _library is None:
        return
    if isinstance(device, torch.device):
        device = device.index
    index = torch.cuda.current_device() if device is None else int(device)
    CudaEngine(_library, index)._ok(_library.actoff_replay_reset_peak(index))
