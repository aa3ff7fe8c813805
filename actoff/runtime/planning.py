"""The auto policy's plans: made from the blocks' measurements once they are measured, checked
against every step that runs one, calibrated on their own step and replanned when a step is off
(Note [calibrated plans] in actoff.runtime.auto; the model: Note [the budget model] in
actoff.budget). What the plans report: `actoff.stats()`'s plan fields and the per-block decisions.
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
from actoff.owners import ByOwner
from actoff.policy import AutoDecision, budget_share, host_split

from .distributed import local_world_size
from .measured import AutoRun, Measured, figures, measured_s

if TYPE_CHECKING:
    from .runtime import Runtime
    from .step import ScopeRun

__all__ = ["AutoPlans", "Ended", "StepPlan"]


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


@dataclass
class Ended:
    """A step whose blocks are all measured: its runs' states and blocks, the placements they
    ran, its prefetch depth and the device peaks at the moments of the budget model."""

    states: list[AutoRun]
    entries: list[Measured]
    keys: tuple
    ran: tuple[Placement, ...]
    depth: int | None
    moments: tuple | None


def _decision(
    placement: Placement,
    cost: BlockCost,
    step_plan: StepPlan,
    fractions: tuple[float, float],
    per_layer: float | None,
    why: str,
) -> AutoDecision:
    """What a block's plan reports (`actoff.stats().auto`)."""
    return AutoDecision(
        placement=str(placement),
        cpu_fraction=fractions[0],
        nvme_fraction=fractions[1],
        prefetch_depth=step_plan.plan.depth,
        bandwidth_gbps=step_plan.link_bytes_per_s / 1e9,
        t_layer_ms=cost.forward_s * 1e3,
        attention_ms=cost.attention_s * 1e3,
        input_bytes=cost.input_bytes,
        attention_bytes=cost.attention_bytes,
        other_bytes=cost.local_bytes,
        host_budget_per_layer=per_layer,
        reason=f"{step_plan.reason}; {why}",
    )


def _link(runtime: Runtime, run: ScopeRun) -> float:
    """The host link in bytes per second: ``ACTOFF_HOST_BANDWIDTH``, else measured once per
    device (ranks on one host copy at the same time: each gets its share)."""
    if run.config.host_bandwidth is not None:
        return float(run.config.host_bandwidth)
    if run.device not in runtime.bandwidths:
        runtime.bandwidths[run.device] = run.backend.host_bandwidth() / local_world_size()
    return runtime.bandwidths[run.device]


class AutoPlans:
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
        self._warned: set[str] = set()

    def budget(self, run: ScopeRun) -> int | None:
        """``ACTOFF_GPU_BUDGET``, else the device's own (None: no budget)."""
        if run.config.gpu_budget is not None:
            return run.config.gpu_budget
        return run.backend.default_budget()

    def plan_step(self, runtime: Runtime, ended: Ended) -> None:
        """A step whose blocks are measured ended: compare it with the plan it ran, give the
        blocks the plan made for them before, or plan them."""
        current = self.plans.setdefault(ended.states[0].key.owner, dict).get(ended.keys)
        if current is not None and ended.ran == current.plan.placements:
            self._check(runtime, ended, current)
        elif current is not None:  # another plan placed these blocks since: this one again
            self._apply(ended, current)
        else:
            self._plan(runtime, ended, "planned after measuring")
            figures(ended.states, None)

    def _check(self, runtime: Runtime, ended: Ended, current: StepPlan) -> None:
        """A step ran ``current``: compare it with its prediction, calibrate or replan."""
        peak = None if ended.moments is None else max(ended.moments)
        seconds = sum(measured_s(state) for state in ended.states)
        current.measured_peak_bytes, current.measured_s = peak, seconds
        self.current = self.measured = current
        figures(ended.states, current)
        if not self.replan_allowed:
            return
        if not current.calibrated:  # planned again from its own placements' peaks (Note [calibrated plans])
            self._plan(runtime, ended, "calibrated on its own step", calibrated=True)
            return
        what = []
        if peak is not None and (off_by(peak, current.plan.peak_bytes) or peak > current.budget_bytes):
            what.append(f"peak {format_bytes(peak)} vs {format_bytes(current.plan.peak_bytes)} predicted")
        if off_by(seconds, current.predicted_s):
            what.append(f"time {seconds * 1e3:.1f} ms vs {current.predicted_s * 1e3:.1f} ms predicted")
        if what:
            self.replans += 1
            self._plan(runtime, ended, "replanned: " + ", ".join(what), calibrated=True)

    def _plan(self, runtime: Runtime, ended: Ended, reason: str, *, calibrated: bool = False) -> None:
        run = ended.states[0].run
        costs = tuple(entry.cost() for entry in ended.entries)
        link = _link(runtime, run)
        budget = self.budget(run)
        moments = ended.moments
        outside = Outside() if moments is None else outside_from(moments, costs, ended.ran, depth=ended.depth)
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
        names = tuple(state.run.name for state in ended.states)
        step_plan = StepPlan(
            ended.keys, names, tuple(ended.entries), chosen, costs, budget, link, outside, reason, calibrated
        )
        self.reasons.append(reason)
        self.plans.setdefault(ended.states[0].key.owner, dict)[ended.keys] = self.current = step_plan
        self.budget_bytes = budget
        self._apply(ended, step_plan)

    def _apply(self, ended: Ended, step_plan: StepPlan) -> None:
        """Give each block its placement (per occurrence in the step), token fractions and
        reported decision; the next steps run them."""
        config = ended.states[0].run.config
        per_layer = budget_share(config.host_budget, local_world_size())
        if per_layer is not None:
            per_layer = per_layer / max(len(ended.states) - 2, 1)
        occurrences: collections.Counter = collections.Counter()
        rows = zip(ended.entries, step_plan.plan.placements, step_plan.costs, strict=True)
        for entry, placement, cost in rows:
            index = occurrences[id(entry)]
            occurrences[id(entry)] += 1
            cpu, nvme, why = 0.0, 0.0, "planned"
            if placement.kind == "tokenwise":
                cpu, nvme, why = host_split(
                    placement.stored,
                    fixed_bytes=cost.input_bytes + cost.attention_bytes,
                    other_bytes=cost.local_bytes,
                    host_budget_per_layer=per_layer,
                    nvme_available=config.nvme_dir is not None,
                )
            decision = _decision(placement, cost, step_plan, (cpu, nvme), per_layer, why)
            for listing, value in (
                (entry.placements, placement),
                (entry.fractions, (cpu, nvme)),
                (entry.decisions, decision),
            ):
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
        return {
            "placements": self.current.plan.placements,
            "depth": self.current.plan.depth,
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
            entry.depth = shared["depth"]
        placements = tuple(shared["placements"])
        current.plan = Plan(placements, shared["depth"], current.plan.peak_bytes, current.plan.seconds)

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
