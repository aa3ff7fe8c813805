"""NVMe store: one preallocated file per runtime, 4 KiB-aligned extents reused across steps,
every record sealed when written and checked when read (Note [sealed records])."""

from __future__ import annotations

import bisect
import errno as errno_codes
import itertools
import os
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from actoff.config import Config

from . import engines
from .engines import ALIGNMENT, CppEngine, FailedFuture, IoEngine, PythonEngine
from .files import SpillFile, reclaim_dead
from .kvikio import KvikioEngine, check_kvikio

if TYPE_CHECKING:
    from actoff.device.base import Ticket

__all__ = ["Extent", "ExtentAllocator", "NvmeStore", "StoreRegistry", "open_engine"]


_HOST: Any = object()  # no ticket: a host buffer


def _align(value: int) -> int:
    return (value + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Extent:
    """``size`` bytes (a multiple of 4 KiB) at ``offset`` in the store's file."""

    offset: int
    size: int


class ExtentAllocator:
    """First-fit over a sorted free list, coalescing on free. Pure bookkeeping, no I/O.

    The same allocation sequence after everything was freed gets the same offsets, so a
    training step reuses the file's extents and the file stops growing after step one.

    >>> extents = ExtentAllocator()
    >>> a = extents.alloc(100); b = extents.alloc(5000)
    >>> (a.offset, a.size, b.offset, b.size, extents.end)
    (0, 4096, 4096, 8192, 12288)
    >>> extents.free(a); extents.free(b); extents.alloc(1).offset
    0
    """

    def __init__(self) -> None:
        self.end = 0  # bytes of file the allocator has handed out at most
        self._free: list[tuple[int, int]] = []  # (offset, size), sorted by offset

    @property
    def live_bytes(self) -> int:
        return self.end - sum(size for _, size in self._free)

    def alloc(self, nbytes: int) -> Extent:
        size = _align(max(nbytes, 1))
        for i, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free_size - size)
                return Extent(offset, size)
        # Take the tail: extend the last free run if it touches the end.
        if self._free and self._free[-1][0] + self._free[-1][1] == self.end:
            offset, _ = self._free.pop()
        else:
            offset = self.end
        self.end = offset + size
        return Extent(offset, size)

    def free(self, extent: Extent) -> None:
        i = bisect.bisect_left(self._free, (extent.offset, 0))
        offset, size = extent.offset, extent.size
        if i < len(self._free) and self._free[i][0] == offset + size:  # merge right
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge left
            prev_offset, prev_size = self._free.pop(i - 1)
            offset, size = prev_offset, prev_size + size
            i -= 1
        self._free.insert(i, (offset, size))


def open_engine(file: SpillFile | str, backend: str = "auto", num_threads: int = 4) -> IoEngine:
    """Open the I/O engine for ``file`` (or the file at a path): ``auto`` picks kvikio when it
    really works.

    >>> import tempfile, os
    >>> directory = tempfile.mkdtemp()
    >>> engine = open_engine(os.path.join(directory, "f.bin"), "posix")
    >>> engine.name.startswith("posix")
    True
    >>> engine.close()
    """
    directory = file.directory if isinstance(file, SpillFile) else os.path.dirname(file) or "."
    if backend == "kvikio" or (backend == "auto" and check_kvikio(directory)[0]):
        return KvikioEngine(file, num_threads)
    if engines._C is not None:  # looked up here: tests switch the extension off
        return CppEngine(file, num_threads)
    return PythonEngine(file, num_threads)


