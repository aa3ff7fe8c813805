"""Steps and scope runs: one forward call of a scope, its records, and the pack/unpack hooks.

A `Step` is the scope runs of one forward pass, in order, until its backward ends. A
`ScopeRun` is one call of an offload scope: its pack hook turns each saved tensor into a
`Handle` to a `Record` (actoff.runtime.hooks; or passes it through), its placement decides what
they become (Note [placements], actoff.runtime.placements.base), and it is what the tiers see of
the run (`actoff.tiers.run_view.RunView`: the arena, the NVMe store, the statistics). Fetching in
backward is here; placement and release are the runtime's and the tiers' (actoff.runtime.runtime,
actoff.tiers.base).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from actoff.config import Config
from actoff.device.base import DeviceBackend, Ticket
from actoff.figures import BlockStats
from actoff.tiers.nvme.tier import spill_to_nvme
from actoff.tiers.record import Record, State

from .fetch import FetchQueue
from .hooks import Handle, PackHook

if TYPE_CHECKING:
    from actoff.memory.host_arena import HostArena
    from actoff.tiers.nvme.store import NvmeStore

    from .placements.base import Placement
    from .runtime import Runtime

__all__ = ["ScopeRun", "Step"]


class Step:
    """The scope runs of one forward pass, in order, until its backward ends."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.runs: list[ScopeRun] = []
        self.pending: collections.deque[ScopeRun] = collections.deque()  # sealed, not placed
        self.modules: set[int] = set()  # ids of module scopes entered (re-entry: new step)
        self.in_flight: list[ScopeRun] = []  # placed runs with copies out not yet finished
        # Records whose copy out started at pack and still hold their device tensor, oldest
        # first (Note [copy out at pack]); the most bytes they held at once.
        self.outbound: list[Record] = []
        self.outbound_peak = 0
        self.last_placed: ScopeRun | None = None
        self.live = 0  # records not yet released
        self.timings: list[tuple[ScopeRun, str, Ticket]] = []  # copies to time at the end
        self.backward_started = False
        self.callback_queued = False
        self.aborted = False
        # How far backward fetches ahead, for the whole step: the auto policy's plan, in runs or
        # bytes (actoff.runtime.auto); None: each run's own settings (`ScopeRun.fetch_limits`).
        self.depth: int | None = None
        self.window: int | None = None
        self.copy_window: int | None = None  # bytes copying out at once (Note [copy out at pack])
        self.fetches = FetchQueue(self)  # Note [fetch per saved tensor]

    def harvest(self, *, block: bool) -> None:
        """Add the times of copies that were in flight when accounted (`ScopeRun.account`):
        those done now, or every one (``block``: waits for them) when the step is over."""
        still = []
        for run, what, ticket in self.timings:
            if block:
                ticket.synchronize()
            if block or ticket.query():
                setattr(run.stats, what, getattr(run.stats, what) + ticket.elapsed_ms())
            else:
                still.append((run, what, ticket))
        self.timings = still

    def progress(self, *, finish: bool = False) -> None:
        """Advance copies out: finish what completed; runs older than the last placed must finish.

        MEMO's double buffering: the copies of run i overlap the forward of run i+1 and are
        waited for (stream-side, no host stall) when the next run is placed: the time that wait
        takes is run i's ``place_wait_ms`` (Note [the waits at placing]).
        """
        still: list[ScopeRun] = []
        for run in self.in_flight:
            force = run is not self.last_placed or run.placement.finish_copies_first
            busy = False
            for record in run.all_records():
                if record.state is State.OFFLOADING:
                    record.check_version()  # the copy out may have read a changed tensor
                    ticket = record.copy_ticket
                    if (force or finish) and ticket is not None and not ticket.query():
                        record.run.account("place_wait_ms", record.run.backend.stall(ticket))
                    record.tier.advance(record, force=force, finish=finish)
                    busy = busy or record.state is State.OFFLOADING
            if busy:
                still.append(run)
        self.in_flight = still

    # Note [the waits at placing]: a run's copies out still under way when a later run is placed
    # (or the step is flushed) are waited for there, between the blocks' stopwatches: in no
    # forward's time and in no copy window's waits (``out_wait_ms``). Uncounted, a plan whose
    # copies outlast the next block's forward, as a token-wise block's copies at its end do, read
    # under its prediction (Note [one link] in actoff.step_time prices them as the block's own
    # added time) and looked cheap to keep. Each such wait, stream-side, is timed from where the
    # compute stream stands to the copy's end (`DeviceBackend.stall`) into the copying run's
    # ``place_wait_ms``, and auto's measured time counts it (actoff.runtime.measured). Not the
    # last placed run's: its copies are served from the device or waited for at backward, untimed.
    #
    # Note [copy out at pack]: a placement that stores every record whole on a tier that copies
    # (cpu, nvme, checkpoint's inputs) starts each record's copy out when autograd saves it, not
    # when its block's forward ends: the copy overlaps the rest of the block, and the record lets
    # go of its device tensor as soon as the copy lands (checked at every save), so a block's saves
    # do not pile up on the device until its end. ``copy_window`` caps the bytes still copying:
    # past it the compute stream waits for the oldest copies (no host wait), so a slow link makes
    # forward slower instead of the step larger. Double buffering still holds as a bound: a run's
    # copies are finished (stream-side) when the run after it is placed. Not for the last
    # ``keep_last`` runs, which stay where they are.
    #
    # Note [let go as copies land]: a landed copy is seen at the next save, and none comes after
    # a block's last: a block's inputs (a chunked block's only records, saved as its forward ends)
    # held their device memory through the next block's forward, and the last block's through the
    # loss and its backward, a residual row a token each: on the 8B proxy the loss's backward
    # bound the step with it (results/cpu-2026-12-04-row-sums). So what runs between saves looks
    # too, without waiting, until backward begins: each scope's entry, each chunk of a chunked
    # block's forward, and each chunk of a tiled module (the final norm) and of the chunked loss,
    # forward and backward (`actoff.runtime.runtime.let_go_landed`, `Step.let_go_landed`). Only
    # in the training thread, whose runtime it is: on CUDA autograd runs the loss's and the tiles'
    # backward in its device threads, where nothing looks, so there a copy still in flight when
    # the loss's forward ends is let go at backward (the simulated device runs backward in the
    # training thread, and its copies land at once: it lets go earlier than a GPU may). The last
    # block's records, let go, come back from the host at its backward's first unpack instead of
    # being served from the device (Note [forward what is still on the device]): a copy in at
    # backward's start, as every other block's; ``keep_last=1`` keeps them instead. Not for the
    # NVMe tier (``lets_go_between_saves``): its records, let go, start their writes, and read
    # back they need host staging room that a tight host budget spends on those writes (a read
    # found none under 200 KiB: tests/tiers/nvme/test_staging.py, in the simulated-device pass).
    #
    # Note [the floor moves small tensors too]: a run that streams with both windows at none (the
    # auto policy's measuring steps and its plans at the floor, or ACTOFF_FETCH_WINDOW=0 and
    # ACTOFF_COPY_WINDOW=0) is at its least memory, save_on_cpu's, and moves every saved tensor,
    # those under ``min_bytes`` too: kept, a block's small saves (norms' statistics, attention's
    # log-sum-exp) put the main run's auto 160 KiB over save_on_cpu's peak, out of memory at it.
    def copies_out(
        self, window: int | None, waiting: ScopeRun | None = None, *, between_saves: bool = False
    ) -> None:
        """Records whose copy has landed let go of their device tensor (no wait); past ``window``
        bytes still held, the oldest are waited for, stream-side (the wait timed into
        ``waiting``'s figures: the run whose forward it holds up). ``between_saves``: only those
        whose tier lets go there (Note [let go as copies land])."""
        held, still = 0, []
        for record in self.outbound:
            if record.state is not State.OFFLOADING or record.device_tensor is None:
                continue  # finished since (`progress`), or released
            ticket = record.copy_ticket
            skipped = between_saves and not record.tier.lets_go_between_saves
            if not skipped and (ticket is None or ticket.query()):  # landed, or a write the tier watches
                record.tier.advance(record, force=ticket is not None)
            if record.state is State.OFFLOADING and record.device_tensor is not None:
                still.append(record)
                held += record.geometry.nbytes
        self.outbound_peak = max(self.outbound_peak, held)
        if window is not None:
            for record in still:
                if held <= window:
                    break
                if waiting is not None and record.copy_ticket is not None:
                    waiting.account("out_wait_ms", waiting.backend.stall(record.copy_ticket))
                record.tier.advance(record, force=True)  # the compute stream waits for its copy
                if record.state is not State.OFFLOADING or record.device_tensor is None:
                    held -= record.geometry.nbytes
        self.outbound = [r for r in still if r.state is State.OFFLOADING and r.device_tensor is not None]

    def let_go_landed(self, lock: Any) -> None:
        """Records whose copy out has landed let go of their device tensor now, under the
        runtime's ``lock`` (Note [let go as copies land]); nothing once backward began, or waits."""
        if self.outbound and not self.backward_started:
            with lock:
                if not self.backward_started:  # it may have begun while the lock was held elsewhere
                    self.copies_out(None, between_saves=True)


