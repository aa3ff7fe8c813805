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
classes, and so the token-wise placements' costs, could not be measured. The first step is
cold (the probe's re-forward, allocators and kernels warming up): bytes come from it, times
from the second.

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
    PLAN_HEADROOM,
    BlockCost,
    Placement,
    Plan,
    added_seconds,
    floor_plan,
    off_by,
    outside_estimate,
    plan,
)
from actoff.config import format_bytes
from actoff.policy import AutoDecision, budget_share, host_split
from actoff.tiers.tokenwise.probes import ByOwner

from .distributed import local_world_size
from .measured import BlockKey, Measured

if TYPE_CHECKING:
    from .runtime import Runtime
    from .step import ScopeRun, Step

__all__ = ["MEASURE_STEPS", "AutoPlanner", "StepPlan", "attention_ms", "forward_ms"]

#: Steps a block runs at the measuring placement under new conditions: one cold, one warm.
MEASURE_STEPS = 2
#: The measuring placement (Note [measuring at recompute]).
MEASURING = Placement("tokenwise", 0.0)
KEEP = Placement("keep")


def forward_ms(run: ScopeRun) -> float:
    """Measured forward time of a block, in milliseconds.

    One of the two places where the auto policy reads a measured time (with `attention_ms`):
    tests replace them to make decisions independent of the machine's load.
    """
    watch = run.forward_watch
    if watch is None:
        return 0.0
    watch.synchronize()
    return watch.elapsed_ms()


def attention_ms(run: ScopeRun) -> float | None:
    """Time of the token mixers' calls in the block's forward (milliseconds), or ``None`` when
    they were not timed (a run not token-wise)."""
    tokenwise = run.tokenwise
    if tokenwise is None or tokenwise.mixer_watches is None:
        return None
    total = 0.0
    for watch in tokenwise.mixer_watches:
        watch.synchronize()
        total += watch.elapsed_ms()
    return total


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
    outside_bytes: float
    reason: str
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

    def place(self, run: ScopeRun, key: BlockKey) -> None:
        """Set a new run's placement (``run.placement``; None: measuring), its token fractions
        and ``run.auto_key`` (left None without a budget: the run is kept, nothing planned). The
        step's first auto run sets its prefetch depth."""
        self.sample(run)
        if self.budget(run) is None:
            run.placement = KEEP  # no budget: nothing to fit
            return
        run.auto_key = key
        by_conditions = self.blocks.setdefault(key.owner, dict)
        entry = by_conditions.get(key.conditions)
        if entry is None:
            entry = by_conditions[key.conditions] = Measured(run.name)
        step = run.step
        if not step.auto_seen:
            step.depth = entry.depth
        occurrence = step.auto_seen[key.ident]
        step.auto_seen[key.ident] += 1
        if occurrence < len(entry.placements):
            run.placement = entry.placements[occurrence]
            run.auto_fractions = entry.fractions[occurrence]

    # ------------------------------------------------------------------ end of a step
    def end_step(self, runtime: Runtime, step: Step) -> None:
        """After the step's backward: take its measurements, then plan, compare or replan."""
        runs = [run for run in step.runs if run.auto_key is not None]
        if not runs or step.aborted:
            return
        watch = self.watch(runs[0])
        peak = None
        if watch is not None:
            watch.sample()
            peak = watch.peak if watch.counted() else None
            watch.reset()
        entries = [self.blocks.get(run.auto_key.owner)[run.auto_key.conditions] for run in runs]
        counted: set[int] = set()
        for run, entry in zip(runs, entries, strict=True):
            if id(entry) not in counted:  # once a step, however often the block ran
                counted.add(id(entry))
                entry.steps += 1
            _observe(entry, run)
        if not all(entry.ready for entry in entries):
            _figures(runs, None)
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
            measured_s = sum(_measured_s(run) for run in runs)
            current.measured_peak_bytes, current.measured_s = peak, measured_s
            self.current = self.measured = current
            _figures(runs, current)
            off_peak = peak is not None and (
                off_by(peak, current.plan.peak_bytes) or peak > current.budget_bytes
            )
            off_time = off_by(measured_s, current.predicted_s)
            if self.replan_allowed and (off_peak or off_time):
                self.replans += 1
                what = (
                    [f"peak {format_bytes(peak)} vs {format_bytes(current.plan.peak_bytes)} predicted"]
                    if off_peak
                    else []
                )
                what += (
                    [f"time {measured_s * 1e3:.1f} ms vs {current.predicted_s * 1e3:.1f} ms predicted"]
                    if off_time
                    else []
                )
                self._plan(
                    runtime, runs, entries, keys, ran, step.depth, peak, "replanned: " + ", ".join(what)
                )
            return
        if current is not None:  # another plan placed these blocks since: this one again
            self._apply(runs, entries, current)
            return
        self._plan(runtime, runs, entries, keys, ran, step.depth, peak, "planned after measuring")
        _figures(runs, None)

    def _plan(self, runtime: Runtime, runs: list[ScopeRun], entries: list[Measured], keys: tuple,
              ran: tuple[Placement, ...], depth: int, peak: int | None, reason: str) -> None:  # fmt: skip
        costs = tuple(entry.cost() for entry in entries)
        link = _link(runtime, runs[0])
        budget = self.budget(runs[0])
        outside = 0.0 if peak is None else outside_estimate(peak, costs, ran, link, depth=depth)
        chosen = plan(costs, link, budget * (1 - PLAN_HEADROOM), outside_bytes=int(outside))
        if chosen is None:
            chosen = floor_plan(costs, link, outside_bytes=int(outside))
            reason += "; nothing fits the budget: the least memory"
            if "floor" not in self._warned:
                self._warned.add("floor")
                warnings.warn(
                    f"actoff: auto: no placement fits the device budget of {format_bytes(budget)} "
                    f"(predicted least {format_bytes(chosen.peak_bytes)}, of which "
                    f"{format_bytes(outside)} outside the blocks): every block runs at its least "
                    "memory (checkpoint); the step may run out of memory",
                    RuntimeWarning,
                    stacklevel=3,
                )
        step_plan = StepPlan(keys, tuple(run.name for run in runs), tuple(entries), chosen, costs, budget,
                             link, outside, reason)  # fmt: skip
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
            "outside_bytes": int(current.outside_bytes),
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


