"""The auto policy: measure the blocks, plan their placements and the step's windows under the
device budget (actoff.budget, actoff.fitting), check every step against the plan's prediction,
and replan when it is off.

Note [measuring at the floor]: a block the auto policy has not measured under its conditions (its
module, input shapes, dtypes, autocast, training flags: Note [probes per module and conditions])
runs its first `MEASURE_STEPS` steps at the least device memory any plan can reach: every saved
tensor copied out as it is saved and fetched back at its own unpack (`MeasuringPlacement`: the
``stream`` placement with windows of none, Note [copy out at pack], Note [fetch per saved
tensor]). Those steps fit wherever a plan will, down to the floor of PyTorch's ``save_on_cpu``;
they sort the bytes into the planner's classes (the run knows which tensors are the block's
inputs and which its token mixers saved), watch the forward for collectives and inputs written
in place (which close ``checkpoint``), and time the forward less its waits for copies. Times come
from the second step on (the first is cold: allocators and kernels warming up).

Token-wise recompute needs a probe (Note [probe in the first backward]), and a probe holds a
block's saves whole in backward: so the first plan has no ``tokenwise`` placement, and where it
offloads and the budget has room for a probe (a block's saves and half of them again, over the
memory outside the blocks) the next step probes its blocks (`PROBE`: stored whole, probed in
backward, each block's copies out finished before the next runs), after which the blocks are
planned again with what the probes learned.

Then each step's blocks, in forward order, are planned together (`actoff.fitting.plan`): the
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

from actoff.budget import PLAN_HEADROOM, BlockCost, Placement, Windows, least
from actoff.owners import ByOwner, Recent

from .lengths import Ahead, new_entry, plan_ahead
from .measured import PROBE, AutoRun, BlockKey, Measured, figures, input_bytes, observe, stand_in_forwards
from .placements.base import Call
from .placements.checkpoint import CheckpointPlacement
from .placements.chunked import ChunkedPlacement
from .placements.measuring import MeasuringPlacement
from .placements.tokenwise import TokenwisePlacement
from .placements.whole import KeptPlacement, WholePlacement
from .planning import AutoPlans, Ended, StepPlan

if TYPE_CHECKING:
    from actoff.device.base import Stopwatch

    from .placements.base import Placement as RunPlacement
    from .placements.chunk_attention import Watch
    from .runtime import Runtime
    from .step import ScopeRun, Step

__all__ = ["MEASURE_STEPS", "AutoObserver", "StepPlan"]  # StepPlan: actoff.runtime.planning

#: Steps a block runs at the measuring placement under new conditions: one cold, one warm.
MEASURE_STEPS = 2
#: What the measuring steps run (Note [measuring at the floor]): the stream placement, no windows.
MEASURING = Placement("stream")
#: What a measuring step that ran blocks again (a small host budget) is described as.
MEASURED_AGAIN = Placement("checkpoint")
#: A measured run that went on in chunks (Note [measuring where only chunks fit]).
CHUNKED = Placement("chunked")


@dataclass
class AutoStep:
    """The auto policy's part of one step: its runs per block key so far, and the device peaks of
    the forward and the head (Note [the budget model] in actoff.budget)."""

    seen: collections.Counter = field(default_factory=collections.Counter)
    peaks: list[int] = field(default_factory=lambda: [0, 0])
    ahead: Ahead | None = None  # planned before it ran (Note [other lengths planned ahead])
    ended: bool = False  # its first backward ended (a retained graph's next ones are not measured)
    # From its first block's forward (Note [a plan tried against its runner-up]).
    watch: Stopwatch | None = None


class AutoObserver(AutoPlans):
    """The auto policy in a runtime, an observer of its steps: it gives each run of a planned
    policy its placement (`placement_for`), measures the runs, and plans, checks and replans at
    the end of each step (`AutoPlans`). Its own state: measurements per block and conditions, the
    device's memory watch, and beside each run and step it observes, its part of them (Note
    [measuring at the floor])."""

    def __init__(self) -> None:
        super().__init__()
        self._runs: weakref.WeakKeyDictionary[ScopeRun, AutoRun] = weakref.WeakKeyDictionary()
        self._steps: weakref.WeakKeyDictionary[Step, AutoStep] = weakref.WeakKeyDictionary()
        self.blocks: ByOwner[dict[tuple, Measured]] = ByOwner()
        self._watches: dict[Any, Any] = {}  # backend -> memory watch (None: not counted)
        # The last measured step's blocks: owner ids and figures (Note [other lengths planned ahead]).
        self.last_step: list[tuple[int, Measured]] = []

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
        """A run's forward ended (called once more after a measured forward that went on in chunks)."""
        state = self._runs.get(run)
        if state is not None and state.forward_watch is not None and not state.forward_timed:
            state.forward_watch.stop()
            state.forward_timed = True

    def only_chunks_fit(self, run: ScopeRun, survey: Watch) -> bool:
        """Whether a measured run goes on in chunks (Note [measuring where only chunks fit] in
        actoff.runtime.placements.measuring): the device's peak in the block's forward and attention's
        node go over the budget less `PLAN_HEADROOM`, and the chunked placement holds less than
        streaming."""
        state, budget, memory = self._runs.get(run), self.budget(run), self.watch(run)
        tokens, chunk = survey.seq_len, run.config.chunk_tokens
        if state is None or budget is None or memory is None or not memory.counted() or chunk >= tokens:
            return False
        entry = self.blocks.get(state.key.owner).get(state.key.conditions)
        if entry is None or entry.chunk_refusal:
            return False  # a probe refused it in an earlier measuring step
        saved = sum(record.geometry.nbytes for record in run.records)
        inputs = min(state.input_bytes, saved)
        kv, node = survey.kv_bytes, survey.node_bytes
        cost = BlockCost(
            0.0, 0.0, inputs, 0, saved - inputs, chunk_share=chunk / tokens, kv_bytes=kv, node_bytes=node
        )
        memory.sample()
        streamed = memory.peak + node  # the block's forward window, and its node back whole
        return least(cost) == CHUNKED and streamed > (1.0 - PLAN_HEADROOM) * budget

    def sealing(self, run: ScopeRun) -> None:
        """A run's placement decided what to place: its bytes by class are taken, and while it
        probes (stored whole) its copies out finish before the next block runs, not alongside
        it, so that step holds one block's saves at a time (Note [measuring at the floor])."""
        state = self._runs.get(run)
        if state is None:
            return
        state.classes = run.placement.saved_by_class(state.input_bytes)
        if state.placement is PROBE:
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
        """A new run's placement: its plan's, measuring (Note [measuring at the floor]) while its
        block has none, probing where a probe is due, or kept where no budget applies. The step's
        first planned run sets the step's windows."""
        self.sample(run)
        if self.budget(run) is None:
            return KeptPlacement(run)  # no budget: nothing to fit
        key = BlockKey(call.owner, call.flattened(run.device, run.config.token_dim).conditions)
        by_conditions = self.blocks.setdefault(key.owner, Recent)
        entry = by_conditions.get(key.conditions)
        if entry is None:  # another length's figures, scaled (Note [other lengths planned ahead])
            entry = by_conditions[key.conditions] = new_entry(run, call, by_conditions)
        step = self._steps.setdefault(run.step, AutoStep())
        if not step.seen:  # measuring and probing: windows of none (Note [measuring at the floor])
            step.watch = run.backend.stopwatch().start()
            windows = entry.windows if entry.placements and not entry.probe_next else Windows()
            if not entry.placements and not entry.probe_next:
                step.ahead = plan_ahead(self, run, call, entry, self.last_step)
                windows = step.ahead.plan.windows if step.ahead is not None else windows
            run.step.window, run.step.copy_window, run.step.depth = (
                int(windows.fetch),
                int(windows.copy),
                None,
            )
        position = sum(step.seen.values())
        occurrence = step.seen[key.ident]
        step.seen[key.ident] += 1
        placement, fractions = None, None
        if entry.probe_next:
            placement = PROBE
        elif occurrence < len(entry.placements):
            placement, fractions = entry.placements[occurrence], entry.fractions[occurrence]
        elif step.ahead is not None:
            planned = step.ahead.placement_at(position, call.owner) if entry.ready else None
            if planned is None:
                step.ahead = None  # not the step it was taken for: the rest measures
            else:
                placement, fractions = planned
        self._runs[run] = AutoRun(weakref.ref(run), key, placement, fractions)
        return _placement(run, placement, fractions)

    # ------------------------------------------------------------------ end of a step
    def end_step(self, runtime: Runtime, step: Step) -> None:
        """After the step's backward: take its measurements, then plan, compare or replan."""
        states = [self._runs[run] for run in step.runs if run in self._runs]
        if not states or step.aborted:
            return
        step.harvest(block=True)  # the copies' and stalls' times of this step, forward's waits too
        moments = self._moments(states[0].run, step)
        self._said(states, moments)
        part = self._steps[step]
        if part.ended:  # a retained graph's next backward: said, not measured again
            return
        part.ended = True
        self.holds = False  # until a check keeps the plan this step ran
        ended = self._measured_step(states, step, moments)
        if ended is None:
            figures(states, None)
            return  # still measuring
        self.last_step = [
            (id(state.key.owner), entry) for state, entry in zip(states, ended.entries, strict=True)
        ]
        self.plan_step(runtime, ended)

    def _said(self, states: list[AutoRun], moments: tuple[int, int, int] | None) -> None:
        """A step over the budget is counted and said (Note [every step over the budget is
        said]), with its cause: measuring, probing, a plan at the floor, or a plan that was off."""
        budget = self.budget(states[0].run)
        if moments is None or budget is None:
            return
        placements = [state.placement for state in states]
        if any(state.run.stats.over_budget_bytes for state in states):
            cause = "host budget"
        elif any(placement is None for placement in placements):
            cause = "measuring"
        elif any(placement is PROBE for placement in placements):
            cause = "probing"
        elif self.current is not None and self.current.trying:
            cause = "trying"
        elif self.current is not None and "nothing fits" in self.current.reason:
            cause = "floor"
        else:
            cause = "planned"
        self.over.step(max(moments), budget, cause, stacklevel=6)

    def _measured_step(
        self, states: list[AutoRun], step: Step, moments: tuple[int, int, int] | None
    ) -> Ended | None:
        """The step's measurements taken into its blocks'; None while a block still measures."""
        entries = [self.blocks.get(state.key.owner)[state.key.conditions] for state in states]
        counted: set[int] = set()
        for state, entry in zip(states, entries, strict=True):
            if id(entry) not in counted:  # once a step, however often the block ran
                counted.add(id(entry))
                entry.steps += 1
            observe(entry, state, self.blocks.get(state.key.owner).values())
        stand_in_forwards(entries)
        if not all(entry.ready for entry in entries):
            return None
        ran = tuple(_ran(state) for state in states)
        keys = tuple(state.key.ident for state in states)
        windows = Windows(step.window or 0, step.copy_window or 0)
        probing = any(state.placement is PROBE for state in states)
        ended = Ended(states, entries, keys, ran, windows, None if probing else moments, probing)
        ended.watch = self._steps[step].watch
        return ended


