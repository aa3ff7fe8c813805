"""The budget planner against brute force, on numbers."""

import random

import pytest

from actoff.budget import PLACEMENTS, BlockCost, Placement, brute_force, plan, predict


def _block(rng: random.Random) -> BlockCost:
    forward = rng.uniform(0.002, 0.05)
    return BlockCost(forward, forward * rng.uniform(0.05, 0.5), rng.randint(1, 40) * 10**6,
                     rng.randint(1, 60) * 10**6, rng.randint(10, 300) * 10**6)  # fmt: skip


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
    rng = random.Random(1000 + seed)
    blocks = [_block(rng) for _ in range(rng.randint(1, 3))]
    link = rng.choice([5e9, 55e9])
    floor, _ = predict(blocks, [Placement("checkpoint")] * len(blocks), link)
    budget = floor * rng.uniform(1.0, 3.0)
    expected, actual = brute_force(blocks, link, budget), plan(blocks, link, budget)
    assert expected is not None and actual is not None
    assert actual.peak_bytes <= budget and actual.seconds >= expected.seconds - 1e-12


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