class NvmeStore:
    """A spill file in ``directory`` and its extents; the file has no name there (Note [spill
    files die with the process]): ``path`` is the name it was made under (rank and pid in it),
    for messages.

    `close()` (or collecting the store) finishes its I/O and closes the file; the kernel frees
    its blocks then, and when the process ends however it ends.

    >>> import tempfile
    >>> directory = tempfile.mkdtemp()
    >>> store = NvmeStore(directory, backend="posix")
    >>> data = torch.arange(1024, dtype=torch.float32)
    >>> extent, future = store.write(data, data.numel() * 4); _ = future.wait()
    >>> back = torch.empty_like(data); _ = store.read(back, extent, back.numel() * 4).wait()
    >>> torch.equal(back, data), os.listdir(directory)
    (True, [])
    >>> store.close()
    """

    def __init__(self, directory: str, *, backend: str = "auto", num_threads: int = 4) -> None:
        rank = os.environ.get("RANK", "0")
        name = f"actoff-rank{rank}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        reclaim_dead(directory)  # what processes killed at the wrong instant left
        self.file = SpillFile.anonymous(directory, name)
        self.path = self.file.label
        try:
            self.engine: IoEngine = open_engine(self.file, backend, num_threads)
        except BaseException:
            self.file.close()
            raise
        self.extents = ExtentAllocator()
        self.reserved = 0  # bytes preallocated in the file
        self.growths = 0  # times the file was grown (constant after the first step)
        self._lock = threading.Lock()
        self._io: dict[int, object] = {}  # extent offset -> its last request's future
        # Per extent offset, its last write (Note [sealed records]): (sequence or None, bytes, future)
        self._written: dict[int, tuple[int | None, int, Any]] = {}
        self._sequence = itertools.count(1)
        # Runs on close() and when the store is collected; nothing needs exit handlers now.
        self._finalizer = weakref.finalize(self, _close, self.engine, self.file)
        _live_stores.add(self)

    @property
    def takes_device_buffers(self) -> bool:
        """Whether the engine writes and reads device buffers itself (kvikio with GDS active)."""
        return self.engine.takes_device_buffers

    def allocate(self, nbytes: int) -> tuple[Extent, OSError | None]:
        """Take an extent for ``nbytes``, growing the file if needed; returns it and, if the
        file could not grow (disk full, file-size limit), the error (the extent is still
        taken: `free` it)."""
        with self._lock:
            extent = self.extents.alloc(nbytes)
            if extent.offset + extent.size > self.reserved:
                # Grow geometrically: few growths in the first step, none after.
                want = max(extent.offset + extent.size, 2 * self.reserved)
                try:
                    self.engine.reserve(want)
                except OSError as error:
                    try:
                        self.engine.reserve(extent.offset + extent.size)
                        want = extent.offset + extent.size
                    except OSError:
                        return extent, _io_error(error)
                self.reserved = want
                self.growths += 1
        return extent, None

    def write(
        self,
        buffer: torch.Tensor,
        nbytes: int,
        *,
        extent: Extent | None = None,
        after: Ticket = _HOST,
        sealed: bool = True,
    ) -> tuple[Extent, object]:
        """Start writing ``nbytes`` of contiguous ``buffer`` to ``extent`` (one `allocate`
        gave), or to a new extent; returns the extent and the request's future.

        ``after``: ``buffer`` is device memory, written once that ticket completes (only when
        `takes_device_buffers`; Note [direct device I/O] in actoff.tiers.nvme.kvikio).
        ``sealed``: the write seals what it writes under a new sequence number, and `read`
        checks it (Note [sealed records]; ``ACTOFF_NVME_CHECKSUM``).
        """
        if extent is None:
            extent, error = self.allocate(nbytes)
            if error is not None:
                return extent, FailedFuture(error)
        sequence = next(self._sequence) if sealed else None
        if after is _HOST:
            future = self.engine.pwrite(buffer, nbytes, extent.offset, sequence)
        else:
            future = self.engine.pwrite_device(buffer, nbytes, extent.offset, after, sequence)
        self._io[extent.offset] = future
        self._written[extent.offset] = (sequence, nbytes, future)
        return extent, future

    def read(self, buffer: torch.Tensor, extent: Extent, nbytes: int, *, after: Ticket = _HOST) -> object:
        """Start reading ``nbytes`` of ``extent`` into contiguous ``buffer`` (device memory,
        once ticket ``after`` completes, when given: see `write`). The read checks that it got
        what the extent's last write wrote: as many bytes, with its seal (when sealed)."""
        sequence, written, write_future = self._written.get(extent.offset, (None, None, None))
        if written != nbytes or not write_future.done():
            state = (
                "was never written"
                if written is None
                else f"was written with {written} bytes"
                if written != nbytes
                else "is still being written"
            )
            raise RuntimeError(
                f"actoff internal error: reading {nbytes} bytes of the NVMe extent at offset "
                f"{extent.offset} of {self.path}, which {state}"
            )
        checksum = 0
        if sequence is not None:
            checksum = write_future.checksum()
            if checksum is None:  # the write failed: its record fell back and is never read here
                raise RuntimeError(
                    f"actoff internal error: reading the NVMe extent at offset {extent.offset} of "
                    f"{self.path}, whose write failed"
                )
        if after is _HOST:
            future = self.engine.pread(buffer, nbytes, extent.offset, sequence, checksum)
        else:
            future = self.engine.pread_device(buffer, nbytes, extent.offset, after, sequence, checksum)
        self._io[extent.offset] = future
        return future

    def free(self, extent: Extent | None) -> None:
        """Return ``extent``; raise if a request on it is still running (the next write there
        could land before it, or it could overwrite the new bytes)."""
        if extent is None:
            return
        with self._lock:
            future = self._io.pop(extent.offset, None)
            if future is not None and not future.done():
                self._io[extent.offset] = future
                raise RuntimeError(
                    f"actoff internal error: NVMe extent at offset {extent.offset} freed while a "
                    "request on it is still running"
                )
            self._written.pop(extent.offset, None)
            self.extents.free(extent)

    def file_size(self) -> int:
        try:
            return self.engine.file_size()
        except OSError:
            return 0

    def close(self) -> None:
        """Finish queued I/O and close the file (which frees it: it has no name)."""
        self._finalizer()


def _io_error(error: OSError) -> OSError:
    code = error.errno if error.errno is not None else errno_codes.EIO
    return OSError(code, str(error))


def _close(engine: IoEngine, file: SpillFile) -> None:
    try:
        engine.close()
    finally:
        file.close()


_live_stores: weakref.WeakSet[NvmeStore] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: the parent's stores are never closed here (their
    engines are the parent's: Note [engines across fork]); the child leaks them and, if it
    offloads, opens stores of its own."""
    for store in list(_live_stores):
        store._finalizer.detach()
    _live_stores.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class StoreRegistry:
    """One `NvmeStore` per (directory, backend, threads), opened on first use."""

    def __init__(self) -> None:
        self._stores: dict[tuple, NvmeStore] = {}
        self._lock = threading.Lock()

    def get(self, config: Config) -> NvmeStore:
        key = (config.nvme_dir, config.io_backend, config.io_threads)
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                if config.nvme_dir is None:
                    raise ValueError("the nvme tier needs ACTOFF_NVME_DIR (Config.nvme_dir)")
                store = NvmeStore(config.nvme_dir, backend=config.io_backend, num_threads=config.io_threads)
                self._stores[key] = store
            return store

    def stores(self) -> list[NvmeStore]:
        return list(self._stores.values())

    def file_bytes(self) -> int:
        return sum(store.file_size() for store in self._stores.values())

    def backend_name(self) -> str:
        names = sorted({store.engine.name for store in self._stores.values()})
        return ", ".join(names) if names else "none"

    def close(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()
