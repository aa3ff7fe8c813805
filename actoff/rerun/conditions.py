"""A block call's conditions: what decides what the block saves, as a hashable key.

What a probe learned about a block (actoff.tiers.tokenwise.probes) and what the auto policy measured
of it (actoff.runtime.auto) hold only under the conditions they were learned under: Note [probes per
module and conditions] in actoff.tiers.tokenwise.probes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .state import ForwardState, autograd_status

__all__ = ["FlatCall", "conditions"]

# Non-tensor inputs kept by value in the key; others by type (a cache object, say).
_BY_VALUE = (bool, int, float, str, bytes, torch.dtype, torch.device)


def conditions(
    values: list[Any],
    spec: Any,
    module: torch.nn.Module | None,
    grad_enabled: bool,
    autocast: tuple,
    seq_len: int | None = None,
) -> tuple:
    """What decides what a block saves, as a hashable key (Note [probes per module and conditions]).

    ``values`` are the flattened inputs and ``spec`` their pytree structure; ``autocast`` is
    `actoff.rerun.state.autocast_state`. Tensors count by shape (batch included), strides, dtype,
    device and how they take part in autograd; other inputs by value when plain, else by type;
    the module by the training flag of every submodule and the dtype, ``requires_grad`` and
    shape of every parameter. With ``seq_len``, the key of every length
    (Note [a probe serves other lengths]): dimensions of that length count as "a length" and
    strides by their order.

    >>> x = torch.zeros(2, 8, 4)
    >>> key = conditions([x], None, None, True, ())
    >>> key == conditions([torch.ones(2, 8, 4)], None, None, True, ())  # values do not count
    True
    >>> key == conditions([torch.zeros(1, 8, 4)], None, None, True, ())  # a smaller batch does
    False
    >>> conditions([x], None, None, True, (), 8) == conditions([torch.zeros(2, 5, 4)], None, None, True, (), 5)
    True
    """
    inputs = tuple(_input_key(value, seq_len) for value in values)
    if module is None:
        return (spec, inputs, grad_enabled, autocast)
    training = tuple(m.training for m in module.modules())
    parameters = tuple((p.dtype, p.requires_grad, p.shape) for p in module.parameters())
    return (spec, inputs, grad_enabled, autocast, training, parameters)


def _input_key(value: Any, seq_len: int | None) -> Any:
    if isinstance(value, torch.Tensor):
        strides = value.stride() if value.layout == torch.strided else value.layout
        shape = tuple(value.shape)
        if seq_len is not None:
            shape = tuple(-1 if n == seq_len else n for n in shape)
            if value.layout == torch.strided:  # their order, and whether they are dense
                strides = (
                    tuple(sorted(range(value.dim()), key=lambda i: -value.stride(i))),
                    value.is_contiguous(),
                )
        return (shape, strides, value.dtype, value.device, autograd_status(value))
    if value is None or type(value) in _BY_VALUE:
        return value
    return type(value)


@dataclass
class FlatCall:
    """A block call flattened for whoever needs its inputs one by one: the leaves of
    ``(args, kwargs)`` and their structure, the forward's state, and the call's `conditions`.
    Computed once per call (the auto policy keys its measurements by it, a token-wise run keeps
    its inputs from it).

    >>> flat = FlatCall.of((torch.zeros(2, 8, 4),), {"scale": 2}, None, torch.device("cpu"))
    >>> len(flat.values), flat.forward.grad_enabled
    (2, True)
    """

    values: list[Any]
    spec: Any
    forward: ForwardState
    conditions: tuple

    @classmethod
    def of(cls, args: tuple, kwargs: dict, module: torch.nn.Module | None, device: torch.device) -> FlatCall:
        """Flatten a call of ``module`` (``None``: a function scope) on ``device``."""
        # Inputs may nest (Hugging Face passes position_embeddings=(cos, sin)).
        values, spec = pytree.tree_flatten((args, kwargs))
        forward = ForwardState.now(device)
        return cls(
            values, spec, forward, conditions(values, spec, module, forward.grad_enabled, forward.autocast)
        )
