"""The forward's state a re-run of a block must run under: grad mode and autocast, and how each
input took part in autograd.

Note [re-run state]: whether an operation saves an operand, and in which dtype, depends on grad
mode and on autocast (under autocast a linear layer saves the bf16 cast of its weight), and on
whether its operands require grad (frozen base weights under LoRA). Backward runs with grad off
and usually outside the training loop's autocast region, and a probe could run under another
state than the step it recomputes for: so every re-run sets the state its forward ran under
(`ForwardState.restored`), and gives each input the part in autograd it had (`with_status`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ForwardState", "autocast_state", "autograd_status", "with_status"]


def autocast_state(device: torch.device) -> tuple[tuple[str, bool, torch.dtype, bool], ...]:
    """Autocast as it is now, for the CPU and ``device``'s type: ``(device type, enabled,
    dtype, weight cache enabled)`` each. Part of what decides what autograd saves.

    >>> autocast_state(torch.device("cpu"))
    (('cpu', False, torch.bfloat16, True),)
    """
    device_types = ("cpu",) if device.type == "cpu" else ("cpu", device.type)
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), cache)
        for kind in device_types
    )


@dataclass(frozen=True)
class ForwardState:
    """Grad mode and autocast of a forward (Note [re-run state]).

    >>> state = ForwardState.now(torch.device("cpu"))
    >>> with torch.no_grad(), state.restored():
    ...     torch.is_grad_enabled()
    True
    """

    grad_enabled: bool
    autocast: tuple

    @classmethod
    def now(cls, device: torch.device) -> ForwardState:
        """The state in force now, for a block on ``device``."""
        return cls(torch.is_grad_enabled(), autocast_state(device))

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run under this grad mode and autocast state."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
                )
            yield

    @property
    def half_precision(self) -> bool:
        """Whether autocast computes in a half-precision dtype."""
        return any(
            enabled and dtype in (torch.bfloat16, torch.float16) for _, enabled, dtype, _ in self.autocast
        )


def autograd_status(value: Any) -> str | None:
    """How a block input took part in autograd: ``None`` (not at all), ``"leaf"`` (a leaf that
    requires grad), ``"leaf_view"`` (a view of one) or ``"intermediate"``.

    >>> autograd_status(torch.ones(1)), autograd_status(torch.ones(1, requires_grad=True))
    (None, 'leaf')
    """
    if not isinstance(value, torch.Tensor) or not value.requires_grad:
        return None
    if value.is_leaf:
        return "leaf"
    base = value._base
    return "leaf_view" if base is not None and base.is_leaf and base.requires_grad else "intermediate"


def with_status(status: str | None, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` made to take part in autograd as the original tensor did (`autograd_status`),
    so both passes save the same tensors: whether an operand requires grad decides what an
    operation saves, and the pack filter skips leaves (an exact clone makes an intermediate).

    >>> with_status("intermediate", torch.ones(2)).grad_fn is not None
    True
    """
    if status is None or not rows.is_floating_point():
        return rows
    leaf = rows.requires_grad_(True)
    if status == "leaf":
        return leaf
    return leaf.view_as(leaf) if status == "leaf_view" else leaf.clone()