class ScopeRun(PackHook):
    """One forward call of an offload scope and the records it made."""

    def __init__(
        self,
        runtime: Runtime,
        step: Step,
        name: str,
        config: Config,
        backend: DeviceBackend,
        param_storages: set[int],
    ) -> None:
        self.runtime = runtime
        self.step = step
        self.index = len(step.runs)
        self.name = name
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.param_storages = param_storages
        # Saved tensors under this many bytes stay where they are (Note [the floor moves small
        # tensors too]: none where the run streams at its least memory).
        self.min_bytes = config.min_bytes
        self.records: list[Record] = []
        self.dedup: dict[tuple, tuple[Any, weakref.ref]] = {}  # key -> (packed, its tensor's root)
        # (storage, dtype, version) -> the first record of it in the run, its span in the storage
        # and its tensor's root, weakly (Note [views of one storage], actoff.runtime.hooks).
        self.spans: dict[tuple, tuple[Handle | None, int, int, weakref.ref]] = {}
        self.stats = BlockStats(name, calls=1)
        self.live = 0  # records not yet released
        self.streaming = False  # its records' copies out started at pack (Note [copy out at pack])
        self.fetch_issued = False  # a record of it fetched this backward (Note [fetch per saved tensor])
        self.window_issued = False  # its first unpack of this backward seen
        # What its saved tensors become (Note [placements]): set by the runtime as it opens the run.
        self.placement: Placement = None  # type: ignore[assignment]

    def place(self, placement: Placement) -> None:
        """The run's placement, set as the runtime opens it; streaming with both windows at none,
        the run keeps no saved tensor for being small (Note [the floor moves small tensors too])."""
        self.placement = placement
        if placement.streams_out and self.fetch_limits() == (0, 0) and self.copy_window_bytes() == 0:
            self.min_bytes = 0

    def reached(self, record: Record | None) -> None:
        """Backward unpacks ``record`` of this run (None: a tensor kept as is; the runtime's lock
        held): at the step's first unpack queue the end-of-backward callback, at the run's first
        tell its placement (a probe runs), and at every unpack fetch what the window reaches
        (Note [fetch per saved tensor], actoff.runtime.fetch)."""
        step, runtime = self.step, self.runtime
        if not step.backward_started:
            step.backward_started = True
            runtime.auto.backward_starts(self)
        arena = runtime.arenas.on_device.get(self.device)
        if arena is not None:
            arena.unpacked()  # the tenants that die from now to the next unpack are a wave
        if not step.callback_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: runtime.end_backward(step))
                step.callback_queued = True
            except RuntimeError:
                pass  # unpacked outside a backward pass (e.g. grad_fn._saved_self)
        step.fetches.unpacking(self, record, runtime.orders)
        if not self.window_issued:
            self.window_issued = True
            runtime.auto.prefetched(self)  # the prefetches' buffers are taken now
            self.placement.reached()

    def stream_out(self, record: Record) -> None:
        """``record``'s copy out starts now, not at the scope's exit (Note [copy out at pack])."""
        with self.runtime.lock:
            step = self.step
            self.placement.tier.place(record)
            if not self.streaming:
                self.streaming = True
                step.in_flight.append(self)
            if record.state is State.OFFLOADING and record.device_tensor is not None:
                step.outbound.append(record)
            window = self.copy_window_bytes()
            # A token mixer's saves wait for its end: its time is attention's, not the copies'.
            step.copies_out(None if self.placement.in_mixer else window, waiting=self)

    def copy_window_bytes(self) -> int | None:
        """The bytes forward may have copying out (Note [copy out at pack]): the step's (the auto
        policy's plan), else the setting's; None: no cap."""
        step = self.step
        return step.copy_window if step.copy_window is not None else self.config.copy_window

    def fetch_limits(self) -> tuple[int, int | None]:
        """How far backward fetches ahead from this run: ``(depth, None)`` in runs, or ``(0, bytes)``
        (Note [fetch per saved tensor]); the auto policy's plan sets the step's."""
        step, config = self.step, self.config
        window = step.window if step.window is not None else config.fetch_window
        if window is not None and step.depth is None:
            return 0, window
        return (config.prefetch_depth if step.depth is None else step.depth), None

    def released(self) -> None:
        """One of the run's records was released (the runtime's lock held): at the last, the
        device arena lets go of the run's buffers (Note [a buffer per wave])."""
        self.live -= 1
        if self.live == 0 and self.step is self.runtime.step:  # not an older step's run
            self.runtime.arenas.run_done(self.device, self.index)

    def all_records(self) -> tuple[Record, ...]:
        """The run's records and any a tier made for it (a token-wise run's packed rows)."""
        return self.placement.records()

    # ------------------------------------------------------------------ for the tiers
    # Note [tiers see a view of their run] (actoff.tiers.run_view): what follows is the `RunView`.
    @property
    def step_number(self) -> int:
        return self.step.number

    def arena(self) -> HostArena:
        """The host arena of this run's device."""
        return self.runtime.arena(self)

    def device_buffer(self, numel: int, dtype: torch.dtype, key: tuple) -> torch.Tensor:
        """A 1-D device tensor for a copy back or a token-wise rebuild of ``key`` (what, record
        index): from the device arena where there is one (actoff.memory.device_arena), else new."""
        arena = self.runtime.arenas.device_arena(self.backend, self.config)
        if arena is not None:
            return arena.empty(numel, dtype, self.arena_key(*key), tag=self.index)
        return self.backend.device_empty(numel, dtype)

    # Note [a part per tensor fetched alone]: fetched one saved tensor at a time (a window in
    # bytes), each request to the device arena is a group of its own. Which requests one unpack
    # makes varies from step to step with the copies' timing, and a part's buffer, taken at its
    # first request, held the range of a request made an unpack later: a dead 2.8 MB range
    # through a streamed block's backward, the main run's auto out of memory at the floor that
    # streaming without the arena fits.
    def arena_key(self, what: str, *rest: Any) -> tuple:
        """The device arena's key of a request of this run: ``(run, group, *rest)``, the first two
        naming its part's group (actoff.memory.arenas.waves; Note [a part per tensor fetched
        alone])."""
        alone = what == "fetch" and self.fetch_limits()[1] is not None
        return (self.index, (what, *rest) if alone else what, *rest)

    def expect_device_buffer(self, record: Record) -> None:
        """A record served from the device this step may be fetched in another: the device
        arena expects it (`DeviceArena.expect`)."""
        arena = self.runtime.arenas.device_arena(self.backend, self.config)
        if arena is not None:
            arena.expect(self.arena_key("fetch", record.index))

    def store(self) -> NvmeStore:
        """The NVMe store of this run's settings."""
        return self.runtime.stores.get(self.config)

    def account(self, what: str, ticket: Ticket | None) -> None:
        """Add a copy's time to the run's figures now, or at the end of backward if in flight."""
        if ticket is None:
            return
        if ticket.query():
            setattr(self.stats, what, getattr(self.stats, what) + ticket.elapsed_ms())
        else:
            self.step.timings.append((self, what, ticket))

    def account_io(self, what: str, future: Any) -> None:
        """Add an NVMe request's time (the engine's, queueing excluded) to the run's figures."""
        setattr(self.stats, what, getattr(self.stats, what) + future.elapsed() * 1e3)

    def quarantine(self, *held: object) -> None:
        self.runtime.quarantine.append(held)

    def warn_once(self, key: str, message: str) -> None:
        self.runtime.warn_once(key, message)

    def host_refused(self, record: Record) -> bool:
        return spill_to_nvme(record) or self.placement.host_refused(record)

    def hold(self, tensor: torch.Tensor, nbytes: int) -> tuple[Record, object]:
        storage = tensor.untyped_storage().data_ptr()
        handle = self.handle_for(tensor, storage, nbytes)
        return handle.record, handle

    def adopt(self, record: Record) -> None:
        self.step.live += 1
        self.live += 1

    def release(self, record: Record) -> None:
        self.runtime.release(record)

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        stack = self.runtime.thread.stack
        stack.append(self)
        try:
            yield
        finally:
            stack.pop()
