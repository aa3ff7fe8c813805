"""The auto policy's plans: made from the blocks' measurements once they are measured, checked
against every step that runs one, calibrated on their own step and replanned when a step is off
(Note [calibrated plans] in actoff.runtime.auto; the model: Note [the budget model] in
actoff.budget). What the plans report: `actoff.stats()`'s plan fields and the per-block decisions.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actoff.budget import (
    CALIBRATED_HEADROOM,
    PLAN_HEADROOM,
    REPLAN_TOLERANCE,
    BlockCost,
    Outside,
    Placement,
    Plan,
    Windows,
    off_by,
    outside_from,
)
from actoff.config import format_bytes
from actoff.fitting import fit
from actoff.owners import ByOwner
from actoff.policy import AutoDecision

from . import measured
from .decisions import apply, fractions, host_room
from .distributed import local_world_size
from .measured import AutoRun, Measured, figures, measured_s
from .over_budget import OverBudget, warn_no_fit
from .trials import Trial, Trials, still_good

if TYPE_CHECKING:
    from actoff.device.base import Stopwatch

    from .runtime import Runtime
    from .step import ScopeRun

__all__ = ["AutoPlans", "Ended", "StepPlan", "fit", "fractions", "host_room", "link_rate"]


@dataclass
class StepPlan:
    """A plan for one step's blocks (in forward order), what it predicted and what was measured."""

    keys: tuple  # per run: `BlockKey.ident`
    names: tuple[str, ...]
    entries: tuple[Measured, ...]  # per run: its block's
    plan: Plan
    costs: tuple[BlockCost, ...]
    budget_bytes: int
    link_bytes_per_s: float
    outside: Outside
    reason: str
    calibrated: bool  # made from the peaks of a step of its own placements (Note [calibrated plans])
    measured_peak_bytes: int | None = None
    measured_s: float | None = None
    #: A replan gave the same plan (Note [settled plans]): only a peak over the budget replans it.
    settled: bool = False
    # Note [a plan tried against its runner-up] (actoff.runtime.trials): what the plan was chosen
    # from, the trial under way, whether one was run.
    candidates: tuple[Plan, ...] = ()  # the best plans of their placements, best first
    seen: Windows | None = None  # the windows of the step its outside was measured on (`unsure`)
    trial: Trial | None = None
    tried: bool = False

    @property
    def trying(self) -> bool:
        """Whether the plan in force is a trial's runner-up (Note [a plan tried against its runner-up])."""
        return self.trial is not None and self.plan == self.trial.challenger

    @property
    def predicted_s(self) -> float:
        """The step's blocks' forward times plus what the placements add."""
        return sum(cost.forward_s for cost in self.costs) + self.plan.seconds


@dataclass
class Ended:
    """A step whose blocks are all measured: its runs' states and blocks, the placements they
    ran, its windows and the device peaks at the moments of the budget model (None: not counted,
    or a probe's step, whose placements the model does not describe)."""

    states: list[AutoRun]
    entries: list[Measured]
    keys: tuple
    ran: tuple[Placement, ...]
    windows: Windows
    moments: tuple | None
    probing: bool = False
    # From its first block's forward (Note [a plan tried against its runner-up]).
    watch: Stopwatch | None = None

    def step_s(self) -> float | None:
        """The step's time from its first block's forward to the end of backward, read where a
        trial asks (it waits for the device); None where not timed."""
        if self.watch is None:
            return None
        return measured.step_s(self.watch, self.ran)  # looked up here: tests replace it


