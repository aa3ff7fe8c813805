"""Token-wise placement decisions: token dimensions, canonical views, ranges, MEMO's closed form.

Pure functions on shapes and numbers, so they are tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Canon", "TokenRanges", "auto_fractions", "canonical_view", "token_ranges", "unique_dim"]


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

    ``shape``/``stride``/``offset`` are relative to the record's copied span (elements);
    ``dim`` is the token dimension in ``shape``.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dim: int

    def view(self, flat: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """The canonical tensor over a 1-D buffer holding ``pad`` spare elements, then the span."""
        return flat.as_strided(self.shape, self.stride, pad + self.offset)

    def row_elements(self) -> int:
        """Elements in one token row (all dimensions but the token one)."""
        count = 1
        for i, n in enumerate(self.shape):
            if i != self.dim:
                count *= n
        return count


def canonical_view(tensor: torch.Tensor, seq_len: int) -> Canon | None:
    """Token-dimension view of ``tensor``: on the tensor itself if exactly one dimension has the
    sequence length, else on its ``_base`` when the tensor is a merged view of it (linear layers
    save ``(B*S, H)``); ``None`` when neither works (the tensor is then stored whole).

    Offsets are relative to the tensor's own storage offset (the start of its copied span).

    >>> base = torch.zeros(2, 16, 8)
    >>> canonical_view(base.view(32, 8), 16).dim
    1
    """
    dim = unique_dim(tuple(tensor.shape), seq_len)
    if dim is not None:
        return Canon(tuple(tensor.shape), tuple(tensor.stride()), 0, dim)
    base = tensor._base
    if base is None or base.numel() != tensor.numel():
        return None
    dim = unique_dim(tuple(base.shape), seq_len)
    if dim is None or base.storage_offset() != tensor.storage_offset():
        return None
    # The view must cover exactly the base's elements in the base's memory order.
    if not _same_memory(tensor, base):
        return None
    return Canon(tuple(base.shape), tuple(base.stride()), 0, dim)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both are dense (no gaps, no overlap) over the same elements, so either can view them."""
    return _dense(a) and _dense(b)


def _dense(t: torch.Tensor) -> bool:
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


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


@dataclass(frozen=True)
class AutoDecision:
    """The `auto` policy's choice for one block shape, with its inputs (reported in stats)."""

    cpu_fraction: float
    nvme_fraction: float
    bandwidth_gbps: float  # host link, bytes per ns
    t_layer_ms: float
    input_bytes: int
    attention_bytes: int
    other_bytes: int
    host_budget_per_layer: float | None
    reason: str


def auto_fractions(
    *,
    bandwidth_bytes_per_s: float,
    t_layer_s: float,
    input_bytes: int,
    attention_bytes: int,
    other_bytes: int,
    num_layers: int,
    host_budget: int | None,
    nvme_available: bool,
) -> AutoDecision:
    """MEMO's closed form for the stored fraction of the token-local activations.

    ``alpha = clip(min((B*T - S_in - S_attn) / S_other, (M_cpu/(n-2) - S_in - S_attn) / S_other), 0, 1)``:
    store as much as the host link can copy during one block's forward, within the host budget.
    When the budget binds and an NVMe directory is set, the part the link could still hide
    goes to NVMe instead of being recomputed.

    >>> d = auto_fractions(bandwidth_bytes_per_s=1e9, t_layer_s=0.01, input_bytes=2_000_000,
    ...                    attention_bytes=2_000_000, other_bytes=12_000_000, num_layers=8,
    ...                    host_budget=None, nvme_available=False)
    >>> round(d.cpu_fraction, 3)
    0.5
    """
    fixed = input_bytes + attention_bytes
    other = max(other_bytes, 1)
    alpha_time = (bandwidth_bytes_per_s * t_layer_s - fixed) / other
    per_layer = None if host_budget is None else host_budget / max(num_layers - 2, 1)
    alpha_memory = float("inf") if per_layer is None else (per_layer - fixed) / other
    clip = lambda value: min(max(value, 0.0), 1.0)  # noqa: E731
    cpu = clip(min(alpha_time, alpha_memory))
    nvme = 0.0
    reason = "host link bound" if alpha_time <= alpha_memory else "host budget bound"
    if nvme_available and alpha_memory < alpha_time:
        nvme = clip(alpha_time) - cpu
        reason = "host budget bound; spilling to NVMe"
    return AutoDecision(
        cpu_fraction=cpu,
        nvme_fraction=max(nvme, 0.0),
        bandwidth_gbps=bandwidth_bytes_per_s / 1e9,
        t_layer_ms=t_layer_s * 1e3,
        input_bytes=input_bytes,
        attention_bytes=attention_bytes,
        other_bytes=other_bytes,
        host_budget_per_layer=per_layer,
        reason=reason,
    )
