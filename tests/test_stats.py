"""actoff.stats(): per-block figures that add up, and a readable table."""

import pytest
from _helpers import make_model, train

import actoff
from actoff.reference import Block


@pytest.mark.sim_device  # the host arena: copies happen on a device with DMA
def test_stats_add_up_and_print():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0, keep_last=1)
    train(model, 2)
    stats = actoff.stats()
    assert stats.steps == 2
    for block in stats.blocks.values():
        assert block.calls == 1
        assert sum(block.bytes_per_tier.values()) == block.bytes_saved
    assert stats.blocks["layers.0"].copy_ms > 0
    assert stats.blocks["layers.0"].fetch_ms > 0
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