def link_rate(runtime: Runtime, run: ScopeRun) -> float:
    """The host link in bytes per second: ``ACTOFF_HOST_BANDWIDTH``, else measured once per
    device (ranks on one host copy at the same time: each gets its share), with a copy of at most
    half the budget's room left: its buffer is the probe's, not the next step's peak."""
    if run.config.host_bandwidth is not None:
        return float(run.config.host_bandwidth)
    if run.device not in runtime.bandwidths:
        watch, budget = runtime.auto.watch(run), runtime.auto.budget(run)
        room = 2**26 if watch is None or budget is None else max(2**20, (budget - watch.live()) // 2)
        runtime.bandwidths[run.device] = run.backend.host_bandwidth(min(2**26, room)) / local_world_size()
        if watch is not None:
            watch.reset()
    return runtime.bandwidths[run.device]


class AutoPlans(Trials):
    """The auto policy's plans in a runtime: per step of blocks (under its first block's owner,
    dropped with it), the one in force, the last one a step ran, and why each was made."""

    def __init__(self) -> None:
        self.plans: ByOwner[dict[tuple, StepPlan]] = ByOwner()
        self.current: StepPlan | None = None  # the plan of the last step that had one
        self.measured: StepPlan | None = None  # the last plan a step ran and measured
        self.replans = 0
        self.budget_bytes: int | None = None  # of the last step planned
        self.replan_allowed = True  # off under torch.distributed once ranks agreed
        self.reasons: collections.deque[str] = collections.deque(maxlen=16)  # why each plan, the last
        self._warned: set[tuple] = set()  # step keys told no plan fits
        self.over = OverBudget()  # Note [every step over the budget is said]
        self.trials_run: set[tuple] = set()  # Note [a plan tried against its runner-up]
        # The last step ran the plan in force and its check kept it (or planned it again the
        # same): measuring, probing and calibrating are behind. A step of new blocks or
        # conditions, or one off its prediction, starts them again.
        self.holds = False

    def budget(self, run: ScopeRun) -> int | None:
        """``ACTOFF_GPU_BUDGET``, else the device's own (None: no budget)."""
        if run.config.gpu_budget is not None:
            return run.config.gpu_budget
        return run.backend.default_budget()

    def plan_step(self, runtime: Runtime, ended: Ended) -> None:
        """A step whose blocks are measured ended: compare it with the plan it ran, give the
        blocks the plan made for them before, or plan them."""
        current = self.plans.setdefault(ended.states[0].key.owner, dict).get(ended.keys)
        if ended.probing and current is not None:  # Note [measuring at the floor]
            self._plan(runtime, ended, "planned after the probes", outside=current.outside, seen=current.seen)
            figures(ended.states, None)
        elif current is not None and ended.ran == current.plan.placements:
            self._check(runtime, ended, current)
        elif current is not None:  # another plan placed these blocks since: this one again
            self._apply(ended, current)
        else:
            self._plan(runtime, ended, "planned after measuring")
            figures(ended.states, None)
        if any(getattr(state.run.placement, "refused", None) for state in ended.states):
            _leave_refused_chunks(self, ended)

    def _check(self, runtime: Runtime, ended: Ended, current: StepPlan) -> None:
        """A step ran ``current``: compare it with its prediction, calibrate or replan."""
        peak = None if ended.moments is None else max(ended.moments)
        seconds = sum(measured_s(state) for state in ended.states)
        current.measured_peak_bytes, current.measured_s = peak, seconds
        self.current = self.measured = current
        figures(ended.states, current)
        refused = sorted(
            {state.run.name for state in ended.states if getattr(state.run.placement, "refused", None)}
        )
        if refused:  # Note [a chunked block the plan misjudged]: its step ran otherwise
            self._plan(
                runtime,
                ended,
                f"replanned: {', '.join(refused)} cannot run in token chunks",
                outside=current.outside,  # its new placements have not run: a first plan's headroom
                seen=current.seen,
            )
            self.replans += 1
            return
        if current.trial is not None and self._trial_step(ended, current, peak):
            return  # Note [a plan tried against its runner-up]
        self.holds = current.calibrated or not self.replan_allowed
        if not self.replan_allowed:
            return
        if not current.calibrated:  # planned again from its own placements' peaks (Note [calibrated plans])
            # A chunked step holds less outside the blocks (Note [the chunked placement in the plan]).
            at_least = current.outside if any(p.kind == "chunked" for p in current.plan.placements) else None
            self._plan(runtime, ended, "calibrated on its own step", calibrated=True, at_least=at_least)
            return
        over = peak is not None and peak > current.budget_bytes
        what = []
        peak_off = over or (
            peak is not None and off_by(peak, current.plan.peak_bytes) and not current.settled
        )
        if peak_off:
            what.append(f"peak {format_bytes(peak)} vs {format_bytes(current.plan.peak_bytes)} predicted")
        if off_by(seconds, current.predicted_s) and not current.settled:
            what.append(f"time {seconds * 1e3:.1f} ms vs {current.predicted_s * 1e3:.1f} ms predicted")
        if what:
            # The memory outside the blocks only grows from replan to replan: estimated from steps
            # of other placements it can swing both ways, and two plans would take turns.
            self._plan(
                runtime, ended, "replanned: " + ", ".join(what), calibrated=True, at_least=current.outside
            )
            again = self.current
            same = (
                again.plan.placements == current.plan.placements
                and again.plan.windows == current.plan.windows
            )
            if not same and not peak_off:
                same = self._keep_in_force(ended, current, again)
            # Note [settled plans]: a replan that gives the same plan again settles it: a step off
            # its prediction in ways the model cannot tell from these figures (waits it does not
            # predict, a peak below it) is not checked again, only a peak over the budget is.
            #
            # Note [a plan kept against time noise]: a step's time is noisy (a busy machine, a
            # CPU's clock), and near the budget two plans often predict within a few percent of
            # each other: replanning to whichever the last step's times favour had plans take
            # turns (the main run's auto<=128MiB went from 1 tokenwise:0.25 to 1 tokenwise:0 in a
            # timed step, 12% off on time). So a replan on time alone moves only to a plan
            # predicted more than REPLAN_TOLERANCE faster; else the plan in force stays, settled.
            self.current.settled = same  # the plan in force: `again`, or the one kept against it
            self.holds = same
            if not same:
                self.replans += 1
        self._start_trial(ended)

    def _keep_in_force(self, ended: Ended, current: StepPlan, again: StepPlan) -> bool:
        """Where `still_good` keeps the plan in force against ``again`` (Note [a plan kept
        against time noise]), it stays (its predictions renewed from the new figures): True."""
        plan = still_good(current.plan, again)
        if plan is None:
            return False
        kept = dataclasses.replace(
            again,
            plan=plan,
            reason=again.reason + f"; kept {current.plan.describe()}: "
            f"{again.plan.describe()} is not {REPLAN_TOLERANCE:.0%} faster",
        )
        self.reasons.append(kept.reason)
        self.plans.setdefault(ended.states[0].key.owner, dict)[ended.keys] = self.current = kept
        self._apply(ended, kept)
        return True

    def _plan(
        self,
        runtime: Runtime,
        ended: Ended,
        reason: str,
        *,
        calibrated: bool = False,
        outside: Outside | None = None,
        at_least: Outside | None = None,
        seen: Windows | None = None,
    ) -> None:
        run = ended.states[0].run
        room = host_room(run.config, len(ended.states))
        costs = tuple(dataclasses.replace(entry.cost(), host_room=room) for entry in ended.entries)
        link = link_rate(runtime, run)
        budget = self.budget(run)
        if outside is None:  # measured on this step, under its windows
            seen = ended.windows if ended.moments is not None else None
        if outside is None:
            moments = ended.moments
            outside = Outside() if moments is None else outside_from(moments, costs, ended.ran, ended.windows)
        if at_least is not None:
            outside = Outside(
                *(
                    max(a, b)
                    for a, b in zip(dataclasses.astuple(outside), dataclasses.astuple(at_least), strict=True)
                )
            )
        chosen, at_floor, found = fit(costs, link, budget, outside, calibrated=calibrated, seen=seen)
        if at_floor:
            reason += "; nothing fits the budget: the least memory"
            if ended.keys not in self._warned:  # once per step of blocks, before it runs
                self._warned.add(ended.keys)
                headroom = CALIBRATED_HEADROOM if calibrated else PLAN_HEADROOM
                warn_no_fit(budget, headroom, chosen, outside, first=not calibrated)
        self._schedule_probes(ended, chosen, outside, budget)
        names = tuple(state.run.name for state in ended.states)
        step_plan = StepPlan(
            ended.keys, names, tuple(ended.entries), chosen, costs, budget, link, outside, reason, calibrated
        )
        step_plan.candidates, step_plan.seen = found, seen
        self.reasons.append(reason)
        self.plans.setdefault(ended.states[0].key.owner, dict)[ended.keys] = self.current = step_plan
        self.budget_bytes = budget
        self._apply(ended, step_plan)

    @staticmethod
    def _schedule_probes(ended: Ended, chosen: Plan, outside: Outside, budget: float) -> None:
        """Blocks not probed yet are probed in the next step where the plan offloads and a probe
        fits: a block's saves, and half of them again for its re-run, over the memory outside the
        blocks, and the block's saves in its share of the host budget (Note [measuring at the
        floor])."""
        unprobed = [entry for entry in ended.entries if not entry.probed]
        if not unprobed or all(p.kind == "keep" for p in chosen.placements):
            return
        largest = max(entry.cost().saved_bytes for entry in unprobed)
        run = ended.states[0].run
        # A probe stores its block whole: in the host budget, unless nothing is copied (a host device).
        room = None if run.backend.host_resident else host_room(run.config, len(ended.states))
        if outside.peak + 1.5 * largest <= budget and (room is None or largest <= room):
            for entry in unprobed:
                entry.probe_next = True

    def _apply(self, ended: Ended, step_plan: StepPlan) -> None:
        """Give each block its placement, token fractions and reported decision (`apply`)."""
        apply(ended.entries, step_plan, ended.states[0].run.config)

    # ------------------------------------------------------------------ reports and ranks
    def decisions(self) -> dict[str, AutoDecision]:
        """Per block name, its decision in the current plan (the block's first call's)."""
        found: dict[str, AutoDecision] = {}
        if self.current is not None:
            for name, entry in zip(self.current.names, self.current.entries, strict=True):
                if entry.decisions and name not in found:
                    found[name] = entry.decisions[0]
        return found

    def export(self) -> dict | None:
        """The current plan in a form another rank applies by position (module identities and
        devices differ between processes)."""
        if self.current is None:
            return None
        return {
            "placements": self.current.plan.placements,
            "windows": self.current.plan.windows,
            "decisions": [entry.decisions[0] for entry in self.current.entries],
        }

    def adopt(self, shared: dict | None) -> None:
        """Rank 0's plan (`export`) instead of this rank's, where the steps have as many blocks;
        from now on plans change only for steps of new blocks or conditions."""
        self.replan_allowed = False
        current = self.current
        if shared is None or current is None or len(shared["placements"]) != len(current.keys):
            return
        rows = zip(current.entries, shared["placements"], shared["decisions"], strict=True)
        for entry, placement, decision in rows:
            entry.placements[:] = [placement]
            entry.decisions[:] = [decision]
            entry.fractions[:] = [(decision.cpu_fraction, decision.nvme_fraction)]
            entry.windows = shared["windows"]
        placements = tuple(shared["placements"])
        current.plan = Plan(placements, shared["windows"], current.plan.peak_bytes, current.plan.seconds)

    def summary(self) -> dict[str, Any]:
        """The `actoff.runtime.stats.Stats` fields of the current plan."""
        current = self.current
        if current is None:
            return self.over.summary()
        return {
            **self.over.summary(),
            "plan": current.plan.describe(),
            "plan_reason": current.reason,
            "budget_bytes": current.budget_bytes,
            "outside_bytes": int(current.outside.peak),
            "predicted_peak_bytes": int(current.plan.peak_bytes),
            "predicted_step_ms": current.predicted_s * 1e3,
            "replans": self.replans,
            "plan_holds": self.holds,
            **self._measured(),
        }

    def _measured(self) -> dict[str, Any]:
        """The last measured plan's prediction and measurement (the plan in force may be newer)."""
        measured = self.measured
        if measured is None:
            return {}
        return {
            "measured_plan": measured.plan.describe(),
            "measured_predicted_peak_bytes": int(measured.plan.peak_bytes),
            "measured_peak_bytes": measured.measured_peak_bytes,
            "measured_predicted_step_ms": measured.predicted_s * 1e3,
            "measured_step_ms": None if measured.measured_s is None else measured.measured_s * 1e3,
        }


def _refused_chunks(plan: Plan, entries: tuple[Measured, ...]) -> bool:
    """Whether ``plan`` places a block in chunks that its figures say cannot run in them."""
    rows = zip(entries, plan.placements, strict=True)
    return any(entry.chunk_refusal and placement.kind == "chunked" for entry, placement in rows)


def _leave_refused_chunks(plans: AutoPlans, ended: Ended) -> None:
    """Plans of the step's blocks at other lengths that place a block in chunks that is now
    refused there (a failed probe holds at every length: `measured.observe`) are made again
    from their own figures, a first plan's headroom, before they run a refused step of their
    own; their candidates and trials lose such plans (Note [a plan tried against its runner-up])."""
    by_keys = plans.plans.get(ended.states[0].key.owner)
    config = ended.states[0].run.config
    for keys, other in list(by_keys.items()):
        other.candidates = tuple(
            plan for plan in other.candidates if not _refused_chunks(plan, other.entries)
        )
        if other.trial is not None and _refused_chunks(other.trial.challenger, other.entries):
            if other.plan == other.trial.challenger:  # a trial's plan in force is the one it runs
                other.plan = other.trial.incumbent
                apply(other.entries, other, config)
            other.trial, other.settled = None, True  # as a decided trial leaves it
        if not _refused_chunks(other.plan, other.entries):
            continue
        costs = tuple(
            dataclasses.replace(entry.cost(), host_room=cost.host_room)
            for entry, cost in zip(other.entries, other.costs, strict=True)
        )
        chosen, at_floor, found = fit(
            costs,
            other.link_bytes_per_s,
            other.budget_bytes,
            other.outside,
            calibrated=False,
            seen=other.seen,
        )
        reason = "replanned: a block it placed in token chunks cannot run in them (found at another length)"
        if at_floor:
            reason += "; nothing fits the budget: the least memory"
        again = dataclasses.replace(
            other, plan=chosen, costs=costs, reason=reason, calibrated=False, candidates=found
        )
        again.measured_peak_bytes = again.measured_s = again.trial = None
        again.settled = again.tried = False
        by_keys[keys] = again
        if plans.current is other:
            plans.current = again
        plans.reasons.append(reason)
        plans.replans += 1
        apply(other.entries, again, config)
    # Plans of blocks this step shares with another length's (an encoder at a fixed length)
    # gave them theirs: this step's blocks run its own plan.
    if ended.keys in by_keys:
        apply(ended.entries, by_keys[ended.keys], config)
