"""The device arena's plans, one per shape of step, the most recently used kept.

Note [a plan per shape]: the arena keeps the plans of the last few shapes of step (`KEPT`; a
shape is a sequence length, a batch, a model), and a step whose request the plan in force does
not know goes on with the most recently used kept plan that knows that request and the step's
requests so far, at their sizes (`DevicePlans.pick`). Training does not keep to one shape
(lengths padded to a multiple vary by batch, a curriculum steps through lengths, a teacher and a
student take turns): with one plan in force, each step of the other shape would diverge and
become the plan, and with two shapes in turns nothing would ever be served. A pick is a guess:
a request the picked plan does not know later in the step diverges as before. A request
`expect`ed in some step is a fallback, never a reason to switch, and a plan made again after
fallbacks, with no divergence, replaces the plan in force: one shape, one plan.

Most often the request that picks is the step's first fetch, of the last block, whose size tells
lengths and batches apart; a request both plans know (a norm's statistics of two models of one
width) does not stop the pick of the right one later. Ranges served from the plan in force
before a switch stay in its buffers; the picked plan's buffers leave out the requests already
made. Keeping a plan costs host memory only: its buffers are taken when its requests come
(Note [a buffer per wave], actoff.memory.device_arena).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from actoff.planner import Layout

__all__ = ["KEPT", "DevicePlan", "DevicePlans"]

#: Plans kept per device arena (Note [a plan per shape]): the shapes a run of training cycles
#: through (lengths to a multiple of 64 up to 2048 are 32; those of one epoch's batches, fewer).
KEPT = 16


class DevicePlan:
    """Where each request of one shape of step is served: ``offsets[key] = (size, offset, part)``,
    ``parts[part]`` the keys of a part, its layout, and the fallbacks of the last step it served.

    >>> from actoff.planner import Layout
    >>> plan = DevicePlan([(0, "fetch", 0, 0)], [512], Layout((0,), 512, 512, "greedy", True))
    >>> plan.offsets, plan.parts
    ({(0, 'fetch', 0, 0): (512, 0, (0, 'fetch'))}, {(0, 'fetch'): [(0, 'fetch', 0, 0)]})
    """

    __slots__ = ("identity", "last_fallbacks", "layout", "offsets", "parts")

    def __init__(
        self,
        keys: Sequence[tuple],
        sizes: Sequence[int],
        layout: Layout,
        parts: Sequence[tuple] | None = None,
    ) -> None:
        parts = parts if parts is not None else [key[:2] for key in keys]
        self.offsets: dict[tuple, tuple[int, int, tuple]] = {}
        self.parts: dict[tuple, list[tuple]] = {}
        for key, size, offset, part in zip(keys, sizes, layout.offsets, parts, strict=True):
            self.offsets[key] = (size, offset, part)
            self.parts.setdefault(part, []).append(key)
        self.layout = layout
        # The requests it serves: a plan of the same ones (a replan after fallbacks) replaces it.
        self.identity = frozenset(zip(keys, sizes, strict=True))
        self.last_fallbacks = 0  # under this plan, in the last step it served


class DevicePlans:
    """The plans of the last `KEPT` shapes of step, the most recently used last, and the plan in
    force.

    >>> from actoff.planner import Layout
    >>> plans = DevicePlans()
    >>> short = DevicePlan([(0, "fetch", 0, 0)], [512], Layout((0,), 512, 512, "greedy", True))
    >>> long = DevicePlan([(0, "fetch", 0, 0)], [1024], Layout((0,), 1024, 1024, "greedy", True))
    >>> plans.add(short); plans.add(long)
    >>> plans.pick((0, "fetch", 0, 0), 512) is short, plans.pick((0, "fetch", 0, 0), 2048)
    (True, None)
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # None: `KEPT`
        self._plans: collections.OrderedDict[frozenset, DevicePlan] = collections.OrderedDict()
        self.current: DevicePlan | None = None  # the plan in force
        self._told = False  # the step's fallbacks were told to the plan that served it

    def _tell(self, fallbacks: int) -> None:
        if self.current is not None and not self._told:
            self.current.last_fallbacks = fallbacks
        self._told = True

    def begin_step(self, fallbacks: int) -> None:
        """The last step is over with ``fallbacks`` (its plan remembers them); a new one begins."""
        self._tell(fallbacks)
        self._told = False

    def fell_back_twice(self, fallbacks: int) -> bool:
        """After a step with ``fallbacks``: did the step before it under the same plan fall back too?"""
        return bool(fallbacks and self.current is not None and self.current.last_fallbacks)

    def install(self, plan: DevicePlan, fallbacks: int, replaces: bool = False) -> None:
        """After a step with ``fallbacks``: ``plan`` is kept and in force; it ``replaces`` the
        plan in force (a replan of the same shape) or is kept beside it."""
        self._tell(fallbacks)
        if replaces and self.current is not None:
            self._plans.pop(self.current.identity, None)
        self.add(plan)
        self.current = plan

    def __len__(self) -> int:
        return len(self._plans)

    def add(self, plan: DevicePlan) -> None:
        """Keep ``plan`` as the most recently used; it replaces a plan of the same requests, and
        the least recently used goes past ``limit``."""
        self._plans.pop(plan.identity, None)
        self._plans[plan.identity] = plan
        while len(self._plans) > (self.limit if self.limit is not None else KEPT):
            self._plans.popitem(last=False)

    def pick(self, key: tuple, size: int, asked: Sequence[tuple[tuple, int]] = ()) -> DevicePlan | None:
        """The most recently used plan that serves request ``key`` at ``size`` bytes and the
        step's requests so far, ``asked`` (``(key, size)`` each), now in force and the most
        recently used; None if no plan kept does."""
        for identity, plan in reversed(self._plans.items()):
            if plan is self.current:
                continue
            if all(plan.offsets.get(k, (None,))[0] == s for k, s in ((key, size), *asked)):
                self._plans.move_to_end(identity)
                self.current = plan
                return plan
        return None
