"""The NVMe tier: a record's bytes in the process's file, staged through host memory on CUDA.

Three paths, by what the device and the I/O engine can do:
- staged (a device with DMA, ``backend.staged``, and an engine that takes host buffers: the
  POSIX engine, kvikio in compat mode): a record is copied into a host arena slot first and
  written from there (4 KiB-aligned slot: O_DIRECT-ready);
- direct from the device (kvikio with GPUDirect Storage active): the engine writes the
  device tensor and reads into a fresh device buffer itself, ordered against the compute
  stream by a ticket (Note [direct device I/O] in actoff.tiers.nvme.kvikio); no host memory is involved,
  and the device tensor is held until the disk has the bytes;
- host-resident (a plain CPU device): written straight from the tensor.
Reads come back the same way. A failed write loses nothing: the bytes are still in the
staging slot (the record becomes a host-tier record) or on the device (it stays resident). A
failed, short or hung read raises in the training thread, and so does a read whose bytes are
not the ones written (Note [sealed records] in actoff.tiers.nvme.seals), naming the block and
the step, before anything uses them.

Note [staging room for reads]: a staged read takes a host arena slot, under the host budget,
and gives it back once its copy to the device is ordered (the file keeps the bytes), not when
the record is released. Where the budget has no room for the next read, the reads in flight
land first and give theirs back (`FetchQueue.make_room`); a prefetch that still finds none
waits to be fetched at its own unpack, and only a read with nothing in flight to wait for
raises, naming the budget. Before, prefetched reads held their slots until backward released
their records, and a budget of a few records raised in backward a step whose writes had all
landed (tests/tiers/nvme/test_staging.py).
"""

from __future__ import annotations

import errno

import torch

from actoff.tiers.base import KEEP, NoStagingRoom, checksum, verify
from actoff.tiers.cpu import CPU, CpuTier
from actoff.tiers.record import Record, State

__all__ = ["NVME", "NvmeTier", "spill_to_nvme"]


