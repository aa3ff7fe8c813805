"""actoff: activation offloading for long-context transformer training on one GPU.

Decorate transformer blocks with `offload` (or apply `offload_` to a model) and every tensor
autograd saves inside them is placed by policy: kept on the device, copied to host memory,
or written to NVMe, and brought back exactly for backward. Policy comes from ``ACTOFF_*``
environment variables (`Config.from_env`) or from Python.

Example:
    >>> import torch, actoff
    >>> from actoff.reference import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig.preset("tiny"))
    >>> _ = actoff.offload_(model, block_cls=actoff.reference.Block, policy="cpu", min_bytes=0)
    >>> tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    >>> model.loss(tokens).backward()
    >>> actoff.stats().total_bytes_offloaded > 0
    True
"""

import contextlib
from collections.abc import Iterator

from . import _allocator, _config, _io, _io_kvikio, _nvme
from ._allocator import AllocatorStats
from ._allocator import install as install_replay_allocator
from ._allocator import stats as replay_allocator_stats
from ._config import Config, get_config, parse_size, set_config
from ._io_kvikio import kvikio_available
from ._loss import chunked_cross_entropy, chunked_loss_
from ._mixers import register_token_mixer
from ._runtime import get_runtime
from ._scope import no_offload, offload, offload_
from ._stats import BlockStats, Stats
from ._tile import tile_
from ._version import __version__

try:
    from . import _C  # noqa: F401

    HAS_EXTENSION = True
except ImportError:
    HAS_EXTENSION = False

# ACTOFF_ALLOCATOR=replay must swap torch's CUDA allocator before the first CUDA allocation:
# importing actoff is the earliest point actoff runs. A refusal is raised at the first CUDA step.
_allocator.install_from_environment()

__all__ = [
    "HAS_EXTENSION",
    "AllocatorStats",
    "BlockStats",
    "Config",
    "Stats",
    "__version__",
    "chunked_cross_entropy",
    "chunked_loss_",
    "format_bytes",
    "get_config",
    "held_bytes",
    "install_replay_allocator",
    "kvikio_available",
    "no_offload",
    "offload",
    "offload_",
    "open_io_engine",
    "parse_size",
    "probe_kvikio",
    "register_token_mixer",
    "replay_allocator_stats",
    "reset",
    "set_config",
    "stats",
    "tile_",
    "trace_arenas",
]


def stats() -> Stats:
    """Figures of the last step: per block bytes saved, bytes per tier, copy times.

    Example:
        >>> import actoff
        >>> print(actoff.stats())  # doctest: +ELLIPSIS
        block ...
    """
    return get_runtime().stats()


def reset() -> None:
    """Forget statistics and the current step, and close NVMe stores (removing their files).

    Call it between independent runs in one process (tests, benchmarks).

    Example:
        >>> import actoff
        >>> actoff.reset()
        >>> actoff.stats().steps
        0
    """
    get_runtime().close()


def format_bytes(nbytes: float) -> str:
    """A size in binary units, as actoff's messages print it.

    Example:
        >>> import actoff
        >>> actoff.format_bytes(3 * 2**20), actoff.format_bytes(512)
        ('3.00 MiB', '512 B')
    """
    return _config.format_bytes(nbytes)


def held_bytes() -> dict[str, int]:
    """Bytes of activations actoff holds off the device right now: ``"cpu"``, handed out in
    its host arenas (waiting for the copies still in flight), and ``"nvme"``, live in its NVMe
    files. Cheap enough to call from hooks inside a step, for a memory timeline.

    Example:
        >>> import actoff
        >>> actoff.reset()
        >>> actoff.held_bytes()
        {'cpu': 0, 'nvme': 0}
    """
    runtime = get_runtime()
    return {
        "cpu": sum(arena.used for arena in runtime.arenas.values()),
        "nvme": sum(store.extents.live_bytes for store in runtime.stores.stores()),
    }


