"""Arenas of the process (a host arena per device backend, a device arena per device), and their
layouts: from the buffers a step traced to a plan installed in the arena.

A traced step becomes a plan (from memory, the on-disk cache, or a solve by actoff.planner).
Both kinds of arena trace every step, so a step that diverged is planned at once, and keep the
plans of the last few shapes of step (Note [a host plan per shape], actoff.memory.host_plans;
Note [a plan per shape], actoff.memory.device_plans).
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from actoff.config import Config
from actoff.device.base import DeviceBackend
from actoff.planner import Buffer, Layout, PlanCache, solve, solve_bilevel

from .device_arena import DeviceArena
from .device_plans import DevicePlan
from .host_arena import ALIGNMENT, HostArena

__all__ = ["Arenas", "plan_arena", "plan_device_arena"]


class Arenas(dict):
    """The host arenas of the process, one per device backend (a dict ``backend -> HostArena``),
    and the device arenas (``on_device``, of backends with streams).

    By backend, not device: a CPU device inside `actoff.testing.simulated_device` and outside
    it are two backends, each with its own host buffers (the simulated device must know its
    host buffers, or it would count them as device memory).
    """

    def __init__(self) -> None:
        super().__init__()
        self.on_device: dict[torch.device, DeviceArena] = {}

    def device_arena(self, backend: DeviceBackend, config: Config) -> DeviceArena | None:
        """The device arena of ``backend``'s device; None where actoff allocates on the device
        as PyTorch does: a backend without streams (`DeviceBackend.device_arena`) or the planner
        off."""
        if not backend.device_arena or config.planner == "off":
            return None
        arena = self.on_device.get(backend.device)
        if arena is None or arena.backend is not backend:  # a new simulated device: a new arena
            arena = self.on_device[backend.device] = DeviceArena(backend)
        return arena

    def for_device(self, backend: DeviceBackend, config: Config, budget: int | None) -> HostArena:
        """The arena of ``backend``'s device under ``budget`` and the config's pinned budget (the
        config in force decides them); its trace starts here when the planner is on (every step
        is traced from then on)."""
        arena = self.get(backend)
        if arena is None:
            arena = self[backend] = HostArena(backend, budget)
        arena.budget = budget
        arena.memory.pinned_budget = config.pinned_budget  # a process's own (the cap is on pinning)
        if config.planner != "off" and not arena.tracing:
            arena.take_trace()
            arena.tracing = True  # the planner lays out each step that did not keep to a plan
        return arena

    def begin_step(self) -> None:
        for arena in (*self.values(), *self.on_device.values()):
            arena.begin_step()

    def consolidate(self, device: torch.device | None = None) -> None:
        """Merge empty chunks, of ``device``'s arena or of every arena."""
        for arena in self.values():
            if device is None or arena.backend.device == device:
                arena.consolidate()

    def records_back(self, device: torch.device, current: bool) -> None:
        """A step's records on ``device`` are all back: its host arena merges empty chunks, and,
        if it is the ``current`` step (an older one's says nothing of the current backward),
        its device arena lets go of the buffers it still holds (Note [a buffer per wave])."""
        self.consolidate(device)
        arena = self.on_device.get(device)
        if current and arena is not None:
            arena.give_back()

    def run_done(self, device: torch.device, run: int) -> None:
        """Run ``run``'s records on ``device`` are all back: its device buffer goes."""
        arena = self.on_device.get(device)
        if arena is not None:
            arena.run_done(run)

    def plan(self, config: Config, plans: dict[str, Layout]) -> None:
        """After a step whose buffers are all back: every arena laid out (`plan_arena`)."""
        for arena in self.values():
            plan_arena(arena, config, plans)
        for device_arena in self.on_device.values():
            plan_device_arena(device_arena, config, plans)


def plan_arena(arena: HostArena, config: Config, plans: dict[str, Layout]) -> None:
    """After a step whose buffers are all back: a step that kept to the arena's plans changes
    nothing (its spare bump chunks go); any other step's trace becomes the plan of its shape,
    kept beside the others (Note [a host plan per shape], actoff.memory.host_plans).

    ``plans`` maps trace signatures to layouts solved so far in this process (and broadcast
    from rank 0, Note [one agreement]); a new layout is added to it.
    """
    if not arena.tracing:
        return
    trace = arena.take_trace()  # a new one starts: every step is traced
    if not trace:
        arena.idle_step()  # Note [an idle arena lets go]
        return
    arena.idle_steps = 0
    if config.planner == "off":
        return
    if arena.plan is not None and not arena.divergences:  # the step kept to the arena's plans
        arena.drop_spare_chunks()
        return
    origin = min(start for _, start, _, _ in trace)
    buffers = [Buffer(size, start - origin, end - origin) for size, start, end, _ in trace]
    layout = _layout("host-arena", buffers, None, config, plans, ALIGNMENT)
    arena.install_plan(tuple(b.size for b in buffers), layout.offsets, layout.peak, layout.method)


