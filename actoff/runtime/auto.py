"""The auto policy: measure the blocks, plan their placements under the device budget
(actoff.budget), check every step against the plan's prediction, and replan when it is off.

Note [measuring at recompute]: a block the auto policy has not measured under its conditions
(its module, input shapes, dtypes, autocast, training flags: Note [probes per module and
conditions]) runs its first `MEASURE_STEPS` steps at the token-wise ``recompute`` placement:
its inputs and what attention saves go to the host, and every token-local activation is
recomputed in backward. That is safe for a budget (one block's activations come back at a
time) and it sorts the bytes into the planner's classes, because the run knows which tensors
are the block's inputs, which attention saved and which the probe could split by token. It costs
those steps a token-local re-run of every block (about what the block's forward costs
outside attention) and the copies of the inputs and attention's saves. The ``checkpoint``
placement would hold less, but under it the forward saves nothing but the block's inputs: the
classes, and so the token-wise placements' costs, could not be measured. A block not yet probed
stores its first step whole and is probed in that step's backward (Note [probe in the first
backward]; the probe shrinks its slice when short of memory: Note [a probe short of memory]);
in that step a block's copies out finish before the next block runs
(`ScopeRun.stored_whole_to_measure`), so it holds one block's saves at a time, not two;
bytes by class come from the first step that splits, times from the second step on (the first
is cold: the probe's re-run, allocators and kernels warming up). Measuring steps fetch
nothing ahead in backward (prefetch depth 0): a block stored whole holds the most, and the
measuring steps must fit wherever the plan will.

Then each step's blocks, in forward order, are planned together (`actoff.budget.plan`): the
least added time whose predicted peak fits the budget, from each block's forward time and
attention's share of it, its bytes by class, the host link (``ACTOFF_HOST_BANDWIDTH`` or the
backend's measured copy rate) and the step's memory outside the blocks (Note [memory outside
the blocks] in actoff.budget). The plan holds for steps with the same blocks under the same
conditions; a step of other blocks or conditions (a new length) measures the blocks it has not
seen and gets its own plan. Every step that ran a plan is compared with its prediction: a peak
or a time off by more than `actoff.budget.REPLAN_TOLERANCE` replans from that step's figures
(the peak gives a new estimate of the memory outside the blocks; forward times keep the least
seen, since a step that stalls on copies shows them in its forward).

Note [calibrated plans]: the model of the peak (Note [the budget model] in actoff.budget) is
exact for the placements whose step gave the memory outside the blocks, and drifts the further
a plan's placements are from those (the device arena's buffers, transients in backward). So the
first plan, from the measuring steps, leaves `PLAN_HEADROOM` of the budget free, and once its
own step has run it is planned again from that step's peaks with `CALIBRATED_HEADROOM`; so is
every replan.

The budget is ``ACTOFF_GPU_BUDGET``, else the device's (`DeviceBackend.default_budget`). A
device without one (a plain CPU device) gets no plan: every block is kept, as ``keep`` would.
Where the device's memory is not counted the memory outside the blocks is taken as none: the
budget is then for what the blocks save.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actoff.budget import Placement
from actoff.owners import ByOwner

from .measured import AutoRun, BlockKey, Measured, figures, input_bytes, observe
from .placements.base import Call
from .placements.checkpoint import CheckpointPlacement
from .placements.tokenwise import TokenwisePlacement
from .placements.whole import KeptPlacement
from .planning import AutoPlans, Ended, StepPlan

if TYPE_CHECKING:
    from .placements.base import Placement as RunPlacement
    from .runtime import Runtime
    from .step import ScopeRun, Step

__all__ = ["MEASURE_STEPS", "AutoObserver", "StepPlan"]  # StepPlan: actoff.runtime.planning

#: Steps a block runs at the measuring placement under new conditions: one cold, one warm.
MEASURE_STEPS = 2
#: The measuring placement (Note [measuring at recompute]).
MEASURING = Placement("tokenwise", 0.0)
#: What a measuring block that cannot be split runs: stored whole.
STORED = Placement("tokenwise", 1.0)


@dataclass
class AutoStep:
    """The auto policy's part of one step: its runs per block key so far, and the device peaks of
    the forward and the head (Note [the budget model] in actoff.budget)."""

    seen: collections.Counter = field(default_factory=collections.Counter)
    peaks: list[int] = field(default_factory=lambda: [0, 0])


class AutoObserver(AutoPlans):
    """The auto policy in a runtime, an observer of its steps: it gives each run of a planned
    policy its placement (`placement_for`), measures the runs, and plans, checks and replans at
    the end of each step (`AutoPlans`). Its own state: measurements per block and conditions, the
    device's memory watch, and beside each run and step it observes, its part of them (Note
    [measuring at recompute])."""

    def __init__(self) -> None:
        super().__init__()
        self._runs: weakref.WeakKeyDictionary[ScopeRun, AutoRun] = weakref.WeakKeyDictionary()
        self._steps: weakref.WeakKeyDictionary[Step, AutoStep] = weakref.WeakKeyDictionary()
        self.blocks: ByOwner[dict[tuple, Measured]] = ByOwner()
        self._watches: dict[Any, Any] = {}  # backend -> memory watch (None: not counted)

    def watch(self, run: ScopeRun) -> Any:
        """The memory watch of the run's device (created at its first run), or None."""
        backend = run.backend
        if backend not in self._watches:
            self._watches[backend] = backend.memory_watch()
        return self._watches[backend]

    def sample(self, run: ScopeRun) -> None:
        """A point of the step's peak where the watch samples (CUDA); nothing on the simulated
        device, where every allocation counts."""
        watch = self.watch(run)
        if watch is not None:
            watch.sample()

    def forward_starts(self, run: ScopeRun, call: Call) -> None:
        """A run's forward starts: its input bytes taken while it measures, its forward and its
        token mixers' calls timed."""
        state = self._runs.get(run)
        if state is None:
            return
        if state.placement is None:
            state.input_bytes = input_bytes(run, call.flattened(run.device, run.config.token_dim).values)
        state.forward_watch = run.backend.stopwatch().start()
        run.placement.time_mixers()

    def forward_ends(self, run: ScopeRun) -> None:
        state = self._runs.get(run)
        if state is not None and state.forward_watch is not None:
            state.forward_watch.stop()

    def sealing(self, run: ScopeRun) -> None:
        """A run's placement decided what to place: its bytes by class are taken, and while it
        measures stored whole its copies out finish before the next block runs, not alongside
        it, so that step holds one block's saves at a time, as the checkpoint placement does
        (Note [measuring at recompute])."""
        state = self._runs.get(run)
        if state is None:
            return
        state.classes = run.placement.saved_by_class(state.input_bytes)
        if state.placement is None:
            run.placement.finish_copies_first = not run.placement.splits

    def sealed(self, run: ScopeRun) -> None:
        """A run's forward ended: the forward's peak so far is kept, and a new window opens (the
        one after the last block's is the head's)."""
        watch = self.watch(run) if run in self._runs else None
        if watch is not None:
            watch.sample()
            peaks = self._steps[run.step].peaks
            peaks[0] = max(peaks[0], watch.peak)
            watch.reset()

    def backward_starts(self, run: ScopeRun) -> None:
        """Backward reached its first run: the head's window closes, backward's opens."""
        step = self._steps.get(run.step)
        watch = self.watch(run) if step is not None and step.seen else None
        if watch is not None:
            watch.sample()
            step.peaks[1] = watch.peak
            watch.reset()

    def prefetched(self, run: ScopeRun) -> None:
        """A run's backward fetched the runs before it: their buffers are taken now."""
        if run in self._runs:
            self.sample(run)

    def _moments(self, run: ScopeRun, step: Step) -> tuple[int, int, int] | None:
        """The step's peaks at the moments of Note [the budget model] (the last forward's window
        stands for the forward: every block's forward is one), or None where not counted."""
        watch = self.watch(run)
        if watch is None:
            return None
        watch.sample()
        forward, head = self._steps[step].peaks
        moments = (forward, head if head else watch.peak, watch.peak)
        watch.reset()
        return moments if watch.counted() else None

    def placement_for(self, run: ScopeRun, call: Call) -> RunPlacement:
        """A new run's placement: its plan's, measuring (token-wise, nothing stored: Note
        [measuring at recompute]) while its block has none, or kept where no budget applies. The
        step's first planned run sets its prefetch depth."""
        self.sample(run)
        if self.budget(run) is None:
            return KeptPlacement(run)  # no budget: nothing to fit
        key = BlockKey(call.owner, call.flattened(run.device, run.config.token_dim).conditions)
        by_conditions = self.blocks.setdefault(key.owner, dict)
        entry = by_conditions.get(key.conditions)
        if entry is None:
            entry = by_conditions[key.conditions] = Measured(run.name)
        step = self._steps.setdefault(run.step, AutoStep())
        if not step.seen:  # measuring: nothing fetched ahead (Note [measuring at recompute])
            run.step.depth = entry.depth if entry.placements else 0
        occurrence = step.seen[key.ident]
        step.seen[key.ident] += 1
        placement, fractions = None, None
        if occurrence < len(entry.placements):
            placement, fractions = entry.placements[occurrence], entry.fractions[occurrence]
        self._runs[run] = AutoRun(weakref.ref(run), key, placement, fractions)
        if placement is None or placement.kind == "tokenwise":
            return TokenwisePlacement(run, planned=fractions)
        return KeptPlacement(run) if placement.kind == "keep" else CheckpointPlacement(run)

    # ------------------------------------------------------------------ end of a step
    def end_step(self, runtime: Runtime, step: Step) -> None:
        """After the step's backward: take its measurements, then plan, compare or replan."""
        states = [self._runs[run] for run in step.runs if run in self._runs]
        if not states or step.aborted:
            return
        ended = self._measured_step(states, step)
        if ended is None:
            figures(states, None)
            return  # still measuring
        step.harvest(block=True)  # the copies' and stalls' times of this step
        self.plan_step(runtime, ended)

    def _measured_step(self, states: list[AutoRun], step: Step) -> Ended | None:
        """The step's measurements taken into its blocks'; None while a block still measures."""
        moments = self._moments(states[0].run, step)
        entries = [self.blocks.get(state.key.owner)[state.key.conditions] for state in states]
        counted: set[int] = set()
        for state, entry in zip(states, entries, strict=True):
            if id(entry) not in counted:  # once a step, however often the block ran
                counted.add(id(entry))
                entry.steps += 1
            observe(entry, state)
        if not all(entry.ready for entry in entries):
            return None
        ran = tuple(
            state.placement if state.placement is not None else MEASURING if entry.tokenwise else STORED
            for state, entry in zip(states, entries, strict=True)
        )
        keys = tuple(state.key.ident for state in states)
        return Ended(states, entries, keys, ran, step.depth, moments)
