"""Token rows gathered: the selected rows of several saved tensors copied into one contiguous
staging buffer, and scattered back. Triton kernels on CUDA; torch copies everywhere else.

A source is a strided view (the rows ``[start, stop)`` of a record's canonical tensor); the
staging buffer is uint8 and each source lands at a 16-byte-aligned byte offset in it.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["gather_rows", "row_offsets", "scatter_rows", "triton_available"]

_ALIGN = 16
_MAX_DIMS = 4
_BLOCK = 1024


def row_offsets(views: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of each view in the staging buffer, and the buffer's size.

    >>> row_offsets([torch.empty(3), torch.empty(2, dtype=torch.float64)])
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
def _kernel():
    from .rows_triton import copy_rows  # imports triton: only when a kernel runs

    return copy_rows


# Triton has no complex, bool or (in every version) float8 types, and the copy needs none:
# every element is moved as the integer of its width.
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(view: torch.Tensor) -> torch.Tensor | None:
    """``view``'s bytes as a same-width integer view with the same layout, or ``None``.

    Complex tensors become (..., 2) real views first (``view_as_real``: any strides), so a
    complex128 element is two int64s. Conjugate or negative views carry lazy bits that a raw
    copy would drop: they take the torch path.
    """
    if view.is_conj() or view.is_neg():
        return None
    if view.is_complex():
        view = torch.view_as_real(view)
    dtype = _INT_OF_WIDTH.get(view.element_size())
    return None if dtype is None else view.view(dtype)


def _rows(view: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``view`` as rows: sizes ``[n0, n1, n2, row_len]`` and element strides ``[t0, t1, t2, t3]``.

    Size-1 dimensions are dropped and neighbours contiguous with each other merged, so a
    (B, S, H) slice of a contiguous tensor is rows of ``H`` (or one long row); ``None`` when
    more than four dimensions remain.

    >>> _rows(torch.empty(2, 40, 24)[:, 10:27])
    ([1, 1, 2, 408], [0, 0, 960, 1])
    """
    merged: list[list[int]] = []
    for size, stride in zip(view.shape, view.stride(), strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > _MAX_DIMS:
        return None
    merged = [[1, 0]] * (_MAX_DIMS - len(merged)) + (merged or [])
    if merged[-1][0] == 1:  # a single element: one row of one
        merged[-1] = [1, 1]
    return [size for size, _ in merged], [stride for _, stride in merged]


def _use_triton(view: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        use_triton = view.is_cuda
    return use_triton and triton_available() and view.numel() > 0


def _launch(strided: torch.Tensor, slot: torch.Tensor, *, strided_src: bool) -> bool:
    """Copy between ``strided`` and its contiguous ``slot``; False when the kernel cannot."""
    import triton

    strided, gathered = _as_int(strided), _as_int(slot)
    shape = _rows(strided) if strided is not None else None
    if shape is None:
        return False
    (n0, n1, n2, row_len), strides = shape
    num_rows = n0 * n1 * n2
    # A tile of about _BLOCK elements, as many rows as fit when rows are short, so the row index
    # split is paid once per row (Note [index arithmetic], actoff.tiers.tokenwise.rows_triton).
    block_c = min(_BLOCK, triton.next_power_of_2(row_len))
    block_r = min(_BLOCK // block_c, triton.next_power_of_2(num_rows))
    grid = (triton.cdiv(num_rows, block_r) * triton.cdiv(row_len, block_c),)
    src, dst = (strided, gathered) if strided_src else (gathered, strided)
    _kernel()[grid](
        src,
        dst,
        num_rows,
        row_len,
        n1,
        n2,
        *strides,
        STRIDED_SRC=strided_src,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
    )
    return True


def gather_rows(
    views: list[torch.Tensor], *, use_triton: bool | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Copy each (strided) view into one new contiguous uint8 buffer; return it and the offsets.

    ``use_triton=None`` uses the Triton kernel for CUDA tensors when Triton is available. Every
    dtype takes it (moved as integers of its width); views with more than four dimensions that
    do not merge, and conjugate views, take torch's copy.

    >>> base = torch.arange(24.0).view(2, 3, 4)
    >>> buffer, offsets = gather_rows([base[:, 1:], base[:, :1]])
    >>> buffer[offsets[1]:].view(torch.float32)[:4].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    offsets, total = row_offsets(views)
    device = views[0].device if views else torch.device("cpu")
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for view, offset in zip(views, offsets, strict=True):
        slot = _slot(buffer, offset, view)
        if not (_use_triton(view, use_triton) and _launch(view, slot, strided_src=True)):
            slot.view(view.shape).copy_(view)
    return buffer, offsets


def scatter_rows(
    buffer: torch.Tensor, offsets: list[int], views: list[torch.Tensor], *, use_triton: bool | None = None
) -> None:
    """Copy the gathered rows back into each (strided) destination view, in place."""
    for view, offset in zip(views, offsets, strict=True):
        slot = _slot(buffer, offset, view)
        if not (_use_triton(view, use_triton) and _launch(view, slot, strided_src=False)):
            view.copy_(slot.view(view.shape))
