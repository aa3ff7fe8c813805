"""The kvikio adapter: kvikio 26's ``CuFile`` behind actoff's I/O engine interface (actoff.tiers.nvme.engines).

GPUDirect Storage where the system really has it, else kvikio's compat (POSIX) mode; `name`
says which (``kvikio (GDS)`` or ``kvikio (compat)``), and `check_kvikio` whether kvikio can do
I/O here at all (without a CUDA driver every request fails, host buffers included). With GDS
active the engine also takes device buffers (Note [direct device I/O]). kvikio runs its requests
on threads of its own, so the engine's seals (Note [sealed records] in actoff.tiers.nvme.seals)
run on a small pool of the engine's: CRC32C for host buffers, `device_seal` on the device for
device buffers. kvikio opens the file by path: the engine gives it ``/proc/self/fd/N``, so the
spill file needs no name on disk.
"""

from __future__ import annotations

import concurrent.futures
import errno as errno_codes
import importlib.util
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from .engines import ALIGNMENT, FailedFuture, IoEngine, PoolFuture, describe_request, forked_error, reserve
from .files import SpillFile
from .seals import device_seal, fast_crc, host_seal, mismatch

if TYPE_CHECKING:
    from actoff.device.base import Ticket

__all__ = ["KvikioEngine", "check_kvikio", "kvikio_available", "kvikio_compat_mode"]


class _KvikioFuture:
    """A kvikio ``IOFuture`` behind the engines' future interface.

    kvikio's future wraps a C++ ``std::future``: ``get()`` may be called once only, and the
    future (and the buffer it reads or writes) must stay referenced until then, so this object
    holds both and remembers the result. kvikio reports no timing: ``elapsed()`` is the time
    from submission until completion was first seen (``done()`` or ``wait()``), queueing in
    kvikio's thread pool included.
    """

    __slots__ = ("_buffer", "_error", "_file", "_finished_s", "_future", "_moved", "_request", "_started_s")

    def __init__(
        self, future, buffer, request: tuple[str, str, int, int], started_s: float, file: SpillFile
    ) -> None:
        self._future, self._buffer = future, buffer
        self._request = request  # (op, path, nbytes, offset)
        self._file = file
        self._started_s = started_s
        self._finished_s: float | None = None
        self._moved: int | None = None
        self._error: OSError | None = None

    def done(self) -> bool:
        if self._finished_s is not None:
            return True
        if self._future.done():
            self._finished_s = time.perf_counter()
            return True
        return False

    def wait(self, timeout: float = -1.0) -> int:
        del timeout  # kvikio futures have no timeout
        if self._moved is None and self._error is None:
            try:
                self._moved = int(self._future.get())
            except Exception as error:  # kvikio raises RuntimeError for I/O failures
                self._error = self._failure(error)
            else:
                if self._moved != self._request[2]:
                    self._error = self._failure(None)
            if self._finished_s is None:
                self._finished_s = time.perf_counter()
            self._future = self._buffer = None  # the C++ future is spent: let both go
        if self._error is not None:
            raise self._error
        return self._moved

    def _failure(self, error: Exception | None) -> OSError:
        op, path, nbytes, offset = self._request
        describe = describe_request(op, path, nbytes, offset)
        try:
            file_size = self._file.size()
        except OSError:
            file_size = -1
        if op == "pread" and 0 <= file_size < offset + nbytes:
            # kvikio fails a read past the end of the file ("POSIX error on pread: EOF") without
            # saying how far it got: the file size does.
            moved = max(0, min(nbytes, file_size - offset))
            return OSError(
                errno_codes.EIO,
                f"{describe} is a short read: {moved} of {nbytes} bytes moved (file size {file_size})",
            )
        if error is None:
            return OSError(errno_codes.EIO, f"{describe} moved {self._moved} of {nbytes} bytes")
        return OSError(getattr(error, "errno", None) or errno_codes.EIO, f"{describe} failed: {error}")

    def elapsed(self) -> float:
        """Seconds from submission to completion (0 until completion was seen, or on failure)."""
        if self._finished_s is None or self._error is not None:
            return 0.0
        return self._finished_s - self._started_s

    def checksum(self) -> int | None:
        return None  # unsealed: sealed requests are `PoolFuture`s around this one


