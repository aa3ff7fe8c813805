"""Dropout in a re-run: the forward's masks, drawn again at full length and sliced.

Note [dropout in a re-run]: dropout draws a mask the size of its input, so a re-run on a
token slice would draw other masks (other values in every row). The forward notes the input
shape and strides of each ``F.dropout`` call (`dropout_call`; ``nn.Dropout`` and PEFT's ``lora_dropout``
call it), and the re-run, which starts from the forward's RNG state, draws each mask again at
that full shape, in the same order, with the same kernel, so with the same random numbers, then
takes the rows of its slice (`sliced_dropout`). What autograd saves is what the forward's call
saved, on those rows: the scaled mask of the CPU kernel (``input * noise``), the boolean mask of
the fused CUDA kernel (``native_dropout``). A block that draws random numbers a re-run does
not (dropout inside attention, which the re-run serves from its stored output) shifts the
later masks: its rows differ, the probe or the sentinel rows see it, and the block is placed
whole.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["dropout_call", "sliced_dropout"]

# Devices whose dropout is the fused kernel (aten's is_fused_kernel_acceptable): its mask is saved.
_FUSED = ("cuda", "xpu")


def dropout_call(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, float] | None:
    """``(input, p)`` of a call of ``F.dropout`` that draws a mask (training, ``0 < p < 1``, not in
    place), else ``None``.

    >>> x = torch.ones(2, 3)
    >>> dropout_call(F.dropout, (x, 0.1), {})[1], dropout_call(F.dropout, (x, 0.1), {"training": False})
    (0.1, None)
    """
    if func is not F.dropout:
        return None
    names = ("input", "p", "training", "inplace")
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    x, p = bound.get("input"), bound.get("p", 0.5)
    if not isinstance(x, torch.Tensor) or not bound.get("training", True) or bound.get("inplace", False):
        return None
    return (x, p) if 0 < p < 1 and x.numel() else None


class _SavedMask(torch.autograd.Function):
    """``x * mask * scale`` saving the boolean mask, as the fused dropout kernel's backward does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask.to(x.dtype) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype) * ctx.scale, None, None


def sliced_dropout(
    x: torch.Tensor, p: float, full: tuple[tuple[int, ...], tuple[int, ...]], dim: int, start: int
) -> torch.Tensor:
    """Dropout of ``x``, rows ``[start, start + len)`` along ``dim`` of the forward's input,
    whose shape and strides were ``full``, with the mask the forward drew for it (Note [dropout
    in a re-run]). The mask is drawn on a tensor laid out as that input was: the kernels
    draw in memory order, so a permuted input (``(B, S, H)`` seen from ``(S, B, H)``) gets
    another mask than a contiguous one.

    >>> x = torch.randn(2, 8, 4)
    >>> _ = torch.manual_seed(0); full = F.dropout(x, 0.5)
    >>> _ = torch.manual_seed(0); rows = sliced_dropout(x[:, 5:], 0.5, ((2, 8, 4), x.stride()), 1, 5)
    >>> torch.equal(rows, full[:, 5:])
    True
    """
    length = x.shape[dim]
    # ones_like keeps the layout where the kernel's own empty_like would (dense strides).
    ones = torch.ones_like(torch.empty_strided(*full, dtype=x.dtype, device=x.device))
    with torch.no_grad():
        if x.device.type in _FUSED:
            _, mask = torch.native_dropout(ones, p, True)
        else:
            noise = F.dropout(ones, p, True)  # the CPU kernel: ones * (bernoulli / (1 - p))
    if x.device.type in _FUSED:  # with grad: the re-run's graph saves the mask, as forward's did
        return _SavedMask.apply(x, mask.narrow(dim, start, length), 1.0 / (1.0 - p))
    return x * noise.narrow(dim, start, length)
