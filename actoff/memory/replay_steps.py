"""Record, plan and replay per step for the replay allocator (``ACTOFF_ALLOCATOR=replay``).

A window is one step: from its first offload scope to the end of its backward
(Note [the window]). The first window is recorded (everything from cudaMallocAsync); its
requests freed inside it are laid out in one arena by the greedy planner, and the next
windows serve request k at its planned offset. A window that diverged (another size, more
requests) is planned again from its own log; after `GIVE_UP_AFTER` such windows in a row the
device goes back to plain cudaMallocAsync with one warning. Recorded errors are raised at the
start and the end of every step. The library itself is actoff.memory.replay_allocator.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actoff.planner import Buffer, solve

from . import replay_allocator

__all__ = ["ALIGNMENT", "GIVE_UP_AFTER", "UNPLANNED", "Replay", "ReplayDrivers", "ReplayPlan", "plan_window"]

UNPLANNED = 2**64 - 1  # ReplayAllocator::kUnplanned: the fallback serves the request by plan
ALIGNMENT = 512  # offsets in the arena, as the caching allocator aligns
GIVE_UP_AFTER = 3  # windows in a row that diverged from their plan


@dataclass(frozen=True)
class ReplayPlan:
    """Per request of a window: its size and arena offset (`UNPLANNED`: the fallback's)."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    arena_bytes: int
    lower_bound: int  # most bytes of planned requests live at once: no arena can be smaller


def plan_window(log: Sequence[tuple[int, int, int]]) -> ReplayPlan:
    """A plan for a logged window ``(size, allocated at, freed at or -1)``: requests freed
    inside it share one arena (greedy best fit; the MIP does not scale to a step's thousands
    of requests), those that outlived it are left to the fallback.

    Example:
        >>> plan = plan_window([(1024, 1, 2), (1024, 3, 4), (4096, 5, -1)])
        >>> plan.offsets[:2], plan.offsets[2] == UNPLANNED, plan.arena_bytes
        ((0, 0), True, 1024)
    """
    inside = [k for k, (_, _, end) in enumerate(log) if end >= 0]
    buffers = [Buffer(log[k][0], log[k][1], log[k][2]) for k in inside]
    layout = solve(buffers, method="greedy", alignment=ALIGNMENT)
    offsets = [UNPLANNED] * len(log)
    for k, offset in zip(inside, layout.offsets, strict=True):
        offsets[k] = offset
    return ReplayPlan(tuple(size for size, _, _ in log), tuple(offsets), layout.peak, layout.lower_bound)


class Replay:
    """Record, plan and replay of one device's windows, over an engine (a
    `actoff.memory.replay_allocator.CudaEngine` on CUDA; the tests drive the host core through the same
    methods).

    Note [the window]: a step opens at its first offload scope and closes at the end of its
    backward. Allocations before it (embeddings outside a scope, the previous optimizer step)
    are not numbered, so they cannot shift the sequence. A step that ends without backward
    (an exception, a forward only) closes at the next step's start, unplanned from.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.open = False
        self.recording = False
        self.planned = False
        self.misses = 0  # windows in a row that diverged from their plan
        self.given_up = False
        self._diverged = 0

    def begin(self) -> None:
        if self.given_up:
            return
        if self.open:
            self.engine.end_step()
        if self.planned:
            self.engine.begin_step()
        else:
            self.engine.begin_record()
        self.recording = not self.planned
        self._diverged = self.engine.stats()["diverged"]
        self.open = True

    def end(self) -> str | None:
        """Close the window; plan from it if it was recorded or diverged. A warning, or None."""
        if not self.open:
            return None
        self.open = False
        self.engine.end_step()
        diverged = self.engine.stats()["diverged"] > self._diverged
        if not (self.recording or diverged):
            self.misses = 0
            return None
        self.misses += diverged
        if self.misses >= GIVE_UP_AFTER:
            self.engine.clear_plan()
            self.planned, self.given_up = False, True
            return (
                f"the replay allocator's sequence changed in {self.misses} steps in a row (shapes "
                "that vary by step?): every allocation now comes from cudaMallocAsync"
            )
        plan = plan_window(self.engine.log())
        self.engine.set_plan(plan.sizes, plan.offsets, plan.arena_bytes, plan.lower_bound)
        self.planned = True
        return None

    def close(self) -> None:
        if self.open:
            self.engine.end_step()
            self.open = False
        self.engine.clear_plan()
        self.planned = self.recording = self.given_up = False
        self.misses = 0


# A device's replay allocator is the process's (torch's allocator), and a window is one training
# loop's step: two threads' steps interleaved in one sequence would diverge every step. So one
# runtime (one training thread: Note [a runtime per thread]) drives a device; another is refused.
_drivers_of: dict[int, weakref.ref] = {}  # CUDA device index -> the ReplayDrivers driving it
_drivers_lock = threading.Lock()


class ReplayDrivers:
    """The runtime's step hooks for the replay allocator: one `Replay` per CUDA device."""

    def __init__(self) -> None:
        self.by_device: dict[int, Replay] = {}
        self.current: Replay | None = None

    def _claim(self, index: int) -> None:
        with _drivers_lock:
            owner = _drivers_of.get(index)
            if owner is not None and owner() not in (None, self):
                raise RuntimeError(
                    f"ACTOFF_ALLOCATOR=replay plans the steps of one training thread per CUDA device, "
                    f"and another thread already trains on cuda:{index}: set ACTOFF_ALLOCATOR=caching "
                    "for threads that train side by side, or train them in processes of their own"
                )
            _drivers_of[index] = weakref.ref(self)

    def begin(self, device: torch.device, allocator: str, warn: Callable[[str, str], None]) -> None:
        """A step begins on ``device`` under the ``allocator`` setting."""
        if allocator != "replay":
            return
        if device.type != "cuda":
            warn(
                "replay-allocator-device",
                f"ACTOFF_ALLOCATOR=replay plans CUDA allocations only; on device {device} it is "
                "ignored (set ACTOFF_ALLOCATOR=caching to silence this)",
            )
            return
        if not replay_allocator.installed():
            raise RuntimeError(replay_allocator.refusal())
        replay_allocator.check()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._claim(index)
        replay = self.by_device.get(index)
        if replay is None:
            replay = self.by_device[index] = Replay(
                replay_allocator.CudaEngine(replay_allocator.library(), index)
            )
        self.current = replay
        replay.begin()

    def end(self, warn: Callable[[str, str], None]) -> None:
        """The step's backward ended."""
        replay, self.current = self.current, None
        if replay is not None:
            message = replay.end()
            if message is not None:
                warn("replay-allocator-gave-up", message)
        replay_allocator.check()

    def close(self) -> None:
        """Forget plans (`actoff.reset`): the next step records again; the arena is kept."""
        for replay in self.by_device.values():
            replay.close()
        self.current = None
        with _drivers_lock:  # another thread may drive the devices now
            for index, owner in list(_drivers_of.items()):
                if owner() is self:
                    del _drivers_of[index]
