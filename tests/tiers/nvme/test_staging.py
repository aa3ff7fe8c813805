"""The NVMe tier's host staging under a host budget that holds a few records at a time (Note
[staging room for reads]): backward reads every record back through it, however small, and
loses nothing. On the simulated device, whose copies are staged as on CUDA without GPUDirect."""

import warnings

import pytest
from _helpers import assert_same_history, baseline_and_offloaded

import actoff
from actoff.testing import simulated_device

pytestmark = pytest.mark.nvme


@pytest.mark.parametrize("host_budget", ["64KiB", "200KiB"])
def test_reads_wait_for_staging_room_instead_of_failing(nvme_dir, host_budget):
    # Before: the reads prefetched in backward held their staging slots until their records were
    # released, the budget ran out, and the next read raised "no host staging memory" in
    # backward, a step whose every write had landed.
    with warnings.catch_warnings(), simulated_device(seed=0):
        warnings.simplefilter("ignore")  # what the budget cannot stage stays on the device: said
        expected, actual = baseline_and_offloaded(
            3, policy="nvme", nvme_dir=nvme_dir, min_bytes=0, host_budget=host_budget
        )
    assert_same_history(expected, actual)
    assert actoff.stats().blocks["layers.0"].bytes_per_tier["nvme"] > 0
