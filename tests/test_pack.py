"""Packing token rows: Triton kernels (interpreted on CPU, native on GPU) match torch."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from actoff._pack import layout_offsets, pack_rows, scatter_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _views(dtype, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    bsh = torch.randn(3, 40, 24, generator=generator).to(dtype).to(device)  # (B, S, H)
    bhsd = (
        torch.randn(2, 5, 40, 8, generator=generator).to(dtype).to(device).transpose(1, 2)
    )  # (B, S, nH, D) view
    sbh = torch.randn(40, 3, 16, generator=generator).to(dtype).to(device)  # (S, B, H)
    return [bsh.narrow(1, 10, 17), bhsd.narrow(1, 0, 9), sbh.narrow(0, 30, 10), bsh[0].narrow(0, 5, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_round_trip(dtype):
    views = _views(dtype)
    buffer, offsets = pack_rows(views, use_triton=False)
    assert buffer.dtype == torch.uint8 and all(o % 16 == 0 for o in offsets)
    targets = [torch.zeros_like(v.contiguous()) for v in views]
    targets = [
        t.as_strided(v.shape, v.stride()) if v.is_contiguous() else t
        for v, t in zip(views, targets, strict=True)
    ]
    scatter_rows(buffer, offsets, targets, use_triton=False)
    for view, target in zip(views, targets, strict=True):
        assert torch.equal(view, target)


def test_layout_offsets_are_aligned():
    offsets, total = layout_offsets(
        [torch.empty(1, dtype=torch.uint8), torch.empty(3), torch.empty(5, dtype=torch.float16)]
    )
    assert offsets == [0, 16, 32] and total == 48


def test_triton_kernels_match_torch_in_the_interpreter():
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from actoff._pack import pack_rows, scatter_rows, triton_available
        assert triton_available()
        import test_pack as t
        for dtype in t.DTYPES:
            views = t._views(dtype)
            expected, offsets = pack_rows(views, use_triton=False)
            got, offsets2 = pack_rows(views, use_triton=True)
            assert offsets == offsets2 and torch.equal(got, expected), dtype
            # Scatter into strided destinations (views of bigger tensors).
            targets = [torch.zeros(v.shape[0] + 2, *v.shape[1:], dtype=dtype).narrow(0, 1, v.shape[0]).transpose(0, -1).contiguous().transpose(0, -1) for v in views]
            scatter_rows(got, offsets, targets, use_triton=True)
            for v, target in zip(views, targets):
                assert torch.equal(v, target), dtype
        print("OK")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.path.dirname(__file__)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernels_match_torch_on_gpu(dtype):
    views = _views(dtype, "cuda")
    expected, offsets = pack_rows(views, use_triton=False)
    got, _ = pack_rows(views, use_triton=True)
    assert torch.equal(got, expected)
    targets = [torch.empty_like(v) for v in views]
    scatter_rows(got, offsets, targets, use_triton=True)
    assert all(torch.equal(v, t) for v, t in zip(views, targets, strict=True))
