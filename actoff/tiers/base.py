"""Tiers: where a record's bytes live between forward and backward, and every move they make.

One small interface (`Tier`) with an object per tier: `KEEP` (stay on the device) here, `CPU`
(a host arena slot, pinned on CUDA) in actoff.tiers.cpu, `NVME` in actoff.tiers.nvme.tier, and a
token-wise run's split records in actoff.tiers.tokenwise.tier; actoff.tiers.registry names them. The runtime calls the record's tier and never asks which
tier it is. Tier objects hold no state: everything lives on the record and its run.

Each record moves through its state machine (actoff.tiers.record): ``place`` starts the copy out
(RESIDENT -> OFFLOADING), ``advance`` finishes it (-> OFFLOADED), ``fetch`` starts the copy
back (-> FETCHING), ``materialize`` waits for it and returns the tensor (-> READY), ``evict``
drops the device copy kept for ``retain_graph`` (-> OFFLOADED), ``release`` returns every
buffer. Copy times go into the run's statistics as they complete.
"""

from __future__ import annotations

import zlib

import torch

from .record import Record, State

__all__ = ["KEEP", "KeepTier", "NoStagingRoom", "Tier", "checksum", "verify"]


class NoStagingRoom(RuntimeError):
    """A fetch needs host staging memory the host budget has no room for now (Note [staging room
    for reads], actoff.tiers.nvme.tier): the fetches in flight give theirs back, or it waits."""


class Tier:
    """What a tier does with a record. The base class is the device itself (nothing moves)."""

    name = "keep"
    #: Records of this tier come back to the device by `fetch` (Note [fetch per saved tensor]).
    fetches = False
    #: A landed copy lets go between saves too (Note [let go as copies land] in actoff.runtime.step).
    lets_go_between_saves = True

    def place(self, record: Record) -> None:
        """Start moving ``record`` off the device; a record that cannot go stays RESIDENT."""

    def advance(self, record: Record, *, force: bool, finish: bool = False) -> None:
        """OFFLOADING -> OFFLOADED once the copy out is done. ``force``: the device side must
        be done now (stream-side where the device allows: the host does not wait), so the
        device tensor can go; ``finish``: everything now, the disk included (`Runtime.flush`)."""

    def settle(self, record: Record) -> None:
        """Backward is about to need an OFFLOADING record: finish moving it out where the
        tier needs that (a staged NVMe write) before it is read back."""

    def fetch(self, record: Record) -> None:
        """OFFLOADED -> FETCHING: start bringing the bytes back (a prefetch)."""

    def materialize(self, record: Record) -> torch.Tensor:
        """The device tensor of an OFFLOADED or FETCHING record (or an OFFLOADING one whose
        device tensor is gone), ready for compute (-> READY)."""
        return record.device_tensor

    def poll(self, record: Record) -> None:
        """Move a prefetch on without waiting (an NVMe read that landed starts its copy)."""

    def land(self, record: Record) -> bool:
        """Finish a FETCHING record's fetch now and give back the host staging memory it holds
        (Note [staging room for reads]); whether it gave any back."""
        return False

    def drop_forwarded(self, record: Record) -> None:
        """An OFFLOADING record that backward was served from the device and needs no more
        (Note [forward what is still on the device]): its device tensor goes once its copy out
        is ordered (-> OFFLOADED); a move further out not yet started is skipped."""

    def evict(self, record: Record) -> None:
        """READY -> OFFLOADED: drop the device copy; what is stored off the device stays."""
        if record.state is not State.READY:
            return
        record.device_tensor = None  # the copy back's ticket stays (Note [host slot reuse])
        record.to(State.OFFLOADED)

    def release(self, record: Record) -> None:
        """Return every buffer the record holds in this tier (the runtime marks it RELEASED)."""
        record.device_tensor = record.copy_source = None

    def count(self, record: Record, bytes_per_tier: dict[str, int]) -> None:
        """Add the record's bytes to ``bytes_per_tier`` (tier name -> bytes) for the statistics."""
        bytes_per_tier[self.name] += record.geometry.nbytes


class KeepTier(Tier):
    """The device: a record stays resident (the ``keep`` policy, runs kept last, no room)."""


def checksum(tensor: torch.Tensor) -> int:
    """crc32 of a tensor's bytes (``ACTOFF_VERIFY``)."""
    host = tensor.detach().reshape(-1).view(torch.uint8).cpu()
    return zlib.crc32(host.numpy())


def verify(record: Record, buffer: torch.Tensor) -> None:
    """Raise if ``buffer`` does not hold the bytes whose checksum was taken at offload."""
    expected = record.checksum
    if expected is None:
        return
    actual = checksum(buffer)
    if actual != expected:
        raise RuntimeError(
            f"actoff: a saved activation of block {record.run.name!r} (tier {record.tier.name}, "
            f"{record.geometry.nbytes} bytes) came back corrupted: checksum {actual:#010x}, "
            f"expected {expected:#010x} (ACTOFF_VERIFY=1). Check the disk and memory."
        )


KEEP = KeepTier()
