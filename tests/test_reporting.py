"""`actoff.report`: the last step's device peak, what it would have been with everything kept,
where the bytes went and the plan, on the simulated device (its memory count is exact)."""

import copy

import pytest
from _helpers import make_model, train

import actoff
from actoff.reference import Block
from actoff.testing import simulated_device


@pytest.fixture(scope="module")
def model():
    return make_model(num_layers=4)


def _report(model, policy, steps=2, capacity=None, **settings):
    """Train a copy of ``model`` under ``policy`` on a fresh simulated device (the weights, built
    outside it, do not count); the report after the last step, and the device."""
    actoff.reset()
    net = actoff.offload_(copy.deepcopy(model), block_cls=Block, policy=policy, min_bytes=0, **settings)
    with simulated_device(seed=0, capacity=capacity) as device:
        train(net, steps, seq=129)
        return actoff.report(), device


def test_the_peak_moved_and_keeps_peak_is_within_the_estimate(model):
    keep, _ = _report(model, "keep")
    assert keep.offloaded_bytes == 0 and keep.kept_peak_bytes == keep.device_peak_bytes > 0
    placed, _ = _report(model, "cpu")
    assert placed.device_peak_bytes < keep.device_peak_bytes
    assert placed.host_bytes == placed.offloaded_bytes == actoff.stats().total_bytes_offloaded > 0
    assert placed.nvme_bytes == placed.recomputed_bytes == 0
    # At most peak + bytes placed off (Note [the peak kept]); the measured peak falls in backward here.
    assert keep.device_peak_bytes <= placed.kept_peak_bytes <= 1.5 * keep.device_peak_bytes
    text = str(placed)
    assert "\n" not in text and text.startswith("actoff, step 2: device peak ")
    assert "blocks_ms" not in placed.to_dict() and "plan" not in placed.to_dict()  # auto's figures only


def test_recomputed_rows_count_as_off_the_device(model):
    figures, _ = _report(model, "tokenwise", cpu_fraction=0.5)
    assert figures.host_bytes > 0 and figures.recomputed_bytes > 0
    assert figures.offloaded_bytes == figures.host_bytes + figures.recomputed_bytes
    assert figures.kept_peak_bytes == figures.device_peak_bytes + figures.offloaded_bytes


def test_each_report_starts_a_new_peak_unless_asked_not_to(model):
    net = actoff.offload_(copy.deepcopy(model), block_cls=Block, policy="cpu", min_bytes=0)
    with simulated_device(seed=0) as device:
        train(net, 1, seq=129)
        first = actoff.report(reset_peak=False)
        assert actoff.report().device_peak_bytes == first.device_peak_bytes  # not reset in between
        idle = actoff.report().device_peak_bytes
        assert idle == device.memory.live < first.device_peak_bytes
        train(net, 1, seq=129)
        assert actoff.report().device_peak_bytes > idle  # the window holds the new step


def test_the_auto_policy_adds_its_plan_and_the_blocks_times(model):
    keep, _ = _report(model, "keep")
    figures, _ = _report(
        model, "auto", steps=4, host_bandwidth="10GB", gpu_budget=int(keep.device_peak_bytes * 0.8)
    )
    stats = actoff.stats()
    assert figures.plan == stats.plan != "none"
    assert figures.offloaded_bytes > 0  # the budget moved some blocks' bytes
    assert figures.blocks_ms == stats.measured_step_ms
    assert figures.blocks_keep_ms == sum(block.forward_ms for block in stats.blocks.values()) > 0
    assert {"plan", "blocks_ms", "blocks_keep_ms"} <= figures.to_dict().keys()
    assert f"plan {stats.plan}" in str(figures)


@pytest.mark.no_sim_device
def test_a_device_that_does_not_count_its_memory_has_no_peak(model):
    net = actoff.offload_(copy.deepcopy(model), block_cls=Block, policy="cpu", min_bytes=0)
    train(net, 1, seq=33)
    figures = actoff.report(device="cpu")
    assert figures.device_peak_bytes is None and figures.kept_peak_bytes is None
    assert figures.host_bytes > 0
    assert "device_peak_bytes" not in figures.to_dict()
    assert "device peak not counted" in str(figures)
    with simulated_device(seed=0, track_memory=False):  # a simulated device told not to count
        assert actoff.report().device_peak_bytes is None


@pytest.mark.gpu
def test_on_cuda_the_peak_is_torchs_between_reports():
    import torch

    actoff.report(device="cuda")  # the window starts here
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del block
    figures = actoff.report(device="cuda")
    assert figures.device_peak_bytes >= 64 * 2**20 + torch.cuda.memory_allocated()
    assert actoff.report(device="cuda").device_peak_bytes == torch.cuda.memory_allocated()
