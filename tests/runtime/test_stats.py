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


def _windows_run(fetch_window: str, copy_window: str) -> tuple[actoff.Stats, int]:
    actoff.reset()
    model = make_model(num_layers=3)
    actoff.offload_(
        model, block_cls=Block, policy="cpu", min_bytes=0, fetch_window=fetch_window, copy_window=copy_window
    )
    with simulated_device():
        train(model, steps=2, seq=257)
        runs = get_runtime().step.runs
    return actoff.stats(), max(sum(r.geometry.nbytes for r in run.records) for run in runs)


def test_the_windows_and_what_they_held_are_in_the_statistics():
    """Issue 36 (item 3): the windows in force and the most bytes each held. Fetched bytes are
    the window's reach ahead plus what the nodes autograd is running hold (fetched at their own
    unpack, as save_on_cpu's are), so the peak lies within the window and one block's saves, and
    a wider window holds more; copies out wait past their window, at most a block's saves over."""
    stats, block = _windows_run("1MiB", "2MiB")
    assert (stats.fetch_window_bytes, stats.copy_window_bytes) == (2**20, 2**21)
    assert 0 < stats.fetched_peak_bytes <= 2**20 + block
    assert 0 < stats.copying_peak_bytes <= 2**21 + block
    assert "windows: fetched and not let go" in str(stats) and "(window 1.00 MiB)" in str(stats)
    wide, _ = _windows_run("64MiB", "64MiB")
    assert wide.fetched_peak_bytes > stats.fetched_peak_bytes

    actoff.reset()
    plain = make_model(num_layers=3)
    actoff.offload_(plain, block_cls=Block, policy="cpu", min_bytes=0)  # a prefetch depth, no cap out
    with simulated_device():
        train(plain, steps=1, seq=257)
    stats = actoff.stats()
    assert stats.fetch_window_bytes is None and stats.copy_window_bytes is None
    assert stats.copying_peak_bytes > 0  # copies out still start at pack, uncapped
