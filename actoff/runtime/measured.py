"""What the auto policy measures of a block: its key (module and conditions), its bytes by
class, its times, and its placements (Note [measuring at recompute] in actoff.runtime.auto)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from actoff.budget import BlockCost, Placement
from actoff.policy import AutoDecision
from actoff.tiers.record import Record, param_like
from actoff.tiers.tokenwise.probes import conditions
from actoff.tiers.tokenwise.reforward import autocast_state

if TYPE_CHECKING:
    from .step import ScopeRun

__all__ = ["BlockKey", "Measured", "block_key", "classes", "input_bytes"]


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
    run did not decide its split (every token stored: nothing to probe)."""
    total = sum(record.geometry.nbytes for record in run.records)
    tokenwise = run.tokenwise
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
