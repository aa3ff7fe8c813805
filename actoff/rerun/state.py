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

__all__ = ["ForwardState", "RngState", "autocast_state", "autograd_status", "with_status"]


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


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state (and the tensor's device's) before a chunk's forward.

    `restore` restores it inside ``torch.random.fork_rng``, so the recompute draws the same
    random numbers (the same dropout mask) as the forward did, and the caller's RNG stream
    continues afterwards as if nothing had been drawn.

    >>> state = RngState.capture(torch.device("cpu"))
    >>> first = torch.rand(3)
    >>> with state.restore():
    ...     torch.equal(torch.rand(3), first)
    True
    """

    cpu: torch.Tensor
    device: torch.device | None  # None: the CPU generator is all there is
    device_state: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        if device.type in ("cpu", "meta"):
            return cls(torch.get_rng_state(), None, None)
        module = torch.get_device_module(device)
        return cls(torch.get_rng_state(), device, module.get_rng_state(device))

    def same_as(self, other: RngState) -> bool:
        """Whether no random number was drawn between the two captures."""
        if not torch.equal(self.cpu, other.cpu):
            return False
        return self.device_state is None or torch.equal(self.device_state, other.device_state)  # type: ignore[arg-type]

    def drawn_since(self) -> bool:
        """Whether a random number was drawn since this capture."""
        return not self.same_as(RngState.capture(self.device or torch.device("cpu")))

    def set(self) -> None:
        """The generators back to this state, for good (`restore` only within its block)."""
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(self.device).set_rng_state(self.device_state, self.device)

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        if self.device is None:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self.cpu)
                yield
            return
        module = torch.get_device_module(self.device)
        index = self.device.index if self.device.index is not None else module.current_device()
        with torch.random.fork_rng(devices=[index], device_type=self.device.type):
            torch.set_rng_state(self.cpu)
            module.set_rng_state(self.device_state, self.device)
            yield
