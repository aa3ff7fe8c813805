"""Configuration: the frozen, self-validating `Config` and its `ACTOFF_*` environment reader."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

from .policy import policy_names, spec
from .units import format_bytes, parse_size

__all__ = ["Config", "format_bytes", "get_config", "keywords_of", "parse_size", "set_config"]

PLANNERS = ("mip", "greedy", "off")
IO_BACKENDS = ("auto", "kvikio", "posix")
ALLOCATORS = ("caching", "replay")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_name(field_name: str) -> str:
    return "ACTOFF_" + field_name.upper()


def _where(field_name: str) -> str:
    """A setting in messages: its keyword inside `keywords_of`, else its variable and field."""
    if getattr(_KEYWORDS, "caller", None):
        return field_name
    return f"{_env_name(field_name)} (Config.{field_name})"


def _unknown(name: str, known: set[str]) -> TypeError:
    what = "got an unexpected keyword" if getattr(_KEYWORDS, "caller", None) else "Config has no field"
    return TypeError(f"{what} {name!r}; actoff's settings: {', '.join(sorted(known))}")


_KEYWORDS = threading.local()  # the call whose keywords are being validated (`keywords_of`)


@contextlib.contextmanager
def keywords_of(caller: str) -> Iterator[None]:
    """Validate settings a user passed as keywords to ``caller``: a bad one is named as the
    keyword of that call, not as its environment variable.

    >>> with keywords_of("offload_"):
    ...     Config().replace(policy="bogus")
    Traceback (most recent call last):
    ValueError: offload_(): policy='bogus' is not valid: expected one of keep, recompute, cpu, nvme, tokenwise, checkpoint, chunked, auto
    """
    outer = getattr(_KEYWORDS, "caller", None)
    _KEYWORDS.caller = caller
    try:
        yield
    except (ValueError, TypeError) as error:
        if outer is not None:
            raise
        raise type(error)(f"{caller}(): {error}") from None
    finally:
        _KEYWORDS.caller = outer


@dataclass(frozen=True)
class Config:
    """How actoff places activations. Frozen; every field is validated at construction.

    Each field has an environment variable ``ACTOFF_<FIELD>``; :meth:`from_env` reads them,
    and keyword arguments given in Python win over the environment. A bad value raises
    ``ValueError`` naming the variable, the value and what is allowed, at configuration
    time, never mid-step.

    Example:
        >>> cfg = Config(policy="cpu", min_bytes="1MiB", keep_last=1)
        >>> cfg.min_bytes
        1048576
        >>> Config.from_env({"ACTOFF_POLICY": "keep"}, keep_last=2).keep_last
        2
    """

    #: Where activations go: ``keep`` (stay on the device), ``cpu`` (host memory), ``nvme`` (a
    #: file under ``nvme_dir``), ``tokenwise`` (token ranges split between cpu, nvme and recompute
    #: by the fractions below), ``recompute`` (every token-local activation recomputed; block inputs
    #: and attention outputs in host memory), ``checkpoint`` (only the block's inputs, in host
    #: memory; the whole block run again in backward), ``chunked`` (as checkpoint, the backward run
    #: in chunks of ``chunk_tokens``), ``auto`` (per block keep, a stored token fraction or checkpoint,
    #: and a prefetch depth: the least predicted step time that fits ``gpu_budget``; runtime.auto).
    policy: str = "cpu"
    #: Token fraction stored in host memory under ``tokenwise`` (the rest: nvme, recompute).
    cpu_fraction: float = 1.0
    #: Token fraction stored on NVMe under ``tokenwise``. ``cpu_fraction + nvme_fraction <= 1``.
    nvme_fraction: float = 0.0
    #: Directory for the per-process NVMe file; created if its parent exists.
    nvme_dir: str | None = None
    #: Saved tensors smaller than this (bytes; sizes like ``64KiB`` accepted) are kept.
    min_bytes: int = 64 * 2**10
    #: The last N blocks of the forward pass are never offloaded (backward needs them first).
    keep_last: int = 0
    #: Blocks fetched ahead in backward: at a block's first unpack, the saves of this many blocks
    #: before it start coming back (a setting per scope). ``0``: each block's come back at its own
    #: first unpack, as PyTorch's ``save_on_cpu`` brings them, holding one block's fewer on the
    #: device with the copies no longer hidden. Under ``auto`` its plan sets the step's depth.
    prefetch_depth: int = 1
    #: Bytes of saved tensors backward may have fetched and not let go at once (a size like
    #: ``64MiB``; ``None``: ``prefetch_depth`` blocks instead). Records come back one saved tensor
    #: at a time, in backward's order, as far ahead as this reaches (Note [fetch per saved tensor]
    #: in actoff.runtime.fetch); ``0`` fetches each at its own unpack, as PyTorch's ``save_on_cpu``:
    #: the least device memory, the copies back not hidden.
    fetch_window: int | None = None
    #: Bytes of saved tensors forward may be copying out at once (``None``: no cap). Each saved
    #: tensor's copy to the host starts when autograd saves it, and its device memory goes when
    #: the copy lands; past this many bytes in flight the compute stream waits for the oldest.
    copy_window: int | None = None
    #: Cap on the host memory actoff may hold (``None``: no cap). Over it, tensors stay put.
    host_budget: int | None = None
    #: Cap on the pinned (page-locked) host memory of each process's host arena (a size like
    #: ``1GiB``; ``None``: no cap). Past it, or once pinning fails, the arena falls back to
    #: pageable host memory for the rest of the run, with one warning: the same gradients, but
    #: copies to and from pageable memory are synchronous (the host waits for each) and slower
    #: (``actoff.stats().host_pageable_bytes`` counts those bytes). Set it under the system's
    #: cap on pinned memory (WSL2: 1-2 GB). Not shared by ranks: each process's own.
    pinned_budget: int | None = None
    #: Device memory the ``auto`` policy plans the whole step under: weights, gradients,
    #: optimizer state and activations (``None``: the device's: CUDA's total memory less the
    #: larger of 2 GiB and 5%, the simulated device's capacity; none on a plain CPU device,
    #: where ``auto`` keeps everything).
    gpu_budget: int | None = None
    #: Memory layout planner of the host arena and the device arena: ``mip``, ``greedy`` or ``off``
    #: (``off``: bump allocation on the host, a new device tensor per request).
    planner: str = "greedy"
    #: Directory for cached memory plans (``None``: no cache).
    plan_cache: str | None = None
    #: NVMe I/O engine: ``auto`` (kvikio when it really works, else posix), ``kvikio``, ``posix``.
    io_backend: str = "auto"
    #: Host link bandwidth for ``auto`` in bytes per second (``25GB`` = 25e9 B/s); ``None``:
    #: measured once per device on pinned copies (Note [timing the link] in actoff.device.base).
    host_bandwidth: int | None = None
    #: Worker threads of the POSIX I/O engine.
    io_threads: int = 4
    #: Seconds to wait for one NVMe request before calling the I/O worker dead (an error).
    io_timeout: float = 300.0
    #: Seal every NVMe record with a checksum of its sequence number, length and bytes when it
    #: is written, and check it when it is read back (in the I/O threads). Off, a spill file
    #: changed, truncated or replaced behind actoff's back gives wrong gradients silently.
    nvme_checksum: bool = True
    #: Checksum every offloaded range and check it when it comes back; every
    #: ``verify_interval`` steps also compare one recomputed token range with a kept copy.
    verify: bool = False
    #: Steps between the recompute checks of ``verify``.
    verify_interval: int = 100
    #: Token dimension of a block's input: 1 for ``(B, S, H)``, 0 for ``(S, B, H)``.
    token_dim: int = 1
    #: Tokens per chunk of a block's backward under ``chunked`` (Note [chunked backward]).
    chunk_tokens: int = 4096
    #: `actoff.tile_` splits a module's tokens into this many chunks (``None``: not set).
    tile_chunks: int | None = None
    #: `actoff.tile_` gives a chunk at most this many positions along the token dimension
    #: (``None``: not set). At most one of ``tile_chunks`` and ``tile_max_tokens``.
    tile_max_tokens: int | None = None
    #: Run scopes on a CPU device on the simulated asynchronous device (a debugging aid like
    #: ``CUDA_LAUNCH_BLOCKING``: CUDA's stream semantics, poisoned copy destinations and a race
    #: checker on the CPU; see `actoff.testing.simulated_device`).
    sim_device: bool = False
    #: Memory of the simulated device (a size like ``2GiB``; ``None``: unlimited). Needs
    #: ``sim_device``. Storages allocated on it while its memory model is on
    #: (`actoff.testing.device_memory`) count against it, and an allocation past it raises
    #: ``torch.OutOfMemoryError`` as CUDA's allocator does; host buffers do not count.
    sim_device_memory: int | None = None
    #: Host link rate of the simulated device in bytes per second, each direction (a size like
    #: ``2GB``, optionally ``/s``; ``None``: copies run at memcpy speed). Needs ``sim_device``.
    #: A copy off the compute stream then takes at least bytes / rate of wall time, so the CPU
    #: measures step time as a GPU with that copy-to-compute ratio would (the wind tunnel).
    sim_device_bandwidth: int | None = None
    #: CUDA allocator: ``caching`` (PyTorch's) or ``replay`` (actoff's, which serves each
    #: step's allocations at offsets planned from the first step). ``replay`` takes effect only
    #: when set in the environment before actoff is imported (or after
    #: `actoff.install_replay_allocator`): torch swaps allocators only before CUDA is used.
    allocator: str = "caching"

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_numbers()
        self._check_sim_device()
        self._check_paths()

    def _check_choices(self) -> None:
        set_ = object.__setattr__  # frozen: normalise through object.__setattr__
        for name in ("policy", "planner", "io_backend", "allocator"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{_where(name)} must be a string, got {type(value).__name__}")
            set_(self, name, value.strip().lower())
        _check_choice("policy", self.policy, policy_names())  # Note [the policy table]
        _check_choice("planner", self.planner, PLANNERS)
        _check_choice("io_backend", self.io_backend, IO_BACKENDS)
        _check_choice("allocator", self.allocator, ALLOCATORS)

    def _check_numbers(self) -> None:
        set_ = object.__setattr__
        for name in ("cpu_fraction", "nvme_fraction"):
            value = _as_float(name, getattr(self, name))
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{_where(name)}={value!r} is out of range: expected 0 to 1")
            set_(self, name, value)
        if self.cpu_fraction + self.nvme_fraction > 1.0 + 1e-9:
            cpu, nvme = (_where(n).split(" ")[0] for n in ("cpu_fraction", "nvme_fraction"))
            raise ValueError(
                f"{cpu} + {nvme} = {self.cpu_fraction} + "
                f"{self.nvme_fraction} > 1: the fractions share the tokens, and the rest is "
                "recomputed; lower one of them"
            )

        set_(self, "min_bytes", _as_size("min_bytes", self.min_bytes, allow_bare=True))
        for name in ("host_budget", "pinned_budget", "gpu_budget", "host_bandwidth"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, _as_size(name, value, allow_bare=False))
        for name in ("fetch_window", "copy_window"):  # 0 is a window (and needs no unit), not "unset"
            value = getattr(self, name)
            if value is not None:
                set_(self, name, 0 if str(value).strip() == "0" else _as_size(name, value, allow_bare=False))
        timeout = _as_float("io_timeout", self.io_timeout)
        if timeout <= 0:
            raise ValueError(f"{_where('io_timeout')}={timeout!r} is out of range: expected seconds > 0")
        set_(self, "io_timeout", timeout)
        for name, low in (
            ("keep_last", 0),
            ("prefetch_depth", 0),
            ("io_threads", 1),
            ("token_dim", 0),
            ("chunk_tokens", 1),
            ("verify_interval", 1),
        ):
            set_(self, name, _as_int(name, getattr(self, name), low))
        set_(self, "verify", _as_bool("verify", self.verify))
        set_(self, "nvme_checksum", _as_bool("nvme_checksum", self.nvme_checksum))
        for name in ("tile_chunks", "tile_max_tokens"):
            if getattr(self, name) is not None:
                set_(self, name, _as_int(name, getattr(self, name), 1))
        if self.tile_chunks is not None and self.tile_max_tokens is not None:
            raise ValueError(
                f"{_where('tile_chunks')}={self.tile_chunks} and {_where('tile_max_tokens')}={self.tile_max_tokens} "
                "are both set: a tile is sized by one of them; unset the other"
            )

    def _check_sim_device(self) -> None:
        set_ = object.__setattr__
        set_(self, "sim_device", _as_bool("sim_device", self.sim_device))
        if self.sim_device_memory is not None:
            capacity = _as_size("sim_device_memory", self.sim_device_memory, allow_bare=False)
            if capacity <= 0:
                raise ValueError(
                    f"{_where('sim_device_memory')}={self.sim_device_memory!r} is out of range: "
                    "expected a size > 0, e.g. '2GiB'"
                )
            if not self.sim_device:
                raise ValueError(
                    f"{_where('sim_device_memory')}={self.sim_device_memory!r} caps the simulated device, "
                    f"which is off: turn {_where('sim_device')} on as well (1), or leave the cap unset"
                )
            set_(self, "sim_device_memory", capacity)
        if self.sim_device_bandwidth is not None:
            rate = _as_size("sim_device_bandwidth", _per_second(self.sim_device_bandwidth), allow_bare=False)
            if rate <= 0 or not self.sim_device:
                raise ValueError(
                    f"{_where('sim_device_bandwidth')}={self.sim_device_bandwidth!r}: "
                    + (
                        "expected a rate > 0, e.g. '2GB/s'"
                        if rate <= 0
                        else "sets the simulated device's link, which is off: set ACTOFF_SIM_DEVICE=1 as well "
                        "(Config.sim_device), or unset ACTOFF_SIM_DEVICE_BANDWIDTH"
                    )
                )
            set_(self, "sim_device_bandwidth", rate)

    def _check_paths(self) -> None:
        set_ = object.__setattr__
        for name in ("nvme_dir", "plan_cache"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{_where(name)} must be a path, got {type(value).__name__}")
            if value is not None:
                set_(self, name, os.fspath(value) or None)
        if spec(self.policy).needs_nvme(self) and self.nvme_dir is None:
            raise ValueError(
                f"{_where('policy')}={self.policy!r} with NVMe placement needs a directory: set "
                f"{_where('nvme_dir')} to a directory on a fast local disk"
            )
        if self.nvme_dir is not None:
            check_writable_dir(self.nvme_dir, _where("nvme_dir"))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Read ``ACTOFF_*`` variables (values case-insensitive), then apply ``overrides``.

        Unknown ``ACTOFF_`` variables raise, so a typo never goes unnoticed.

        >>> Config.from_env({"ACTOFF_POLICY": "KEEP", "ACTOFF_KEEP_LAST": "1"}).policy
        'keep'
        """
        environ = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        values: dict[str, object] = {}
        for key, raw in environ.items():
            if not key.startswith("ACTOFF_") or key in _NOT_CONFIG:
                continue
            name = key[len("ACTOFF_") :].lower()
            if name not in known:
                raise ValueError(
                    f"{key} is not an actoff setting; known: "
                    + ", ".join(sorted(_env_name(n) for n in known))
                )
            text = raw.strip()
            if name in ("nvme_dir", "plan_cache"):
                values[name] = text or None
            elif name in _OPTIONAL and text.lower() in ("", "none"):
                values[name] = None
            else:
                values[name] = text
        for name in overrides:
            if name not in known:
                raise _unknown(name, known)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> Config:
        """A copy with ``changes`` applied and validated: ``cfg.replace(policy="keep")``."""
        known = {f.name for f in fields(self)}
        for name in changes:
            if name not in known:
                raise _unknown(name, known)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# Settings whose variable may say "none" (or be empty) for "not set".
