"""The time a plan adds to a step (Note [one link] in actoff.step_time): copies over one link,
hidden behind a block's own compute and what its neighbour leaves free, and recompute."""

import pytest

from actoff.budget import BlockCost, Placement, Windows
from actoff.fitting import plan
from actoff.step_time import added_seconds, predict

STREAM, KEEP, CHECKPOINT = Placement("stream"), Placement("keep"), Placement("checkpoint")


def test_the_last_blocks_windows_hide_its_copies_behind_up_to_two_of_its_forwards():
    block = BlockCost(0.01, 0.002, 10**7, 10**7, 3 * 10**7)  # 50 MB: 50 ms over 1 GB/s
    stream, seconds = Placement("stream"), []
    for share in (0, 0.5, 1, 2, 4):
        windows = Windows(fetch=share * 50e6, copy=share * 50e6)
        seconds.append(added_seconds(block, stream, 1e9, windows))
    # out: 50 ms less share x 10 ms of forward; back: 50 ms less share x 20 ms of backward
    assert seconds == pytest.approx([0.1, 0.085, 0.07, 0.04, 0.04])
    assert added_seconds(block, stream, 1e12, Windows(fetch=50e6, copy=50e6)) == 0.0


def test_recompute_costs_its_share_of_the_forward_outside_attention():
    block = BlockCost(0.01, 0.002, 10, 10, 30)
    free = 1e18  # the link takes no time: only recompute is left
    assert added_seconds(block, Placement("checkpoint"), free, Windows()) == pytest.approx(0.01)
    assert added_seconds(block, Placement("tokenwise", 0.0), free, Windows()) == pytest.approx(0.008)
    assert added_seconds(block, Placement("tokenwise", 0.75), free, Windows()) == pytest.approx(0.002)
    assert added_seconds(block, Placement("keep"), 1.0, Windows()) == 0.0


def test_a_neighbour_hides_a_blocks_copies_only_where_its_own_leave_the_link_free():
    # 15 MB a block over 1 GB/s: 15 ms of copy each way against a forward of 10 ms; windows of two blocks
    block = BlockCost(0.01, 0.002, 3 * 10**6, 3 * 10**6, 9 * 10**6)
    two = Windows(fetch=30e6, copy=30e6)
    alone = added_seconds(block, STREAM, 1e9, two, (block, KEEP))  # a kept neighbour copies nothing
    assert alone == 0.0  # out: 10 ms own + 10 of the next forward; back: 20 ms own
    # a streamed neighbour's own 15 ms fill its forward: out, 5 ms are left over (back, its 20 ms hide them)
    assert added_seconds(block, STREAM, 1e9, two, (block, STREAM)) == pytest.approx(0.005)
    # a checkpointed neighbour copies its input only (3 ms) and runs its forward again in backward
    assert added_seconds(block, STREAM, 1e9, two, (block, CHECKPOINT)) == 0.0


def test_four_streamed_blocks_pay_for_the_link_they_share():
    """Every block's copies took 15 ms against a 10 ms forward: the old model hid each behind two
    forwards and priced the plan at 0; over one link the forwards hide 40 of the 60 ms out."""
    block = BlockCost(0.01, 0.002, 3 * 10**6, 3 * 10**6, 9 * 10**6)
    two = Windows(fetch=30e6, copy=30e6)
    _, seconds = predict([block] * 4, [STREAM] * 4, 1e9, windows=two)
    assert seconds == pytest.approx(3 * 0.005)  # the last block's leftover hides behind the head


def test_the_plan_mixes_in_recompute_where_the_link_is_the_bottleneck():
    """Streaming every offloaded block is priced by the link they share (21 ms of copies a block
    against a forward of 10), so at a budget that keeps one block the least added time runs one
    of the others again (its input alone crosses the link, and its re-run leaves the link to its
    neighbours' copies). Priced as if each block had the link to itself, three streamed blocks
    added 4 ms and were the plan."""
    block = BlockCost(0.01, 0.002, 10**6, 4 * 10**6, 10 * 10**6)  # 15 MB
    found = plan([block] * 4, 0.7e9, 30e6)
    assert found is not None and found.placements[-1] == KEEP
    assert CHECKPOINT in found.placements and STREAM in found.placements, found.describe()
    streamed = predict([block] * 4, [STREAM] * 3 + [KEEP], 0.7e9, windows=found.windows)[1]
    assert found.seconds < streamed
