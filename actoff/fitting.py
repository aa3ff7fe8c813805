"""The plan that fits a device budget at the least step time: a placement per block and the step's
windows, searched over the model of actoff.budget (Note [the budget model]).

Pure functions on numbers, tested against brute force.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .budget import (
    CALIBRATED_HEADROOM,
    PLACEMENTS,
    PLAN_HEADROOM,
    BlockCost,
    Outside,
    Placement,
    Plan,
    Windows,
    _forward_bytes,
    _leaving,
    _streaming,
    _working_bytes,
    allowed,
    least,
    moments,
    unsure,
)
from .step_time import added_seconds, predict

__all__ = ["WINDOW_SHARES", "fit", "floor_plan", "plan", "plans", "window_choices"]

#: The windows a plan may choose, in shares of the step's largest block's saved bytes: none (one
#: saved tensor at a time, as ``save_on_cpu``), a quarter of a block, one block, two.
WINDOW_SHARES = (0.0, 0.25, 1.0, 2.0)


def window_choices(blocks: Sequence[BlockCost]) -> list[Windows]:
    """Every pair of windows a plan of ``blocks`` may choose (`WINDOW_SHARES`).

    >>> len(window_choices([BlockCost(0.01, 0.0, 10, 10, 10)]))
    16
    """
    unit = max(block.saved_bytes for block in blocks)
    values = sorted({share * unit for share in WINDOW_SHARES})
    return [Windows(fetch, copy) for fetch in values for copy in values]


def plan(
    blocks: Sequence[BlockCost], link_bytes_per_s: float, budget_bytes: float, **options: Any
) -> Plan | None:
    """The least added time whose predicted peak fits ``budget_bytes``, or None if nothing does.

    Keeping is free in time, so each count of kept blocks is tried: the last ones that may be
    kept (their backward comes first and lets them go before an offloaded block comes back; a
    kept block between offloaded ones, which would leave them the link, is not tried), and every
    block open to nothing else (`actoff.budget.allowed`) wherever it lies. Each comes with every
    pair of windows (``choices``, else `window_choices`; ``options``: `plans`'s ``outside_bytes``
    and ``choices``); the offloaded blocks get placements by dynamic programming over the blocks
    in order, the state being the last placement (what is still copying out while a block runs). Exact: the moments and
    the added times (Note [one link] in actoff.step_time) depend on neighbours only, and on the last offloaded block
    for the head and the kept blocks.

    >>> blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 4  # 50 bytes each: copies take no time
    >>> plan(blocks, 1e9, 200).describe()  # keep fits: keep
    '4 keep; fetch window 0 MiB, copy window 0 MiB'
    >>> plan(blocks, 1e9, 150).placements[-1], plan(blocks, 1e9, 0).describe()
    (Placement(kind='keep', stored=1.0), '4 stream; fetch window 0 MiB, copy window 0 MiB')
    >>> plan(blocks, 1e9, -1) is None
    True
    """
    found = plans(blocks, link_bytes_per_s, budget_bytes, **options)
    return found[0] if found else None


def plans(
    blocks: Sequence[BlockCost],
    link_bytes_per_s: float,
    budget_bytes: float,
    *,
    outside_bytes: Outside | float = 0,
    choices: Sequence[Windows] | None = None,
    seen: Windows | None = None,
) -> list[Plan]:
    """Every plan `plan` weighs that fits ``budget_bytes``, the best of each set of placements,
    best first (least added time, then least peak); the first is `plan`'s. None past a plan
    that adds no time. ``seen``: the windows of the step that measured ``outside_bytes`` (a
    plan with others is predicted with theirs added: Note [windows the step did not run]).

    >>> blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 4
    >>> [found.describe().split(";")[0] for found in plans(blocks, 1e9, 150)]
    ['2 stream, 2 keep', '1 stream, 3 keep']
    """
    outside = outside_bytes if isinstance(outside_bytes, Outside) else Outside.flat(outside_bytes)
    # A block that may only run in chunks (`BlockCost.chunks_only`) is never kept, one that may
    # only be kept (no split, no re-run, no host room) always is: the others kept are the last.
    keepable = [index for index, block in enumerate(blocks) if PLACEMENTS[0] in allowed(block)]
    forced = frozenset(index for index in keepable if allowed(blocks[index]) == (PLACEMENTS[0],))
    free = [index for index in keepable if index not in forced]
    best: Plan | None = None
    found: dict[tuple[Placement, ...], Plan] = {}
    for count in range(len(free), -1, -1):
        kept = forced | frozenset(free[len(free) - count :])
        if outside.head + sum(blocks[index].saved_bytes for index in kept) > budget_bytes:
            continue
        for windows in [Windows()] if len(kept) == len(blocks) else (choices or window_choices(blocks)):
            here = unsure(outside, seen, windows)

            def fits(
                placements: tuple[Placement, ...], windows: Windows = windows, here: Outside = here
            ) -> bool:
                return max(moments(blocks, placements, here, windows)) <= budget_bytes

            placements = _cheapest(blocks, kept, link_bytes_per_s, windows, here, budget_bytes, fits)
            if placements is None:
                continue
            peak, seconds = predict(blocks, placements, link_bytes_per_s, outside_bytes=here, windows=windows)
            candidate = Plan(placements, windows, peak, seconds)
            if _better(candidate, found.get(placements)):
                found[placements] = candidate
            if _better(candidate, best):
                best = candidate
        if best is not None and best.seconds == 0.0:
            break  # nothing is faster than adding no time: keeping more only holds more
    ranked = sorted(found.values(), key=lambda p: (p.seconds, p.peak_bytes))
    if best is not None:  # ties keep the search's order
        ranked.remove(found[best.placements])
        ranked.insert(0, best)
    return ranked


def _better(candidate: Plan, incumbent: Plan | None) -> bool:
    return (
        incumbent is None
        or candidate.seconds < incumbent.seconds - 1e-12
        or (candidate.seconds <= incumbent.seconds + 1e-12 and candidate.peak_bytes < incumbent.peak_bytes)
    )


def _cheapest(
    blocks: Sequence[BlockCost],
    kept: frozenset[int],
    link_bytes_per_s: float,
    windows: Windows,
    outside: Outside,
    budget_bytes: float,
    fits: Callable[[tuple[Placement, ...]], bool],
) -> tuple[Placement, ...] | None:
    """Placements for ``blocks`` (in forward order), those at the indices ``kept`` kept and the
    others offloaded, with the least added time such that each block's forward and backward
    moments stay within the budget, and the whole plan ``fits`` (which depends on the last
    offloaded placement only: the kept blocks are given)."""
    # state: the last offloaded block and its placement (None before any), whose copies out may
    # still be under way (kept blocks wait for none) -> (seconds, placements so far). The seconds
    # are those of the blocks before the last offloaded one: its own depend on the block after it
    # (Note [one link]), added when that block is placed, or at the end if it is the last.
    Last = tuple[int, Placement] | None
    states: dict[Last, tuple[float, tuple[Placement, ...]]] = {None: (0.0, ())}
    held = 0.0  # the saved bytes of the kept blocks before this one
    for index, block in enumerate(blocks):
        following: dict[Last, tuple[float, tuple[Placement, ...]]] = {}
        options = [PLACEMENTS[0]] if index in kept else [p for p in allowed(block) if p != PLACEMENTS[0]]
        for previous, (seconds, chosen) in states.items():
            source = (blocks[previous[0]], previous[1]) if previous is not None else None
            leaving = _leaving(*source) if source is not None else 0.0
            streamed = _streaming(*source, windows) if source is not None else 0.0
            ahead = windows.fetch if any(p != PLACEMENTS[0] for p in chosen) else 0.0
            for placement in options:
                forward = (
                    held
                    + leaving
                    + _forward_bytes(block, placement)
                    + max(streamed, _streaming(block, placement, windows))
                )
                backward = held + _working_bytes(block, placement) + ahead
                if outside.forward + forward > budget_bytes or outside.backward + backward > budget_bytes:
                    continue
                total = seconds
                if previous is not None and previous[0] == index - 1:
                    total += added_seconds(
                        blocks[previous[0]], previous[1], link_bytes_per_s, windows, (block, placement)
                    )
                key = previous if index in kept else (index, placement)
                if key not in following or total < following[key][0] - 1e-15:
                    following[key] = (total, (*chosen, placement))
        states = following
        held += block.saved_bytes if index in kept else 0.0
        if not states:
            return None
    last = len(blocks) - 1

    def total(key: Last, state: tuple[float, tuple[Placement, ...]]) -> float:
        if key is None or key[0] != last:
            return state[0]
        return state[0] + added_seconds(blocks[last], key[1], link_bytes_per_s, windows)

    valid = [(total(key, state), state[1]) for key, state in states.items() if fits(state[1])]
    return min(valid, key=lambda found: found[0])[1] if valid else None


def floor_plan(
    blocks: Sequence[BlockCost], link_bytes_per_s: float, *, outside_bytes: Outside | float = 0
) -> Plan:
    """Every block at the least device memory open to it (`actoff.budget.least`), windows of
    none: what runs when no plan fits the budget (it may still fit: the model errs both ways).

    >>> floor_plan([BlockCost(0.01, 0.002, 10, 10, 30)] * 2, 1e9).describe()
    '2 stream; fetch window 0 MiB, copy window 0 MiB'
    """
    placements = tuple(least(block) for block in blocks)
    peak, seconds = predict(
        blocks, placements, link_bytes_per_s, outside_bytes=outside_bytes, windows=Windows()
    )
    return Plan(placements, Windows(), peak, seconds)


def fit(
    costs: tuple[BlockCost, ...],
    link: float,
    budget: float,
    outside: Outside,
    *,
    calibrated: bool,
    seen: Windows | None = None,
) -> tuple[Plan, bool, tuple[Plan, ...]]:
    """The plan of ``costs`` under ``budget`` less its headroom (Note [calibrated plans] in
    actoff.runtime.auto),
    whether it is the floor's (nothing fits), and the best plan of each set of placements that
    fits, best first (Note [a plan tried against its runner-up] in actoff.runtime.trials). ``seen``: the windows of the
    step that measured ``outside`` (Note [windows the step did not run] in actoff.budget)."""
    headroom = CALIBRATED_HEADROOM if calibrated else PLAN_HEADROOM
    found = plans(costs, link, budget * (1 - headroom), outside_bytes=outside, seen=seen)
    if not found:
        return floor_plan(costs, link, outside_bytes=outside), True, ()
    return found[0], False, tuple(found)
