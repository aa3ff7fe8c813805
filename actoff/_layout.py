"""Host arenas of the process (one per device backend), and their layouts: from the buffers a step
traced to a plan installed in the arena.

A traced step becomes a plan (from memory, the on-disk cache, or a solve by actoff.planner);
a step that diverged from its plan drops it, and the next step is traced again.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from ._arena import ALIGNMENT, HostArena
from ._config import Config
from ._device import DeviceBackend
from .planner import Buffer, Layout, PlanCache, solve

__all__ = ["Arenas", "plan_arena"]


class Arenas(dict):
    """The host arenas of the process, one per device backend (a dict ``backend -> HostArena``).

    By backend, not device: a CPU device inside `actoff.testing.simulated_device` and outside
    it are two backends, each with its own host buffers (the simulated device must know its
    host buffers, or it would count them as device memory).
    """

    def for_device(self, backend: DeviceBackend, config: Config, budget: int | None) -> HostArena:
        """The arena of ``backend``'s device under ``budget`` (the config in force decides it);
        a new plan's trace starts here when the planner is on and the arena has no plan."""
        arena = self.get(backend)
        if arena is None:
            arena = self[backend] = HostArena(backend, budget)
        arena.budget = budget
        if arena.plan is None and config.planner != "off" and not arena.tracing:
            arena.take_trace()
            arena.tracing = True  # trace this step: the planner lays it out at its end
        return arena

    def begin_step(self) -> None:
        for arena in self.values():
            arena.begin_step()

    def consolidate(self, device: torch.device | None = None) -> None:
        """Merge empty chunks, of ``device``'s arena or of every arena."""
        for arena in self.values():
            if device is None or arena.backend.device == device:
                arena.consolidate()

    def plan(self, config: Config, plans: dict[str, Layout]) -> None:
        """After a step whose buffers are all back: every arena laid out (`plan_arena`)."""
        for arena in self.values():
            plan_arena(arena, config, plans)


def plan_arena(arena: HostArena, config: Config, plans: dict[str, Layout]) -> None:
    """After a step whose buffers are all back: lay out the arena for the next steps.

    ``plans`` maps trace signatures to layouts solved so far in this process (and broadcast
    from rank 0, Note [one agreement]); a new layout is added to it.
    """
    if arena.plan is not None and arena.divergences:
        arena.drop_plan()
        return
    if arena.plan is not None or not arena.tracing:
        return
    trace = arena.take_trace()
    arena.tracing = False
    if not trace or config.planner == "off":
        return
    origin = min(start for _, start, _, _ in trace)
    buffers = [Buffer(size, start - origin, end - origin) for size, start, end, _ in trace]
    signature = hashlib.sha256(repr([dataclasses.astuple(b) for b in buffers]).encode()).hexdigest()
    layout = plans.get(signature)
    cache = PlanCache(config.plan_cache) if config.plan_cache else None
    key = {"kind": "host-arena", "trace": signature, "policy": config.policy, "planner": config.planner}
    if layout is None and cache is not None:
        layout = cache.get(key, buffers, ALIGNMENT)
    if layout is None:
        method = "mip" if config.planner == "mip" else "greedy"
        layout = solve(buffers, method=method, time_limit_s=30.0, alignment=ALIGNMENT)
        if cache is not None:
            cache.put(key, buffers, layout)
    plans[signature] = layout
    arena.plan_method = layout.method
    arena.install_plan(tuple(b.size for b in buffers), layout.offsets, layout.peak)
