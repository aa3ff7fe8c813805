"""The host arena's plans, one per shape of step, the most recently used kept.

Note [a host plan per shape]: training does not keep to one shape of step: dynamic padding
cycles a few sequence lengths, a curriculum steps through them. The host arena keeps the plans
of the last `KEPT` shapes (a plan is known by its requests' sizes, in order), and a request the
plan in force does not know switches to the most recently used plan that knows it and the
step's requests so far, at their sizes (`HostPlans.place`). The arena traces every step; a step
that kept to its plans changes nothing, any other becomes the plan of its shape at once (the
next step may be another shape). All plans lay out the one planned chunk, as large as the
largest of them: it grows with a larger shape and never shrinks, so once each shape has come
round the arena allocates nothing and holds the largest shape's peak. A request that no plan
knows goes to the planned chunk's free room before a bump chunk: a new shape no larger than one
seen before allocates nothing either.

With one plan in force, dropped at each divergence, and the planned chunk replaced at each new
plan, four lengths in turns made every other step diverge and allocate a bump chunk (16 MiB at
least) that the next plan dropped again: 90 host allocations in 200 steps, and a capacity of
18.8 MB against a high-water mark of 3.4 MB (issue 35).

A switch is a guess, as the device arena's (Note [a plan per shape], actoff.memory.device_plans):
requests served before it stay where the plan in force put them, and a later request whose
planned range one of them holds is a divergence.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .device_plans import KEPT

__all__ = ["HostPlan", "HostPlans"]


@dataclass(frozen=True)
class HostPlan:
    """Where one shape of step puts its requests: request k, of ``sizes[k]`` bytes, at
    ``offsets[k]`` in the planned chunk; ``peak`` bytes in all; ``method`` says where the
    layout came from (`actoff.planner.Layout.method`, shown in stats)."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    peak: int
    method: str = "none"


class HostPlans:
    """The plans of the last `KEPT` shapes of step, the most recently used last, the plan in
    force, and the sizes the step has asked for so far.

    >>> plans = HostPlans()
    >>> plans.add(HostPlan((4096, 8192), (0, 4096), 12288))
    >>> plans.add(HostPlan((8192, 8192), (0, 8192), 16384))
    >>> plans.begin_step()
    >>> plans.place(4096, room=16384), plans.current.sizes  # request 0: the first plan knows it
    (0, (4096, 8192))
    >>> plans.place(4096, room=16384) is None  # request 1 at 4096 bytes: no plan knows it
    True
    """

    def __init__(self) -> None:
        self._plans: collections.OrderedDict[tuple[int, ...], HostPlan] = collections.OrderedDict()
        self.current: HostPlan | None = None  # the plan in force
        self.asked: list[int] = []  # sizes of the step's requests so far
        self._lost = False  # no plan kept knows the step's requests so far: none will

    def __len__(self) -> int:
        return len(self._plans)

    def begin_step(self) -> None:
        """A new step: the next request is request 0."""
        self.asked = []
        self._lost = False

    def add(self, plan: HostPlan) -> None:
        """Keep ``plan`` as the most recently used and put it in force; it replaces a plan of the
        same sizes, and the least recently used goes past `KEPT`."""
        self._plans.pop(plan.sizes, None)
        self._plans[plan.sizes] = plan
        while len(self._plans) > KEPT:
            self._plans.popitem(last=False)
        self.current = plan

    def place(self, size: int, room: int) -> int | None:
        """The step's next request, of ``size`` bytes: its offset in the plan in force or, if
        that plan does not know it, in the most recently used plan (of a peak within ``room``
        bytes) that knows it and the step's requests so far, which is then in force; ``None``
        if no plan kept does (Note [a host plan per shape])."""
        k = len(self.asked)
        self.asked.append(size)
        plan = self.current
        if plan is None or k >= len(plan.sizes) or plan.sizes[k] != size:
            plan = self._pick(room)
        return None if plan is None else plan.offsets[k]

    def _pick(self, room: int) -> HostPlan | None:
        if self._lost:  # no plan knew a shorter prefix of the requests: none knows this one
            return None
        asked = tuple(self.asked)
        for sizes, plan in reversed(self._plans.items()):
            if plan is not self.current and sizes[: len(asked)] == asked and plan.peak <= room:
                self._plans.move_to_end(sizes)
                self.current = plan
                return plan
        self._lost = True
        return None