def _timed_out(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno == errno.ETIMEDOUT


class NvmeTier(CpuTier):
    """A file extent of the run's NVMe store (actoff.tiers.nvme.store), written and read by its engine."""

    name = "nvme"
    # Not between saves (Note [let go as copies land]): let go there, the last block's records
    # would be read back through staging room a tight host budget spends on writes still going.
    lets_go_between_saves = False

    def place(self, record: Record) -> None:
        run, geometry = record.run, record.geometry
        store = run.store()
        direct = run.backend.staged and store.takes_device_buffers
        if run.backend.staged and not direct:
            super().place(record)  # the host copy first; the write starts in advance()
            if record.host_slot is not None:
                # Note [extents at placement]: a staged record's extent is taken here, in
                # forward order, not when its write starts (once the host sees the copy out
                # end, in forward or in backward between the frees of later blocks' extents).
                # Taken then, extents would follow copy timing: a step whose copies end
                # earlier than the first step's would need more at once and grow the file.
                record.store = store
                record.extent, error = store.allocate(record.host_slot.capacity)
                if error is not None:  # the file cannot grow: the slot keeps the bytes
                    self._stay_in_slot(record)
                    self._warn_fallback(record, error, "host memory")
            return
        # Host-resident tensors, or device tensors the engine writes itself (GDS), go straight
        # to the file; no staging copy.
        source = geometry.flat(record.device_tensor)
        if run.config.verify:
            record.checksum = checksum(source)
        sealed = run.config.nvme_checksum
        if direct:  # Note [direct device I/O]: written once the compute stream has produced it
            record.extent, record.write_future = store.write(
                source, geometry.nbytes, after=run.backend.mark(), sealed=sealed
            )
        else:
            record.extent, record.write_future = store.write(source, geometry.nbytes, sealed=sealed)
        record.store = store
        record.copy_source = source
        record.tier = self
        record.to(State.OFFLOADING)

    def advance(self, record: Record, *, force: bool, finish: bool = False) -> None:
        run, ticket = record.run, record.copy_ticket
        if record.write_future is None:
            # Staged, the file write not started: the host copy first.
            if record.device_tensor is not None:
                if not ticket.query():
                    if not (force or finish):
                        return
                    run.backend.wait(ticket)  # stream-side: the device tensor may go now
                # Note [staged writes free the device early]: once the copy into the staging
                # slot is ordered, the device tensor goes, not when the disk is done: the slot
                # holds the bytes (in stream order) and a backward that comes before the write
                # ends is served from the slot (OFFLOADING -> FETCHING), the write going on.
                record.device_tensor = record.copy_source = None
            if not ticket.query():  # the write reads what the host sees: the copy must be over
                if not finish:
                    return
                ticket.synchronize()
            store, slot = run.store(), record.host_slot
            run.backend.check_host_reuse(slot.raw(), "written to disk")  # no copy may touch it now
            if run.config.verify:
                record.checksum = checksum(slot.view(record.geometry.dtype, record.geometry.span))
            # The whole aligned slot: aligned address, size and offset take O_DIRECT.
            _, record.write_future = store.write(
                slot.raw(), slot.capacity, extent=record.extent, sealed=run.config.nvme_checksum
            )
        future = record.write_future
        if not future.done() and not finish:
            return  # never wait for the disk in forward: a later call (or backward) finishes it
        self._finish_write(record)

    def drop_forwarded(self, record: Record) -> None:
        if record.write_future is None and record.host_slot is not None:
            # Staged and not written yet: backward has used the bytes, so writing them now
            # would cost a write nobody reads back. The slot is the record's home now (a
            # retained graph's second backward reads it from there).
            self._stay_in_slot(record)
            CPU.drop_forwarded(record)
        else:  # the write is under way (or the device tensor is the source: GDS, host-resident)
            self.advance(record, force=True)

    def settle(self, record: Record) -> None:
        # A record whose device tensor went (a staged write running) is read back from the
        # file once its write ends: backward reads every record the same way.
        if record.device_tensor is None:
            self.advance(record, force=True, finish=True)

    def _finish_write(self, record: Record) -> None:
        run, future = record.run, record.write_future
        try:
            future.wait(run.config.io_timeout)
        except Exception as error:  # an OSError, a timeout, or a worker that died
            self._write_failed(record, error)
            return
        run.account_io("copy_ms", future)
        record.write_future = None
        if record.state is State.OFFLOADING:
            self._free_slot(record)  # the staging slot: the file has the bytes now
            self._offloaded(record)

    def _write_failed(self, record: Record, error: Exception) -> None:
        # Nothing is lost: the bytes are still in the staging slot (-> host tier) or in the
        # device tensor, which the record still holds (-> keep).
        run = record.run
        if _timed_out(error):
            # Note [hung I/O]: an extent or buffer that a timed-out request may still touch is
            # never handed out again: it goes to the runtime's quarantine, with the source the
            # request reads from kept alive. A worker that hangs may still write or read later.
            run.quarantine(record.extent, record.copy_source)
        else:
            record.store.free(record.extent)
        record.extent = None
        record.write_future = None
        record.copy_source = None
        if record.host_slot is not None:
            record.tier = CPU
            if record.state is State.OFFLOADING:
                record.device_tensor = None
                record.to(State.OFFLOADED)
            fallback = "host memory"
        else:
            record.tier = KEEP
            record.to(State.RESIDENT)
            fallback = "the device"
        self._warn_fallback(record, error, fallback)

    @staticmethod
    def _warn_fallback(record: Record, error: Exception, fallback: str) -> None:
        run = record.run
        run.stats.write_fallback_bytes += record.geometry.nbytes
        run.warn_once(
            f"nvme-write:{run.config.nvme_dir}",
            f"actoff: an NVMe write failed ({error}); affected activations stay in {fallback} "
            "and training continues with exact values. Free space or fix ACTOFF_NVME_DIR.",
        )

    @staticmethod
    def _stay_in_slot(record: Record) -> None:
        """A staged record never written: its host slot is its home from now on (a host-tier
        record), and its extent goes back."""
        if record.extent is not None:
            record.store.free(record.extent)
            record.extent = None
        record.tier = CPU

    def fetch(self, record: Record) -> None:
        run, geometry, store = record.run, record.geometry, record.store
        if run.backend.staged and not store.takes_device_buffers:
            slot = run.arena().alloc(geometry.nbytes, tag=run.index)
            if slot is None:  # Note [staging room for reads]
                raise NoStagingRoom(
                    f"actoff: no host staging memory to read {geometry.nbytes} bytes back from "
                    f"NVMe for block {run.name!r}, with no other read to wait for: raise "
                    "ACTOFF_HOST_BUDGET"
                )
            record.host_slot = slot
            record.write_future = store.read(slot.raw(), record.extent, slot.capacity)
            record.copy_source = slot.view(geometry.dtype, geometry.span)
        else:
            flat = torch.empty(geometry.pad + geometry.span, dtype=geometry.dtype, device=run.device)
            record.device_tensor = geometry.rebuild(flat)
            record.copy_source = flat[geometry.pad :]
            if run.backend.staged:
                # The fresh allocation may reuse memory that kernels queued on the compute
                # stream still use: the read lands after they ran (Note [direct device I/O]).
                record.write_future = store.read(
                    record.copy_source, record.extent, geometry.nbytes, after=run.backend.mark()
                )
            else:
                record.write_future = store.read(record.copy_source, record.extent, geometry.nbytes)
        record.to(State.FETCHING)

    def materialize(self, record: Record) -> torch.Tensor:
        if record.state is State.OFFLOADING:
            # The device tensor is gone and the staging slot has the bytes; the write, if
            # started, goes on (Note [staged writes free the device early]).
            self.advance(record, force=False)
            if record.tier is not self:  # the write failed just now: the record fell back
                return record.tier.materialize(record)
            if record.state is State.OFFLOADING:
                if record.write_future is None:
                    self._stay_in_slot(record)  # never written
                CpuTier.fetch(self, record)
                self._arrive(record, prefetched=False)
                return record.device_tensor
        prefetched = record.state is State.FETCHING
        if not prefetched:
            self.fetch(record)
        if record.write_future is not None:
            self._finish_read(record)
        self._arrive(record, prefetched)
        self._free_slot(record)  # the device has the bytes, the file keeps them
        return record.device_tensor

    def land(self, record: Record) -> bool:
        if record.state is not State.FETCHING or record.host_slot is None or record.tier is not self:
            return False
        if record.write_future is not None:
            self._finish_read(record)
        self._arrive(record, prefetched=True)
        self._free_slot(record)
        return True

    def poll(self, record: Record) -> None:
        # A prefetched read that has landed starts its copy to the device now, so that the
        # copy overlaps compute rather than starting when backward asks for the tensor.
        if record.state is State.FETCHING and record.write_future is not None and record.write_future.done():
            self._finish_read(record)

    def _finish_read(self, record: Record) -> None:
        run, geometry = record.run, record.geometry
        future, record.write_future = record.write_future, None
        try:
            future.wait(run.config.io_timeout)
            run.account_io("fetch_ms", future)
        except Exception as error:  # an OSError, a timeout, or a worker that died
            if _timed_out(error):  # Note [hung I/O]: the read may still land in this buffer
                # ... and still reads its extent: neither is handed out again (a free of the
                # extent with the read running would raise when the record is released).
                run.quarantine(record.host_slot, record.extent, record.copy_source)
                record.host_slot = record.extent = None
            raise RuntimeError(
                f"actoff: reading a saved activation of block {run.name!r} (record "
                f"{record.index}, step {run.step_number}) back from NVMe failed: {error}. The step "
                "cannot continue with this activation; check the disk, and that nothing else "
                "writes in ACTOFF_NVME_DIR."
            ) from error
        buffer, record.copy_source = record.copy_source, None
        if run.config.verify:
            verify(record, buffer)
        if record.host_slot is not None:  # staged: the slot's bytes go to the device now
            flat = run.device_buffer(geometry.pad + geometry.span, geometry.dtype, ("fetch", record.index))
            flat, record.fetch_ticket = run.backend.copy_to_device(
                buffer, pad=geometry.pad, what=record.what(), out=flat
            )
            record.device_tensor = geometry.rebuild(flat)
        else:  # read straight into the device tensor; the host saw it land
            record.fetch_ticket = None

    def evict(self, record: Record) -> None:
        if record.state is State.READY and record.host_slot is not None:
            if record.write_future is not None:  # served from the slot while the write went on
                self._finish_write(record)
            if record.tier is self:  # the file has the bytes (a failed write left it in CPU)
                self._free_slot(record)
        super().evict(record)

    def release(self, record: Record) -> None:
        self._order_device_side(record)
        if record.write_future is not None:
            # A write or read still running (rare: a graph freed before its write ended, a
            # prefetch backward never used): it touches the slot and the extent, so it ends first.
            try:
                record.write_future.wait(record.run.config.io_timeout)
            except Exception as error:
                if _timed_out(error):  # Note [hung I/O]
                    record.run.quarantine(record.host_slot, record.extent, record.copy_source)
                    record.host_slot = record.extent = None
            record.write_future = None
        self._free_slot(record)
        if record.extent is not None:
            record.store.free(record.extent)
            record.extent = None
        record.device_tensor = record.copy_source = None


NVME = NvmeTier()


# Note [a full host spills to NVMe]: a record the host budget cannot take goes to the NVMe file
# where ACTOFF_NVME_DIR is given and its I/O engine writes device memory itself (kvikio with
# GPUDirect Storage: Note [direct device I/O]), under every policy that stores on the host
# (cpu, checkpoint's inputs, auto's placements and measuring steps). Where the engine needs host
# buffers (POSIX, kvikio's compat mode) an NVMe write is staged through the same full host
# budget, so the record stays on the device, counted and said.
def spill_to_nvme(record: Record) -> bool:
    """(Note [a full host spills to NVMe]) Whether ``record`` went to the NVMe file instead."""
    run, config = record.run, record.run.config
    if config.nvme_dir is None or config.io_backend == "posix" or not run.backend.staged:
        return False
    try:
        direct = run.store().takes_device_buffers
    except Exception:  # the store cannot open here (said where a policy asks for it): stays put
        return False
    if not direct:
        return False
    NVME.place(record)
    return record.state is State.OFFLOADING
