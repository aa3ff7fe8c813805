"""actoff.stats(): per-block figures that add up, and a readable table."""

import pytest
from _helpers import make_model, train

import actoff
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime
from actoff.testing import simulated_device


@pytest.mark.no_sim_device  # its own simulated device, drained before each backward
def test_stats_add_up_and_print():
    """On a device with DMA (the host arena shows). The copies out are drained and seen done
    before backward: a record whose copy is still under way when backward starts is served from
    the device, not fetched, and on a loaded machine that can be every record of a block (seen
    in CI twice, the second time with the copies drained but not yet seen done), leaving its
    fetch_ms at 0."""
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0, keep_last=1)
    with simulated_device(seed=3) as device:

        def copies_landed():  # and seen to have landed: a record still copying is not fetched
            device.drain()
            get_runtime().step.progress()

        train(model, 2, before_backward=copies_landed)
    stats = actoff.stats()
    assert stats.steps == 2
    for block in stats.blocks.values():
        assert block.calls == 1
        assert sum(block.bytes_per_tier.values()) == block.bytes_saved
    first = stats.blocks["layers.0"]
    assert first.copy_ms > 0 and first.fetch_ms > 0
    table = str(stats)
    assert "layers.0" in table and "layers.1" in table and "total" in table
    assert "host arena" in table


def test_stats_before_any_backward_show_the_forward():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    import torch

    loss = model.loss(torch.randint(0, 256, (2, 17)))
    assert actoff.stats().total_bytes_saved > 0
    assert actoff.stats().steps == 0
    loss.backward()
    assert actoff.stats().steps == 1


def test_reset_clears_everything():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    train(model, 1)
    actoff.reset()
    stats = actoff.stats()
    assert stats.steps == 0 and stats.blocks == {} and stats.host_capacity == 0