def _observe(entry: Measured, run: ScopeRun) -> None:
    """Take a run's measurements into its block's: bytes by class while it measures (the
    token-wise placement sorts them), times from warm steps."""
    if run.placement is None and run.classes is not None:
        entry.input_bytes, entry.attention_bytes, entry.local_bytes, entry.tokenwise = run.classes
    tokenwise = run.tokenwise
    if tokenwise is not None and tokenwise.collective is not None:
        entry.rerun = False  # a re-run would call the collective again, on this rank alone
    if entry.steps < 2:
        return  # cold: the probe's re-forward, the allocators and kernels warming up
    # The least forward time seen, and attention's share in the step that gave it: figures
    # that only settle, so replans from them settle too (no plan flapping with the noise).
    forward_s = forward_ms(run) / 1e3
    if forward_s > 0 and (entry.forward_s is None or forward_s < entry.forward_s):
        entry.forward_s = forward_s
        mixers = attention_ms(run)
        if mixers is not None:
            entry.attention_share = min(mixers / 1e3 / forward_s, 1.0)


def _measured_s(run: ScopeRun) -> float:
    """A run's forward, and what its placement added in backward: recompute and stalls."""
    return forward_ms(run) / 1e3 + (run.stats.recompute_ms + run.stats.wait_ms) / 1e3


def _figures(runs: list[ScopeRun], step_plan: StepPlan | None) -> None:
    """Each run's placement, measured time and, where a plan ran, its prediction (statistics)."""
    for index, run in enumerate(runs):
        stats = run.stats
        stats.placement = "measuring (recompute)" if run.placement is None else str(run.placement)
        stats.forward_ms = forward_ms(run)
        stats.measured_ms = _measured_s(run) * 1e3
        if step_plan is not None:
            cost = step_plan.costs[index]
            placement = step_plan.plan.placements[index]
            added = added_seconds(cost, placement, step_plan.link_bytes_per_s, step_plan.plan.depth)
            stats.predicted_ms = (cost.forward_s + added) * 1e3


def _link(runtime: Runtime, run: ScopeRun) -> float:
    """The host link in bytes per second: ``ACTOFF_HOST_BANDWIDTH``, else measured once per
    device (ranks on one host copy at the same time: each gets its share)."""
    if run.config.host_bandwidth is not None:
        return float(run.config.host_bandwidth)
    if run.device not in runtime.bandwidths:
        runtime.bandwidths[run.device] = run.backend.host_bandwidth() / local_world_size()
    return runtime.bandwidths[run.device]
