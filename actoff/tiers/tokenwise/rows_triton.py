"""Triton kernel for actoff.tiers.tokenwise.rows: strided token rows to and from a contiguous buffer.

Kept in its own module so that importing actoff never imports Triton. The caller hands over
a view already reduced to rows (see ``rows._rows``): ``num_rows`` rows, the row index split
over three outer dimensions ``(n0, n1, n2)`` with element strides ``t0, t1, t2``, and
``row_len`` elements per row ``t3`` apart (1 when the innermost dimension is contiguous, the
common case). The contiguous side is row-major: element ``col`` of row ``row`` sits at
``row * row_len + col``.

Note [index arithmetic]: the int64 division that splits a row index into its three outer
coordinates is paid once per row of a tile, never per element. A program copies a tile of
``BLOCK_R`` rows by ``BLOCK_C`` columns (about 1024 elements); per element it does one
multiply-add, ``col * t3`` (Triton specialises ``t3 == 1`` away), and the adds that broadcast a
row's offset over its columns. A GPU has no integer divider: an int64 division is a software
sequence of tens of instructions, well under one per element for rows of a hidden size but
several per element for short rows (a head dimension split). The launch stays 1-D (one division
per program, to split its id): CUDA caps grid axes 1 and 2 at 65535 blocks, which a long merged
row (up to ``S * H`` elements) exceeds.
"""

import triton
import triton.language as tl


@triton.jit
def copy_rows(
    src,
    dst,
    num_rows,
    row_len,
    n1,
    n2,
    t0,
    t1,
    t2,
    t3,
    STRIDED_SRC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Strided rows of ``src`` to contiguous ``dst`` (``STRIDED_SRC``), or the reverse."""
    col_blocks = tl.cdiv(row_len, BLOCK_C)
    program = tl.program_id(0).to(tl.int64)
    row_block = program // col_blocks
    col_block = program % col_blocks
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # (BLOCK_R,)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)  # (BLOCK_C,)
    # Per row, not per element (Note [index arithmetic]).
    i2 = rows % n2
    rest = rows // n2
    i1 = rest % n1
    i0 = rest // n1
    strided = (i0 * t0 + i1 * t1 + i2 * t2)[:, None] + (cols * t3)[None, :]  # (BLOCK_R, BLOCK_C)
    flat = (rows * row_len)[:, None] + cols[None, :]
    mask = (rows < num_rows)[:, None] & (cols < row_len)[None, :]
    if STRIDED_SRC:
        values = tl.load(src + strided, mask=mask)
        tl.store(dst + flat, values, mask=mask)
    else:
        values = tl.load(src + flat, mask=mask)
        tl.store(dst + strided, values, mask=mask)
