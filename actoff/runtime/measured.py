"""What the auto policy measures of a block: its key (module and conditions), its bytes by
class, its times (`forward_ms` and `attention_ms` are the one place measured times are read:
tests replace them), and its placements (Note [measuring at recompute] in actoff.runtime.auto)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from actoff.budget import BlockCost, Placement, added_seconds
from actoff.policy import AutoDecision
from actoff.tiers.record import Record, param_like
from actoff.tiers.tokenwise.probes import conditions
from actoff.tiers.tokenwise.reforward import autocast_state

if TYPE_CHECKING:
    from .auto import StepPlan
    from .step import ScopeRun

__all__ = [
    "BlockKey",
    "Measured",
    "attention_ms",
    "block_key",
    "classes",
    "figures",
    "forward_ms",
    "input_bytes",
    "measured_s",
    "observe",
    "start_timing",
]


def forward_ms(run: ScopeRun) -> float:
    """Measured forward time of a block, in milliseconds.

    One of the two places where the auto policy reads a measured time (with `attention_ms`):
    tests replace them to make decisions independent of the machine's load.
    """
    watch = run.forward_watch
    if watch is None:
        return 0.0
    watch.synchronize()
    return watch.elapsed_ms()


def attention_ms(run: ScopeRun) -> float | None:
    """Time of the token mixers' calls in the block's forward (milliseconds), or ``None`` when
    they were not timed (a run not token-wise)."""
    tokenwise = run.tokenwise
    if tokenwise is None or tokenwise.mixer_watches is None:
        return None
    total = 0.0
    for watch in tokenwise.mixer_watches:
        watch.synchronize()
        total += watch.elapsed_ms()
    return total


@dataclass
class BlockKey:
    """A block call's identity for the auto policy: its owner (the module, or a function
    scope's function) and `conditions`, with what computing them flattened (the token-wise
    run's capture reuses it)."""

    owner: Any
    conditions: tuple
    values: list
    spec: Any
    grad_enabled: bool
    autocast: tuple

    @property
    def ident(self) -> tuple:
        return (id(self.owner), self.conditions)


def block_key(owner: Any, module: torch.nn.Module | None, args: tuple, kwargs: dict,
              device: torch.device) -> BlockKey:  # fmt: skip
    """The `BlockKey` of a call of ``owner`` with ``args`` and ``kwargs``."""
    values, spec = pytree.tree_flatten((args, kwargs))
    grad_enabled, autocast = torch.is_grad_enabled(), autocast_state(device)
    return BlockKey(owner, conditions(values, spec, module, grad_enabled, autocast), values, spec,
                    grad_enabled, autocast)  # fmt: skip


@dataclass
class Measured:
    """What steps measured of one block under one set of conditions, and its placements (one
    per call of the block in a step: a function scope may run several times)."""

    name: str
    steps: int = 0  # steps that ran the block under these conditions
    input_bytes: int | None = None  # bytes by class (None: not measured yet)
    attention_bytes: int = 0
    local_bytes: int = 0
    tokenwise: bool = True  # recomputable token-wise (its probe passed)
    rerun: bool = True  # its forward calls no collective outside a mixer
    forward_s: float | None = None  # the least warm forward time seen
    attention_share: float = 0.0  # attention's share of the forward, in the step of `forward_s`
    placements: list[Placement] = field(default_factory=list)
    fractions: list[tuple[float, float]] = field(default_factory=list)
    decisions: list[AutoDecision] = field(default_factory=list)
    depth: int = 1  # the prefetch depth of the plan that placed it last

    @property
    def ready(self) -> bool:
        return self.input_bytes is not None and self.forward_s is not None

    def cost(self) -> BlockCost:
        forward_s = self.forward_s or 0.0
        return BlockCost(forward_s, forward_s * self.attention_share, self.input_bytes or 0,
                         self.attention_bytes, self.local_bytes, self.tokenwise, self.rerun)  # fmt: skip