_OPTIONAL = {"host_budget", "pinned_budget", "gpu_budget", "host_bandwidth", "tile_chunks", "tile_max_tokens",
             "sim_device_memory", "sim_device_bandwidth", "fetch_window", "copy_window"}  # fmt: skip

# Variables that share the prefix but configure tests or builds, not the runtime.
_NOT_CONFIG = frozenset({"ACTOFF_BUILD_EXT", "ACTOFF_RUN_SLOW", "ACTOFF_TEST_NVME_DIR"})


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{_where(name)}={value!r} is not valid: expected one of {', '.join(allowed)}")


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{_where(name)} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{_where(name)}={value!r} is not a number: expected e.g. 0.5") from None


def _as_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{_where(name)} must be an integer, got {type(value).__name__}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{_where(name)}={value!r} is not an integer") from None
    if number < low:
        raise ValueError(f"{_where(name)}={number} is out of range: expected an integer >= {low}")
    return number


def _as_size(name: str, value: object, *, allow_bare: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{_where(name)} must be a byte count or a size string like '64GiB'")
    number = parse_size(value, what=_where(name), allow_bare=allow_bare) if isinstance(value, str) else value
    if number < 0:
        raise ValueError(f"{_where(name)}={value!r} is negative: expected a size >= 0")
    return number


def _per_second(value: object) -> object:
    """A rate written as a size per second (``2GB/s``) as the size alone."""
    return value.strip().removesuffix("/s") if isinstance(value, str) else value


def _as_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{_where(name)}={value!r} is not a boolean: expected 1/0, true/false, on/off")


def check_writable_dir(path: str, what: str) -> None:
    """Make sure ``path`` is a writable directory, creating it if its parent exists."""
    if os.path.isfile(path):
        raise ValueError(f"{what}={path!r} is a regular file: point it at a directory")
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(
                f"{what}={path!r} does not exist and neither does its parent {parent!r}: "
                "create the directory first"
            )
        try:
            os.mkdir(path)
        except OSError as error:
            raise ValueError(f"{what}={path!r} could not be created: {error.strerror}") from None
    try:  # a file, not os.access(): that says yes to root even on read-only mounts
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(
            f"{what}={path!r} is not writable by this process ({error.strerror}): choose another directory"
        ) from None


_global_config: Config | None = None


def get_config() -> Config:
    """The process-wide configuration: read from the environment once, on first use.

    >>> get_config().policy in policy_names()
    True
    """
    global _global_config
    if _global_config is None:
        _global_config = Config.from_env()
    return _global_config


def set_config(config: Config | None = None, **overrides: object) -> Config:
    """Replace the process-wide configuration; ``set_config()`` re-reads the environment.

    >>> set_config(policy="keep").policy
    'keep'
    >>> _ = set_config()  # back to the environment
    """
    global _global_config
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"set_config expects an actoff.Config, got {type(config).__name__}")
    base = config if config is not None else Config.from_env()
    with keywords_of("set_config"):
        _global_config = base.replace(**overrides) if overrides else base
    return _global_config
