"""The budget model on numbers (Note [the budget model]): what each placement holds at each
moment and adds in time, and the figures the auto policy plans with."""

import pytest

from actoff.budget import (
    PLACEMENTS,
    BlockCost,
    Outside,
    Placement,
    Windows,
    allowed,
    cuda_budget,
    least,
    moments,
    off_by,
    outside_from,
)
from actoff.step_time import added_seconds, predict

BLOCK = BlockCost(0.01, 0.002, 10, 10, 30)  # 50 bytes: input 10, attention 10, the rest 30


def test_every_placement_is_open_unless_the_block_says_otherwise():
    # storing every row token-wise holds more than streaming: open only where stream is closed;
    # chunked only where the block's survey found nothing it refuses (a chunk share)
    closed = (Placement("tokenwise", 1.0), Placement("chunked"))
    assert allowed(BLOCK) == tuple(p for p in PLACEMENTS if p not in closed)
    no_split = BlockCost(0.01, 0.002, 10, 10, 30, tokenwise=False)
    assert all(p.kind != "tokenwise" for p in allowed(no_split))
    assert Placement("checkpoint") not in allowed(BlockCost(0.01, 0.002, 10, 10, 30, rerun=False))


def test_a_block_only_chunks_fit_is_open_to_the_chunked_placement_alone_while_it_takes_the_block():
    """(Note [measuring where only chunks fit]) its steps' peaks tell of no other placement; a
    block the chunked placement no longer takes (refused: no chunk share) gets the others back."""
    only = BlockCost(0.01, 0.002, 10, 10, 30, chunk_share=0.25, chunks_only=True)
    assert allowed(only) == (Placement("chunked"),) and least(only) == Placement("chunked")
    refused = BlockCost(0.01, 0.002, 10, 10, 30, chunks_only=True)
    assert allowed(refused) == allowed(BLOCK)
    assert Placement("chunked") not in allowed(
        BlockCost(0.01, 0.002, 10, 10, 30, rerun=False, chunks_only=True)
    )


def test_a_host_budget_too_small_for_a_blocks_saves_closes_stream():
    roomy = BlockCost(0.01, 0.002, 10, 10, 30, host_room=50)
    assert Placement("stream") in allowed(roomy) and least(roomy) == Placement("stream")
    tight = BlockCost(0.01, 0.002, 10, 10, 30, host_room=49)
    assert Placement("stream") not in allowed(tight) and Placement("tokenwise", 1.0) in allowed(tight)
    assert least(tight) == Placement("checkpoint")  # its input only goes to the host
    unsplit = BlockCost(0.01, 0.002, 10, 10, 30, tokenwise=False, rerun=False, host_room=0)
    assert allowed(unsplit) == (Placement("keep"),)
    assert least(unsplit) == Placement("stream")  # all the same: what the host cannot take stays, said


def test_a_streamed_block_holds_only_its_copy_window_in_forward_and_its_fetch_window_in_backward():
    blocks = [BLOCK] * 3
    stream = [Placement("stream")] * 3
    assert moments(blocks, stream, 0, Windows()) == (0, 0, 0)
    forward, head, backward = moments(blocks, stream, 0, Windows(fetch=20, copy=15))
    assert (forward, head, backward) == (15, 15, 20)
    # a copy window wider than the block: no more than the block is ever on its way out
    assert moments(blocks, stream, 0, Windows(copy=500))[0] == 50


def test_copies_out_of_a_streamed_block_last_through_the_kept_blocks_after_it():
    # A kept block's forward waits for no copy: what the streamed block before it still copies
    # out is on the device through its forward, the head and the last block's backward. Counted
    # only where the streamed block was last or just before, a plan keeping the last blocks
    # peaked 1.05-1.13x its budget one run in seven (tests/runtime/test_over_budget.py).
    blocks = [BLOCK] * 3
    placements = [Placement("stream"), Placement("keep"), Placement("keep")]
    forward, head, backward = moments(blocks, placements, 0, Windows(fetch=5, copy=15))
    assert forward == 50 + 50 + 15  # the last block's forward: two kept, the first's copies
    assert head == 2 * 50 + 15
    assert backward == 50 + 50 + 15  # the last block's: both kept, the copies served from the device
    # A token-wise block's copies, issued at its end, likewise (only an offloaded block's placement
    # waits for them): its 50 stored bytes through the two kept forwards and the head.
    placements = [Placement("tokenwise", 1.0), Placement("keep"), Placement("keep")]
    forward, head, backward = moments(blocks, placements, 0, Windows(fetch=5, copy=15))
    assert (forward, head, backward) == (50 + 50 + 50, 2 * 50 + 50, 50 + 50 + 50)  # within the fetch window


