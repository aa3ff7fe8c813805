"""The budget planner against brute force, on numbers; and the figures the auto policy plans with."""

import itertools
import random
from collections.abc import Sequence

import pytest

from actoff.budget import (
    PLACEMENTS,
    BlockCost,
    Outside,
    Placement,
    Plan,
    allowed,
    cuda_budget,
    floor_plan,
    off_by,
    outside_from,
    plan,
    predict,
)


def brute_force(
    blocks: Sequence[BlockCost],
    link_bytes_per_s: float,
    budget_bytes: float,
    *,
    outside_bytes: int = 0,
    depths: Sequence[int] = (1, 2),
    kept_last: bool = False,
) -> Plan | None:
    """Every combination of placements and depths: the reference `plan` is held to. With
    ``kept_last`` only those whose kept blocks are the last ones (the plans `plan` searches
    when the blocks differ)."""
    best: Plan | None = None
    for placements in itertools.product(*(allowed(block) for block in blocks)):
        kinds = [p.kind == "keep" for p in placements]
        if kept_last and kinds != sorted(kinds):  # a kept block before an offloaded one
            continue
        for depth in depths:
            peak, seconds = predict(
                blocks, placements, link_bytes_per_s, outside_bytes=outside_bytes, depth=depth
            )
            if peak <= budget_bytes and (best is None or seconds < best.seconds - 1e-12):
                best = Plan(tuple(placements), depth, peak, seconds)
    return best


def _block(rng: random.Random) -> BlockCost:
    forward = rng.uniform(0.002, 0.05)
    return BlockCost(
        forward,
        forward * rng.uniform(0.05, 0.5),
        rng.randint(1, 40) * 10**6,
        rng.randint(1, 60) * 10**6,
        rng.randint(10, 300) * 10**6,
    )


