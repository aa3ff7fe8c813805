"""Runtime: the step lifecycle. It drives scope runs through placement, backward and release.

Data flow of one step (the README's "How it works" has the map of modules):
1. Forward inside a scope: `call` opens a `ScopeRun` (actoff.runtime.step) with the placement the
   policy table names (Note [placements], actoff.runtime.placements.base; under ``auto``, the
   one its plan gives the run: actoff.runtime.auto). Its pack hook turns each saved tensor into a
   `Handle` to a `Record`. Nothing is copied yet.
2. Scope exit: the run is sealed (its placement decides) and queued; once it is more than
   ``keep_last`` runs old it is placed and its records' tiers start the copies out
   (actoff.tiers.base); `Step.progress` finishes them, MEMO's double buffering.
3. Backward: the first unpack in a run fetches all of that run's records and prefetches those
   of the ``prefetch_depth`` runs before it; unpack waits on exactly the record it serves.
4. End of backward (autograd final callback): device copies kept for ``retain_graph`` are
   evicted, the auto policy measures, plans or replans (actoff.runtime.auto), ranks agree
   (actoff.runtime.distributed), statistics are published, the host arena is laid out for the
   next steps (actoff.memory.arenas); the replay allocator's window ends (actoff.memory.replay_steps).

A record is released when autograd drops its handle (after its last use, or when a retained
graph is freed): ``retain_graph=True`` and partial backward passes need no special case.

Note [a runtime per thread]: a runtime's step is one training loop's forward until its
backward ends, so each thread that enters a scope gets a runtime of its own (`get_runtime`):
its step, arenas, NVMe store, statistics and probe results. Shared, two threads' forwards
would join one step, and one backward's end would evict the other's rows mid-rebuild. Records
know their run, so a backward on another thread (autograd's on CUDA) reaches the right one;
what a thread's scopes nest in (`thread_state`) stays per thread. After ``os.fork()`` the
child starts with no runtime (`_fresh_in_child`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from actoff.config import Config
from actoff.device.base import backend_for
from actoff.device.sim.device import settings_for
from actoff.memory.arenas import Arenas
from actoff.memory.host_arena import HostArena
from actoff.memory.replay_steps import ReplayDrivers
from actoff.owners import ByOwner, Recent
from actoff.params import learned, param_storages
from actoff.planner import Layout
from actoff.policy import budget_share, runs_to_place, spec
from actoff.tiers.nvme.store import StoreRegistry
from actoff.tiers.record import Record, State
from actoff.tiers.tokenwise.probes import ModuleProbes

from .arguments import find_device
from .auto import MEASURE_STEPS, AutoObserver
from .distributed import agree_on_auto, agree_with_rank0, local_world_size
from .enclosing import enclosing, warn_enclosed
from .hooks import unpack
from .lock import RuntimeLock
from .placements import Call, Placement, placement_class
from .stats import BlockStats, Stats, collect, snapshot, window_figures
from .step import ScopeRun, Step

__all__ = ["Runtime", "find_device", "get_runtime", "let_go_landed", "reset_runtimes", "thread_state"]


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[ScopeRun] = []  # the runs this thread's scopes are inside
        self.disabled = 0  # no_offload() depth


#: Per thread, whatever the runtime (Note [a runtime per thread]).
thread_state = _ThreadState()


class Runtime:
    """A training thread's state: the current step, host arenas, NVMe stores and what was
    learned (Note [a runtime per thread])."""

    def __init__(self) -> None:
        # Note [releases from the collector]; it calls `_release` holding the lock
        self.lock = RuntimeLock(lambda record: self._release(record))
        self.thread = thread_state
        self.in_parent = False  # made before os.fork(), seen from the child (`_fresh_in_child`)
        self.step: Step | None = None
        self.steps_started = 0
        self.steps_completed = 0
        self.last_runs: int | None = None  # runs of the step before (`_streams`)
        self.arenas = Arenas()  # host arenas by device backend
        self.last_stats: dict[str, BlockStats] = {}
        self.last_windows: dict[str, int | None] = {}  # `window_figures` of the last step
        # What probes learned, per module by identity (Note [probes per module and conditions])
        self.probe_results: ByOwner[ModuleProbes] = ByOwner()
        self.auto = AutoObserver()  # the auto policy: measurements, plans, each run's placement
        self.quarantine: list[tuple] = []  # Note [hung I/O]: memory and extents never reused
        self.layouts: dict[str, Layout] = {}  # trace signature -> host arena layout
        self.orders: Recent[tuple, list] = Recent(16)  # step shape -> backward's unpack order
        self.bandwidths: dict[torch.device, float] = {}  # measured host link, bytes/s
        self._warned: set[str] = set()
        self.stores = StoreRegistry()
        self.replay = ReplayDrivers()  # the replay allocator's windows, one per step

    # ------------------------------------------------------------------ forward
    def call(
        self,
        name: str,
        config: Config,
        module: torch.nn.Module | None,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` as an offload scope (or pass through, see `passes_through`)."""
        if self.passes_through(module):
            return fn(*args, **kwargs)
        call = Call(fn, args, kwargs, module)
        run = self.enter_scope(name, config, module, find_device(args, kwargs, module), call)
        try:
            run.placement.capture(call)
            self.auto.forward_starts(run, call)
            with _saving(run, module):
                output = run.placement.forward(call)
            self.auto.forward_ends(run)
        except BaseException:
            self.exit_scope(run, failed=True)
            raise
        self.exit_scope(run, failed=False)
        return output

    def exit_scope(self, run: ScopeRun, failed: bool) -> None:
        """Close the current run: sealed and queued for placement, or aborted (an exception)."""
        self.thread.stack.pop()
        if failed:
            self._abort(run)
        else:
            self._seal(run)

    def passes_through(self, module: torch.nn.Module | None) -> bool:
        """Nested scopes, ``no_offload()`` and ``torch.no_grad()`` run untouched; so do scopes
        inside another saved-tensor hooks context (torch's checkpoint) or called during backward,
        with one warning per kind (Note [under checkpointing]). Eval mode with gradients on is
        placed as training is: RL and distillation loops train in eval mode (dropout off), and
        what autograd saves there needs the same room."""
        if self.thread.stack or self.thread.disabled or not torch.is_grad_enabled():
            return True
        context = enclosing()
        if context is None:
            return False
        warn_enclosed(self.warn_once, module, context)
        return True

    def enter_scope(
        self,
        name: str,
        config: Config,
        module: torch.nn.Module | None,
        device: torch.device,
        call: Call | None = None,
    ) -> ScopeRun:
        """Open a run as the thread's current one (`exit_scope` closes it); the caller checked
        `passes_through` and installs the hooks (`call`; actoff.scope.compile: Note [compile]).
        Without a ``call`` (a compiled body, which no placement can run again) a placement that
        would re-run the block gives way to the policy's whole-tier one."""
        with self.lock:
            step = self._step_for(module, device, config)
            backend = backend_for(
                device, settings_for(config.sim_device, config.sim_device_memory, config.sim_device_bandwidth)
            )
            run = ScopeRun(self, step, name, config, backend, param_storages(module))
            run.place(self._placement(run, call))
            step.runs.append(run)
        self.thread.stack.append(run)
        return run

    def _step_for(self, module: torch.nn.Module | None, device: torch.device, config: Config) -> Step:
        """The step a scope call joins, begun anew after a backward began, after an aborted
        forward, or when a module scope comes round again (a forward without backward between)."""
        step = self.step
        module_id = id(module) if module is not None else None
        if (
            step is None
            or step.backward_started
            or step.aborted
            or (module_id in step.modules and step.live == 0)
        ):
            if step is not None:  # finish its copies: their sources can go now
                self.last_runs = len(step.runs)
                step.last_placed = None
                step.progress()
                step.harvest(block=True)  # long done: a whole step ran since
            self._publish(step)
            self.replay.begin(device, config.allocator, self.warn_once)
            self.arenas.begin_step()
            step = self.step = Step(self.steps_started)
            self.steps_started += 1
        if module_id is not None:
            step.modules.add(module_id)
        return step

    def _placement(self, run: ScopeRun, call: Call | None) -> Placement:
        """The run's placement: the policy table's (Note [the policy table]), or under a planned
        policy the plan's (actoff.runtime.auto)."""
        entry = spec(run.config.policy)
        if entry.planned and call is not None:
            placement = self.auto.placement_for(run, call)
        else:
            kind = None if entry.planned else placement_class(entry.placement)
            if kind is None or (call is None and kind.needs_call):
                kind = placement_class("whole")
            placement = kind(run)
        if placement.streams_out and not self._streams(run):
            placement.streams_out = False
        return placement

    def _streams(self, run: ScopeRun) -> bool:
        """Whether ``run``'s copies out may start at pack (Note [copy out at pack]): not on a host
        device (nothing to copy), nor for the last ``keep_last`` runs of the step (counted on the
        step before: until one has run, none streams)."""
        keep_last = run.config.keep_last
        if run.backend.host_resident:
            return False
        return keep_last == 0 or (self.last_runs is not None and run.index < self.last_runs - keep_last)

    def _abort(self, run: ScopeRun) -> None:
        # An exception inside the scope: nothing is copied; the records stay resident and
        # are released when the partial graph holding their handles is freed.
        with self.lock:
            run.dedup.clear()
            run.spans.clear()
            run.placement.aborted()
            run.step.aborted = True
            run.step.pending.clear()  # never placed now: their graph is being torn down

    def _seal(self, run: ScopeRun) -> None:
        with self.lock:
            run.dedup.clear()  # Note [pack is hot]: the handles now live in autograd only
            run.spans.clear()
            unneeded = run.placement.seal()
            self.auto.sealing(run)
        del unneeded  # outside the lock: released at once, never placed (no copy out)
        with self.lock:
            step = run.step
            if not run.placement.keeps_as_is:
                step.pending.append(run)
                for _ in range(runs_to_place(len(step.pending), run.config.keep_last)):
                    self._place(step.pending.popleft())
            step.progress()
            self.auto.sealed(run)  # placed: what it let go of is not the head's

    def _place(self, run: ScopeRun) -> None:
        for record in run.records:
            record.check_version()  # the copies out are about to read them
        run.placement.place()
        run.step.in_flight.append(run)
        run.step.last_placed = run

    def flush(self) -> None:
        """Finish every copy out of the current step (writes included) before returning."""
        with self.lock:
            step = self.step
            if step is None:
                return
            step.last_placed = None  # nothing is exempt: force all
            step.progress(finish=True)

    # ------------------------------------------------------------------ backward
    def unpack(self, record: Record) -> torch.Tensor:
        """Serve a saved tensor to autograd (called from the backward threads)."""
        if self.in_parent:
            raise RuntimeError(
                f"actoff: a saved activation of block {record.run.name!r} was made by the parent "
                "process before os.fork(); its bytes (host memory, the NVMe file) are the parent's. "
                "Run backward in the process that ran the forward pass."
            )
        with self.lock:
            run = record.run
            run.reached(record)
            record.check_version()
            tensor = run.step.fetches.serve(record)
            run.step.fetches.consumed(record)
            return tensor

    def end_backward(self, step: Step) -> None:
        """Autograd's final callback of a backward that unpacked ``step`` (`ScopeRun.reached`)."""
        with self.lock:
            step.callback_queued = False
            # Copies still running are timed when the next step begins (the host never waits).
            step.harvest(block=False)
            self.auto.end_step(self, step)
            for run in step.runs:
                for record in run.all_records():
                    # Kept for retain_graph: drop the device copy; the stored copy stays.
                    record.tier.evict(record)
                    record.unpacks = 0
                run.fetch_issued = run.window_issued = False
                run.placement.backward_ended()
            trace = step.fetches.ended()
            if trace:  # Note [fetch per saved tensor]: the next step of this shape fetches in this order
                self.orders[step.fetches.signature()] = trace
            self.steps_completed += 1
            if self.steps_completed == 1:  # Note [one agreement]
                agree_with_rank0(self.layouts, lambda: self._publish(step))
            if self.steps_completed == MEASURE_STEPS:
                agree_on_auto(self.auto)
            self._publish(step)
            self.replay.end(self.warn_once)  # last: it may raise what the allocator recorded

    def release(self, record: Record) -> None:
        """Return everything a record holds (Note [releases from the collector]: when)."""
        with self.lock:
            self._release(record)

    def _release(self, record: Record) -> None:
        if record.state is State.RELEASED or self.in_parent:  # the parent's: leaked in a child
            return
        record.tier.release(record)
        record.state = State.RELEASED  # from any other state (the transitions allow it)
        step = record.run.step
        step.live -= 1
        step.fetches.let_go(record)
        record.run.released()
        record.run.placement.released(record)
        if step.live == 0 and (step.backward_started or step.aborted or self.step is not step):
            # Nothing of the step can run again now: what re-runs would need goes.
            for done in step.runs:
                done.placement.let_go()
            self.arenas.records_back(record.run.device, current=self.step is step)

    # ------------------------------------------------------------------ resources and figures
    def arena(self, run: ScopeRun) -> HostArena:
        """The host arena of ``run``'s device, under the budget of the config in force (shared
        by the ranks on this host)."""
        budget = budget_share(run.config.host_budget, local_world_size())
        return self.arenas.for_device(run.backend, run.config, budget)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _publish(self, step: Step | None) -> None:
        if step is None or not step.runs:
            return
        self.last_stats = collect(step)
        self.last_windows = window_figures(step)
        if step.live == 0:
            self.arenas.consolidate()
            self.arenas.plan(step.runs[0].config, self.layouts)

    def stats(self) -> Stats:
        with self.lock:
            blocks = self.last_stats
            step = self.step
            if step is not None and step.runs and (step.timings or not step.backward_started):
                step.harvest(block=True)  # asked for figures: wait for the copies timed
                blocks, windows = collect(step), window_figures(step)
                if step.backward_started:
                    self.last_stats, self.last_windows = blocks, windows
            else:
                windows = self.last_windows
            return snapshot(blocks, self.steps_completed, self.arenas, self.stores, self.auto, windows)

    def close(self) -> None:
        """Forget the step, statistics and host arenas; close NVMe stores (removing their files)."""
        with self.lock:
            self.step = None
            self.last_stats, self.last_windows = {}, {}
            self.steps_started = self.steps_completed = 0
            # Slots still held by live graphs keep their chunk alive; a dropped arena waits for
            # the copies that still touch returned ones (HostArena's finalizer).
            self.arenas = Arenas()
            self.probe_results, self._warned = ByOwner(), set()
            self.auto, self.layouts, self.orders = AutoObserver(), {}, Recent(16)
            self.stores.close()
            self.replay.close()


