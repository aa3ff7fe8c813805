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
from actoff.tiers.record import Record, State

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
        self.last_placed: ScopeRun | None = None
        self.live = 0  # records not yet released
        self.timings: list[tuple[ScopeRun, str, Ticket]] = []  # copies to time at the end
        self.backward_started = False
        self.callback_queued = False
        self.aborted = False
        # Runs prefetched ahead of the one backward is in, for the whole step: the auto policy's
        # plan (actoff.runtime.auto); None: each run's own ``prefetch_depth``.
        self.depth: int | None = None

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
        waited for (stream-side, no host stall) when the next run is placed.
        """
        still: list[ScopeRun] = []
        for run in self.in_flight:
            force = run is not self.last_placed or run.placement.finish_copies_first
            busy = False
            for record in run.all_records():
                if record.state is State.OFFLOADING:
                    record.check_version()  # the copy out may have read a changed tensor
                    record.tier.advance(record, force=force, finish=finish)
                    busy = busy or record.state is State.OFFLOADING
            if busy:
                still.append(run)
        self.in_flight = still


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
        self.records: list[Record] = []
        self.dedup: dict[tuple, tuple[Any, weakref.ref]] = {}  # key -> (packed, its tensor's root)
        # (storage, dtype, version) -> the first record of it in the run, its span in the storage
        # and its tensor's root, weakly (Note [views of one storage], actoff.runtime.hooks).
        self.spans: dict[tuple, tuple[Handle | None, int, int, weakref.ref]] = {}
        self.stats = BlockStats(name, calls=1)
        self.live = 0  # records not yet released
        self.fetch_issued = False
        self.window_issued = False  # the runs before it prefetched (at its first unpack)
        self.fetching: list[Record] = []  # records the prefetch left FETCHING, for `poll`
        # What its saved tensors become (Note [placements]): set by the runtime as it opens the run.
        self.placement: Placement = None  # type: ignore[assignment]

    def reached(self) -> None:
        """Backward unpacks this run (the runtime's lock held): at its first unpack queue the
        end-of-backward callback, bring back this run's records and prefetch the records of the
        ``step.depth`` runs before it; later, move those prefetches on."""
        step = self.step
        if not step.backward_started:
            step.backward_started = True
            self.runtime.auto.backward_starts(self)
        arena = self.runtime.arenas.on_device.get(self.device)
        if arena is not None:
            arena.unpacked()  # the tenants that die from now to the next unpack are a wave
        if not step.callback_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self.runtime.end_backward(step)
                )
                step.callback_queued = True
            except RuntimeError:
                pass  # unpacked outside a backward pass (e.g. grad_fn._saved_self)
        if not self.fetch_issued:
            self.prefetch()
        depth = self.config.prefetch_depth if step.depth is None else step.depth
        window = step.runs[max(0, self.index - depth) : self.index]
        if not self.window_issued:
            self.window_issued = True
            for run in reversed(window):  # the next one backward reaches first
                if not run.fetch_issued:
                    run.prefetch()
            self.runtime.auto.prefetched(self)  # the prefetches' buffers are taken now
            self.placement.reached()
        else:
            for run in reversed(window):
                run.poll()

    def released(self) -> None:
        """One of the run's records was released (the runtime's lock held): at the last, the
        device arena lets go of the run's buffers (Note [a buffer per wave])."""
        self.live -= 1
        if self.live == 0 and self.step is self.runtime.step:  # not an older step's run
            self.runtime.arenas.run_done(self.device, self.index)

    def all_records(self) -> tuple[Record, ...]:
        """The run's records and any a tier made for it (a token-wise run's packed rows)."""
        return self.placement.records()

    def prefetch(self) -> None:
        """Start bringing back every offloaded record not still alive elsewhere (once a step).

        Note [forward what is still on the device]: a record whose copy out is still under way
        when backward starts (the last runs placed) keeps its device tensor and is served from
        it: finishing the copy now would drop the tensor only to copy it back. It also keeps
        the device arena's requests the same from step to step, whenever the copies end.
        """
        self.fetch_issued = True
        self.fetching = []
        fetched = []
        for record in self.all_records():
            if record.state is State.OFFLOADING:
                record.tier.settle(record)  # a staged write that has ended since: finish it
            if record.state is State.OFFLOADED and record.live_source() is None:
                fetched.append(record)
            elif record.state is State.OFFLOADING and record.device_tensor is not None:
                self._expect_device_buffer(record)
        # The device arena hears of every record forwarded before the first fetch: it sizes the
        # run's buffers to what is fetched (Note [skipped requests], actoff.memory.device_arena).
        for record in fetched:
            record.tier.fetch(record)
            if record.state is State.FETCHING:
                self.fetching.append(record)

    def poll(self) -> None:
        """Move this run's prefetches on without waiting (see `Tier.poll`). Called at every
        unpack of the next run: it visits only the prefetches still in flight, not every record
        (the profile of a CPU step showed the full loop as actoff's largest cost there)."""
        if self.fetching:
            self.fetching = [record for record in self.fetching if record.state is State.FETCHING]
            for record in self.fetching:
                record.tier.poll(record)

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
            return arena.empty(numel, dtype, (self.index, *key), tag=self.index)
        return self.backend.device_empty(numel, dtype)

    def _expect_device_buffer(self, record: Record) -> None:
        """A record served from the device this step may be fetched in another: the device
        arena expects it (`DeviceArena.expect`)."""
        arena = self.runtime.arenas.device_arena(self.backend, self.config)
        if arena is not None:
            arena.expect((self.index, "fetch", record.index))

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
