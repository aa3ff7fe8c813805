"""The cpu tier: a record's bytes in a host arena slot (pinned on CUDA), copied off the compute
stream and back."""

from __future__ import annotations

import torch

from .base import Tier, checksum, verify
from .record import Record, State

__all__ = ["CPU", "CPU_IN_PLACE", "CpuTier", "InPlaceCpuTier"]


class CpuTier(Tier):
    """Host memory: a slot of the host arena, filled by a copy off the compute stream."""

    name = "cpu"
    fetches = True

    def place(self, record: Record) -> None:
        run, geometry = record.run, record.geometry
        if run.backend.host_resident:
            record.tier = CPU_IN_PLACE
            return
        slot = run.arena().alloc(geometry.nbytes, tag=run.index)
        if slot is None:
            if run.host_refused(record):
                return  # to NVMe, or run again in backward (`RunView.host_refused`)
            if record.refused:
                return  # tried at pack, again when placed: counted and said once
            record.refused = True
            run.stats.over_budget_bytes += geometry.nbytes
            run.warn_once(
                "host budget full",
                f"actoff: the host budget (ACTOFF_HOST_BUDGET) is full: saved tensors of block "
                f"{run.name!r} and any after it that do not fit stay on the device "
                "(actoff.stats().blocks[...].over_budget_bytes counts them); raise the budget, or "
                "give ACTOFF_NVME_DIR with an I/O engine that writes device memory itself (kvikio "
                "with GPUDirect Storage), where the rest then goes (Note [a full host spills to NVMe])",
            )
            return  # stays resident: the host budget is full
        source = geometry.flat(record.device_tensor)
        record.host_slot = slot
        record.copy_source = source  # Note [no record_stream]: held until the copy is done
        record.copy_ticket = run.backend.copy_to_host(
            slot.view(geometry.dtype, geometry.span), source, record.what()
        )
        record.tier = self
        record.to(State.OFFLOADING)
        run.account("copy_ms", record.copy_ticket)  # timed when done, forwarded or not

    def advance(self, record: Record, *, force: bool, finish: bool = False) -> None:
        run, ticket = record.run, record.copy_ticket
        if run.config.verify or finish:
            ticket.synchronize()  # the checksum reads the host bytes
            if run.config.verify:
                record.checksum = checksum(record.host_slot.view(record.geometry.dtype, record.geometry.span))
        elif force:
            run.backend.wait(ticket)
        elif not ticket.query():
            return
        self._offloaded(record)

    def drop_forwarded(self, record: Record) -> None:
        self.advance(record, force=True)  # the compute stream waits for the copy; no host wait

    @staticmethod
    def _offloaded(record: Record) -> None:
        # The copy's ticket stays until the slot is freed (Note [host slot reuse]).
        record.device_tensor = None
        record.copy_source = None
        record.to(State.OFFLOADED)

    def fetch(self, record: Record) -> None:
        run, geometry = record.run, record.geometry
        host = record.host_slot.view(geometry.dtype, geometry.span)
        if run.config.verify:
            verify(record, host)
        flat = run.device_buffer(geometry.pad + geometry.span, geometry.dtype, ("fetch", record.index))
        flat, record.fetch_ticket = run.backend.copy_to_device(
            host, pad=geometry.pad, what=record.what(), out=flat
        )
        record.device_tensor = geometry.rebuild(flat)
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
        self._order_device_side(record)
        self._free_slot(record)
        super().release(record)

    @staticmethod
    def _order_device_side(record: Record) -> None:
        """Before a record drops its device tensor with a copy still in flight (a graph freed
        right after forward, a prefetch backward never used), the compute stream waits for
        the copy: the caching allocator may then hand the memory out (Note [no record_stream]).
        The host does not wait."""
        if record.state is State.OFFLOADING and record.device_tensor is not None:
            record.run.backend.wait(record.copy_ticket)
        elif record.state is State.FETCHING and record.fetch_ticket is not None:
            record.run.backend.wait(record.fetch_ticket)

    @staticmethod
    def _free_slot(record: Record) -> None:
        """Return the slot with the tickets of both its copies: the arena hands it out again
        only once they are done, without blocking the host (Note [host slot reuse],
        actoff.memory.host_arena)."""
        if record.host_slot is not None:
            record.run.arena().free(record.host_slot, after=(record.copy_ticket, record.fetch_ticket))
            record.host_slot = None
        record.copy_ticket = record.fetch_ticket = None


class InPlaceCpuTier(Tier):
    """Note [nothing to copy on the host]: on a plain CPU device the tensor already is in
    host memory. Copying it into the arena would only cost time (``save_on_cpu`` does not copy
    there either: ``tensor.cpu()`` is the tensor itself), so the record keeps it and counts as
    host bytes. The copy paths are exercised on the simulated device (actoff.device.sim.device)."""

    name = "cpu"
    fetches = False  # its records stay where they are


CPU = CpuTier()
CPU_IN_PLACE = InPlaceCpuTier()
