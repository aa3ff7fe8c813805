"""Triton kernels for actoff._pack: strided token rows to and from a contiguous buffer.

Kept in their own module so that importing actoff never imports Triton. A view has at most
four dimensions (padded with leading 1s); element ``index`` of it, in row-major order, lives
at ``strided_offsets(index, ...)`` in its storage.
"""

import triton
import triton.language as tl


@triton.jit
def strided_offsets(index, s1, s2, s3, t0, t1, t2, t3):
    """Row-major element ``index`` of a (s0, s1, s2, s3) view to its offset by strides t0..t3."""
    i3 = index % s3
    rest = index // s3
    i2 = rest % s2
    rest = rest // s2
    i1 = rest % s1
    i0 = rest // s1
    return i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3


@triton.jit
def gather(src, dst, numel, s1, s2, s3, t0, t1, t2, t3, BLOCK: tl.constexpr):
    """Strided ``src`` view to contiguous ``dst``."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = index < numel
    values = tl.load(src + strided_offsets(index, s1, s2, s3, t0, t1, t2, t3), mask=mask)
    tl.store(dst + index, values, mask=mask)


@triton.jit
def scatter(src, dst, numel, s1, s2, s3, t0, t1, t2, t3, BLOCK: tl.constexpr):
    """Contiguous ``src`` to strided ``dst`` view."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = index < numel
    values = tl.load(src + index, mask=mask)
    tl.store(dst + strided_offsets(index, s1, s2, s3, t0, t1, t2, t3), values, mask=mask)
