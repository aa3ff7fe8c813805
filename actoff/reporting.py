"""Did the peak move? `report`: a short account of the last step to print or log every N steps.

Note [the peak kept]: the report estimates the device peak had everything been kept as the
measured peak plus every byte actoff placed off the device in the last step (to host memory, to
NVMe, or dropped to be recomputed). Those bytes are all live at once only when forward ends, so
the peak with everything kept is at most this figure, and lower where the measured peak falls in
backward (on the simulated device: 1.4x keep's measured peak under ``cpu`` for the reference
model, ``tests/test_reporting.py``). The saves inside a checkpointed block's body are never actoff's
(PyTorch's checkpoint keeps a placeholder for each), so under the ``checkpoint`` placement the
estimate leaves them out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from actoff.config import format_bytes, get_config
from actoff.device.base import DeviceBackend, backend_for
from actoff.device.sim.device import settings_for
from actoff.runtime.runtime import get_runtime

__all__ = ["Report", "report"]


@dataclass(frozen=True)
class Report:
    """The last step in figures (`report`); ``str(report)`` is one paragraph, `to_dict` its figures.

    Bytes are the last step's; ``None`` is a figure this run does not know (`to_dict` leaves it
    out): the device peak where the device does not count its memory (a plain CPU device), the
    blocks' times where the ``auto`` policy has not measured a planned step.

    Example:
        >>> figures = Report(steps=4, device_peak_bytes=None, kept_peak_bytes=None, offloaded_bytes=2048,
        ...                  host_bytes=2048, nvme_bytes=0, recomputed_bytes=0)
        >>> figures.to_dict()
        {'steps': 4, 'offloaded_bytes': 2048, 'host_bytes': 2048, 'nvme_bytes': 0, 'recomputed_bytes': 0}
        >>> print(figures)
        actoff, step 4: device peak not counted on this device; off the device 2.00 KiB (host 2.00 KiB, NVMe 0 B, recomputed 0 B).
    """

    steps: int  # backward passes since `actoff.reset`
    #: The most device bytes in use at once since the last report (or the program's last reset
    #: of the device's peak counter), and that peak had everything been kept (Note [the peak kept]).
    device_peak_bytes: int | None
    kept_peak_bytes: int | None
    offloaded_bytes: int  # placed off the device: the three below
    host_bytes: int
    nvme_bytes: int
    recomputed_bytes: int  # dropped in forward, rebuilt in backward (token-wise)
    #: The blocks' time in the last step that ran ``auto``'s plan (forwards plus what placements
    #: added in backward: recompute, waits for copies), and the same blocks' forwards alone, as
    #: under ``keep`` (``Stats.measured_step_ms`` and the blocks' ``forward_ms``).
    blocks_ms: float | None = None
    blocks_keep_ms: float | None = None
    plan: str | None = None  # the plan ``auto`` runs (``Stats.plan``)
    #: Blocks that stored whole what their policy recomputes, each with why (Note [no silent
    #: downgrade], ``BlockStats.stored_whole``); None: none did.
    stored_whole: dict[str, str] | None = None

    def to_dict(self) -> dict[str, int | float | str]:
        """The known figures by name (``None`` ones left out), for a logger."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def __str__(self) -> str:
        if self.device_peak_bytes is None:
            peak = "device peak not counted on this device"
        else:
            peak = (
                f"device peak {format_bytes(self.device_peak_bytes)} (everything kept: at most "
                f"{format_bytes(self.kept_peak_bytes or 0)})"
            )
        parts = [
            f"actoff, step {self.steps}: {peak}",
            f"off the device {format_bytes(self.offloaded_bytes)} (host {format_bytes(self.host_bytes)}, "
            f"NVMe {format_bytes(self.nvme_bytes)}, recomputed {format_bytes(self.recomputed_bytes)})",
        ]
        if self.blocks_ms is not None and self.blocks_keep_ms is not None:
            parts.append(f"blocks {self.blocks_ms:.1f} ms against {self.blocks_keep_ms:.1f} ms kept")
        if self.plan is not None:
            parts.append(f"plan {self.plan}")
        if self.stored_whole:
            name, why = next(iter(self.stored_whole.items()))
            others = len(self.stored_whole) - 1
            parts.append(
                f"{name}{f' and {others} more' if others else ''} recomputed nothing, stored whole: {why}"
            )
        return "; ".join(parts) + "."


def report(device: torch.device | str | None = None, *, reset_peak: bool = True) -> Report:
    """The calling thread's last step in figures, with the device's peak (`Report`).

    ``device``: where the scopes run (default: CUDA's current device where CUDA is available,
    else the CPU, the simulated device inside `actoff.testing.simulated_device` or under
    ``ACTOFF_SIM_DEVICE=1``). With ``reset_peak`` the device's peak counter starts again from
    what is live now, so each report covers the steps since the one before (called every N steps,
    the most of those N steps' peaks). Call it between steps, after ``backward``.

    Example:
        >>> import torch, actoff
        >>> from actoff.reference import Block, ModelConfig, Transformer
        >>> from actoff.testing import simulated_device
        >>> actoff.reset()
        >>> model = Transformer(ModelConfig.preset("tiny"))
        >>> _ = actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
        >>> with simulated_device():
        ...     model.loss(torch.randint(0, 256, (2, 33))).backward()
        ...     figures = actoff.report()
        >>> figures.device_peak_bytes < figures.kept_peak_bytes
        True
        >>> print(figures)  # doctest: +ELLIPSIS
        actoff, step 1: device peak ... (everything kept: at most ...); off the device ... (host ..., NVMe 0 B, ...
    """
    stats = get_runtime().stats()
    per_tier = {tier: sum(b.bytes_per_tier[tier] for b in stats.blocks.values()) for tier in ("cpu", "nvme")}
    recomputed = sum(b.bytes_per_tier["recompute"] for b in stats.blocks.values())
    offloaded = per_tier["cpu"] + per_tier["nvme"] + recomputed
    peak = _device_backend(device).memory_peak(reset=reset_peak)
    forwards = sum(b.forward_ms for b in stats.blocks.values())
    timed = stats.measured_step_ms is not None and forwards > 0
    return Report(
        steps=stats.steps,
        device_peak_bytes=peak,
        kept_peak_bytes=None if peak is None else peak + offloaded,  # Note [the peak kept]
        offloaded_bytes=offloaded,
        host_bytes=per_tier["cpu"],
        nvme_bytes=per_tier["nvme"],
        recomputed_bytes=recomputed,
        blocks_ms=stats.measured_step_ms if timed else None,
        blocks_keep_ms=forwards if timed else None,
        plan=None if stats.plan == "none" else stats.plan,
        stored_whole={name: b.stored_whole for name, b in stats.blocks.items() if b.stored_whole} or None,
    )


def _device_backend(device: torch.device | str | None) -> DeviceBackend:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = get_config()
    # The backend the scopes use: on a CPU device, the simulated one where one is in force.
    simulated = settings_for(config.sim_device, config.sim_device_memory, config.sim_device_bandwidth)
    return backend_for(torch.device(device), simulated)
