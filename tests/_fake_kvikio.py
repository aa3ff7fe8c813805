"""A stand-in for kvikio 26's Python API that does POSIX I/O on host buffers (tests only).

It follows the documented surface of kvikio 26.x (``kvikio.CuFile``, ``kvikio.defaults``,
``kvikio.CompatMode``), including the parts an adapter can get wrong:

- ``CuFile(path, flags)`` takes ``"r"``, ``"r+"``, ``"w"``, ``"w+"`` (``"a"`` is refused) and
  opens the file at once; ``pread``/``pwrite(buf, size=None, file_offset=0, task_size=None)``
  split the request into ``task_size`` tasks on a global thread pool and return an
  ``IOFuture`` whose ``get()`` blocks and may be called once only (it wraps a C++
  ``std::future``); ``read``/``write`` block; a read past the end of the file fails with
  kvikio's "POSIX error on pread: EOF"; I/O errors surface as ``RuntimeError``.
- ``kvikio.defaults.get(name)`` / ``set(name, value)`` / ``set({...})`` (a context manager
  that restores on exit) over ``compat_mode`` (a ``CompatMode`` enum), ``num_threads``,
  ``task_size``, ...; unknown names raise ``KeyError``. ``is_compat_mode_preferred()``
  resolves ``AUTO`` to on (this stand-in has no cuFile). There is no per-file compat query
  and none of kvikio 24's removed names (``set_compat_mode``, ``compat_mode()``).
- Device buffers (``__cuda_array_interface__``) are refused: no GPU here.

Install it with `install(monkeypatch)`; ``KVIKIO_COMPAT_MODE`` and ``KVIKIO_NTHREADS`` are
read at install time, as kvikio reads them at import. Test aids beyond kvikio's API: ``calls``
lists every ``pread``/``pwrite`` as ``(op, calling thread's name, buffer address, size)``, and
``io_delay_s`` delays every task (a slow disk). With ``compat_mode`` OFF the stand-in says GDS
is active (``is_compat_mode_preferred()`` is false) and still does POSIX I/O: on a CPU the
simulated device's "device" tensors are host memory, so the direct device path can run.
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import sys
import threading
import types

__version__ = "26.10.00"


class CompatMode(enum.IntEnum):
    OFF = 0
    ON = 1
    AUTO = 2


# ------------------------------------------------------------------------------ defaults
_settings: dict[str, object] = {}
calls: list[tuple[str, str, int | None, int]] = []  # test aid: (op, thread, address, size)
io_delay_s = 0.0  # test aid: seconds every task sleeps first
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_NAMES = ("compat_mode", "num_threads", "task_size", "gds_threshold", "bounce_buffer_size",
          "http_max_attempts", "http_status_codes", "http_timeout", "auto_direct_io_read",
          "auto_direct_io_write")  # fmt: skip


def _reset() -> None:
    global _pool, io_delay_s
    mode = os.environ.get("KVIKIO_COMPAT_MODE", "AUTO").upper()
    mode = {"TRUE": "ON", "YES": "ON", "1": "ON", "FALSE": "OFF", "NO": "OFF", "0": "OFF"}.get(mode, mode)
    calls.clear()
    io_delay_s = 0.0
    _settings.clear()
    _settings.update(
        compat_mode=CompatMode[mode],
        num_threads=int(os.environ.get("KVIKIO_NTHREADS", "1")),
        task_size=4 * 2**20,
        gds_threshold=16 * 2**10,
        bounce_buffer_size=16 * 2**20,
        http_max_attempts=3,
        http_status_codes=[429, 500, 502, 503, 504],
        http_timeout=60,
        auto_direct_io_read=False,
        auto_direct_io_write=True,
    )
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool = None


def _thread_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_settings["num_threads"], "fake-kvikio")
        return _pool


def _get(name: str) -> object:
    if name not in _NAMES:
        raise KeyError(name)
    return _settings[name]


def _set_one(name: str, value: object) -> None:
    global _pool
    if name not in _NAMES:
        raise KeyError(name)
    if name == "compat_mode":
        value = CompatMode(value) if not isinstance(value, str) else CompatMode[value.upper()]
    if name == "num_threads":
        if int(value) <= 0:
            raise ValueError("number of threads must be a positive integer")
        with _pool_lock:  # kvikio resets its pool to the new size
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool = None
    _settings[name] = value


class ConfigContextManager:
    def __init__(self, config: dict) -> None:
        self._old = {key: _get(key) for key in config}
        for key, value in config.items():
            _set_one(key, value)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        for key, value in self._old.items():
            _set_one(key, value)


def _defaults_set(*config) -> ConfigContextManager:
    if len(config) == 1 and isinstance(config[0], dict):
        return ConfigContextManager(config[0])
    if len(config) == 2 and isinstance(config[0], str):
        return ConfigContextManager({config[0]: config[1]})
    raise ValueError(
        "Valid arguments are kvikio.defaults.set(config: dict) or kvikio.defaults.set(key: str, value: Any)"
    )


def _is_compat_mode_preferred() -> bool:
    return _settings["compat_mode"] != CompatMode.OFF  # AUTO resolves to ON: no cuFile here


defaults = types.ModuleType("kvikio.defaults", "kvikio 26 settings (stand-in)")
defaults.get = _get
defaults.set = _defaults_set
defaults.is_compat_mode_preferred = _is_compat_mode_preferred
defaults.ConfigContextManager = ConfigContextManager


# ------------------------------------------------------------------------------ files
class IOFuture:
    """Future of a ``pread``/``pwrite``: ``get()`` once, ``done()`` any time."""

    __slots__ = ("_parts", "_spent")

    def __init__(self, parts: list[concurrent.futures.Future]) -> None:
        self._parts = parts
        self._spent = False

    def get(self) -> int:
        if self._spent:  # std::future::get on a future whose state was taken
            raise RuntimeError("std::future_error: No associated state")
        self._spent = True
        return sum(part.result() for part in self._parts)

    def done(self) -> bool:
        if self._spent:
            raise RuntimeError("std::future_error: No associated state")
        return all(part.done() for part in self._parts)


def _parse_flags(flags: str) -> int:
    if not flags:
        raise ValueError("Unknown file open flag")
    if flags[0] == "r":
        mode = os.O_RDWR if flags[1:2] == "+" else os.O_RDONLY
    elif flags[0] == "w":
        mode = (os.O_RDWR if flags[1:2] == "+" else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC
    elif flags[0] == "a":
        raise ValueError("Open flag 'a' isn't supported")
    else:
        raise ValueError("Unknown file open flag")
    return mode | os.O_CLOEXEC


def _host_view(buf, size: int | None) -> memoryview:
    if hasattr(buf, "__cuda_array_interface__"):
        raise RuntimeError("CUDA error: cuPointerGetAttribute: initialization error (stand-in: no GPU)")
    view = memoryview(buf).cast("B")
    if size is None:
        size = view.nbytes
    if size > view.nbytes:
        raise ValueError(f"buffer is smaller than size ({view.nbytes} < {size})")
    return view[:size]


class CuFile:
    """File handle for GPUDirect Storage (stand-in: POSIX I/O only)."""

    def __init__(self, file, flags: str = "r") -> None:
        try:
            self._fd = os.open(os.fspath(file), _parse_flags(flags), 0o644)
        except OSError as error:
            raise RuntimeError(f"Unable to open file: {error.strerror} ({file})") from None
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._fd

    def open_flags(self) -> int:
        import fcntl

        return fcntl.fcntl(self._fd, fcntl.F_GETFL)

    def __enter__(self) -> CuFile:
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.close()

    def _task(self, op: str, view: memoryview, file_offset: int) -> int:
        if io_delay_s:
            import time

            time.sleep(io_delay_s)
        done = 0
        while done < view.nbytes:
            try:
                if op == "pwrite":
                    moved = os.pwrite(self._fd, view[done:], file_offset + done)
                else:
                    moved = os.preadv(self._fd, [view[done:]], file_offset + done)
            except InterruptedError:
                continue
            except OSError as error:
                raise RuntimeError(f"POSIX error on {op}: {error.strerror}") from None
            if moved == 0:
                raise RuntimeError(f"POSIX error on {op}: EOF")
            done += moved
        return done

    def _submit(self, op: str, buf, size, file_offset: int, task_size) -> IOFuture:
        if self._closed:
            raise RuntimeError("the file is closed")
        view = _host_view(buf, size)
        interface = getattr(buf, "__array_interface__", None)
        address = interface["data"][0] if interface else None
        calls.append((op, threading.current_thread().name, address, view.nbytes))
        task_size = task_size or _settings["task_size"]
        pool = _thread_pool()
        parts = [
            pool.submit(self._task, op, view[start : start + task_size], file_offset + start)
            for start in range(0, view.nbytes, task_size)
        ]
        if not parts:  # zero bytes: a future that is done with 0
            parts = [pool.submit(int)]
        return IOFuture(parts)

    def pread(self, buf, size: int | None = None, file_offset: int = 0, task_size: int | None = None):
        return self._submit("pread", buf, size, file_offset, task_size)

    def pwrite(self, buf, size: int | None = None, file_offset: int = 0, task_size: int | None = None):
        return self._submit("pwrite", buf, size, file_offset, task_size)

    def read(self, buf, size: int | None = None, file_offset: int = 0, task_size: int | None = None) -> int:
        return self.pread(buf, size, file_offset, task_size).get()

    def write(self, buf, size: int | None = None, file_offset: int = 0, task_size: int | None = None) -> int:
        return self.pwrite(buf, size, file_offset, task_size).get()


def package() -> types.ModuleType:
    """The stand-in as ``import kvikio`` binds it. As in kvikio 26, whose ``__init__`` imports
    no ``defaults``, the settings are not an attribute of the package: only
    ``import kvikio.defaults`` (sys.modules) reaches them."""
    module = sys.modules[__name__]
    bound = types.ModuleType("kvikio", module.__doc__)
    for name, value in vars(module).items():
        if not name.startswith("__") and name != "defaults":
            setattr(bound, name, value)
    return bound


def install(monkeypatch) -> types.ModuleType:
    """Make ``import kvikio`` give this stand-in (fresh settings) for one test; returns the
    stand-in module itself, whose ``defaults`` the test may use."""
    _reset()
    monkeypatch.setitem(sys.modules, "kvikio", package())
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    return sys.modules[__name__]


_reset()
