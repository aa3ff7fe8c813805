"""Tiers: where a record's bytes live between forward and backward, and every move they make.

One small interface (`Tier`) with an object per tier: `KEEP` (stay on the device) and `HOST`
(a host arena slot, pinned on CUDA) here, `NVME` in actoff._tier_nvme, and a token-wise run's
split records in actoff._tokenwise. The runtime calls the record's tier and never asks which
tier it is. Tier objects hold no state: everything lives on the record and its run.

Each record moves through its state machine (actoff._record): ``place`` starts the copy out
(RESIDENT -> OFFLOADING), ``advance`` finishes it (-> OFFLOADED), ``fetch`` starts the copy
back (-> FETCHING), ``materialize`` waits for it and returns the tensor (-> READY), ``evict``
drops the device copy kept for ``retain_graph`` (-> OFFLOADED), ``release`` returns every
buffer. Copy times go into the run's statistics as they complete.
"""

from __future__ import annotations

import zlib

import torch

from ._record import Record, State

__all__ = ["HOST", "KEEP", "HostTier", "KeepTier", "Tier", "checksum", "verify"]


class Tier:
    """What a tier does with a record. The base class is the device itself (nothing moves)."""

    name = "keep"

    def place(self, record: Record) -> None:
        """Start moving ``record`` off the device; a record that cannot go stays RESIDENT."""

    def advance(self, record: Record, *, force: bool) -> None:
        """OFFLOADING -> OFFLOADED once the copy out is done; ``force`` makes it finish now
        (stream-side where the device allows)."""

    def fetch(self, record: Record) -> None:
        """OFFLOADED -> FETCHING: start bringing the bytes back (a prefetch)."""

    def materialize(self, record: Record) -> torch.Tensor:
        """The device tensor of an OFFLOADED or FETCHING record, ready for compute (-> READY)."""
        return record.device_tensor

    def evict(self, record: Record) -> None:
        """READY -> OFFLOADED: drop the device copy; what is stored off the device stays."""
        if record.state is not State.READY:
            return
        record.fetch_ticket = None
        record.device_tensor = None
        record.to(State.OFFLOADED)

    def release(self, record: Record) -> None:
        """Return every buffer the record holds in this tier (the runtime marks it RELEASED)."""
        record.device_tensor = record.copy_source = None

    def count(self, record: Record, bytes_per_tier: dict[str, int]) -> None:
        """Add the record's bytes to ``bytes_per_tier`` (tier name -> bytes) for the statistics."""
        bytes_per_tier[self.name] += record.layout.nbytes


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
            f"{record.layout.nbytes} bytes) came back corrupted: checksum {actual:#010x}, "
            f"expected {expected:#010x} (ACTOFF_VERIFY=1). Check the disk and memory."
        )


class HostTier(Tier):
    """Host memory: a slot of the host arena, filled by a copy off the compute stream."""

    name = "cpu"

    def place(self, record: Record) -> None:
        run, layout = record.run, record.layout
        slot = run.arena().alloc(layout.nbytes, tag=run.index)
        if slot is None:
            run.stats.over_budget_bytes += layout.nbytes
            return  # stays resident: the host budget is full
        source = layout.flat(record.device_tensor)
        record.host_slot = slot
        record.copy_source = source  # Note [no record_stream]: held until the copy is done
        record.copy_ticket = run.backend.copy_to_host(slot.view(layout.dtype, layout.span), source)
        record.tier = self
        record.to(State.OFFLOADING)

    def advance(self, record: Record, *, force: bool) -> None:
        run, ticket = record.run, record.copy_ticket
        if run.config.verify:
            ticket.synchronize()  # the checksum reads the host bytes
            record.checksum = checksum(record.host_slot.view(record.layout.dtype, record.layout.span))
        elif force:
            run.backend.wait(ticket)
        elif not ticket.query():
            return
        self._offloaded(record)

    @staticmethod
    def _offloaded(record: Record) -> None:
        record.run.account("copy_ms", record.copy_ticket)
        record.copy_ticket = None
        record.device_tensor = None
        record.copy_source = None
        record.to(State.OFFLOADED)

    def fetch(self, record: Record) -> None:
        run, layout = record.run, record.layout
        host = record.host_slot.view(layout.dtype, layout.span)
        if run.config.verify:
            verify(record, host)
        flat, record.fetch_ticket = run.backend.copy_to_device(host, pad=layout.pad)
        record.device_tensor = layout.rebuild(flat)
        record.to(State.FETCHING)

    def materialize(self, record: Record) -> torch.Tensor:
        prefetched = record.state is State.FETCHING
        if not prefetched:
            self.fetch(record)
        self._arrive(record, prefetched)
        return record.device_tensor

    @staticmethod
    def _arrive(record: Record, prefetched: bool) -> None:
        """The compute stream waits for the copy back: FETCHING -> READY."""
        run, ticket = record.run, record.fetch_ticket
        if prefetched:  # only a copy still in flight makes us wait
            run.account("wait_ms", run.backend.stall(ticket))
        else:  # fetched just now: backward waits for the whole copy
            run.account("wait_ms", ticket)
        run.backend.wait(ticket)
        run.account("fetch_ms", ticket)
        # The ticket stays: Note [host slot reuse] needs it when the slot is freed.
        record.to(State.READY)

    def release(self, record: Record) -> None:
        self._finish_copies(record)
        self._free_slot(record)
        super().release(record)

    @staticmethod
    def _finish_copies(record: Record) -> None:
        # Copies still touching the record's memory must finish first (rare: a graph freed
        # right after forward, or a prefetch that backward never used).
        if record.copy_ticket is not None and record.state is State.OFFLOADING:
            record.copy_ticket.synchronize()
            record.run.account("copy_ms", record.copy_ticket)
        if record.fetch_ticket is not None:
            # Note [host slot reuse]: the compute stream waited for the copy back, but the
            # host did not. A freed slot can be refilled at once by an NVMe read on a host
            # thread while the DMA still reads it, so the copy must be over first. It
            # almost always is: the tensor was used before its handle was dropped.
            record.fetch_ticket.synchronize()
        record.copy_ticket = record.fetch_ticket = None

    @staticmethod
    def _free_slot(record: Record) -> None:
        if record.host_slot is not None:
            record.run.arena().free(record.host_slot)
            record.host_slot = None


KEEP = KeepTier()
HOST = HostTier()