class _DeviceFuture:
    """A device-buffer request of `KvikioEngine`: queued on the engine's device thread until
    its ticket completes (Note [direct device I/O]), then kvikio's own future."""

    __slots__ = ("_describe", "_submitted")

    def __init__(self, submitted: concurrent.futures.Future, describe: str) -> None:
        self._submitted = submitted  # -> a _KvikioFuture or a FailedFuture, never raises
        self._describe = describe

    def done(self) -> bool:
        return self._submitted.done() and self._submitted.result().done()

    def wait(self, timeout: float = -1.0) -> int:
        try:
            inner = self._submitted.result(None if timeout < 0 else timeout)
        except concurrent.futures.TimeoutError:
            raise OSError(
                errno_codes.ETIMEDOUT,
                f"{self._describe} not started after {timeout} s: the compute stream never reached "
                "the point the request waits for, or the device I/O thread hangs",
            ) from None
        return inner.wait(timeout)

    def elapsed(self) -> float:
        return self._submitted.result().elapsed() if self._submitted.done() else 0.0

    def checksum(self) -> int | None:
        return self._submitted.result().checksum() if self._submitted.done() else None


class KvikioEngine(IoEngine):
    """kvikio's ``CuFile``: GPUDirect Storage where the system has it, else kvikio's POSIX mode.

    ``gds`` says whether kvikio runs with cuFile (compat mode off, or ``AUTO`` resolved to
    off); ``name`` says the same (``kvikio (GDS)`` or ``kvikio (compat)``). Host buffers go
    through POSIX I/O inside kvikio in both modes; only device buffers can use GDS.
    ``num_threads`` raises kvikio's global thread pool to at least that many threads
    (``KVIKIO_NTHREADS`` defaults to 1).

    >>> engine = KvikioEngine("/mnt/nvme/a.bin")  # doctest: +SKIP
    >>> engine.name                               # doctest: +SKIP
    'kvikio (compat)'
    """

    def __init__(self, file: SpillFile | str, num_threads: int = 4) -> None:
        try:
            import kvikio  # optional extra: pip install actoff[nvme]

            # A submodule that `import kvikio` leaves unbound (kvikio 26): import it by name.
            settings = importlib.import_module("kvikio.defaults")
        except ImportError as error:
            raise ModuleNotFoundError(
                f"io_backend='kvikio' needs the kvikio package (pip install actoff[nvme]): {error}",
                name="kvikio",
            ) from error

        self._open(file)
        _raise_kvikio_threads(settings, num_threads)
        try:  # the file may have no name: kvikio reopens it through this process's descriptor
            self._file = kvikio.CuFile(self.file.reopen_path(), "r+")
        except BaseException:
            self._close_file()
            raise
        self.gds = not kvikio_compat_mode(settings)
        self.direct = self.gds
        self.name = "kvikio (GDS)" if self.gds else "kvikio (compat)"
        self._closed = False
        self._num_threads = num_threads
        self._device_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._seal_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._seal_stream: Any = None  # a CUDA stream for device seals, made on first use
        self._lock = threading.Lock()

    @staticmethod
    def _buffer(buffer: torch.Tensor):
        # kvikio takes host buffers through the buffer protocol (numpy) and device buffers
        # through __cuda_array_interface__; bytes keep any dtype (bf16 has no numpy twin).
        raw = buffer.view(torch.uint8)
        return raw.numpy() if raw.device.type == "cpu" else raw

    def _submit(self, op: str, buffer: torch.Tensor, nbytes: int, offset: int):
        describe = describe_request(op, self.path, nbytes, offset)
        if self.forked():
            return FailedFuture(forked_error(describe))
        if self._closed:
            return FailedFuture(OSError(0, describe + " failed: the I/O engine is closed"))
        view = self._buffer(buffer)
        started_s = time.perf_counter()
        try:
            call = self._file.pwrite if op == "pwrite" else self._file.pread
            future = call(view, nbytes, offset)
        except Exception as error:  # refused before queueing (bad buffer, closed file, ...)
            return FailedFuture(
                OSError(getattr(error, "errno", None) or errno_codes.EIO, f"{describe} failed: {error}")
            )
        return _KvikioFuture(future, view, (op, self.path, nbytes, offset), started_s, self.file)

    def _sealed(
        self,
        inner,
        op: str,
        buffer: torch.Tensor,
        nbytes: int,
        offset: int,
        seal: tuple[int, int] | None,
        on_device: bool = False,
    ):
        """``inner`` with its seal computed, or checked, on the seal pool once it is done
        (Note [sealed records]): kvikio's own threads cannot be asked to. ``on_device``: a
        device buffer's (``pread_device``/``pwrite_device``), sealed with `device_seal`."""
        if seal is None or isinstance(inner, FailedFuture):
            return inner
        sequence, expected = seal
        with self._lock:
            if self._seal_pool is None:
                self._seal_pool = concurrent.futures.ThreadPoolExecutor(
                    self._num_threads, thread_name_prefix="actoff-seal"
                )
            pool = self._seal_pool

        def check() -> tuple[int, float, int]:
            moved = inner.wait()
            checksum = self._seal_of(buffer, sequence, nbytes, on_device)
            if op == "pread" and checksum != expected:
                raise mismatch(describe_request(op, self.path, nbytes, offset), checksum, sequence, expected)
            return moved, inner.elapsed(), checksum

        return PoolFuture(pool.submit(check))

    def _seal_of(self, buffer: torch.Tensor, sequence: int, nbytes: int, on_device: bool) -> int:
        # By the path the buffer came through, not by where it lives: the simulated device's
        # buffers are CPU tensors, and its GDS path must seal as a GPU's does.
        if not on_device:
            return host_seal(buffer.view(torch.uint8).numpy()[:nbytes], sequence, nbytes, fast_crc)
        if buffer.device.type == "cpu":  # the simulated device: no stream to order against
            return device_seal(buffer, sequence, nbytes)
        if self._seal_stream is None:
            self._seal_stream = torch.cuda.Stream(buffer.device)
        # The bytes are there (kvikio's future is done): a stream of its own, then one wait.
        with torch.cuda.stream(self._seal_stream):
            return device_seal(buffer, sequence, nbytes)

    def pwrite(self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None):
        seal = None if sequence is None else (sequence, 0)
        return self._sealed(
            self._submit("pwrite", buffer, nbytes, offset), "pwrite", buffer, nbytes, offset, seal
        )

    def pread(
        self, buffer: torch.Tensor, nbytes: int, offset: int, sequence: int | None = None, checksum: int = 0
    ):
        seal = None if sequence is None else (sequence, checksum)
        return self._sealed(
            self._submit("pread", buffer, nbytes, offset), "pread", buffer, nbytes, offset, seal
        )

    # Note [direct device I/O]: the training thread never calls kvikio with a device buffer:
    # the engine's device thread does, once the request's ticket (`DeviceBackend.mark`,
    # recorded on the compute stream) has completed, i.e. once the compute stream has produced
    # the bytes (a write) or is done with the memory a read lands in (a fresh allocation may
    # reuse a block that kernels queued earlier still use). cuFile's DMA is ordered against no
    # CUDA stream, and with GDS active kvikio's pread/pwrite of a device buffer first
    # synchronises the legacy default stream in the *calling* thread (a request under its
    # gds_threshold runs synchronously through a bounce buffer). The caller holds the buffer
    # until the future is done.
    def pwrite_device(
        self, buffer: torch.Tensor, nbytes: int, offset: int, after: Ticket, sequence: int | None = None
    ):
        seal = None if sequence is None else (sequence, 0)
        return self._submit_device("pwrite", buffer, nbytes, offset, after, seal)

    def pread_device(
        self,
        buffer: torch.Tensor,
        nbytes: int,
        offset: int,
        after: Ticket,
        sequence: int | None = None,
        checksum: int = 0,
    ):
        seal = None if sequence is None else (sequence, checksum)
        return self._submit_device("pread", buffer, nbytes, offset, after, seal)

    def _submit_device(
        self,
        op: str,
        buffer: torch.Tensor,
        nbytes: int,
        offset: int,
        after: Ticket,
        seal: tuple[int, int] | None,
    ):
        if not self.gds:  # compat mode: kvikio would bounce through host memory, synchronously
            raise NotImplementedError(f"{self.name} takes host buffers only: stage through host memory")
        describe = describe_request(op, self.path, nbytes, offset)
        if self.forked():
            return FailedFuture(forked_error(describe))
        with self._lock:
            if self._closed:
                return FailedFuture(OSError(0, describe + " failed: the I/O engine is closed"))
            if self._device_pool is None:
                self._device_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="actoff-gds")
            pool = self._device_pool

        def submit():
            try:
                if after is not None:
                    after.synchronize()  # the compute stream has reached the request's point
            except Exception as error:
                return FailedFuture(OSError(errno_codes.EIO, f"{describe} failed: {error}"))
            inner = self._submit(op, buffer, nbytes, offset)
            return self._sealed(inner, op, buffer, nbytes, offset, seal, on_device=True)

        return _DeviceFuture(pool.submit(submit), describe)

    def reserve(self, nbytes: int) -> None:
        if self.forked():
            raise forked_error(f"reserving {nbytes} bytes of {self.path}")
        reserve(self.file.fd, nbytes, self.path)

    def close(self) -> None:
        # Callers wait for their futures before closing (the store drains them); a second
        # close is a no-op, as for the other engines. In a forked child kvikio's threads and
        # the pools are the parent's: nothing is joined or closed (Note [engines across fork]).
        if self.forked():
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pools = (self._device_pool, self._seal_pool)
            self._device_pool = self._seal_pool = None
        for pool in pools:  # the device pool first: its requests may queue seals
            if pool is not None:
                pool.shutdown(wait=True)  # requests queued there end (and fail: the engine is closed)
        self._file.close()
        self._close_file()


