"""Testing aids: run code on the simulated asynchronous device.

The simulated device is a debugging aid like ``CUDA_LAUNCH_BLOCKING``, the other way round:
it makes a CPU run as asynchronous as a GPU. Copies run late on worker threads, their
destinations hold NaN until they land, events complete late, and a race checker raises
`RaceError` where a real GPU could read or reuse memory too early (see actoff.device.sim.device).
``ACTOFF_SIM_DEVICE=1`` turns it on for every scope on a CPU device; `simulated_device`
does it for a block of code and hands back the device to inspect.

Device memory is counted only inside a block: a ``simulated_device`` block, or `device_memory`
for the device ``ACTOFF_SIM_DEVICE=1`` selects (with ``ACTOFF_SIM_DEVICE_MEMORY`` as its
capacity). Counting is a dispatch mode, which is per thread and sends every operation through
Python, so a program says where its "device" work begins and ends (the long-context benchmark
enters it around building the model and its steps); nothing is counted behind its back.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import torch

from .config import Config, get_config
from .device.base import backend_for, forget_backend
from .device.sim.device import RaceError, SimSettings, SimStreams, _override, settings_for
from .device.sim.memory import DeviceMemory

__all__ = [
    "DeviceMemory",
    "RaceError",
    "SimSettings",
    "SimStreams",
    "active_device",
    "device_memory",
    "simulated_device",
]

_generations = itertools.count(1)


@contextlib.contextmanager
def simulated_device(
    seed: int = 0,
    *,
    max_delay_s: float = 0.001,
    max_lag_s: float = 0.001,
    capacity: int | str | None = None,
    track_memory: bool = True,
    bandwidth: int | str | None = None,
    pageable_rate: float = 0.5,
    memory: DeviceMemory | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[SimStreams]:
    """Run the scopes on a CPU device inside the block on a fresh simulated device.

    ``seed`` fixes the random delays of its streams; ``max_delay_s`` is the longest delay of
    one queued copy and ``max_lag_s`` how far the compute stream's events trail the host.
    With ``track_memory`` the device's live and peak bytes are counted while the block runs
    (``device.memory.live`` / ``.peak``), and ``capacity`` (bytes or ``"2GiB"``) makes an
    allocation past it raise ``torch.OutOfMemoryError``. ``bandwidth`` (bytes per second or
    ``"2GB/s"``) gives the device a host link of that rate each way: every copy off the compute
    stream then takes at least its bytes over that rate, copies in one direction queue, and
    compute waits for a copy it depends on, so step times compare as on a GPU with that
    copy-to-compute ratio (``device.links`` has each direction's figures); a synchronous copy
    from pageable memory (`SimStreams.transfer`) runs at ``pageable_rate`` of it. ``memory``: the
    device's memory is that `DeviceMemory` (its capacity and counts; the caller counts with it),
    e.g. a capped `device_memory` the program runs in, given a link for a while (the
    long-context benchmark's budget sweep). ``clock``: what the link, copies and events are
    timed by (Note [the device's clock] in actoff.device.sim.link). On leaving, the device is
    drained, and a race not yet raised in the block raises `RaceError`.

    Example:
        >>> import torch, actoff
        >>> from actoff.testing import simulated_device
        >>> from actoff.reference import Block, ModelConfig, Transformer
        >>> model = Transformer(ModelConfig.preset("tiny"))
        >>> _ = actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
        >>> with simulated_device(seed=1) as device:
        ...     model.loss(torch.randint(0, 256, (2, 32))).backward()
        >>> device.races, device.memory.peak > 0
        ([], True)
    """
    from .config import parse_size

    if memory is not None and capacity is not None:
        raise ValueError("simulated_device(memory=..., capacity=...): the memory given has its own capacity")

    limit = capacity if capacity is None or isinstance(capacity, int) else parse_size(capacity)
    rate = (
        bandwidth
        if bandwidth is None or isinstance(bandwidth, int | float)
        else parse_size(bandwidth.removesuffix("/s"))
    )
    if rate is not None and rate <= 0:
        raise ValueError(f"simulated_device(bandwidth={bandwidth!r}): expected a rate > 0, e.g. '2GB/s'")
    settings = SimSettings(
        seed,
        max_delay_s,
        max_lag_s,
        capacity=limit,
        bandwidth=rate,
        pageable_rate=pageable_rate,
        clock=clock,
        generation=next(_generations),
    )
    cpu = torch.device("cpu")
    device = backend_for(cpu, settings).streams
    if memory is not None:
        device.memory = memory  # counted already (entered by the caller): not entered again
    _override.append(settings)
    counting = device.memory if track_memory and memory is None else contextlib.nullcontext()
    try:
        with counting:
            yield device
        device.drain()
        device.surface()
    finally:
        _override.remove(settings)
        device.close()
        forget_backend(cpu, settings)


@contextlib.contextmanager
def device_memory(config: Config | None = None) -> Iterator[DeviceMemory]:
    """Count the memory of the simulated device that ``ACTOFF_SIM_DEVICE=1`` selects while the
    block runs, capped at ``ACTOFF_SIM_DEVICE_MEMORY`` (``config``: the process's by default).

    Storages allocated on the CPU inside the block are the device's (actoff's host buffers are
    not); one past the capacity raises ``torch.OutOfMemoryError``, the type CUDA raises. Build
    the model inside the block too, so that its weights count. The block can be entered again;
    the counts carry over. Inside a `simulated_device` block it is that device's memory, and a
    capacity set here that differs from that device's raises ``ValueError``.

    Example:
        >>> import torch, actoff
        >>> from actoff.testing import device_memory
        >>> config = actoff.Config(sim_device=True, sim_device_memory="1MiB")
        >>> with device_memory(config) as memory:
        ...     weights = torch.zeros(2**16)  # 256 KiB
        ...     try:
        ...         torch.zeros(2**18)  # 1 MiB more
        ...     except torch.OutOfMemoryError:
        ...         print("out of memory at", memory.live)
        out of memory at 262144
    """
    config = get_config() if config is None else config
    if not config.sim_device:
        raise RuntimeError(
            "actoff.testing.device_memory counts the simulated device's memory, which is off: set "
            "ACTOFF_SIM_DEVICE=1 (Config.sim_device), or use actoff.testing.simulated_device"
        )
    settings = settings_for(config.sim_device, config.sim_device_memory, config.sim_device_bandwidth)
    if config.sim_device_memory is not None and settings.capacity != config.sim_device_memory:
        # Inside a simulated_device block its device is the one counted: a capacity asked of
        # the setting would be dropped without a word.
        raise ValueError(
            f"actoff.testing.device_memory: the setting asks for a capacity of "
            f"{config.sim_device_memory} bytes (ACTOFF_SIM_DEVICE_MEMORY), but inside a "
            f"simulated_device block that device is counted, with capacity {settings.capacity}: "
            "pass capacity= to simulated_device instead, or leave its block"
        )
    memory = backend_for(torch.device("cpu"), settings).streams.memory
    with memory:
        yield memory


def active_device(config: Config | None = None) -> SimStreams | None:
    """The simulated device a CPU scope would run on now: the innermost `simulated_device`
    block's, else the one ``ACTOFF_SIM_DEVICE=1`` selects (``config``: the process's), else
    ``None``. Baselines that copy outside actoff use it to pay the link's time
    (`SimStreams.transfer`).

    Example:
        >>> from actoff.testing import active_device, simulated_device
        >>> with simulated_device(bandwidth="1GB/s") as device:
        ...     active_device() is device, round(device.transfer(1000, "device-to-host") * 1e9)
        (True, 1000)
    """
    config = get_config() if config is None else config
    settings = settings_for(config.sim_device, config.sim_device_memory, config.sim_device_bandwidth)
    if settings is None:
        return None
    return backend_for(torch.device("cpu"), settings).streams
