"""Packing token rows: gather the selected rows of several saved tensors into one contiguous
staging buffer, and scatter them back. Triton kernels on CUDA; torch copies everywhere else.

A source is a strided view (the rows ``[start, stop)`` of a record's canonical tensor); the
staging buffer is uint8 and each source lands at a 16-byte-aligned byte offset in it.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["layout_offsets", "pack_rows", "scatter_rows", "triton_available"]

_ALIGN = 16
_MAX_DIMS = 4
_BLOCK = 1024


def layout_offsets(views: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of each view in the staging buffer, and the buffer's size.

    >>> layout_offsets([torch.empty(3), torch.empty(2, dtype=torch.float64)])
    ([0, 16], 32)
    """
    offsets, total = [], 0
    for view in views:
        offsets.append(total)
        total += (view.numel() * view.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, total


def _slot(buffer: torch.Tensor, offset: int, view: torch.Tensor) -> torch.Tensor:
    nbytes = view.numel() * view.element_size()
    return buffer[offset : offset + nbytes].view(view.dtype)


@functools.cache
def triton_available() -> bool:
    """Triton importable, and either a GPU or its interpreter (``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels():
    from ._pack_triton import gather, scatter  # imports triton: only when a kernel runs

    return gather, scatter


def _shape4(view: torch.Tensor) -> tuple[list[int], list[int]] | None:
    shape, stride = list(view.shape), list(view.stride())
    if len(shape) > _MAX_DIMS:
        return None
    pad = _MAX_DIMS - len(shape)
    return [1] * pad + shape, [0] * pad + stride


def _use_triton(view: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        use_triton = view.is_cuda
    return use_triton and triton_available() and view.numel() > 0 and _shape4(view) is not None


def _launch(kernel, src: torch.Tensor, dst: torch.Tensor, strided: torch.Tensor) -> None:
    import triton

    shape, stride = _shape4(strided)
    numel = strided.numel()
    kernel[(triton.cdiv(numel, _BLOCK),)](
        src, dst, numel, shape[1], shape[2], shape[3], *stride, BLOCK=_BLOCK
    )


def pack_rows(views: list[torch.Tensor], *, use_triton: bool | None = None) -> tuple[torch.Tensor, list[int]]:
    """Copy each (strided) view into one new contiguous uint8 buffer; return it and the offsets.

    ``use_triton=None`` uses the Triton kernel for CUDA tensors when Triton is available.

    >>> base = torch.arange(24.0).view(2, 3, 4)
    >>> buffer, offsets = pack_rows([base[:, 1:], base[:, :1]])
    >>> buffer[offsets[1]:].view(torch.float32)[:4].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    offsets, total = layout_offsets(views)
    device = views[0].device if views else torch.device("cpu")
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for view, offset in zip(views, offsets, strict=True):
        slot = _slot(buffer, offset, view)
        if _use_triton(view, use_triton):
            _launch(_kernels()[0], view, slot, view)
        else:
            slot.view(view.shape).copy_(view)
    return buffer, offsets


def scatter_rows(buffer: torch.Tensor, offsets: list[int], views: list[torch.Tensor], *,
                 use_triton: bool | None = None) -> None:  # fmt: skip
    """Copy the packed rows back into each (strided) destination view, in place."""
    for view, offset in zip(views, offsets, strict=True):
        slot = _slot(buffer, offset, view)
        if _use_triton(view, use_triton):
            _launch(_kernels()[1], slot, view, view)
        else:
            view.copy_(slot.view(view.shape))
