"""The cpu tier under a host budget that takes nothing: what it refuses stays on the device and is
counted once, however often its placement tries the host again."""

import warnings

import torch
from _helpers import make_model

import actoff
from actoff.reference import Block
from actoff.testing import simulated_device


def test_a_record_the_host_refuses_is_counted_once():
    # A record refused when copied out at pack was tried again when its run was placed, and
    # counted again: over_budget_bytes read twice the bytes that stayed.
    model = make_model(num_layers=2)
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0, host_budget="1KiB")
    with warnings.catch_warnings(record=True) as caught, simulated_device(seed=0):
        warnings.simplefilter("always")
        model.loss(torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))).backward()
        blocks = actoff.stats().blocks.values()
    for block in blocks:
        assert block.bytes_offloaded == 0  # nothing fits 1 KiB
        assert block.over_budget_bytes == block.bytes_saved > 0
    assert len([w for w in caught if "the host budget (ACTOFF_HOST_BUDGET) is full" in str(w.message)]) == 1
