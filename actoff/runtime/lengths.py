"""Other lengths and batches planned before they run (Note [other lengths planned ahead]).

Note [other lengths planned ahead]: a block's figures hold under its conditions, and its
conditions include the shapes of its inputs, so every new sequence length or batch size is new
conditions. Measured afresh, a new length would run its steps at the floor (Note [measuring at
the floor]): within the budget but slow, and under dynamic padding, where the length changes
every step, no step would ever run a plan. So a block under new conditions that differ from
measured ones only in their lengths (its key of every length is the same: Note [a probe serves
other lengths]) takes that block's figures scaled (`Measured.scaled_to`: bytes and the forward
outside attention by the elements of its first input, attention's time by the elements times
the length; a block measured at one length and then at another is warm at the second, so one
step measures it); and when the first block of a step is such a block, and the step before began with
the same block, the step is taken to be that step's blocks at the new length, planned at once
(`actoff.fitting.plan`, with the first plan's headroom, the memory outside the blocks grown by the
elements' ratio where it grows) and run: each run whose block is the one expected at its place
takes its placement; a run that is not (another model, another layout) measures, and so do the
runs after it. The step's own peaks then make the plan that its length's next steps run, as
any step's do.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from actoff.budget import Outside, Placement
from actoff.rerun.conditions import conditions

from .decisions import fractions, host_room
from .measured import Measured
from .planning import fit, link_rate

if TYPE_CHECKING:
    from actoff.budget import Plan
    from actoff.owners import Recent

    from .placements.base import Call
    from .planning import AutoPlans
    from .step import ScopeRun

__all__ = ["Ahead", "new_entry", "plan_ahead"]


@dataclasses.dataclass
class Ahead:
    """A step planned before it ran: per place, the block expected there (its owner's id) and
    its placement with token fractions; the step's plan."""

    owners: list[int]
    placements: list[tuple[Placement, tuple[float, float]]]
    plan: Plan

    def placement_at(self, position: int, owner: Any) -> tuple[Placement, tuple[float, float]] | None:
        """The placement of the run at ``position`` if its block is the one expected there."""
        if position < len(self.owners) and self.owners[position] == id(owner):
            return self.placements[position]
        return None


def new_entry(run: ScopeRun, call: Call, known: Recent) -> Measured:
    """The figures of a block under new conditions: another length's of the same block, scaled,
    where ``known`` (its figures under other conditions) has them; else none yet."""
    flat = call.flattened(run.device, run.config.token_dim)
    first = next((value for value in flat.values if isinstance(value, torch.Tensor)), None)
    if flat.tokens is None or first is None:
        return Measured(run.name)
    forward = flat.forward
    key = conditions(
        flat.values, flat.spec, call.module, forward.grad_enabled, forward.autocast, seq_len=flat.tokens
    )
    same = [entry for entry in known.values() if entry.any_length == key and entry.tokens]
    siblings = [entry for entry in same if entry.ready]
    if not siblings:
        # Measured here; warm already if another length of it ran (its kernels and allocators
        # are), so one step measures it and the next length is planned ahead.
        warm = 1 if any(entry.steps for entry in same) else 0
        return Measured(run.name, warm, any_length=key, tokens=flat.tokens, numel=first.numel())
    # A probed block's figures first (a probe serves other lengths), its own over scaled ones,
    # then the nearest length; a probe due on it is due on this length instead.
    nearest = min(
        siblings, key=lambda entry: (not entry.probed, entry.scaled, abs(entry.tokens - flat.tokens))
    )
    entry = nearest.scaled_to(flat.tokens, first.numel())
    entry.name, entry.probe_next = run.name, nearest.probe_next and not nearest.probed
    return entry


def plan_ahead(
    plans: AutoPlans, run: ScopeRun, call: Call, entry: Measured, last: list[tuple[int, Measured]]
) -> Ahead | None:
    """The plan of a step whose first run is ``run`` (its block's figures ``entry``, scaled from
    another length), taking it to be the step ``last`` (its blocks' owners and figures) at
    ``entry``'s length; None where it is not (Note [other lengths planned ahead])."""
    if not entry.scaled or not last or last[0][0] != id(call.owner) or plans.current is None:
        return None
    first = last[0][1]
    if not (first.tokens and first.numel):
        return None
    tokens, linear = entry.tokens / first.tokens, entry.numel / first.numel
    blocks = [
        measured.scaled_to(round(measured.tokens * tokens), round(measured.numel * linear))
        for _, measured in last
        if measured.ready and measured.tokens and measured.numel
    ]
    if len(blocks) != len(last):
        return None
    room = host_room(run.config, len(blocks))
    costs = tuple(dataclasses.replace(block.cost(), host_room=room) for block in blocks)
    outside = plans.current.outside
    grown = Outside(
        *(value * max(linear, 1.0) for value in (outside.forward, outside.head, outside.backward))
    )
    budget = plans.budget(run)
    chosen, _, _ = fit(costs, link_rate(run.runtime, run), budget, grown, calibrated=False)
    placements = [
        (placement, fractions(placement, cost, run.config, room)[:2])
        for placement, cost in zip(chosen.placements, costs, strict=True)
    ]
    return Ahead([owner for owner, _ in last], placements, chosen)