def open_io_engine(
    path: str, backend: str = "auto", num_threads: int = 4, *, direct: bool = True
) -> _io.IoEngine:
    """An I/O engine of the NVMe tier on the file ``path``, with ``num_threads`` threads.

    ``backend``: ``"auto"``, ``"posix"`` or ``"kvikio"``, the engine the NVMe tier opens under
    that ``ACTOFF_IO_BACKEND`` (``auto``: kvikio where it really does I/O, else the POSIX
    engine); or one POSIX engine by name: ``"cpp"``, the compiled one (``direct=False``: no
    O_DIRECT), or ``"python"``, its pure-Python twin. ``pwrite(buffer, nbytes, offset)`` and
    ``pread(buffer, nbytes, offset)`` take a contiguous host tensor and return a future with
    ``wait()``; ``reserve(nbytes)`` preallocates; ``name`` says which engine runs; kvikio with
    GPUDirect Storage also has ``pwrite_device`` and ``pread_device``. ``close()`` it.

    Example:
        >>> import os, tempfile, torch, actoff
        >>> engine = actoff.open_io_engine(os.path.join(tempfile.mkdtemp(), "f.bin"), "python", 1)
        >>> data = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
        >>> _ = engine.pwrite(data, 4096, 0).wait()
        >>> back = torch.empty_like(data); _ = engine.pread(back, 4096, 0).wait()
        >>> torch.equal(back, data), engine.name.startswith("posix")
        (True, True)
        >>> engine.close()
    """
    if not direct and backend != "cpp":
        raise ValueError(f"direct=False is for the cpp engine; {backend!r} chooses for itself")
    if backend == "cpp":
        return _io.CppEngine(path, num_threads, allow_direct=direct)
    if backend == "python":
        return _io.PythonEngine(path, num_threads)
    if backend not in _config.IO_BACKENDS:
        choices = ", ".join((*_config.IO_BACKENDS, "cpp", "python"))
        raise ValueError(f"backend {backend!r}: choose from {choices}")
    return _nvme.open_engine(path, backend, num_threads)


def probe_kvikio(directory: str) -> tuple[bool, str]:
    """Whether kvikio really does I/O in ``directory`` (a 4 KiB write and read-back, compared):
    ``(True, engine name)``, the name saying GDS or compat mode, or ``(False, why not)``.

    Example:
        >>> import tempfile, actoff
        >>> ok, why = actoff.probe_kvikio(tempfile.mkdtemp())
        >>> ok or why.startswith(("kvikio is not installed", "kvikio cannot do I/O"))
        True
    """
    return _io_kvikio.probe_kvikio(directory)


@contextlib.contextmanager
def trace_arenas() -> Iterator[dict[str, list[list[tuple]]]]:
    """The buffers actoff's arenas hand out while the block runs, as `actoff.planner` lays
    them out: a list of traces per kind, each a list of buffers with their lifetimes.

    ``"host"``: the host arenas' buffers, ``(size, start, end, block)`` on the arena's clock.
    Every host arena traces inside the block, planned or not; an unplanned arena's trace is
    taken by its planner at the end of its first step, the others' when the block ends (all
    the steps inside it, one after the other).

    ``"device"``: the device arena's requests (CUDA or the simulated device, planner on), one
    trace per step as its planner takes it, ``(size, start, end, block, part)``: ``part`` is
    what the arena gives a range of its own (the run's fetches or rebuilds, and the wave they
    died in, Note [a buffer per wave]).

    For benchmarks of the planner: one block at a time, its steps on one thread.

    Example:
        >>> import torch, actoff
        >>> from actoff.reference import Block, ModelConfig, Transformer
        >>> from actoff.testing import simulated_device
        >>> model = Transformer(ModelConfig.preset("tiny"))
        >>> _ = actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
        >>> tokens = torch.randint(0, model.config.vocab_size, (1, 33))
        >>> with simulated_device(track_memory=False), actoff.trace_arenas() as traces:
        ...     for _ in range(2):
        ...         model.loss(tokens).backward()
        >>> size, start, end, block = traces["host"][-1][0]
        >>> size > 0 and start < end
        True
        >>> size, start, end, block, (run, what, wave) = traces["device"][-1][0]
        >>> what
        'fetch'
        >>> actoff.reset()
    """
    from ._arena import HostArena
    from ._device_arena import DeviceArena
    from ._layout import waves

    traces: dict[str, list[list[tuple]]] = {"host": [], "device": []}
    take_host, take_device = HostArena.take_trace, DeviceArena.take_trace

    def host(arena: HostArena) -> list:
        trace = take_host(arena)
        if trace:
            traces["host"].append(list(trace))
        return trace

    def device(arena: DeviceArena) -> list:
        trace = take_device(arena)
        if trace:
            parts = waves(trace)
            traces["device"].append([(size, start, end, tag, part) for (size, start, end, _, tag, _), part
                                     in zip(trace, parts, strict=True)])  # fmt: skip
        return trace

    untraced = [arena for arena in get_runtime().arenas.values() if not arena.tracing]
    for arena in untraced:
        arena.take_trace()  # what it traced before: nothing of the block's
        arena.tracing = True
    HostArena.take_trace, DeviceArena.take_trace = host, device
    try:
        yield traces
    finally:
        try:
            for arena in untraced:
                if arena.tracing:
                    arena.take_trace()
                    arena.tracing = False
        finally:
            HostArena.take_trace, DeviceArena.take_trace = take_host, take_device
