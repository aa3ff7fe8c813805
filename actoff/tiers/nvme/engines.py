"""I/O engines for the NVMe tier: their interface, the C++ POSIX engine and its pure-Python twin.

Every engine has the same small interface: ``pwrite(buffer, nbytes, offset, sequence)`` and
``pread(buffer, nbytes, offset, sequence, checksum)`` take a contiguous host tensor and return a
future with ``done()``, ``wait()``, ``elapsed()`` (seconds of I/O) and ``checksum()``; ``wait()``
raises ``OSError`` naming the operation, path, offset, size and errno text. A ``sequence``
seals the request (Note [sealed records] in actoff.tiers.nvme.seals): a write's future then
gives the seal of what it wrote, and a read fails with ``EBADMSG`` unless what it read has
``checksum``. ``reserve(nbytes)`` preallocates. ``name`` says which engine runs. An engine
serves one open file (actoff.tiers.nvme.files.SpillFile, or a path it opens), by descriptor.
An engine that `takes_device_buffers` (kvikio with GPUDirect Storage, actoff.tiers.nvme.kvikio)
also has ``pwrite_device``/``pread_device``. `actoff.tiers.nvme.store.open_engine` picks one.

After ``os.fork()`` an engine of the parent refuses every request in the child, and its
``close()`` joins and signals nothing (Note [engines across fork] in csrc/io_engine.cpp).
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

from .files import SpillFile
from .seals import host_seal, mismatch

__all__ = [
    "ALIGNMENT",
    "CppEngine",
    "FailedFuture",
    "IoEngine",
    "PythonEngine",
    "describe_request",
    "fork_generation",
]

try:
    import actoff._C as _C  # type: ignore[import-not-found]
except ImportError:  # pure-Python install (ACTOFF_BUILD_EXT=0) or a build for another torch
    _C = None

ALIGNMENT = 4096

_forks = [0]  # forks this process went through as a child (the C++ engine counts its own)


def fork_generation() -> int:
    """How many times this process was forked into (0 in the process that started)."""
    return _forks[0]


def _count_fork() -> None:
    _forks[0] += 1


os.register_at_fork(after_in_child=_count_fork)


def forked_error(describe: str) -> OSError:
    return OSError(
        errno_codes.ECHILD,
        f"{describe} failed: the I/O engine belongs to the parent process (this process was forked from it)",
    )


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

    def checksum(self) -> int | None:
        return None


def describe_request(op: str, path: str, nbytes: int, offset: int) -> str:
    return f"{op} of {nbytes} bytes at offset {offset} of {path}"


class IoEngine:
    """Base: subclasses implement the five methods below; ``name`` says what runs, ``path``
    names the file in messages (``file`` is the open file itself)."""

    name = "none"
    path: str
    file: SpillFile
    gds = False  # GPUDirect Storage active (kvikio only)
    direct = False  # O_DIRECT (or GDS) in use

    def _open(self, file: SpillFile | str) -> None:
        """Serve ``file``, or the file at a path (opened, or created exclusively, and closed
        with the engine)."""
        self._owns_file = not isinstance(file, SpillFile)
        self.file = SpillFile.open(file) if self._owns_file else file
        self.path = self.file.label
        self._generation = fork_generation()

    def forked(self) -> bool:
        """True in a child forked after the engine was opened: the engine is the parent's."""
        return self._generation != fork_generation()

    def _close_file(self) -> None:
        if self._owns_file:
            self.file.close()

    @property
    def takes_device_buffers(self) -> bool:
        """Whether device buffers go to the disk directly (GDS), not staged through the host."""
        return self.gds

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None):
        raise NotImplementedError

    def pread(
        self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None, checksum: int = 0
    ):
        raise NotImplementedError

    def pwrite_device(
        self, buffer: torch.Tensor, nbytes: int, offset: int, after: Ticket, sequence: int | None = None
    ):
        """Write device ``buffer`` once ``after`` (a ticket: the compute stream has produced
        it) completes; only engines that `takes_device_buffers`."""
        raise NotImplementedError(f"{self.name} takes host buffers only")

    def pread_device(
        self,
        buffer: torch.Tensor,
        nbytes: int,
        offset: int,
        after: Ticket,
        sequence: int | None = None,
        checksum: int = 0,
    ):
        """Read into device ``buffer`` once ``after`` (a ticket: the compute stream is done
        with the memory) completes; only engines that `takes_device_buffers`."""
        raise NotImplementedError(f"{self.name} takes host buffers only")

    def reserve(self, nbytes: int) -> None:
        raise NotImplementedError

    def file_size(self) -> int:
        return self.file.size()

    def close(self) -> None:
        raise NotImplementedError


