"""Token geometry: token dimensions of saved tensors, their canonical views, and token ranges.

Pure functions on shapes and numbers, so they are tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Canon",
    "TokenRanges",
    "base_info",
    "changed_dim",
    "detect_canon",
    "token_ranges",
    "unique_dim",
]


def unique_dim(shape: tuple[int, ...], size: int) -> int | None:
    """The only dimension of ``shape`` equal to ``size``, else ``None`` (none or several).

    >>> unique_dim((2, 128, 64), 128), unique_dim((128, 128), 128), unique_dim((4,), 8)
    (1, None, None)
    """
    found = [i for i, n in enumerate(shape) if n == size]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class Canon:
    """How to see a saved tensor's storage span as a tensor with a token dimension.

    ``shape``/``stride`` describe the saved view itself, or its ``_base`` when ``on_base``
    (linear layers save ``(B*S, H)`` views of ``(B, S, H)`` tensors: no dimension is S);
    ``dim`` is the token dimension in ``shape``. Offsets are relative to the copied span.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dim: int
    on_base: bool = False

    def view(self, flat: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """The canonical tensor over a 1-D buffer holding ``pad`` spare elements, then the span.

        ``flat`` may itself start inside its storage (the span of a ``chunk`` of a fused
        projection starts at the chunk's offset): ``as_strided`` takes an absolute storage
        offset, so ``flat``'s own offset is added, never assumed zero.

        >>> storage = torch.arange(12.0)
        >>> Canon((2, 3), (3, 1), 1).view(storage[6:]).tolist()
        [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]
        """
        return flat.as_strided(self.shape, self.stride, flat.storage_offset() + pad)

    def source(self, saved: torch.Tensor) -> torch.Tensor | None:
        """The tensor to take rows from among a re-run's save: the view or its base."""
        return saved._base if self.on_base else saved


def base_info(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Shape and strides of ``tensor._base`` when the view covers exactly the base's memory
    (a merged view such as ``(B*S, H)`` of ``(B, S, H)``), else ``None``.

    >>> base_info(torch.zeros(2, 16, 8).view(32, 8))
    ((2, 16, 8), (128, 8, 1))
    """
    base = tensor._base
    if (
        base is None
        or base.numel() != tensor.numel()
        or base.storage_offset() != tensor.storage_offset()
        or not (_dense(tensor) and _dense(base))
    ):
        return None
    return tuple(base.shape), tuple(base.stride())


def _dense(t: torch.Tensor) -> bool:
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def changed_dim(
    forward_shape: tuple[int, ...], reforward_shape: tuple[int, ...], seq_len: int, length: int
) -> int | None:
    """The token dimension, found by comparing a save of the forward pass (``seq_len`` tokens)
    with the same save of a re-run on ``length`` tokens: the one dimension that went from
    ``seq_len`` to ``length``. Dimensions that merely equal ``seq_len`` (a hidden size of 4096
    at 4096 tokens) do not change and are not mistaken for it.

    >>> changed_dim((2, 128, 128), (2, 64, 128), 128, 64)
    1
    >>> changed_dim((256, 128), (128, 128), 128, 64) is None  # (B*S, H): not on the view
    True
    """
    if len(forward_shape) != len(reforward_shape) or seq_len == length:
        return None
    diff = [i for i, (a, b) in enumerate(zip(forward_shape, reforward_shape, strict=True)) if a != b]
    if len(diff) == 1 and forward_shape[diff[0]] == seq_len and reforward_shape[diff[0]] == length:
        return diff[0]
    return None


def detect_canon(
    view: tuple[tuple[int, ...], tuple[int, ...]],
    base: tuple[tuple[int, ...], tuple[int, ...]] | None,
    reforward_shape: tuple[int, ...],
    reforward_base_shape: tuple[int, ...] | None,
    seq_len: int,
    length: int,
) -> Canon | None:
    """The `Canon` of a record from its forward view (and base) and the shapes of its
    re-run save (and of that save's base, if it is a view).

    >>> detect_canon(((4, 8), (8, 1)), ((2, 2, 8), (32, 8, 1)), (2, 8), (2, 1, 8), 2, 1)
    Canon(shape=(2, 2, 8), stride=(32, 8, 1), dim=1, on_base=True)
    """
    dim = changed_dim(view[0], reforward_shape, seq_len, length)
    if dim is not None:
        return Canon(view[0], view[1], dim)
    if base is not None and reforward_base_shape is not None:
        dim = changed_dim(base[0], reforward_base_shape, seq_len, length)
        if dim is not None:
            return Canon(base[0], base[1], dim, on_base=True)
    return None


@dataclass(frozen=True)
class TokenRanges:
    """Tokens ``[0, cpu_end)`` to host memory, ``[cpu_end, nvme_end)`` to NVMe, the rest recomputed."""

    seq_len: int
    cpu_end: int
    nvme_end: int

    @property
    def recompute(self) -> tuple[int, int]:
        return self.nvme_end, self.seq_len

    @property
    def recompute_len(self) -> int:
        return self.seq_len - self.nvme_end


def token_ranges(seq_len: int, cpu_fraction: float, nvme_fraction: float) -> TokenRanges:
    """Split ``seq_len`` tokens by fractions (rounded to whole tokens, cpu first).

    >>> token_ranges(100, 0.3, 0.3)
    TokenRanges(seq_len=100, cpu_end=30, nvme_end=60)
    """
    if cpu_fraction + nvme_fraction > 1.0 + 1e-9:
        raise ValueError(f"fractions {cpu_fraction} + {nvme_fraction} exceed 1")
    cpu_end = round(seq_len * cpu_fraction)
    nvme_end = min(seq_len, cpu_end + round(seq_len * nvme_fraction))
    return TokenRanges(seq_len, cpu_end, nvme_end)