def classes(run: ScopeRun) -> tuple[int, int, int, bool] | None:
    """A sealed run's saved bytes by class: inputs, attention's saves and what else is stored
    whole, the token-local rest; and whether the block splits by token. None when a token-wise
    run did not decide its split (every token stored, or its probe still to run)."""
    total = sum(record.geometry.nbytes for record in run.records)
    tokenwise = run.tokenwise
    if tokenwise is not None and tokenwise.probe_pending:
        return None  # stored whole, probed in its backward: the next step sorts its bytes
    if tokenwise is not None and tokenwise.split_records:
        inputs = {id(v): v.geometry.nbytes for v in tokenwise.inputs if isinstance(v, Record)}
        local = sum(record.geometry.nbytes for record in tokenwise.split_records)
        input_bytes = sum(inputs.values())
        return input_bytes, total - input_bytes - local, local, True
    if (
        tokenwise is not None
        and tokenwise.ranges is not None
        and tokenwise.ranges.cpu_end == tokenwise.seq_len
    ):
        return None
    input_total = min(run.input_bytes, total)
    return input_total, 0, total - input_total, False


def input_bytes(run: ScopeRun) -> int:
    """Bytes of the block's tensor inputs actoff would store (on its device, not parameters,
    not under ``min_bytes``), from its key's values (before the forward lets them go)."""
    seen: dict[int, int] = {}
    for value in run.auto_key.values:
        if not isinstance(value, torch.Tensor) or value.device != run.device or value.layout != torch.strided:
            continue
        nbytes = value.numel() * value.element_size()
        storage = value.untyped_storage().data_ptr() if value.numel() else 0
        if nbytes and nbytes >= run.config.min_bytes and not param_like(value, storage, run.param_storages):
            seen[id(value)] = nbytes
    return sum(seen.values())


def start_timing(run: ScopeRun) -> None:
    """A run's forward starts: its input bytes taken while it measures, its key's inputs let go,
    its forward and its token mixers' calls timed."""
    if run.placement is None:
        run.input_bytes = input_bytes(run)
    run.auto_key.values = []  # the inputs: held no longer than the forward needs them
    run.forward_watch = run.backend.stopwatch().start()
    if run.tokenwise is not None:
        run.tokenwise.mixer_watches = []


def observe(entry: Measured, run: ScopeRun) -> None:
    """Take a run's measurements into its block's: bytes by class while it measures (the
    token-wise placement sorts them), times from warm steps."""
    if run.placement is None and run.classes is not None:
        entry.input_bytes, entry.attention_bytes, entry.local_bytes, entry.tokenwise = run.classes
    tokenwise = run.tokenwise
    if tokenwise is not None and tokenwise.collective is not None:
        entry.rerun = False  # a re-run would call the collective again, on this rank alone
    if entry.steps < 2:
        return  # cold: the probe's re-forward, the allocators and kernels warming up
    # The least forward time seen, and attention's share in the step that gave it: figures
    # that only settle, so replans from them settle too (no plan flapping with the noise).
    forward_s = forward_ms(run) / 1e3
    if forward_s > 0 and (entry.forward_s is None or forward_s < entry.forward_s):
        entry.forward_s = forward_s
        mixers = attention_ms(run)
        if mixers is not None:
            entry.attention_share = min(mixers / 1e3 / forward_s, 1.0)


def measured_s(run: ScopeRun) -> float:
    """A run's forward, and what its placement added in backward: recompute and stalls."""
    return forward_ms(run) / 1e3 + (run.stats.recompute_ms + run.stats.wait_ms) / 1e3


def figures(runs: list[ScopeRun], step_plan: StepPlan | None) -> None:
    """Each run's placement, measured time and, where a plan ran, its prediction (statistics)."""
    for index, run in enumerate(runs):
        stats = run.stats
        stats.placement = "measuring (recompute)" if run.placement is None else str(run.placement)
        stats.forward_ms = forward_ms(run)
        stats.measured_ms = measured_s(run) * 1e3
        if step_plan is not None:
            cost = step_plan.costs[index]
            placement = step_plan.plan.placements[index]
            added = added_seconds(cost, placement, step_plan.link_bytes_per_s, step_plan.plan.depth)
            stats.predicted_ms = (cost.forward_s + added) * 1e3
