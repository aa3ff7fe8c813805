"""I/O engines for the NVMe tier: their interface, the C++ POSIX engine and its pure-Python twin.

Every engine has the same small interface: ``pwrite(buffer, nbytes, offset)`` and
``pread(buffer, nbytes, offset)`` take a contiguous host tensor and return a future with
``done()``, ``wait()`` and ``elapsed()`` (seconds of I/O); ``wait()`` raises ``OSError`` naming
the operation, path, offset, size and errno text. ``reserve(nbytes)`` preallocates. ``name``
says which engine runs. An engine that `takes_device_buffers` (kvikio with GPUDirect Storage,
actoff.tiers.nvme.kvikio) also has ``pwrite_device``/``pread_device``. `actoff.tiers.nvme.store.open_engine`
picks one.
"""

from __future__ import annotations

import concurrent.futures
import errno as errno_codes
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from actoff.device.base import Ticket

__all__ = ["ALIGNMENT", "CppEngine", "FailedFuture", "IoEngine", "PythonEngine", "describe_request"]

try:
    from actoff import _C  # type: ignore[attr-defined]
except ImportError:  # pure-Python install (ACTOFF_BUILD_EXT=0) or a build for another torch
    _C = None

ALIGNMENT = 4096


class FailedFuture:
    """A request that failed before it was queued (e.g. the file could not grow)."""

    def __init__(self, error: OSError) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float = -1.0) -> int:
        raise self.error

    def elapsed(self) -> float:
        return 0.0


def describe_request(op: str, path: str, nbytes: int, offset: int) -> str:
    return f"{op} of {nbytes} bytes at offset {offset} of {path}"


class IoEngine:
    """Base: subclasses implement the five methods below; ``name`` says what runs."""

    name = "none"
    path: str
    gds = False  # GPUDirect Storage active (kvikio only)
    direct = False  # O_DIRECT (or GDS) in use

    @property
    def takes_device_buffers(self) -> bool:
        """Whether device buffers go to the disk directly (GDS), not staged through the host."""
        return self.gds

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int):
        raise NotImplementedError

    def pread(self, buffer: torch.Tensor, nbytes: int, offset: int):
        raise NotImplementedError

    def pwrite_device(self, buffer: torch.Tensor, nbytes: int, offset: int, after: Ticket):
        """Write device ``buffer`` once ``after`` (a ticket: the compute stream has produced
        it) completes; only engines that `takes_device_buffers`."""
        raise NotImplementedError(f"{self.name} takes host buffers only")

    def pread_device(self, buffer: torch.Tensor, nbytes: int, offset: int, after: Ticket):
        """Read into device ``buffer`` once ``after`` (a ticket: the compute stream is done
        with the memory) completes; only engines that `takes_device_buffers`."""
        raise NotImplementedError(f"{self.name} takes host buffers only")

    def reserve(self, nbytes: int) -> None:
        raise NotImplementedError

    def file_size(self) -> int:
        return os.stat(self.path).st_size

    def close(self) -> None:
        raise NotImplementedError


class CppEngine(IoEngine):
    """The compiled thread-pool engine (csrc/io_engine.h)."""

    def __init__(self, path: str, num_threads: int, allow_direct: bool = True) -> None:
        self.path = path
        self._engine = _C.IoEngine(path, num_threads, allow_direct, ALIGNMENT)
        self.direct = self._engine.direct_enabled
        self.name = "posix (C++ engine" + (", O_DIRECT)" if self.direct else ", buffered)")

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int):
        return self._engine.pwrite(buffer.data_ptr(), nbytes, offset)

    def pread(self, buffer: torch.Tensor, nbytes: int, offset: int):
        return self._engine.pread(buffer.data_ptr(), nbytes, offset)

    def reserve(self, nbytes: int) -> None:
        self._engine.reserve(nbytes)

    def file_size(self) -> int:
        return self._engine.file_size()

    def close(self) -> None:
        self._engine.close()


class _PyFuture:
    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float = -1.0) -> int:
        try:
            return self._future.result(None if timeout < 0 else timeout)[0]
        except concurrent.futures.TimeoutError:
            raise OSError(
                errno_codes.ETIMEDOUT, f"I/O request not done after {timeout} s: an I/O worker hangs or died"
            ) from None

    def elapsed(self) -> float:
        """Seconds a worker spent on the request (0 until done or if it failed)."""
        if not self._future.done() or self._future.exception() is not None:
            return 0.0
        return self._future.result()[1]


class PythonEngine(IoEngine):
    """Pure-Python twin of the C++ engine: ``os.pwrite``/``os.preadv`` in a thread pool.

    Used when the extension is not built. Buffered I/O only. Same errors as the C++ engine.
    """

    def __init__(self, path: str, num_threads: int) -> None:
        self.path = path
        self.direct = False
        self.name = "posix (Python engine, buffered)"
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="actoff-io")
        self._closed = False
        self._lock = threading.Lock()

    def _submit(self, op: str, buffer: torch.Tensor, nbytes: int, offset: int) -> _PyFuture | FailedFuture:
        view = memoryview(buffer.view(torch.uint8).numpy())[:nbytes]
        with self._lock:
            if self._closed:
                return FailedFuture(
                    OSError(
                        0,
                        describe_request(op, self.path, nbytes, offset) + " failed: the I/O engine is closed",
                    )
                )
            return _PyFuture(self._pool.submit(self._run, op, view, nbytes, offset))

    def _run(self, op: str, view: memoryview, nbytes: int, offset: int) -> tuple[int, float]:
        started = time.perf_counter()
        done = 0
        while done < nbytes:
            try:
                if op == "pwrite":
                    moved = os.pwrite(self._fd, view[done:], offset + done)
                else:
                    moved = os.preadv(self._fd, [view[done:]], offset + done)
            except InterruptedError:
                continue
            except OSError as error:
                raise OSError(
                    error.errno,
                    f"{describe_request(op, self.path, nbytes, offset)} failed: "
                    f"{os.strerror(error.errno)} (errno {error.errno})",
                ) from None
            if moved == 0:
                kind = "made no progress" if op == "pwrite" else "is a short read"
                raise OSError(
                    errno_codes.ENOSPC if op == "pwrite" else errno_codes.EIO,
                    f"{describe_request(op, self.path, nbytes, offset)} {kind}: {done} of {nbytes} "
                    f"bytes moved (file size {self.file_size()})",
                )
            done += moved
        return done, time.perf_counter() - started

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int):
        return self._submit("pwrite", buffer, nbytes, offset)

    def pread(self, buffer: torch.Tensor, nbytes: int, offset: int):
        return self._submit("pread", buffer, nbytes, offset)

    def reserve(self, nbytes: int) -> None:
        if nbytes <= self.file_size():
            return
        try:
            os.posix_fallocate(self._fd, 0, nbytes)
        except OSError as error:
            if error.errno not in (errno_codes.EOPNOTSUPP, errno_codes.EINVAL):
                raise OSError(
                    error.errno,
                    f"cannot reserve {nbytes} bytes for {self.path}: {os.strerror(error.errno)}",
                ) from None
            os.ftruncate(self._fd, nbytes)

    def file_size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)  # Note [drain on close], as in the C++ engine
        os.close(self._fd)