@pytest.mark.parametrize("seed", range(40))
def test_alike_blocks_get_the_least_time_that_fits(seed):
    rng = random.Random(seed)
    blocks = [_block(rng)] * rng.randint(1, 4)
    link = rng.choice([5e9, 25e9, 55e9])
    outside = rng.randint(0, 200) * 10**6
    keep_peak, _ = predict(blocks, [Placement("keep")] * len(blocks), link, outside_bytes=outside)
    for budget in (keep_peak, keep_peak * rng.uniform(0.2, 1.0), outside + blocks[0].saved_bytes * 0.5):
        expected, actual = (
            brute_force(blocks, link, budget, outside_bytes=outside),
            plan(blocks, link, budget, outside_bytes=outside),
        )
        assert (actual is None) == (expected is None)
        if expected is not None:
            assert actual.peak_bytes <= budget
            assert actual.seconds == pytest.approx(expected.seconds, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_any_blocks_get_a_plan_that_fits_whenever_one_exists(seed):
    # Blocks that differ: `plan` is exact among the plans that keep the last blocks (its
    # docstring), so its time equals brute force over those, and no plan of any shape is faster
    # than brute force over all of them.
    rng = random.Random(1000 + seed)
    blocks = [_block(rng) for _ in range(rng.randint(1, 3))]
    link = rng.choice([5e9, 55e9])
    floor, _ = predict(blocks, [Placement("checkpoint")] * len(blocks), link)
    budget = floor * rng.uniform(1.0, 3.0)
    expected, actual = brute_force(blocks, link, budget), plan(blocks, link, budget)
    assert expected is not None and actual is not None
    assert actual.peak_bytes <= budget and actual.seconds >= expected.seconds - 1e-12
    among_kept_last = brute_force(blocks, link, budget, kept_last=True)
    assert actual.seconds == pytest.approx(among_kept_last.seconds, abs=1e-12)


def test_where_keep_fits_keep_adds_nothing():
    blocks = [BlockCost(0.01, 0.003, 10**6, 10**6, 10**7)] * 8
    peak, _ = predict(blocks, [PLACEMENTS[0]] * 8, 25e9, outside_bytes=5 * 10**7)
    chosen = plan(blocks, 25e9, peak, outside_bytes=5 * 10**7)
    assert chosen.placements == (Placement("keep"),) * 8 and chosen.seconds == 0


def test_a_slow_link_prefers_recompute_to_stalled_copies():
    # 7B at 8k on an H100 (benchmarks/results): a block saves 1.6 GB, its copy takes 3.4 times
    # its forward: storing everything stalls; recomputing the token-local rest costs less.
    block = BlockCost(0.0085, 0.0012, 67 * 10**6, 340 * 10**6, 1190 * 10**6)
    chosen = plan([block] * 4, 55e9, 1.9e9)
    assert chosen is not None and all(p.kind != "keep" for p in chosen.placements[:-1])
    assert (
        chosen.seconds
        < predict([block] * 4, [Placement("tokenwise", 1.0)] * 3 + [Placement("keep")], 55e9)[1]
    )


def test_blocks_that_cannot_split_or_rerun_get_only_what_is_open_to_them():
    block = BlockCost(0.001, 0.0002, 10**6, 10**6, 10**7, tokenwise=False, rerun=False)
    assert allowed(block) == (Placement("keep"), Placement("tokenwise", 1.0))
    tight = predict([block] * 4, [Placement("tokenwise", 1.0)] * 4, 1e12)[0]
    chosen = plan([block] * 4, 1e12, tight)  # the link is free: storing everything fits
    assert chosen is not None and set(chosen.placements) <= set(allowed(block))
    assert plan([block] * 4, 1e12, tight - 1) is None  # nothing of theirs holds less
    assert floor_plan([block] * 4, 1e12).placements == (Placement("tokenwise", 1.0),) * 4
    rerun_only = BlockCost(0.001, 0.0002, 10**6, 10**6, 10**7, tokenwise=False)
    assert floor_plan([rerun_only], 1e12).placements == (Placement("checkpoint"),)


@pytest.mark.parametrize("seed", range(10))
def test_brute_force_agrees_when_some_placements_are_closed(seed):
    rng = random.Random(500 + seed)
    base = _block(rng)
    block = BlockCost(
        base.forward_s,
        base.attention_s,
        base.input_bytes,
        base.attention_bytes,
        base.local_bytes,
        tokenwise=rng.random() < 0.5,
        rerun=rng.random() < 0.5,
    )
    blocks, link = [block] * rng.randint(1, 4), rng.choice([5e9, 55e9])
    budget = predict(blocks, [PLACEMENTS[0]] * len(blocks), link)[0] * rng.uniform(0.2, 1.0)
    expected, actual = brute_force(blocks, link, budget), plan(blocks, link, budget)
    assert (actual is None) == (expected is None)
    if expected is not None:
        assert actual.seconds == pytest.approx(expected.seconds, abs=1e-12)
        assert all(p in allowed(block) for p in actual.placements)


def test_a_block_that_stores_and_recomputes_holds_its_stored_rows_twice_when_rebuilt():
    # Fetched packed, then scattered into the rebuilt tensors: the packed copy goes last.
    block = BlockCost(0.01, 0.002, 10, 10, 100)
    for stored, extra in ((0.0, 0), (0.5, 50), (1.0, 0)):
        peak, _ = predict([block], [Placement("tokenwise", stored)], 1e9)
        assert peak == block.saved_bytes + extra


def test_the_memory_outside_the_blocks_is_each_moments_peak_less_the_blocks_share():
    blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 3
    placements = [Placement("tokenwise", 0.0)] * 3
    # Forward: a block saving its 50 while the one before sends its 20 out. Head: the last
    # block's 20 on their way out. Backward: one block back (50), the one before fetched (20).
    assert outside_from((1000, 900, 800), blocks, placements) == Outside(930, 880, 730)
    assert outside_from((10, 10, 10), blocks, placements) == Outside(0, 0, 0)  # never below nothing
    outside = outside_from((1000, 900, 800), blocks, placements)
    assert predict(blocks, placements, 1e9, outside_bytes=outside)[0] == 1000  # the peak it came from


def test_kept_blocks_are_gone_before_offloaded_ones_come_back():
    # The last blocks are kept: their backward comes first. The head holds them all with the
    # logits; an offloaded block's backward holds only itself and what is fetched ahead.
    blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 4
    placements = [Placement("checkpoint")] * 2 + [Placement("keep")] * 2
    outside = Outside(forward=0, head=300, backward=100)
    peak, _ = predict(blocks, placements, 1e9, outside_bytes=outside)
    assert peak == 300 + 2 * 50  # the head: both kept blocks and the logits
    early = [Placement("keep")] * 2 + [Placement("checkpoint")] * 2
    assert predict(blocks, early, 1e9, outside_bytes=outside)[0] == 300 + 100 + 10  # (last input going out)
    outside = Outside(forward=0, head=0, backward=100)
    late_peak = predict(blocks, placements, 1e9, outside_bytes=outside)[0]
    early_peak = predict(blocks, early, 1e9, outside_bytes=outside)[0]
    assert early_peak > late_peak  # kept early, they are still held when the rest come back


def test_off_by_is_relative_to_the_prediction():
    assert not off_by(110, 100) and off_by(110.5, 100) and off_by(0, 100)
    assert off_by(1, 0) and not off_by(0, 0)


def test_the_cuda_budget_keeps_a_margin_of_five_percent_or_two_gib():
    assert cuda_budget(80 * 2**30) == int(80 * 2**30 * 0.95)
    assert cuda_budget(16 * 2**30) == 14 * 2**30  # 5% would be 0.8 GiB: 2 GiB instead
