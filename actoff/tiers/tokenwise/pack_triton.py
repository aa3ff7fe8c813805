"""Triton kernel for actoff.tiers.tokenwise.pack: strided token rows to and from a contiguous buffer.

Kept in its own module so that importing actoff never imports Triton. The caller hands over
a view already reduced to rows (see ``_pack._rows``): ``num_rows`` rows, the row index split
over three outer dimensions ``(n0, n1, n2)`` with element strides ``t0, t1, t2``, and
``row_len`` elements per row ``t3`` apart (1 when the innermost dimension is contiguous, the
common case). The contiguous side is row-major: element ``col`` of row ``row`` sits at
``row * row_len + col``.

Note [index arithmetic]: a program copies a tile of ``BLOCK_R`` rows by ``BLOCK_C`` columns
(``BLOCK_R * BLOCK_C`` is about 1024 elements). What each level costs:
- per element: one multiply-add, ``col * t3`` (Triton specialises ``t3 == 1`` away, the common
  case), and the adds that broadcast a row's offset over its columns;
- per row of the tile: splitting the row index into its three outer coordinates, two int64
  divisions and two modulos (the modulo reuses the quotient). A GPU has no integer divider:
  an int64 division is a software sequence of some tens of instructions. With rows of a
  hidden size (thousands of elements) that is well under one instruction per element; with
  short rows (8 elements, a head dimension split) it is several per element, about what a
  2-byte copy at full memory bandwidth leaves to spare: measure it there before tuning;
- per program: splitting the program id into (row block, column block), one division.
A 2-D launch (row blocks on grid axis 0, column blocks on axis 1) would remove only that last
division, one per ~1024 elements, and CUDA caps grid axes 1 and 2 at 65535 blocks, which a
long merged row (a contiguous slice is one row of up to ``S * H`` elements) exceeds: the
launch stays 1-D. Removing the per-row divisions needs the outer coordinates on the grid
(a 3-D launch, same 65535 cap) or int32 index arithmetic where sizes fit (cheaper divisions);
neither is done until a GPU measurement shows the kernel is not bound by memory bandwidth.
"""

import triton
import triton.language as tl


@triton.jit
def copy_rows(src, dst, num_rows, row_len, n1, n2, t0, t1, t2, t3,
              STRIDED_SRC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Strided rows of ``src`` to contiguous ``dst`` (``STRIDED_SRC``), or the reverse."""
    col_blocks = tl.cdiv(row_len, BLOCK_C)
    program = tl.program_id(0).to(tl.int64)
    row_block = program // col_blocks
    col_block = program % col_blocks
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # (BLOCK_R,)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)  # (BLOCK_C,)
    # Note [index arithmetic]: per row, not per element.
    i2 = rows % n2
    rest = rows // n2
    i1 = rest % n1
    i0 = rest // n1
    strided = (i0 * t0 + i1 * t1 + i2 * t2)[:, None] + (cols * t3)[None, :]  # (BLOCK_R, BLOCK_C)
    packed = (rows * row_len)[:, None] + cols[None, :]
    mask = (rows < num_rows)[:, None] & (cols < row_len)[None, :]
    if STRIDED_SRC:
        values = tl.load(src + strided, mask=mask)
        tl.store(dst + packed, values, mask=mask)
    else:
        values = tl.load(src + packed, mask=mask)
        tl.store(dst + strided, values, mask=mask)
