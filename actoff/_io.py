"""I/O engines for the NVMe tier: the C++ POSIX engine, its pure-Python twin, and kvikio.

Every engine has the same small interface: ``pwrite(buffer, nbytes, offset)`` and
``pread(buffer, nbytes, offset)`` take a contiguous tensor (host memory; device memory too for
kvikio) and return a future with ``done()``, ``wait()`` and ``elapsed()`` (seconds of I/O); ``wait()`` raises ``OSError``
naming the operation, path, offset, size and errno text. ``reserve(nbytes)`` preallocates.
"""

from __future__ import annotations

import concurrent.futures
import errno as errno_codes
import importlib.util
import os
import threading
import time

import torch

__all__ = ["FailedFuture", "IoEngine", "PythonEngine", "open_engine"]

try:
    from . import _C  # type: ignore[attr-defined]
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


def _describe(op: str, path: str, nbytes: int, offset: int) -> str:
    return f"{op} of {nbytes} bytes at offset {offset} of {path}"


class IoEngine:
    """Base: subclasses implement the five methods below; ``name`` says what runs."""

    name = "none"
    path: str

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int):
        raise NotImplementedError

    def pread(self, buffer: torch.Tensor, nbytes: int, offset: int):
        raise NotImplementedError

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
                        _describe(op, self.path, nbytes, offset) + " failed: the I/O engine is closed",
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
                    f"{_describe(op, self.path, nbytes, offset)} failed: "
                    f"{os.strerror(error.errno)} (errno {error.errno})",
                ) from None
            if moved == 0:
                kind = "made no progress" if op == "pwrite" else "is a short read"
                raise OSError(
                    errno_codes.ENOSPC if op == "pwrite" else errno_codes.EIO,
                    f"{_describe(op, self.path, nbytes, offset)} {kind}: {done} of {nbytes} "
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


class _KvikioFuture:
    __slots__ = ("_describe", "_future", "_nbytes")

    def __init__(self, future, nbytes: int, describe: str) -> None:
        self._future, self._nbytes, self._describe = future, nbytes, describe

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float = -1.0) -> int:
        del timeout  # kvikio futures have no timeout
        try:
            moved = self._future.get()
            self._finished = self._finished or time.perf_counter()
        except Exception as error:  # kvikio raises RuntimeError for I/O failures
            raise OSError(errno_codes.EIO, f"{self._describe} failed: {error}") from error
        if moved != self._nbytes:
            raise OSError(0, f"{self._describe} moved {moved} of {self._nbytes} bytes")
        return moved


class KvikioEngine(IoEngine):
    """kvikio's CuFile: GPUDirect Storage where the system has it, else kvikio's POSIX mode."""

    def __init__(self, path: str) -> None:
        import kvikio  # optional extra: pip install actoff[nvme]

        self.path = path
        # Create the file first: CuFile's "r+" needs it to exist.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self._file = kvikio.CuFile(path, "r+")
        self.gds = not _kvikio_compat(kvikio, self._file)
        self.direct = self.gds
        self.name = "kvikio (" + ("GDS" if self.gds else "compat mode: POSIX inside kvikio") + ")"

    @staticmethod
    def _buffer(buffer: torch.Tensor):
        # kvikio takes host buffers through the buffer protocol (numpy) and device buffers
        # through __cuda_array_interface__; bytes keep any dtype (bf16 has no numpy twin).
        raw = buffer.view(torch.uint8)
        return raw.numpy() if raw.device.type == "cpu" else raw

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int):
        future = self._file.pwrite(self._buffer(buffer), nbytes, offset)
        return _KvikioFuture(future, nbytes, _describe("pwrite", self.path, nbytes, offset))

    def pread(self, buffer: torch.Tensor, nbytes: int, offset: int):
        future = self._file.pread(self._buffer(buffer), nbytes, offset)
        return _KvikioFuture(future, nbytes, _describe("pread", self.path, nbytes, offset))

    def reserve(self, nbytes: int) -> None:
        if nbytes <= self.file_size():
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            raise OSError(
                error.errno,
                f"cannot reserve {nbytes} bytes for {self.path}: {os.strerror(error.errno)}",
            ) from None
        finally:
            os.close(fd)

    def close(self) -> None:
        self._file.close()


def _kvikio_compat(kvikio, handle) -> bool:
    """Whether kvikio really runs POSIX I/O (compat mode) for this file."""
    for method in ("is_compat_mode_preferred",):
        probe = getattr(handle, method, None)
        if callable(probe):
            return bool(probe())
    mode = kvikio.defaults.get("compat_mode")
    return str(mode).upper().endswith("ON")


def kvikio_available() -> bool:
    """True when the kvikio package is importable (not that it can do I/O here)."""
    return importlib.util.find_spec("kvikio") is not None


def _probe_kvikio(directory: str) -> KvikioEngine | None:
    """A kvikio engine if a 4 KiB write and read-back really work in ``directory``."""
    if not kvikio_available():
        return None
    path = os.path.join(directory, f".actoff-probe-{os.getpid()}")
    engine = None
    try:
        engine = KvikioEngine(path)
        data = torch.arange(ALIGNMENT, dtype=torch.int32).to(torch.uint8)
        back = torch.empty_like(data)
        engine.pwrite(data, ALIGNMENT, 0).wait()
        engine.pread(back, ALIGNMENT, 0).wait()
        ok = torch.equal(data, back)
    except Exception:  # no driver, no libcufile, ...: kvikio cannot do I/O here
        ok = False
    finally:
        if engine is not None:
            engine.close()
        if os.path.exists(path):
            os.unlink(path)
    return ok or None  # type: ignore[return-value]


def open_engine(path: str, backend: str = "auto", num_threads: int = 4) -> IoEngine:
    """Open the I/O engine for ``path``: ``auto`` picks kvikio when it really works.

    >>> import tempfile, os
    >>> directory = tempfile.mkdtemp()
    >>> engine = open_engine(os.path.join(directory, "f.bin"), "posix")
    >>> engine.name.startswith("posix")
    True
    >>> engine.close()
    """
    if backend == "kvikio" or (backend == "auto" and _probe_kvikio(os.path.dirname(path))):
        return KvikioEngine(path)
    if _C is not None:
        return CppEngine(path, num_threads)
    return PythonEngine(path, num_threads)
