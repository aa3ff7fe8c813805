"""The auto policy: measure the blocks, plan their placements under the device budget
(actoff.budget), check every step against the plan's prediction, and replan when it is off.

Note [measuring at recompute]: a block the auto policy has not measured under its conditions
(its module, input shapes, dtypes, autocast, training flags: Note [probes per module and
conditions]) runs its first `MEASURE_STEPS` steps at the token-wise ``recompute`` placement:
its inputs and what attention saves go to the host, and every token-local activation is
recomputed in backward. That is safe for a budget (one block's activations come back at a
time) and it sorts the bytes into the planner's classes, because the run knows which tensors
are the block's inputs, which attention saved and which the probe could split by token. It costs
those steps a token-local re-forward of every block (about what the block's forward costs
outside attention) and the copies of the inputs and attention's saves. The ``checkpoint``
placement would hold less, but under it the forward saves nothing but the block's inputs: the
classes, and so the token-wise placements' costs, could not be measured. A block not yet probed
stores its first step whole and is probed in that step's backward (Note [probe in the first
backward]; the probe shrinks its slice when short of memory: Note [a probe short of memory]);
in that step a block's copies out finish before the next block runs
(`ScopeRun.stored_whole_to_measure`), so it holds one block's saves at a time, not two;
bytes by class come from the first step that splits, times from the second step on (the first
is cold: the probe's re-forward, allocators and kernels warming up). Measuring steps fetch
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
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actoff.budget import (
    CALIBRATED_HEADROOM,
    PLAN_HEADROOM,
    BlockCost,
    Outside,
    Placement,
    Plan,
    floor_plan,
    off_by,
    outside_from,
    plan,
)
from actoff.config import format_bytes
from actoff.policy import AutoDecision, budget_share, host_split
from actoff.tiers.tokenwise.probes import ByOwner

from .distributed import local_world_size
from .measured import BlockKey, Measured, figures, measured_s, observe

if TYPE_CHECKING:
    from .runtime import Runtime
    from .step import ScopeRun, Step

__all__ = ["MEASURE_STEPS", "AutoPlanner", "StepPlan"]

#: Steps a block runs at the measuring placement under new conditions: one cold, one warm.
MEASURE_STEPS = 2
#: The measuring placement (Note [measuring at recompute]).
MEASURING = Placement("tokenwise", 0.0)
KEEP = Placement("keep")


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

    @property
    def predicted_s(self) -> float:
        """The step's blocks' forward times plus what the placements add."""
        return sum(cost.forward_s for cost in self.costs) + self.plan.seconds


class AutoPlanner:
    """The auto policy's state in a runtime: measurements per block and conditions, plans per
    step of blocks, and the device's memory watch (Note [measuring at recompute])."""

    def __init__(self) -> None:
        self.blocks: ByOwner[dict[tuple, Measured]] = ByOwner()
        # Per step of blocks, under its first block's owner (dropped with it): the plan
        self.plans: ByOwner[dict[tuple, StepPlan]] = ByOwner()
        self.current: StepPlan | None = None  # the plan of the last step that had one
        self.measured: StepPlan | None = None  # the last plan a step ran and measured
        self.replans = 0
        self.budget_bytes: int | None = None  # of the last step planned
        self.replan_allowed = True  # off under torch.distributed once ranks agreed
        self.reasons: collections.deque[str] = collections.deque(maxlen=16)  # why each plan, the last
        self._watches: dict[Any, Any] = {}  # backend -> memory watch (None: not counted)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ forward
    def budget(self, run: ScopeRun) -> int | None:
        """``ACTOFF_GPU_BUDGET``, else the device's own (None: no budget)."""
        if run.config.gpu_budget is not None:
            return run.config.gpu_budget
        return run.backend.default_budget()

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

    def sealed(self, run: ScopeRun) -> None:
        """A run's forward ended: the forward's peak so far is kept, and a new window opens (the
        one after the last block's is the head's)."""
        watch = self.watch(run)
        if watch is not None:
            watch.sample()
            run.step.auto_peaks[0] = max(run.step.auto_peaks[0], watch.peak)
            watch.reset()

    def backward_starts(self, run: ScopeRun) -> None:
        """Backward reached its first run: the head's window closes, backward's opens."""
        watch = self.watch(run)
        if watch is not None:
            watch.sample()
            run.step.auto_peaks[1] = watch.peak
            watch.reset()

    def _moments(self, run: ScopeRun, step: Step) -> tuple[int, int, int] | None:
        """The step's peaks at the moments of Note [the budget model] (the last forward's window
        stands for the forward: every block's forward is one), or None where not counted."""
        watch = self.watch(run)
        if watch is None:
            return None
        watch.sample()
        forward, head = step.auto_peaks
        moments = (forward, head if head else watch.peak, watch.peak)
        watch.reset()
        return moments if watch.counted() else None

    def place(self, run: ScopeRun, key: BlockKey) -> None:
        """Set a new run's placement (``run.placement``; None: measuring), its token fractions
        and ``run.auto_key`` (left None without a budget: the run is kept, nothing planned). The
        step's first auto run sets its prefetch depth."""
        self.sample(run)
        if self.budget(run) is None:
            run.placement, run.kept = KEEP, True  # no budget: nothing to fit
            return
        run.auto_key = key
        by_conditions = self.blocks.setdefault(key.owner, dict)
        entry = by_conditions.get(key.conditions)
        if entry is None:
            entry = by_conditions[key.conditions] = Measured(run.name)
        step = run.step
        if not step.auto_seen:  # measuring: nothing fetched ahead (Note [measuring at recompute])
            step.depth = entry.depth if entry.placements else 0
        occurrence = step.auto_seen[key.ident]
        step.auto_seen[key.ident] += 1
        if occurrence < len(entry.placements):
            run.placement = entry.placements[occurrence]
            run.auto_fractions = entry.fractions[occurrence]
            run.kept = run.placement.kind == "keep"  # Note [kept as is]
            run.checkpointed = run.placement.kind == "checkpoint"

    # ------------------------------------------------------------------ end of a step
    def end_step(self, runtime: Runtime, step: Step) -> None:
        """After the step's backward: take its measurements, then plan, compare or replan."""
        runs = [run for run in step.runs if run.auto_key is not None]
        if not runs or step.aborted:
            return
        moments = self._moments(runs[0], step)
        peak = None if moments is None else max(moments)
        entries = [self.blocks.get(run.auto_key.owner)[run.auto_key.conditions] for run in runs]
        counted: set[int] = set()
        for run, entry in zip(runs, entries, strict=True):
            if id(entry) not in counted:  # once a step, however often the block ran
                counted.add(id(entry))
                entry.steps += 1
            observe(entry, run)
        if not all(entry.ready for entry in entries):
            figures(runs, None)
            return  # still measuring
        step.harvest(block=True)  # the copies' and stalls' times of this step
        keys = tuple(run.auto_key.ident for run in runs)
        ran = tuple(
            run.placement
            if run.placement is not None
            else MEASURING
            if entry.tokenwise
            else Placement("tokenwise", 1.0)
            for run, entry in zip(runs, entries, strict=True)
        )
        current = self.plans.setdefault(runs[0].auto_key.owner, dict).get(keys)
        if current is not None and ran == current.plan.placements:
            seconds = sum(measured_s(run) for run in runs)
            current.measured_peak_bytes, current.measured_s = peak, seconds
            self.current = self.measured = current
            figures(runs, current)
            off_peak = peak is not None and (
                off_by(peak, current.plan.peak_bytes) or peak > current.budget_bytes
            )
            off_time = off_by(seconds, current.predicted_s)
            if self.replan_allowed and not current.calibrated:
                # planned again from the peaks of its own placements (Note [calibrated plans])
                self._plan(runtime, runs, entries, keys, ran, step.depth, moments,
                           "calibrated on its own step", calibrated=True)  # fmt: skip
            elif self.replan_allowed and (off_peak or off_time):
                self.replans += 1
                what = (
                    [f"peak {format_bytes(peak)} vs {format_bytes(current.plan.peak_bytes)} predicted"]
                    if off_peak
                    else []
                )
                what += (
                    [f"time {seconds * 1e3:.1f} ms vs {current.predicted_s * 1e3:.1f} ms predicted"]
                    if off_time
                    else []
                )
                self._plan(
                    runtime,
                    runs,
                    entries,
                    keys,
                    ran,
                    step.depth,
                    moments,
                    "replanned: " + ", ".join(what),
                    calibrated=True,
                )
            return
        if current is not None:  # another plan placed these blocks since: this one again
            self._apply(runs, entries, current)
            return
        self._plan(runtime, runs, entries, keys, ran, step.depth, moments, "planned after measuring")
        figures(runs, None)

    def _plan(self, runtime: Runtime, runs: list[ScopeRun], entries: list[Measured], keys: tuple,
              ran: tuple[Placement, ...], depth: int, moments: tuple | None, reason: str, *,
              calibrated: bool = False) -> None:  # fmt: skip
        costs = tuple(entry.cost() for entry in entries)
        link = _link(runtime, runs[0])
        budget = self.budget(runs[0])
        outside = Outside() if moments is None else outside_from(moments, costs, ran, depth=depth)
        headroom = CALIBRATED_HEADROOM if calibrated else PLAN_HEADROOM
        chosen = plan(costs, link, budget * (1 - headroom), outside_bytes=outside)
        if chosen is None:
            chosen = floor_plan(costs, link, outside_bytes=outside)
            reason += "; nothing fits the budget: the least memory"
            if "floor" not in self._warned:
                self._warned.add("floor")
                warnings.warn(
                    f"actoff: auto: no placement fits the device budget of {format_bytes(budget)} "
                    f"(predicted least {format_bytes(chosen.peak_bytes)}, of which "
                    f"{format_bytes(outside.peak)} outside the blocks): every block runs at its least "
                    "memory (checkpoint); the step may run out of memory",
                    RuntimeWarning,
                    stacklevel=3,
                )
        step_plan = StepPlan(keys, tuple(run.name for run in runs), tuple(entries), chosen, costs, budget,
                             link, outside, reason, calibrated)  # fmt: skip
        self.reasons.append(reason)
        self.plans.setdefault(runs[0].auto_key.owner, dict)[keys] = self.current = step_plan
        self.budget_bytes = budget
        self._apply(runs, entries, step_plan)

    def _apply(self, runs: list[ScopeRun], entries: list[Measured], step_plan: StepPlan) -> None:
        """Give each block its placement (per occurrence in the step), token fractions and
        reported decision; the next steps run them."""
        config = runs[0].config
        per_layer = budget_share(config.host_budget, local_world_size())
        if per_layer is not None:
            per_layer = per_layer / max(len(runs) - 2, 1)
        occurrences: collections.Counter = collections.Counter()
        for run, entry, placement, cost in zip(runs, entries, step_plan.plan.placements, step_plan.costs,
                                               strict=True):  # fmt: skip
            index = occurrences[id(entry)]
            occurrences[id(entry)] += 1
            cpu, nvme, why = 0.0, 0.0, "planned"
            if placement.kind == "tokenwise":
                cpu, nvme, why = host_split(
                    placement.stored,
                    fixed_bytes=cost.input_bytes + cost.attention_bytes,
                    other_bytes=cost.local_bytes,
                    host_budget_per_layer=per_layer,
                    nvme_available=run.config.nvme_dir is not None,
                )
            decision = AutoDecision(
                placement=str(placement), cpu_fraction=cpu, nvme_fraction=nvme,
                prefetch_depth=step_plan.plan.depth, bandwidth_gbps=step_plan.link_bytes_per_s / 1e9,
                t_layer_ms=cost.forward_s * 1e3, attention_ms=cost.attention_s * 1e3,
                input_bytes=cost.input_bytes, attention_bytes=cost.attention_bytes, other_bytes=cost.local_bytes,
                host_budget_per_layer=per_layer, reason=f"{step_plan.reason}; {why}",
            )  # fmt: skip
            for listing, value in ((entry.placements, placement), (entry.fractions, (cpu, nvme)),
                                   (entry.decisions, decision)):  # fmt: skip
                del listing[index:]
                listing.append(value)
            entry.depth = step_plan.plan.depth

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
        return {"placements": self.current.plan.placements, "depth": self.current.plan.depth,
                "decisions": [entry.decisions[0] for entry in self.current.entries]}  # fmt: skip

    def adopt(self, shared: dict | None) -> None:
        """Rank 0's plan (`export`) instead of this rank's, where the steps have as many blocks;
        from now on plans change only for steps of new blocks or conditions."""
        self.replan_allowed = False
        current = self.current
        if shared is None or current is None or len(shared["placements"]) != len(current.keys):
            return
        for entry, placement, decision in zip(current.entries, shared["placements"], shared["decisions"],
                                              strict=True):  # fmt: skip
            entry.placements[:] = [placement]
            entry.decisions[:] = [decision]
            entry.fractions[:] = [(decision.cpu_fraction, decision.nvme_fraction)]
            entry.depth = shared["depth"]
        current.plan = Plan(tuple(shared["placements"]), shared["depth"], current.plan.peak_bytes,
                            current.plan.seconds)  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The `actoff.runtime.stats.Stats` fields of the current plan."""
        current = self.current
        if current is None:
            return {}
        return {
            "plan": current.plan.describe(),
            "plan_reason": current.reason,
            "budget_bytes": current.budget_bytes,
            "outside_bytes": int(current.outside.peak),
            "predicted_peak_bytes": int(current.plan.peak_bytes),
            "predicted_step_ms": current.predicted_s * 1e3,
            "replans": self.replans,
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


def _link(runtime: Runtime, run: ScopeRun) -> float:
    """The host link in bytes per second: ``ACTOFF_HOST_BANDWIDTH``, else measured once per
    device (ranks on one host copy at the same time: each gets its share)."""
    if run.config.host_bandwidth is not None:
        return float(run.config.host_bandwidth)
    if run.device not in runtime.bandwidths:
        runtime.bandwidths[run.device] = run.backend.host_bandwidth() / local_world_size()
    return runtime.bandwidths[run.device]
