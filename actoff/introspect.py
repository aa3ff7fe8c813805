"""What actoff holds and does, for benchmarks and tools: sizes as actoff prints them, the bytes
it holds off the device, its I/O engines and kvikio check, and the traces its arenas plan from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import config
from .runtime.runtime import get_runtime
from .tiers.nvme import engines, kvikio, store

__all__ = ["check_kvikio", "format_bytes", "held_bytes", "open_io_engine", "trace_arenas"]


def format_bytes(nbytes: float) -> str:
    """A size in binary units, as actoff's messages print it.

    Example:
        >>> import actoff
        >>> actoff.format_bytes(3 * 2**20), actoff.format_bytes(512)
        ('3.00 MiB', '512 B')
    """
    return config.format_bytes(nbytes)


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
) -> engines.IoEngine:
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
        return engines.CppEngine(path, num_threads, allow_direct=direct)
    if backend == "python":
        return engines.PythonEngine(path, num_threads)
    if backend not in config.IO_BACKENDS:
        choices = ", ".join((*config.IO_BACKENDS, "cpp", "python"))
        raise ValueError(f"backend {backend!r}: choose from {choices}")
    return store.open_engine(path, backend, num_threads)


def check_kvikio(directory: str) -> tuple[bool, str]:
    """Whether kvikio really does I/O in ``directory`` (a 4 KiB write and read-back, compared):
    ``(True, engine name)``, the name saying GDS or compat mode, or ``(False, why not)``.

    Example:
        >>> import tempfile, actoff
        >>> ok, why = actoff.check_kvikio(tempfile.mkdtemp())
        >>> ok or why.startswith(("kvikio is not installed", "kvikio cannot do I/O"))
        True
    """
    return kvikio.check_kvikio(directory)


@contextlib.contextmanager
def trace_arenas() -> Iterator[dict[str, list[list[tuple]]]]:
    """The buffers actoff's arenas hand out while the block runs, as `actoff.planner` lays
    them out: a list of traces per kind, each a list of buffers with their lifetimes.

    ``"host"``: the host arenas' buffers, ``(size, start, end, block)`` on the arena's clock.
    Every host arena traces inside the block, planned or not, one trace per step as its planner
    takes it at the step's end (Note [a host plan per shape], actoff.memory.host_plans).

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
    from .memory.arenas import waves
    from .memory.device_arena import DeviceArena
    from .memory.host_arena import HostArena

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
            traces["device"].append(
                [
                    (size, start, end, tag, part)
                    for (size, start, end, _, tag, *_), part in zip(trace, parts, strict=True)
                ]
            )
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
