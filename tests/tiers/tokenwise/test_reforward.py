"""The comparison of recomputed rows with the real ones (`actoff.tiers.tokenwise.reforward.rows_differ`), used by
the probe, the sentinel rows and ACTOFF_VERIFY."""

import torch

from actoff.tiers.tokenwise.reforward import rows_differ, rows_match


def test_a_large_value_does_not_hide_a_difference_in_the_others():
    """Found in review: the tolerance scaled with the largest value (at least 1), so one outlier
    feature of 1000, as residual streams have, let every other feature be off by 0.009."""
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    rows[:, 7] = 1000.0
    shifted = rows.clone()
    shifted[:, :7] += 0.009
    assert rows_differ([(rows, shifted)])
    unrelated = rows.bfloat16()
    wrong = unrelated.clone()
    wrong[0, :7] = torch.randn(7).bfloat16()
    assert rows_differ([(unrelated, wrong)])


def test_small_half_precision_values_are_not_below_the_tolerance():
    small = torch.full((3, 16), 0.005, dtype=torch.bfloat16)
    assert rows_differ([(small, torch.zeros_like(small))])


def test_reassociation_passes_and_half_precision_rounding_passes_under_autocast():
    rows = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).float()
    reassociated = rows * (1 + 1e-7)
    assert not rows_differ([(rows, reassociated)])
    one_bf16_rounding = rows * (1 + 2**-8)  # a float32 value computed from a bf16 product
    assert rows_differ([(rows, one_bf16_rounding)])
    assert not rows_differ([(rows, one_bf16_rounding)], half=True)


def test_integers_exactly_and_nan_and_infinities_as_themselves():
    assert rows_match(torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert not rows_match(torch.tensor([1, 2]), torch.tensor([1, 3]))
    special = torch.tensor([float("nan"), 1.0, float("inf")])
    assert rows_match(special, special.clone())
    assert not rows_match(special, torch.tensor([0.0, 1.0, float("inf")]))
    assert not rows_match(special, torch.tensor([float("nan"), 1.0, 5.0]))
    assert not rows_match(torch.ones(2, 3), torch.ones(3, 2))


def test_one_answer_for_many_pairs():
    same = [(torch.ones(4), torch.ones(4)) for _ in range(3)]
    assert not rows_differ(same) and not rows_differ([])
    assert rows_differ([*same, (torch.ones(4), torch.zeros(4))])
