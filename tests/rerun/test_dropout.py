"""Dropout in a re-run (Note [dropout in a re-run]): the rows of the forward's own mask,
drawn again on a tensor laid out as the forward's input, saved as the forward's kernel saved it.
Each comparison is bit for bit: the same kernel draws the same numbers."""

import pytest
import torch
import torch.nn.functional as F

from actoff.rerun import dropout


def test_the_fused_kernels_branch_records_a_graph_that_saves_the_mask(monkeypatch):
    """(Review of issue 28) the CUDA branch applied the mask under no_grad: the re-run's
    output required no grad and saved nothing, so every block with dropout fell back to whole on
    a GPU. Taken here on the CPU, whose native_dropout is the same kind of kernel."""
    monkeypatch.setattr(dropout, "_FUSED", ("cpu",))
    full = torch.randn(2, 8, 4)
    torch.manual_seed(0)
    expected, _ = torch.native_dropout(full, 0.5, True)
    x = full[:, 4:].clone().requires_grad_()
    saved = []
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rows = dropout.sliced_dropout(x, 0.5, ((2, 8, 4), full.stride()), 1, 4)
    assert rows.requires_grad and len(saved) == 1 and saved[0].dtype == torch.bool
    torch.testing.assert_close(rows, expected[:, 4:], rtol=0, atol=0)
    rows.sum().backward()
    torch.testing.assert_close(x.grad, (expected[:, 4:] != 0).float() * 2.0, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["cpu_kernel", "fused_kernel"])
def test_a_permuted_input_gets_the_forwards_mask(monkeypatch, fused):
    """(Review of issue 28) the mask was drawn on a contiguous tensor: for an input seen through a
    permutation (``(B, S, H)`` of an ``(S, B, H)`` tensor) the kernel draws in another order, and
    the rows differed (the block fell back to whole, blaming its dropout)."""
    if fused:
        monkeypatch.setattr(dropout, "_FUSED", ("cpu",))
    base = torch.randn(16, 2, 4)  # (S, B, H)
    x = base.transpose(0, 1)  # (B, S, H), not contiguous
    torch.manual_seed(0)
    forward = torch.native_dropout(x, 0.5, True)[0] if fused else F.dropout(x, 0.5, True)
    torch.manual_seed(0)
    rows = dropout.sliced_dropout(x[:, 8:], 0.5, (tuple(x.shape), x.stride()), 1, 8)
    torch.testing.assert_close(rows, forward[:, 8:], rtol=0, atol=0)