class CppEngine(IoEngine):
    """The compiled thread-pool engine (csrc/io_engine.h); seals are CRC32C, in its workers."""

    def __init__(self, file: SpillFile | str, num_threads: int, allow_direct: bool = True) -> None:
        self._open(file)
        try:
            self._engine = _C.IoEngine(self.file.fd, self.path, num_threads, allow_direct, ALIGNMENT)
        except BaseException:
            self._close_file()
            raise
        self.direct = self._engine.direct_enabled
        self.name = "posix (C++ engine" + (", O_DIRECT)" if self.direct else ", buffered)")

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None):
        return self._engine.pwrite(buffer.data_ptr(), nbytes, offset, sequence)

    def pread(
        self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None, checksum: int = 0
    ):
        return self._engine.pread(buffer.data_ptr(), nbytes, offset, sequence, checksum)

    def reserve(self, nbytes: int) -> None:
        self._engine.reserve(nbytes)

    def file_size(self) -> int:
        return self._engine.file_size()

    def close(self) -> None:
        self._engine.close()  # in a forked child: leaks, joins nothing (Note [engines across fork])
        if not self.forked():
            self._close_file()


class PoolFuture:
    """A request run by a pool thread that returns ``(bytes moved, seconds, seal or None)``."""

    __slots__ = ("_future", "_generation")

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future
        self._generation = fork_generation()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float = -1.0) -> int:
        if self._generation != fork_generation() and not self._future.done():
            raise OSError(
                errno_codes.ECHILD,
                "an I/O request of the parent process cannot be waited for in a forked child",
            )
        try:
            return self._future.result(None if timeout < 0 else timeout)[0]
        except concurrent.futures.TimeoutError:
            raise OSError(
                errno_codes.ETIMEDOUT, f"I/O request not done after {timeout} s: an I/O worker hangs or died"
            ) from None

    def _result(self) -> tuple | None:
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()

    def elapsed(self) -> float:
        """Seconds a worker spent on the request (0 until done or if it failed)."""
        result = self._result()
        return 0.0 if result is None else result[1]

    def checksum(self) -> int | None:
        """The seal of what a sealed write wrote (None until done, or unsealed)."""
        result = self._result()
        return None if result is None else result[2]


class PythonEngine(IoEngine):
    """Pure-Python twin of the C++ engine: ``os.pwrite``/``os.preadv`` in a thread pool, seals
    with ``zlib.crc32`` in the same threads.

    Used when the extension is not built. Buffered I/O only. Same errors as the C++ engine.
    """

    def __init__(self, file: SpillFile | str, num_threads: int) -> None:
        self._open(file)
        self.direct = False
        self.name = "posix (Python engine, buffered)"
        self._fd = os.dup(self.file.fd)  # its own (close-on-exec): the caller may close the file's
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="actoff-io")
        self._closed = False
        self._lock = threading.Lock()

    def _submit(
        self, op: str, buffer: torch.Tensor, nbytes: int, offset: int, seal: tuple[int, int] | None
    ) -> PoolFuture | FailedFuture:
        describe = describe_request(op, self.path, nbytes, offset)
        if self.forked():  # no lock: it may have been copied held (Note [engines across fork])
            return FailedFuture(forked_error(describe))
        view = memoryview(buffer.view(torch.uint8).numpy())[:nbytes]
        with self._lock:
            if self._closed:
                return FailedFuture(OSError(0, describe + " failed: the I/O engine is closed"))
            return PoolFuture(self._pool.submit(self._run, op, view, nbytes, offset, seal))

    def _run(
        self, op: str, view: memoryview, nbytes: int, offset: int, seal: tuple[int, int] | None = None
    ) -> tuple[int, float, int | None]:
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
        checksum = None
        if seal is not None:  # Note [sealed records]: here, not in the caller's thread
            sequence, expected = seal
            checksum = host_seal(view, sequence, nbytes)
            if op == "pread" and checksum != expected:
                raise mismatch(describe_request(op, self.path, nbytes, offset), checksum, sequence, expected)
        return done, time.perf_counter() - started, checksum

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None):
        return self._submit("pwrite", buffer, nbytes, offset, None if sequence is None else (sequence, 0))

    def pread(
        self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None, checksum: int = 0
    ):
        return self._submit(
            "pread", buffer, nbytes, offset, None if sequence is None else (sequence, checksum)
        )

    def reserve(self, nbytes: int) -> None:
        if self.forked():
            raise forked_error(f"reserving {nbytes} bytes of {self.path}")
        reserve(self._fd, nbytes, self.path)

    def file_size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self.forked():  # Note [engines across fork]: leak the parent's pool, join nothing
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)  # Note [drain on close], as in the C++ engine
        os.close(self._fd)
        self._close_file()


def reserve(fd: int, nbytes: int, path: str) -> None:
    """Grow the file of ``fd`` to ``nbytes`` with real blocks (sized, where the file system has
    no fallocate); ``OSError`` naming ``path`` when it cannot."""
    if nbytes <= os.fstat(fd).st_size:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        if error.errno not in (errno_codes.EOPNOTSUPP, errno_codes.EINVAL):
            raise OSError(
                error.errno, f"cannot reserve {nbytes} bytes for {path}: {os.strerror(error.errno)}"
            ) from None
        os.ftruncate(fd, nbytes)
