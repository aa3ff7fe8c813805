"""A plan tried against its runner-up on whole steps (Note [a plan tried against its runner-up]).

Note [a plan tried against its runner-up]: the model prices a placement by its copies and its
recompute (Note [the budget model] in actoff.budget), and two plans it puts close can differ in
the real step by far more: on the 2-core machine of the main run, copies take CPU time that the
compute would have had, in forward and in backward, where the model hides them behind compute
(auto<=87MiB at 1024 tokens settled on `4 stream`, predicted within 10% of a token-wise plan and
40% slower than it), and a token-wise re-run's row copies cost what the model does not see. auto's
own check times a plan's blocks (forward, waits, recompute), not the step around them, so it
never saw it. So once a plan holds, its runner-up is tried: the best plan of another family of
placements (other kinds offloading: a plan that only moves a fraction, a window or a kept block
is priced by the same terms, and likely off by the same) that fits the budget with a first plan's headroom, where it
is predicted within `TRIAL_MARGIN` of the plan. `TRIAL_STEPS` whole steps of each are timed
(from the first block's forward to the end of backward), and the runner-up stays if its least
step is more than `TRIAL_TOLERANCE` faster than the plan's; else the plan in force. Either way the plan
is settled: one trial per plan, a few steps at most `TRIAL_MARGIN` slower, once. A trial step
over the budget ends it at once. Ranks that agreed on a plan (torch.distributed) never try: they
would each pick their own.

The runner-up of another family can still share a kind with the plan, and the error with it: in
the main run at 87 MiB (1024 tokens) auto ran `3 tokenwise:0, 1 checkpoint, 1 keep` and its
runner-up mixed token-wise blocks too, while the one kind left untried, `checkpoint` alone, was
what PyTorch's tools ran faster at less memory. So the first runner-up asked is the plan itself
with every offloaded block under one kind alone, other than the plan's only kind (`one_kind`:
the same blocks kept, the same windows), the best that fits and is within the margin; the
runner-up of another family only where there is none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actoff.budget import (
    CALIBRATED_HEADROOM,
    PLACEMENTS,
    PLAN_HEADROOM,
    REPLAN_TOLERANCE,
    BlockCost,
    Outside,
    Plan,
    allowed,
    unsure,
)
from actoff.step_time import predict

if TYPE_CHECKING:
    from .planning import Ended, StepPlan

__all__ = [
    "TRIAL_MARGIN",
    "TRIAL_STEPS",
    "TRIAL_TOLERANCE",
    "Trial",
    "Trials",
    "family",
    "one_kind",
    "runner_up",
    "still_good",
]

#: A runner-up predicted within this share of the plan's blocks' time is tried.
TRIAL_MARGIN = 0.4
#: Whole steps timed of each plan: the least of them counts (the first after a change of
#: placements can pay for the device arena's new layout).
TRIAL_STEPS = 2
#: The runner-up stays where its least step is faster than the plan's by more than this share.
#: Less than `REPLAN_TOLERANCE`, which holds one step's time against a prediction: a trial sets
#: measured steps side by side, and a bar as high as a plan's error let the main run keep
#: `2 tokenwise:0.25, 3 keep` at 447 ms a step against `2 checkpoint, 3 keep` at 412 (8% faster).
TRIAL_TOLERANCE = 0.05


def family(plan: Plan) -> frozenset[str]:
    """The kinds of placement a plan offloads with (`runner_up` tries another family): ``keep``
    moves nothing, and how many blocks keep is a count the model prices well (the peak's).

    >>> from actoff.budget import Placement, Windows
    >>> sorted(family(Plan((Placement("tokenwise", 0.25), Placement("keep")), Windows(), 0, 0)))
    ['tokenwise']
    """
    return frozenset(placement.kind for placement in plan.placements if placement.kind != "keep")


def one_kind(costs: Sequence[BlockCost], of: Plan, link_bytes_per_s: float, outside: Outside) -> list[Plan]:
    """``of`` with every block it offloads under one kind of placement, for each placement open
    to all of them of a kind that is not ``of``'s only one (the same blocks kept, the same
    windows), predicted with ``outside`` (`actoff.budget.unsure`'s for those windows); best first.

    >>> from actoff.budget import Placement, Windows
    >>> costs = [BlockCost(0.01, 0.002, 10, 10, 30)] * 2
    >>> plan = Plan((Placement("tokenwise", 0.0), Placement("keep")), Windows(), 0, 0)
    >>> [found.describe().split(";")[0] for found in one_kind(costs, plan, 1e9, Outside())]
    ['1 stream, 1 keep', '1 checkpoint, 1 keep']
    >>> mixed = Plan((Placement("tokenwise", 0.0), Placement("checkpoint"), Placement("keep")), Windows(), 0, 0)
    >>> "2 checkpoint, 1 keep" in [v.describe().split(";")[0] for v in one_kind(costs + costs[:1], mixed, 1e9, Outside())]
    True
    """
    offloaded = [index for index, placement in enumerate(of.placements) if placement.kind != "keep"]
    found = []
    for kind in PLACEMENTS[1:]:
        if family(of) == {kind.kind} or kind.kind == "chunked" or not offloaded:
            continue
        if any(kind not in allowed(costs[index]) for index in offloaded):
            continue
        placements = tuple(kind if index in offloaded else p for index, p in enumerate(of.placements))
        peak, seconds = predict(
            costs, placements, link_bytes_per_s, outside_bytes=outside, windows=of.windows
        )
        found.append(Plan(placements, of.windows, peak, seconds))
    return sorted(found, key=lambda plan: (plan.seconds, plan.peak_bytes))


def trial_variants(current: StepPlan) -> list[Plan]:
    """`one_kind` of the plan in force, predicted as `actoff.fitting.plans` predicts its plans:
    with the slack of windows its step did not run (Note [windows the step did not run])."""
    outside = unsure(current.outside, current.seen, current.plan.windows)
    return one_kind(current.costs, current.plan, current.link_bytes_per_s, outside)


def runner_up(found: Sequence[Plan], of: Plan, forwards_s: float, peak_bytes: float) -> Plan | None:
    """The best of ``found`` (best first, as `actoff.fitting.plans` gives them) of another family
    of placements than ``of`` (a plan that only moves a fraction or a window is priced by the same
    terms, and so likely off by the same), whose predicted peak is at most ``peak_bytes`` (a plan
    not calibrated on its own step gets a first plan's headroom: Note [calibrated plans]) and whose
    blocks' time is within `TRIAL_MARGIN` of ``of``'s (``forwards_s``: the blocks' forward time,
    which every plan adds to); None if there is none.

    >>> from actoff.budget import Placement, Windows
    >>> one = Plan((Placement("stream"),), Windows(), 10, 0.01)
    >>> two = Plan((Placement("checkpoint"),), Windows(), 8, 0.03)
    >>> runner_up([one, two], one, 0.1, 8) is two, runner_up([one, two], one, 0.01, 8)
    (True, None)
    """
    limit = (forwards_s + of.seconds) * (1 + TRIAL_MARGIN)
    for plan in found:
        if family(plan) != family(of) and plan.peak_bytes <= peak_bytes:
            return plan if forwards_s + plan.seconds <= limit else None
    return None


def still_good(current: Plan, again: StepPlan) -> Plan | None:
    """The plan in force, predicted from ``again``'s figures (its blocks' costs, the link, the
    memory outside them), if it still fits ``again``'s budget with `CALIBRATED_HEADROOM` and its
    blocks' time is at most `REPLAN_TOLERANCE` over ``again``'s; else None (Note [a plan kept
    against time noise]).

    >>> from actoff.budget import BlockCost, Outside, Placement, Plan, Windows
    >>> costs = (BlockCost(0.01, 0.002, 10**6, 10**6, 3 * 10**6),) * 2
    >>> from actoff.runtime.planning import StepPlan
    >>> again = StepPlan((), (), (), Plan((Placement("keep"),) * 2, Windows(), 10**7, 0.0),
    ...                  costs, 10**8, 1e9, Outside(), "replanned", True)
    >>> still_good(Plan((Placement("stream"),) * 2, Windows(), 0, 0), again) is None  # 10 ms: 50% slower
    True
    >>> still_good(Plan((Placement("stream"),) * 2, Windows(10**7, 10**7), 0, 0), again).seconds  # hidden
    0.0
    """
    peak, seconds = predict(
        again.costs,
        current.placements,
        again.link_bytes_per_s,
        outside_bytes=again.outside,
        windows=current.windows,
    )
    forwards = sum(cost.forward_s for cost in again.costs)
    if peak > again.budget_bytes * (1 - CALIBRATED_HEADROOM):
        return None
    if forwards + seconds > (forwards + again.plan.seconds) * (1 + REPLAN_TOLERANCE):
        return None
    return Plan(current.placements, current.windows, peak, seconds)


@dataclass
class Trial:
    """A plan's trial against its runner-up: their whole steps' times, in seconds."""

    incumbent: Plan
    challenger: Plan
    incumbent_s: list[float] = field(default_factory=list)
    challenger_s: list[float] = field(default_factory=list)
    running: Plan | None = None  # the plan the next step runs, while the trial lasts
    over_budget: bool = False  # a step of the challenger's peaked over the budget

    def timed(self, plan: Plan, seconds: float | None) -> Plan | None:
        """A step of ``plan`` took ``seconds`` (None: not timed): the plan the next step runs,
        or None once the trial is decided (`winner`).

        >>> from actoff.budget import Placement, Windows
        >>> a, b = (Plan((Placement(k),), Windows(), 1, 0) for k in ("stream", "checkpoint"))
        >>> trial = Trial(a, b)
        >>> [trial.timed(a, 0.5) is a, trial.timed(a, 0.4) is b, trial.timed(b, 0.3) is b, trial.timed(b, 0.35)]
        [True, True, True, None]
        >>> trial.winner()[0] is b  # 300 ms against 400: more than 5% faster
        True
        """
        times = self.incumbent_s if plan == self.incumbent else self.challenger_s
        if seconds is not None:
            times.append(seconds)
        if len(self.incumbent_s) < TRIAL_STEPS:
            self.running = self.incumbent
        elif len(self.challenger_s) < TRIAL_STEPS and not self.over_budget:
            self.running = self.challenger
        else:
            self.running = None
        return self.running

    def winner(self) -> tuple[Plan, str]:
        """The plan that stays, and why (for the plan's reason)."""
        mine, theirs = min(self.incumbent_s), min(self.challenger_s, default=float("inf"))
        said = (
            f"tried {self.challenger.describe()}: "
            + ("over the budget" if self.over_budget else f"{theirs * 1e3:.1f} ms a step")
            + f" against {mine * 1e3:.1f} ms"
        )
        if not self.over_budget and theirs < mine * (1 - TRIAL_TOLERANCE):
            return self.challenger, said + "; kept it"
        return self.incumbent, said + "; kept the plan"


class Trials:
    """The trial part of `actoff.runtime.planning.AutoPlans` (Note [a plan tried against its
    runner-up]): it starts a trial where a plan that holds has a runner-up, and runs it. The
    trials run are kept per step of blocks and pair of families: a replan that comes back to a
    plan tried before (a new `StepPlan`) does not try it again."""

    trials_run: set[tuple]

    def _start_trial(self, ended: Ended) -> None:
        """The last step kept the plan in force: its trial starts, this step its first, where it
        has a runner-up not tried yet."""
        current = self.current
        if not self.holds or not self.replan_allowed or current.trial is not None:
            return
        forwards = sum(cost.forward_s for cost in current.costs)
        limit = current.budget_bytes * (1 - PLAN_HEADROOM)
        variants = trial_variants(current)
        challenger = runner_up(variants, current.plan, forwards, limit) or runner_up(
            current.candidates, current.plan, forwards, limit
        )
        if challenger is None:
            return
        key = (current.keys, frozenset((family(current.plan), family(challenger))))
        if key in self.trials_run:
            return
        self.trials_run.add(key)
        current.tried = True
        current.trial = Trial(current.plan, challenger)
        seconds = ended.step_s() if ended.ran == current.plan.placements else None
        self._run_trial(ended, current, current.trial.timed(current.plan, seconds))

    def _trial_step(self, ended: Ended, current: StepPlan, peak: int | None) -> bool:
        """A step of a trial ended: timed, and the next plan given (the winner at its end);
        False where it peaked over the budget running the plan in force, which ends the trial
        (the check that follows replans on that peak)."""
        trial = current.trial
        over = peak is not None and peak > current.budget_bytes
        if over and current.plan != trial.challenger:
            current.plan, current.trial = trial.incumbent, None
            return False
        trial.over_budget = trial.over_budget or over
        self._run_trial(ended, current, trial.timed(current.plan, ended.step_s()))
        return True

    def _run_trial(self, ended: Ended, current: StepPlan, following: Plan | None) -> None:
        if following is None:  # decided
            winner, why = current.trial.winner()
            current.trial, current.settled = None, True
            current.reason += "; " + why
            self.reasons.append(current.reason)
            following = winner
        ran = ended.ran == following.placements
        current.plan = following
        self._apply(ended, current)
        self.holds = current.trial is None and ran
