"""Token-wise decisions on plain shapes and numbers: token dims, ranges, MEMO's closed form."""

import pytest
import torch

from actoff.tiers.record import TensorGeometry
from actoff.tiers.tokenwise.tokens import (
    Canon,
    base_info,
    changed_dim,
    detect_canon,
    token_ranges,
    unique_dim,
)


def test_unique_dim():
    assert unique_dim((2, 128, 64), 128) == 1
    assert unique_dim((128, 128), 128) is None
    assert unique_dim((2, 64), 128) is None


@pytest.mark.parametrize(
    ("forward", "replay", "expected"),
    [
        ((2, 128, 64), (2, 32, 64), 1),
        ((2, 128, 128), (2, 32, 128), 1),  # hidden size == sequence length
        ((128, 2, 128), (32, 2, 128), 0),  # (S, B, H) with H == S
        ((256, 128), (64, 128), None),  # merged (B*S, H): the change is not S -> 32
        ((2, 128, 64), (2, 128, 64), None),  # nothing shrank
        ((2, 128, 64), (1, 32, 64), None),  # two dims changed
    ],
)
def test_changed_dim(forward, replay, expected):
    assert changed_dim(forward, replay, 128, 32) == expected


def test_detect_canon_on_the_base_of_a_merged_view():
    forward = torch.zeros(2, 128, 128)
    saved = forward.view(256, 128)
    recomputed = torch.zeros(2, 32, 128).view(64, 128)
    canon = detect_canon(
        (tuple(saved.shape), saved.stride()), base_info(saved), tuple(recomputed.shape), (2, 32, 128), 128, 32
    )
    assert canon.on_base and canon.dim == 1 and canon.shape == (2, 128, 128)
    assert canon.source(recomputed).shape == (2, 32, 128)
    flat = torch.arange(2 * 128 * 128.0)
    assert torch.equal(canon.view(flat), flat.view(2, 128, 128))


def test_canon_view_of_a_chunk_with_a_storage_offset():
    # The second chunk of a fused projection (Phi-3's gate_up_proj) starts 3 elements into
    # its storage: its canonical view must read from there, not from the storage's start.
    fused = torch.arange(2 * 8 * 6.0).view(2, 8, 6)  # (B, S, 2 * I)
    up = fused.chunk(2, dim=-1)[1]
    assert up.storage_offset() == 3
    canon = Canon(tuple(up.shape), up.stride(), 1)
    assert torch.equal(canon.view(TensorGeometry(up).flat(up)), up)
    span = TensorGeometry(up).span
    copied = torch.cat((torch.full((1,), -1.0), fused.reshape(-1)[3 : 3 + span]))  # a pad, then the span
    assert torch.equal(canon.view(copied, pad=1), up)


def test_base_info_requires_a_dense_merged_view():
    assert base_info(torch.zeros(4, 8)) is None  # not a view
    assert base_info(torch.zeros(4, 8)[:, :4]) is None  # not all of the base
    assert base_info(torch.zeros(2, 4, 8).transpose(1, 2).contiguous().view(2, 32)) is not None


def test_token_ranges():
    ranges = token_ranges(100, 0.3, 0.3)
    assert (ranges.cpu_end, ranges.nvme_end, ranges.recompute, ranges.recompute_len) == (
        30,
        60,
        (60, 100),
        40,
    )
    assert token_ranges(7, 1.0, 0.0).recompute_len == 0
    assert token_ranges(7, 0.0, 0.0).recompute == (0, 7)
    with pytest.raises(ValueError, match="exceed 1"):
        token_ranges(10, 0.7, 0.5)