def kvikio_compat_mode(settings) -> bool:
    """Whether kvikio runs POSIX I/O (compat mode) rather than cuFile, as far as it can tell;
    ``settings`` is the ``kvikio.defaults`` module.

    kvikio 26: ``kvikio.defaults.is_compat_mode_preferred()`` resolves ``AUTO`` (no cuFile
    library, no nvidia-fs, ...) to on or off; Python's ``CuFile`` has no per-file query. An
    older kvikio without it: ``kvikio.defaults.get("compat_mode")`` (a ``CompatMode`` enum),
    where ``AUTO`` counts as compat since nothing says cuFile really works.
    """
    preferred = getattr(settings, "is_compat_mode_preferred", None)
    if callable(preferred):
        return bool(preferred())
    mode = settings.get("compat_mode")
    return getattr(mode, "name", str(mode)).upper().rsplit(".", 1)[-1] != "OFF"


def _raise_kvikio_threads(settings, num_threads: int) -> None:
    """Grow kvikio's global thread pool to ``num_threads`` (never shrink what a user set)."""
    try:
        if int(settings.get("num_threads")) < num_threads:
            settings.set("num_threads", num_threads)
    except (KeyError, ValueError, TypeError):  # a kvikio without the setting: keep its default
        pass


def kvikio_available() -> bool:
    """True when the kvikio package is importable (not that it can do I/O here)."""
    if sys.modules.get("kvikio") is not None:
        return True
    try:
        return importlib.util.find_spec("kvikio") is not None
    except ValueError:  # a module in sys.modules without a spec
        return False


