"""Per-block figures of one step (`BlockStats`): what a block saved and where it went, filled by the
tiers as they move its bytes and by the runtime, and published by `actoff.stats()`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .policy import BUCKETS

__all__ = ["BlockStats"]


@dataclass
class BlockStats:
    """What one block saved for backward in the last step, and where it went."""

    name: str
    calls: int = 0  # forward calls of the block in the step
    tensors: int = 0  # distinct saved tensors actoff took charge of (after dedup)
    bytes_saved: int = 0  # their bytes
    bytes_per_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0))
    dedup_hits: int = 0  # saves served by an existing record (same storage, offset, view)
    skipped_param_bytes: int = 0  # parameters, buffers and their views: never offloaded
    skipped_small_bytes: int = 0  # tensors under min_bytes
    skipped_other_bytes: int = 0  # other devices, subclasses, sparse, empty tensors
    over_budget_bytes: int = 0  # would have been offloaded, but the host budget was full
    # Refused by the host budget while auto measured, run again in backward instead (Note
    # [measuring where the host is small] in actoff.runtime.placements.measuring).
    run_again_bytes: int = 0
    write_fallback_bytes: int = 0  # NVMe writes that failed and fell back to another tier
    copy_ms: float = 0.0  # time of the copies out (device to host, host to file)
    fetch_ms: float = 0.0  # time of the copies back
    wait_ms: float = 0.0  # time backward waited for copies back (0: prefetch hid them)
    out_wait_ms: float = 0.0  # time forward waited for copies out (a copy window's waits)
    place_wait_ms: float = 0.0  # time a later block's placing waited for its copies out
    recompute_ms: float = 0.0  # time of token-wise re-runs in backward
    probes: int = 0  # re-runs that planned a new module or new conditions (batch, length, ...)
    forwarded: int = 0  # unpacks served by a still-live tensor instead of a fetch
    # The auto policy (actoff.runtime.auto): the block's placement in the step ("measuring
    # (recompute)" before its plan; "" under other policies), the forward's measured time,
    # and its time as predicted by the plan that ran ("" before one) and as measured: the
    # forward plus what the placement added in backward (recompute, waits for copies).
    placement: str = ""
    forward_ms: float = 0.0
    predicted_ms: float = 0.0
    measured_ms: float = 0.0
    # Note [no silent downgrade] (actoff.runtime.placements.base): why the block stored whole what
    # its policy re-runs in backward ("": it ran as asked).
    stored_whole: str = ""

    @property
    def bytes_offloaded(self) -> int:
        """Bytes that left the device (cpu + nvme)."""
        return self.bytes_per_tier["cpu"] + self.bytes_per_tier["nvme"]
