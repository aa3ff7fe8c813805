"""What a plan gives each block (actoff.runtime.planning makes the plans): its placement per
occurrence in the step, its token fractions and the decision ``actoff.stats().auto`` reports."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

from actoff.budget import BlockCost, Placement
from actoff.policy import AutoDecision, budget_share, host_split

from .distributed import local_world_size

if TYPE_CHECKING:
    from actoff.config import Config

    from .measured import Measured
    from .planning import StepPlan

__all__ = ["apply", "fractions", "host_room"]


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
        prefetch_depth=0,
        fetch_window=int(step_plan.plan.windows.fetch),
        copy_window=int(step_plan.plan.windows.copy),
        bandwidth_gbps=step_plan.link_bytes_per_s / 1e9,
        t_layer_ms=cost.forward_s * 1e3,
        attention_ms=cost.attention_s * 1e3,
        input_bytes=cost.input_bytes,
        attention_bytes=cost.attention_bytes,
        other_bytes=cost.local_bytes,
        host_budget_per_layer=per_layer,
        reason=f"{step_plan.reason}; {why}",
    )


def fractions(
    placement: Placement, cost: BlockCost, config: Config, per_layer: float | None
) -> tuple[float, float, str]:
    """A placement's token fractions ``(cpu, nvme)`` and why (`actoff.policy.host_split`)."""
    if placement.kind != "tokenwise":
        return 0.0, 0.0, "planned"
    return host_split(
        placement.stored,
        fixed_bytes=cost.input_bytes + cost.attention_bytes,
        other_bytes=cost.local_bytes,
        host_budget_per_layer=per_layer,
        nvme_available=config.nvme_dir is not None,
    )


def host_room(config: Config, runs: int) -> float | None:
    """A block's share of this process's host budget (MEMO's ``M_cpu / (n - 2)``), or None."""
    budget = budget_share(config.host_budget, local_world_size())
    return None if budget is None else budget / max(runs - 2, 1)


def apply(entries: Sequence[Measured], step_plan: StepPlan, config: Config) -> None:
    """Give each block of ``entries`` (a step's, in forward order) its placement in
    ``step_plan`` (per occurrence in the step), token fractions and reported decision; the next
    steps run them. The host room per block is the one its cost was planned with."""
    occurrences: collections.Counter = collections.Counter()
    for entry, placement, cost in zip(entries, step_plan.plan.placements, step_plan.costs, strict=True):
        index = occurrences[id(entry)]
        occurrences[id(entry)] += 1
        cpu, nvme, why = fractions(placement, cost, config, cost.host_room)
        decision = _decision(placement, cost, step_plan, (cpu, nvme), cost.host_room, why)
        for listing, value in (
            (entry.placements, placement),
            (entry.fractions, (cpu, nvme)),
            (entry.decisions, decision),
        ):
            del listing[index:]
            listing.append(value)
        entry.windows = step_plan.plan.windows
