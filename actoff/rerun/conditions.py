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

# Non-tensor inputs kept by value in the key; others by type (a cache object, say). Integers
# (not bools) count by type: a packing collator hands every decoder layer the batch's longest
# document as an int (TRL's max_length_q and max_length_k), and by value every packed batch was
# new conditions, probed again (Note [what a key keeps]).
_BY_VALUE = (bool, float, str, bytes, torch.dtype, torch.device)


# Note [what a key keeps]: a block's conditions must change when what it saves can change, and
# nothing else: a key that changes with every batch makes every batch new (stored whole, probed
# again, never planned), and each key keeps its probe result. So integers count by type, and so do
# the sizes of tensors without a dimension of the sequence's length (per-batch metadata: a packed
# batch's cu_seq_lens, one more than its documents); the tensors that carry the tokens count by
# shape. Nothing is taken on trust: a probe result serves a forward only if it saved the same
# tensors (`actoff.tiers.tokenwise.split.Split.saves`), every re-run checks its saves' shapes,
# and backward checks each step's recomputed rows (Note [sentinel rows]).
def conditions(
    values: list[Any],
    spec: Any,
    module: torch.nn.Module | None,
    grad_enabled: bool,
    autocast: tuple,
    seq_len: int | None = None,
    *,
    tokens: int | None = None,
) -> tuple:
    """What decides what a block saves, as a hashable key (Note [probes per module and conditions]).

    ``values`` are the flattened inputs and ``spec`` their pytree structure; ``autocast`` is
    `actoff.rerun.state.autocast_state`. Tensors count by shape (batch included), strides, dtype,
    device and how they take part in autograd, those without a dimension of the sequence's length
    ``tokens`` by rank (Note [what a key keeps]); other inputs by value when plain (integers by
    type), else by type; the module by the training flag of every submodule and the dtype,
    ``requires_grad`` and shape of every parameter. With ``seq_len``, the key of every length
    (Note [a probe serves other lengths]): tensors count by rank and strides by their order.

    >>> x = torch.zeros(2, 8, 4)
    >>> key = conditions([x], None, None, True, ())
    >>> key == conditions([torch.ones(2, 8, 4)], None, None, True, ())  # values do not count
    True
    >>> key == conditions([torch.zeros(1, 8, 4)], None, None, True, ())  # a smaller batch does
    False
    >>> conditions([x], None, None, True, (), 8) == conditions([torch.zeros(2, 5, 4)], None, None, True, (), 5)
    True
    >>> packed = lambda documents, longest: conditions(  # a packed batch's metadata
    ...     [x, torch.zeros(documents + 1), longest], None, None, True, (), tokens=8)
    >>> packed(3, 5) == packed(4, 6)
    True
    """
    length = seq_len if seq_len is not None else tokens
    inputs = tuple(_input_key(value, length, seq_len is not None) for value in values)
    if module is None:
        return (spec, inputs, grad_enabled, autocast)
    training = tuple(m.training for m in module.modules())
    parameters = tuple((p.dtype, p.requires_grad, p.shape) for p in module.parameters())
    return (spec, inputs, grad_enabled, autocast, training, parameters)


def _input_key(value: Any, length: int | None, any_length: bool) -> Any:
    if isinstance(value, torch.Tensor):
        strides: Any = value.stride() if value.layout == torch.strided else value.layout
        shape: Any = tuple(value.shape)
        ordered = length is not None and (any_length or length not in shape)
        if ordered and value.layout == torch.strided:  # their order, and whether they are dense
            strides = (
                tuple(sorted(range(value.dim()), key=lambda i: -value.stride(i))),
                value.is_contiguous(),
            )
        if any_length or (length is not None and length not in shape):
            # Of every length: tensors by rank (a hidden size equal to the length would make any
            # shape with the length left out ambiguous), and per-batch metadata always by rank
            # (Note [what a key keeps]); `actoff.tiers.tokenwise.probes.transferred` checks the rest.
            shape = value.dim()
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
    tokens: int | None = None  # the sequence's length, on the first tensor input

    @classmethod
    def of(
        cls,
        args: tuple,
        kwargs: dict,
        module: torch.nn.Module | None,
        device: torch.device,
        token_dim: int = 1,
    ) -> FlatCall:
        """Flatten a call of ``module`` (``None``: a function scope) on ``device``, its sequence's
        length read on its first tensor along ``token_dim``."""
        # Inputs may nest (Hugging Face passes position_embeddings=(cos, sin)).
        values, spec = pytree.tree_flatten((args, kwargs))
        forward = ForwardState.now(device)
        first = next((value for value in values if isinstance(value, torch.Tensor)), None)
        tokens = first.shape[token_dim] if first is not None and first.dim() > token_dim else None
        key = conditions(values, spec, module, forward.grad_enabled, forward.autocast, tokens=tokens)
        return cls(values, spec, forward, key, tokens)