def plan_device_arena(arena: DeviceArena, config: Config, plans: dict[str, Layout]) -> None:
    """After a step whose buffers are all back: a device arena whose step kept to its plan keeps
    it; otherwise (`DeviceArena.wants_plan`) the step just traced becomes the plan, so a new
    length or batch is planned from its own first step. MEMO's bi-level solve, with each wave of
    a block's fetches or rebuilds a group in a range apart (Note [a buffer per wave],
    actoff.memory.device_arena)."""
    trace = arena.take_trace()
    if not trace or config.planner == "off" or not arena.wants_plan():
        return
    origin = min(entry[1] for entry in trace)
    buffers = [Buffer(size, start - origin, end - origin) for size, start, end, *_ in trace]
    parts = waves(trace)
    layout = _layout(arena.kind, buffers, parts, config, plans, arena.alignment)
    arena.install_plan(DevicePlan([entry[3] for entry in trace], [b.size for b in buffers], layout, parts))


def waves(trace: list[tuple]) -> list[tuple]:
    """The part of each traced request (Note [a buffer per wave], actoff.memory.device_arena): its
    run's fetches or rebuilds (a key's first two items) asked for between the same two unpacks and
    dying between the same two, numbered from 0 in the order of those pairs. Requests asked for
    apart are parts apart: a part's buffer is taken at its first request and would hold the
    range of a request made much later (fetches of one saved tensor at a time, Note [fetch per
    saved tensor] in actoff.runtime.fetch).

    >>> trace = [(512, 1, 4, (0, "fetch", 0, 0), 0, 7, 0), (512, 2, 3, (0, "fetch", 1, 0), 0, 5, 0),
    ...          (512, 5, 6, (1, "fetch", 0, 0), 1, 7, 0), (512, 6, 8, (1, "fetch", 1, 0), 1, 7, 6)]
    >>> waves(trace)
    [(0, 'fetch', 1), (0, 'fetch', 0), (1, 'fetch', 0), (1, 'fetch', 1)]
    """

    def wave(entry: tuple) -> tuple[int, int]:
        return (entry[6] if len(entry) > 6 else 0, entry[5])  # (asked, died)

    seen: dict[tuple, set[tuple[int, int]]] = {}
    for entry in trace:
        seen.setdefault(entry[3][:2], set()).add(wave(entry))
    order = {group: sorted(pairs, key=lambda pair: (pair[1], pair[0])) for group, pairs in seen.items()}
    return [(*entry[3][:2], order[entry[3][:2]].index(wave(entry))) for entry in trace]


def _layout(
    kind: str,
    buffers: list[Buffer],
    groups: list | None,
    config: Config,
    plans: dict[str, Layout],
    alignment: int,
) -> Layout:
    """The layout of ``buffers``: solved earlier in this process (or by rank 0), cached on disk,
    or solved now; bi-level when ``groups`` names each buffer's block."""
    traced = [dataclasses.astuple(b) for b in buffers]
    # The host arena's signature predates the device arena's: kept, so cached plans stay valid.
    # The device arena's names its blocks kept apart: its plans before per-run buffers were not.
    text = repr(traced) if groups is None else repr((kind, traced, groups, "blocks apart"))
    signature = hashlib.sha256(text.encode()).hexdigest()
    if groups is not None:
        signature = f"{kind}:{signature}"  # in ``plans`` beside the host arena's
    layout = plans.get(signature)
    cache = PlanCache(config.plan_cache) if config.plan_cache else None
    key = {"kind": kind, "trace": signature, "policy": config.policy, "planner": config.planner}
    if layout is None and cache is not None:
        layout = cache.get(key, buffers, alignment)
    if layout is None:
        if groups is None:
            method = "mip" if config.planner == "mip" else "greedy"
            layout = solve(buffers, method=method, time_limit_s=30.0, alignment=alignment)
        else:  # "auto": the MIP wherever greedy misses the lower bound, never worse than greedy
            method = "auto" if config.planner == "mip" else "greedy"
            layout = solve_bilevel(
                buffers, groups, method=method, time_limit_s=30.0, alignment=alignment, blocks_apart=True
            )
        if cache is not None:
            cache.put(key, buffers, layout)
    plans[signature] = layout
    return layout
