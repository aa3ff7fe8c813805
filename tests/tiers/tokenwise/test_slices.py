"""The comparison of recomputed rows with the real ones (`actoff.tiers.tokenwise.slices.rows_differ`), used by
the probe, the sentinel rows and ACTOFF_VERIFY; and the probe's re-run short of memory."""

import copy
import warnings

import torch
from _helpers import RECOMPUTE_TOL, make_model

import actoff
from actoff.reference import Block
from actoff.tiers.tokenwise import slices as reforward
from actoff.tiers.tokenwise.slices import COMPARE_ELEMENTS, rows_differ, rows_match


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


def test_the_comparison_holds_a_few_pieces_not_float32_copies_of_the_whole():
    """Found lowering auto's floor: the probe's re-run fit, then its comparison ran out of
    memory, making float32 copies of all it compared (bf16 rows: four bytes an element each)."""
    from actoff.device.sim.memory import DeviceMemory

    elements = 16 * COMPARE_ELEMENTS
    rows = torch.randn(64, elements // 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    again = rows.clone()
    with DeviceMemory() as memory:
        assert not rows_differ([(rows, again)])
        again[-1, -1] += 1  # the very last element: the last piece is compared too
        assert rows_differ([(rows, again)])
    whole_float32 = 4 * elements
    assert memory.peak <= 8 * 4 * COMPARE_ELEMENTS < whole_float32, memory.peak  # a few pieces'


def test_the_pieces_share_the_whole_rows_mean_magnitude():
    # Large values in the first piece, small ones in the last: the tolerance scales with the mean
    # magnitude of all the rows (1e-5 * 500 here), as it did before the comparison was cut up.
    rows = torch.cat([torch.full((2, COMPARE_ELEMENTS), 1000.0), torch.full((2, COMPARE_ELEMENTS), 1e-3)])
    off = rows.clone()
    off[2:] += 1e-3
    assert not rows_differ([(rows, off)])
    off[2:] += 1.0
    assert rows_differ([(rows, off)])


def _probed_under(monkeypatch, fits: int):
    """A recompute model trained two steps where a probe's re-run longer than ``fits``
    tokens runs out of memory (what the first backward meets on a full device); the slice
    lengths the probe tried, the step's stats, and the gradients against the model alone."""
    real, tried = reforward.recompute, []

    def short_of_memory(tokenwise, start, end, **kwargs):
        if kwargs.get("detect") is not None:
            tried.append(end - start)
            if end - start > fits:
                raise torch.OutOfMemoryError("simulated: the device is full")
        return real(tokenwise, start, end, **kwargs)

    monkeypatch.setattr(reforward, "recompute", short_of_memory)
    model = make_model()
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=Block, policy="recompute", min_bytes=0)
    tokens = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model.loss(tokens).backward()
    reference.loss(tokens).backward()
    return tried, actoff.stats(), caught, model, reference


def test_a_probe_short_of_memory_tries_a_shorter_slice(monkeypatch):
    """(Note [a probe short of memory]) out of memory in the probe's re-run is no verdict on
    the block: it probed a slice PROBE_SHRINK times shorter, and the next step recomputes."""
    tried, stats, caught, model, reference = _probed_under(monkeypatch, fits=16)
    assert tried[:2] == [64, 64 // reforward.PROBE_SHRINK] == [64, 16]  # 128 tokens: half, then 16
    assert not [w for w in caught if "cannot be recomputed" in str(w.message)]
    assert all(block.recompute_ms > 0 for block in stats.blocks.values())  # split in step 2
    for actual, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, **RECOMPUTE_TOL)
    actoff.reset()


def test_a_probe_that_never_fits_places_the_block_whole_and_says_why(monkeypatch):
    tried, stats, caught, model, reference = _probed_under(monkeypatch, fits=0)
    assert min(tried) >= reforward.PROBE_MIN_TOKENS
    messages = [str(w.message) for w in caught if "cannot be recomputed" in str(w.message)]
    assert messages and "OutOfMemoryError" in messages[0]
    assert all(block.recompute_ms == 0 for block in stats.blocks.values())
    for actual, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=0, atol=0)  # stored whole: exact
    actoff.reset()