class _Local(threading.local):
    runtime: Runtime | None = None


_local = _Local()
_runtimes: weakref.WeakSet[Runtime] = weakref.WeakSet()  # for `reset_runtimes`
_runtimes_lock, _parents = threading.Lock(), []  # _parents: in a forked child, leaked on purpose


def get_runtime() -> Runtime:
    """The calling thread's runtime, made on first use (Note [a runtime per thread])."""
    runtime = _local.runtime
    if runtime is None:
        runtime = _local.runtime = Runtime()
        with _runtimes_lock:
            _runtimes.add(runtime)
    return runtime


def let_go_landed() -> None:
    """`Step.let_go_landed` for the calling thread's runtime's step, if it has one (Note [let go
    as copies land] in actoff.runtime.step): the tiled modules and the chunked loss call it at each
    chunk.

    >>> let_go_landed()  # no step in flight: nothing to do
    """
    runtime = _local.runtime
    if runtime is not None and runtime.step is not None:
        runtime.step.let_go_landed(runtime.lock)


def reset_runtimes() -> None:
    """`Runtime.close` every thread's runtime (`actoff.reset`)."""
    with _runtimes_lock:
        runtimes = list(_runtimes)
    for runtime in runtimes:
        runtime.close()


def _fresh_in_child() -> None:
    """In a forked child: the parent's runtimes are left as they are, never closed or waited
    for (their locks may be copied held; their engines are the parent's: Note [engines across
    fork]); their records leak (unpacking one raises); the child makes its own runtime."""
    global _runtimes_lock
    _runtimes_lock = threading.Lock()  # the old one may have been copied held
    for runtime in list(_runtimes):
        runtime.in_parent = True
        runtime.lock = RuntimeLock(lambda record: None)  # releases from the collector: no-ops
        _parents.append(runtime)  # never collected here: nothing of theirs is torn down
    _runtimes.clear()
    _local.runtime = None


os.register_at_fork(after_in_child=_fresh_in_child)


@contextlib.contextmanager
def _saving(run: ScopeRun, module: torch.nn.Module | None) -> Iterator[None]:
    """Around a block's forward: the run's saved-tensor hooks, and for a function scope the
    parameters of the modules it runs learned as it runs them (`actoff.params.learned`); first,
    the copies out that landed let go (Note [let go as copies land] in actoff.runtime.step)."""
    run.step.let_go_landed(run.runtime.lock)
    with torch.autograd.graph.saved_tensors_hooks(run.pack, unpack), learned(run.param_storages, module):
        yield