def check_kvikio(directory: str, num_threads: int = 1) -> tuple[bool, str]:
    """Whether kvikio really does I/O in ``directory``: a 4 KiB write and read-back, compared.

    Returns ``(True, engine name)`` or ``(False, why not)``.

    >>> import tempfile
    >>> ok, why = check_kvikio(tempfile.mkdtemp())
    >>> ok or why.startswith(("kvikio is not installed", "kvikio cannot do I/O"))
    True
    """
    if not kvikio_available():
        return False, "kvikio is not installed"
    engine = spill = None
    try:  # Note [spill files die with the process]: the check's file too
        spill = SpillFile.anonymous(directory, f".actoff-probe-{os.getpid()}-{threading.get_ident()}")
        engine = KvikioEngine(spill, num_threads)
        data = torch.arange(ALIGNMENT, dtype=torch.int32).to(torch.uint8)
        back = torch.empty_like(data)
        engine.pwrite(data, ALIGNMENT, 0).wait()
        engine.pread(back, ALIGNMENT, 0).wait()
        if not torch.equal(data, back):
            return False, "kvikio cannot do I/O here: data read back differs from data written"
        return True, engine.name
    except Exception as error:  # no driver, no libcufile, ...: kvikio cannot do I/O here
        return False, f"kvikio cannot do I/O here: {type(error).__name__}: {error}"
    finally:
        if engine is not None:
            engine.close()
        if spill is not None:
            spill.close()
