"""Packing token rows: Triton kernels (interpreted on CPU, native on GPU) match torch."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from actoff.tiers.tokenwise.rows import gather_rows, row_offsets, scatter_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Everything a saved activation can be: the kernel moves each as the integer of its width.
ALL_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex32,
    torch.complex64, torch.complex128,
    *(getattr(torch, name) for name in dir(torch) if name.startswith(("float8_", "float4_"))),
]  # fmt: skip


def _random(shape, dtype, generator, device="cpu"):
    """Random bits of ``dtype`` (NaN payloads, subnormals and all): copies must keep every bit."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool().to(device)
    itemsize = dtype.itemsize
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=generator)
    with warnings.catch_warnings():  # complex32 warns that it is experimental: a view is fine
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental", UserWarning)
        return raw.view(dtype).to(device)


def _views(dtype, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    bsh = _random((3, 40, 24), dtype, generator, device)  # (B, S, H)
    bhsd = _random((2, 5, 40, 8), dtype, generator, device).transpose(1, 2)  # (B, S, nH, D) view
    sbh = _random((40, 3, 16), dtype, generator, device)  # (S, B, H)
    bhs = _random((2, 24, 40), dtype, generator, device).transpose(1, 2)  # (B, S, H), H strided
    five = _random((3, 5, 40, 7, 8), dtype, generator, device)[::2, ::2, :, ::2, ::2]  # 5 dims: torch copy
    return [
        bsh.narrow(1, 10, 17),
        bhsd.narrow(1, 0, 9),
        sbh.narrow(0, 30, 10),
        bsh[0].narrow(0, 5, 3),
        bhs.narrow(1, 3, 20),
        five.narrow(2, 7, 11),
        bsh[1, 2, 3],
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.shape == b.shape
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_round_trip(dtype):
    views = _views(dtype)
    buffer, offsets = gather_rows(views, use_triton=False)
    assert buffer.dtype == torch.uint8 and all(o % 16 == 0 for o in offsets)
    targets = [torch.zeros_like(v.contiguous()) for v in views]
    targets = [
        t.as_strided(v.shape, v.stride()) if v.is_contiguous() else t
        for v, t in zip(views, targets, strict=True)
    ]
    scatter_rows(buffer, offsets, targets, use_triton=False)
    for view, target in zip(views, targets, strict=True):
        assert _same_bits(view, target)


def test_packed_offsets_are_aligned():
    offsets, total = row_offsets(
        [torch.empty(1, dtype=torch.uint8), torch.empty(3), torch.empty(5, dtype=torch.float16)]
    )
    assert offsets == [0, 16, 32] and total == 48


def test_rows_merge_contiguous_dimensions():
    from actoff.tiers.tokenwise.rows import _rows

    bsh = torch.empty(3, 40, 24)
    assert _rows(bsh.narrow(1, 10, 17)) == ([1, 1, 3, 408], [0, 0, 960, 1])  # rows of S x H
    assert _rows(bsh) == ([1, 1, 1, 2880], [0, 0, 0, 1])  # one row
    assert _rows(bsh.transpose(1, 2)) == ([1, 3, 24, 40], [0, 960, 1, 24])  # innermost strided
    assert _rows(torch.empty(3, 5, 7, 9, 11)[::2, ::2, ::2, ::2, ::2]) is None  # five dimensions left


# What every interpreter script starts with: the row functions, this module as ``t``, and
# ``launched``, whether each copy ran the kernel (True) or torch's copy (False).
_PREAMBLE = textwrap.dedent("""
        import torch
        from actoff.tiers.tokenwise import rows
        from actoff.tiers.tokenwise.rows import gather_rows, scatter_rows, triton_available
        assert triton_available()
        launched = []
        real_launch = rows._launch
        rows._launch = lambda *a, **k: launched.append(real_launch(*a, **k)) or launched[-1]
        import test_rows as t
    """)


def _in_the_interpreter(script: str) -> None:
    """Run `_PREAMBLE` then ``script`` in a fresh process under Triton's interpreter (the kernels
    on the CPU); it prints OK when its checks pass."""
    script = _PREAMBLE + script
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr[-3000:]


def test_triton_kernels_match_torch_in_the_interpreter():
    """Every dtype, every layout, in Triton's interpreter: bit for bit what torch copies."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        for dtype in t.ALL_DTYPES:
            views = t._views(dtype)
            expected, offsets = gather_rows(views, use_triton=False)
            launched.clear()
            got, offsets2 = gather_rows(views, use_triton=True)
            # The kernel ran for all but the five-dimensional view (torch's copy).
            assert launched == [True, True, True, True, True, False, True], (dtype, launched)
            assert offsets == offsets2, dtype
            for v, o in zip(views, offsets):  # the padding between views is never written
                n = v.numel() * v.element_size()
                assert torch.equal(got[o : o + n], expected[o : o + n]), (dtype, v.shape)
            # Scatter into strided destinations (views of bigger tensors).
            targets = [torch.zeros(v.shape[0] + 2, *v.shape[1:], dtype=dtype).narrow(0, 1, v.shape[0]).transpose(0, -1).contiguous().transpose(0, -1) if v.dim() else torch.zeros((), dtype=dtype) for v in views]
            scatter_rows(got, offsets, targets, use_triton=True)
            for v, target in zip(views, targets):
                assert t._same_bits(v, target), dtype
        # A conjugate view has a lazy bit a raw copy would drop: torch's copy resolves it.
        z = t._views(torch.complex64)[0].conj()
        got, _ = gather_rows([z], use_triton=True)
        assert t._same_bits(got[: z.numel() * 8].view(torch.complex64).view(z.shape), z.resolve_conj())
        print("OK", len(t.ALL_DTYPES))
    """)
    _in_the_interpreter(script)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_triton_kernels_match_torch_on_gpu(dtype):
    views = _views(dtype, "cuda")
    expected, offsets = gather_rows(views, use_triton=False)
    got, _ = gather_rows(views, use_triton=True)
    for view, offset in zip(views, offsets, strict=True):  # the padding is never written
        nbytes = view.numel() * view.element_size()
        assert torch.equal(got[offset : offset + nbytes], expected[offset : offset + nbytes])
    targets = [torch.empty_like(v) for v in views]
    scatter_rows(got, offsets, targets, use_triton=True)
    assert all(_same_bits(v, t) for v, t in zip(views, targets, strict=True))


# Note [rows past 2**31]: a million tokens of an 8B model put a token's row of a saved tensor
# past element 2**31 of its storage. A view whose rows lie 2**30 bytes apart reaches byte 2**31
# at its third row; the bases are allocated and never touched whole (the pages a row uses are
# the only ones the process gets), so the test costs a few KiB of memory, not 4 GiB.
_FAR = 2**30


def _far_rows(fill: bool) -> torch.Tensor:
    base = torch.empty(2 * _FAR + 4096, dtype=torch.uint8)
    view = base.as_strided((3, 1024), (_FAR, 1))
    if fill:
        for row in range(3):
            view[row] = torch.arange(1024, dtype=torch.int32).add(row * 7).remainder(251).to(torch.uint8)
    else:
        view.zero_()
    return view


@pytest.mark.plain_pass_only
def test_rows_at_byte_offsets_past_2_31_round_trip_in_the_triton_interpreter():
    """The Triton kernel's index arithmetic is 64-bit (Note [index arithmetic] in
    actoff.tiers.tokenwise.rows_triton): in the interpreter, a row at byte 2**31 of its storage is
    gathered and scattered back bit for bit, as torch's copy does. 32-bit offsets would wrap to a
    negative address there. (One pass: the interpreter does not use the simulated device.)"""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        source = t._far_rows(fill=True)
        assert source.storage_offset() + 2 * source.stride(0) == 2**31
        got, offsets = gather_rows([source], use_triton=True)
        expected, _ = gather_rows([source], use_triton=False)
        assert launched == [True] and torch.equal(got, expected)
        target = t._far_rows(fill=False)
        scatter_rows(got, offsets, [target], use_triton=True)
        assert launched == [True, True] and torch.equal(target, source)
        print("OK")
    """)
    _in_the_interpreter(script)
