"""Token chunks and the autocast / RNG state a chunk's recompute restores."""

import itertools

import pytest
import torch

from actoff.tiling.chunking import AutocastState, RngState, chunk_bounds


@pytest.mark.parametrize("length", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("chunks", [1, 3, 8, 2000])
def test_chunks_cover_the_tokens_in_nearly_equal_parts(length, chunks):
    bounds = chunk_bounds(length, chunks=chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(stop == start for (_, stop), (start, _) in itertools.pairwise(bounds))  # contiguous
    sizes = [stop - start for start, stop in bounds]
    assert len(bounds) == min(chunks, length) and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("length", "max_tokens"), [(1, 1), (10, 3), (64, 16), (65, 16), (5, 100)])
def test_max_tokens_caps_every_chunk(length, max_tokens):
    bounds = chunk_bounds(length, max_tokens=max_tokens)
    sizes = [stop - start for start, stop in bounds]
    assert sum(sizes) == length and max(sizes) <= max_tokens
    assert len(bounds) == -(-length // max_tokens)  # as few chunks as the cap allows


def test_no_tokens_no_chunks():
    assert chunk_bounds(0, chunks=4) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, TypeError, "exactly one of chunks=N or max_tokens=N"),
        ({"chunks": 2, "max_tokens": 8}, TypeError, "exactly one"),
        ({"chunks": 0}, ValueError, "chunks=0 is out of range"),
        ({"max_tokens": -3}, ValueError, "max_tokens=-3 is out of range"),
        ({"chunks": 2.5}, TypeError, "chunks must be an integer"),
        ({"chunks": True}, TypeError, "chunks must be an integer"),
    ],
)
def test_bad_chunking_is_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        chunk_bounds(10, **kwargs)


def test_autocast_state_is_re_entered_outside_the_autocast_block():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = AutocastState.capture(torch.device("cpu"))
    plain = AutocastState.capture(torch.device("cpu"))
    with state.restore():
        assert (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.bfloat16
    with plain.restore():  # a forward without autocast is restored as without it
        assert (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.float32


def test_rng_restore_draws_the_same_numbers_and_leaves_the_stream_alone():
    torch.manual_seed(3)
    state = RngState.capture(torch.device("cpu"))
    first = torch.rand(5)
    after = torch.get_rng_state()
    with state.restore():
        assert torch.equal(torch.rand(5), first)
    assert torch.equal(torch.get_rng_state(), after)  # the caller's stream goes on where it was
    assert not state.same_as(RngState.capture(torch.device("cpu")))