def _ran(state: AutoRun) -> Placement:
    """The placement the model describes a run by: its plan's, or while it measures, ``stream``
    at windows of none, or ``checkpoint`` where it ran again what the host refused (Note
    [measuring where the host is small]): its step's memory is a checkpoint step's, and taken
    for a stream step's it would be charged to the memory outside the blocks."""
    if state.placement is not None:
        return state.placement
    if getattr(state.run.placement, "measured", None) is not None:
        return CHUNKED  # Note [measuring where only chunks fit]
    return MEASURED_AGAIN if state.run.stats.run_again_bytes else MEASURING


def _placement(
    run: ScopeRun, placement: Placement | None, fractions: tuple[float, float] | None
) -> RunPlacement:
    """The placement object of a run the plan placed (``placement``; None: measuring; `PROBE`)."""
    if placement is None:
        return MeasuringPlacement(run)
    if placement is PROBE:  # stored whole, probed in backward (Note [probe in the first backward])
        return TokenwisePlacement(run, planned=(0.0, 0.0))
    if placement.kind == "tokenwise":
        return TokenwisePlacement(run, planned=fractions)
    if placement.kind == "chunked":  # Note [a chunked block the plan misjudged]
        return ChunkedPlacement(run, falls_back=True)
    kinds = {"keep": KeptPlacement, "checkpoint": CheckpointPlacement, "stream": WholePlacement}
    return kinds[placement.kind](run)
