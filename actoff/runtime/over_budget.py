"""Steps over the device budget, said (Note [every step over the budget is said]).

Note [every step over the budget is said]: the auto policy's plans are predictions, and a step
can peak over ``ACTOFF_GPU_BUDGET`` all the same: a plan the model misjudged (replanned from that
step), a budget below the least any plan can hold (the floor), a step still measuring at the
floor. Every such step is counted in `actoff.stats()` (``steps_over_budget``, per cause in
``over_budget_causes``, the largest peak in ``over_budget_peak_bytes``) and warned about with
`actoff.BudgetWarning`, rate-limited per cause: the 1st, 10th, 100th... step of each, so a run
that stays over keeps saying so without flooding its log. Filter the class to silence it.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

from actoff.budget import BudgetWarning, Outside, Plan
from actoff.config import format_bytes

__all__ = ["ADVICE", "OverBudget", "warn_no_fit"]

#: What a user can do, per cause.
ADVICE = {
    "measuring": (
        "the step measured its blocks at the least memory any plan holds (every saved tensor "
        "streamed): nothing fits, so lower the batch or the sequence, tile the MLPs and the loss "
        "(actoff.tile_, actoff.chunked_loss_), or raise ACTOFF_GPU_BUDGET"
    ),
    "probing": "a probe's step stores its blocks whole; the plan after it holds less",
    "floor": (
        "no placement fits the budget and the blocks run at their least memory: lower the batch "
        "or the sequence, tile the MLPs and the loss, or raise ACTOFF_GPU_BUDGET"
    ),
    "planned": "the plan's prediction was low; the next step runs a plan made from this one's peak",
    "trying": "a plan the model put close to the one in force was tried on whole steps; it is dropped",
    "host budget": (
        "ACTOFF_HOST_BUDGET was full, and what it could not take stayed on the device: raise it, "
        "or give ACTOFF_NVME_DIR with kvikio and GPUDirect Storage, where the rest then goes"
    ),
}


class OverBudget:
    """Steps whose measured device peak exceeded the budget: counted per cause, and said."""

    def __init__(self) -> None:
        self.causes: collections.Counter[str] = collections.Counter()
        self.peak_bytes = 0  # the largest peak of those steps

    def step(self, peak: int, budget: int, cause: str, *, stacklevel: int = 2) -> bool:
        """A step peaked at ``peak``: counted and warned (rate-limited) if over ``budget``.

        >>> import warnings
        >>> over = OverBudget()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     said = [over.step(120, 100, "planned") for _ in range(12)]
        >>> all(said), len(caught), over.summary()["steps_over_budget"]  # the 1st and 10th said
        (True, 2, 12)
        """
        if peak <= budget:
            return False
        self.causes[cause] += 1
        self.peak_bytes = max(self.peak_bytes, peak)
        count = self.causes[cause]
        if _power_of_ten(count):
            warnings.warn(
                f"actoff: auto: a step peaked at {format_bytes(peak)}, {peak / budget - 1:.0%} over the "
                f"device budget of {format_bytes(budget)} ({cause}: {ADVICE[cause]}); "
                f"{count} step(s) over it so far for this cause (actoff.stats().steps_over_budget)",
                BudgetWarning,
                stacklevel=stacklevel + 1,
            )
        return True

    def summary(self) -> dict[str, Any]:
        """The `actoff.runtime.stats.Stats` fields."""
        return {
            "steps_over_budget": sum(self.causes.values()),
            "over_budget_causes": dict(self.causes),
            "over_budget_peak_bytes": self.peak_bytes,
        }


def _power_of_ten(count: int) -> bool:
    while count % 10 == 0:
        count //= 10
    return count == 1


def warn_no_fit(budget: float, headroom: float, chosen: Plan, outside: Outside, *, first: bool) -> None:
    """Say, before the step runs, that no plan fits ``budget`` less ``headroom`` and what the floor
    plan ``chosen`` does (once per step of blocks: the caller's)."""
    warnings.warn(
        f"actoff: auto: no placement fits the device budget of {format_bytes(budget)} less "
        f"the {headroom:.0%} a {'first ' if first else ''}plan keeps free "
        f"(predicted least {format_bytes(chosen.peak_bytes)}; outside the blocks "
        f"{format_bytes(outside.peak)}): {_floor_words(chosen)}; "
        "the step may run out of memory",
        BudgetWarning,
        stacklevel=4,
    )


def _floor_words(chosen: Plan) -> str:
    """What the floor plan does, for its warning."""
    kinds = collections.Counter(placement.kind for placement in chosen.placements)
    said = {
        "stream": "stream every saved tensor (copied out as it is saved, fetched at its own unpack)",
        "chunked": "run their backward in token chunks (ACTOFF_CHUNK_TOKENS)",
        "checkpoint": "run again in backward, their inputs on the host",
        "tokenwise": "recompute every row",
    }
    return "blocks at their least memory: " + ", ".join(
        f"{count} {said.get(kind, kind)}" for kind, count in kinds.items()
    )