def test_a_block_that_stores_and_recomputes_holds_its_stored_rows_twice_when_rebuilt():
    # Fetched packed, then scattered into the rebuilt tensors: the packed copy goes last.
    for stored, extra in ((0.0, 0), (0.5, 15), (1.0, 0)):
        _, _, backward = moments([BLOCK], [Placement("tokenwise", stored)], 0, Windows())
        assert backward == BLOCK.saved_bytes + extra


def test_a_tokenwise_blocks_copies_out_are_held_through_the_next_forward():
    blocks = [BLOCK] * 2
    forward, _, _ = moments(blocks, [Placement("tokenwise", 1.0), Placement("keep")], 0, Windows())
    assert forward == 50 + 50  # the second block's saves while the first's 50 go out
    forward, _, _ = moments(blocks, [Placement("tokenwise", 0.0), Placement("keep")], 0, Windows())
    assert forward == 20 + 50  # input and attention only go out; the rest is dropped


def test_kept_blocks_are_gone_before_offloaded_ones_come_back():
    # The last blocks are kept: their backward comes first. The head holds them all with the
    # logits; an offloaded block's backward holds only itself and what is fetched ahead.
    blocks = [BLOCK] * 4
    late = [Placement("checkpoint")] * 2 + [Placement("keep")] * 2
    early = [Placement("keep")] * 2 + [Placement("checkpoint")] * 2
    outside = Outside(forward=0, head=300, backward=100)
    assert predict(blocks, late, 1e9, outside_bytes=outside)[0] == 300 + 2 * 50
    outside = Outside(forward=0, head=0, backward=100)
    late_peak = predict(blocks, late, 1e9, outside_bytes=outside)[0]
    early_peak = predict(blocks, early, 1e9, outside_bytes=outside)[0]
    assert early_peak > late_peak  # kept early, they are still held when the rest come back


@pytest.mark.parametrize("windows", [Windows(), Windows(fetch=20, copy=40)])
def test_the_memory_outside_the_blocks_is_each_moments_peak_less_the_blocks_share(windows):
    blocks = [BLOCK] * 3
    placements = [Placement("tokenwise", 0.0), Placement("stream"), Placement("keep")]
    model = moments(blocks, placements, 0, windows)
    assert outside_from((1000, 900, 800), blocks, placements, windows) == Outside(
        1000 - model[0], 900 - model[1], 800 - model[2]
    )
    assert outside_from((0, 0, 0), blocks, placements, windows) == Outside()  # never below nothing
    outside = outside_from((1000, 900, 800), blocks, placements, windows)
    assert moments(blocks, placements, outside, windows) == (1000, 900, 800)  # what it came from


def test_off_by_is_relative_to_the_prediction():
    assert not off_by(110, 100) and off_by(110.5, 100) and off_by(0, 100)
    assert off_by(1, 0) and not off_by(0, 0)


def test_the_cuda_budget_keeps_a_margin_of_five_percent_or_two_gib():
    assert cuda_budget(80 * 2**30) == int(80 * 2**30 * 0.95)
    assert cuda_budget(16 * 2**30) == 14 * 2**30  # 5% would be 0.8 GiB: 2 GiB instead


def test_a_chunked_block_holds_its_input_keys_and_a_chunk_against_attentions_node():
    """(Note [the chunked placement in the plan]) counted against the memory outside the blocks,
    which holds attention's node at full length under every other placement: its working bytes
    are its input, keys and values twice, and a chunk's share of its saves and that node, less the
    node; it adds the input's copies and the block run twice less attention once."""
    block = BlockCost(0.01, 0.002, 100, 400, 1000, chunk_share=0.25, kv_bytes=100, node_bytes=800)
    chunked = Placement("chunked")
    assert chunked in allowed(block) and chunked not in allowed(BlockCost(0.01, 0.002, 100, 400, 1000))
    assert chunked not in allowed(BlockCost(0.01, 0.002, 100, 400, 1000, rerun=False, chunk_share=0.25))
    _, _, backward = moments([block], [chunked], Outside(0, 0, 5000), Windows())
    assert backward == 5000 + 100 + 200 + 0.25 * (1500 + 800) - 800
    assert least(block) == Placement("stream")  # a quarter of the tokens: more than stream holds
    # with stream closed by the host budget, against what else is open (a checkpoint's 1500)
    no_host = BlockCost(
        0.01, 0.002, 100, 400, 1000, host_room=0, chunk_share=0.25, kv_bytes=100, node_bytes=800
    )
    assert least(no_host) == chunked
    long = BlockCost(0.01, 0.002, 100, 400, 1000, chunk_share=1 / 64, kv_bytes=100, node_bytes=800)
    assert least(long) == chunked  # 100 + 200 + 36 - 800 < 0
    seconds = added_seconds(long, chunked, 1e4, Windows())  # input's copies: 10 ms out, 10 ms in
    assert seconds == pytest.approx(0.02 + 2 * 0.01 - 0.002)
    assert (
        predict([long], [chunked], 1e9, outside_bytes=Outside(0, 0, 1000))[0] == 1000 + 300 + 2300 / 64 - 800
    )
