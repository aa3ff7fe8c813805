"""The NVMe tier under a host budget that holds a few records at a time, on the simulated device
(copies staged as on CUDA): backward reads every record back through the staging room there is
(Note [staging room for reads]), and with an engine that writes device memory itself what the
host cannot take goes to the file (Note [a full host spills to NVMe])."""

import warnings

import _fake_kvikio
import pytest
from _helpers import assert_close_history, assert_same_history, baseline_and_offloaded

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


@pytest.fixture
def gds_kvikio(monkeypatch):
    """The kvikio stand-in with GPUDirect Storage on: it writes device memory itself."""
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    monkeypatch.setenv("KVIKIO_COMPAT_MODE", "OFF")
    kvikio = _fake_kvikio.install(monkeypatch)
    kvikio._reset()
    return kvikio


@pytest.mark.parametrize("policy", ["cpu", "checkpoint", "auto", "chunked"])
def test_a_full_host_spills_to_nvme_where_the_engine_writes_device_memory(nvme_dir, gds_kvikio, policy):
    # (Note [a full host spills to NVMe]) Before, what the host budget could not take stayed on
    # the device under every policy but nvme's, with ACTOFF_NVME_DIR given and GDS on. A chunked
    # block's inputs go as a checkpoint's do (issue 39's host budget with NVMe past it); its
    # gradients within float32 reassociation (Note [chunked backward]: sums over chunks).
    settings = {"auto": {"gpu_budget": 10**9}, "chunked": {"chunk_tokens": 8}}.get(policy, {})
    with warnings.catch_warnings(), simulated_device(seed=0):
        warnings.simplefilter("ignore")  # settings a policy does not read are said
        expected, actual = baseline_and_offloaded(
            2,
            policy=policy,
            nvme_dir=nvme_dir,
            min_bytes=0,
            host_budget="16KiB",  # a block's input is 16.5 KiB
            io_backend="kvikio",
            **settings,
        )
        blocks = actoff.stats().blocks.values()
    (assert_close_history if policy == "chunked" else assert_same_history)(expected, actual)
    assert sum(block.bytes_per_tier["nvme"] for block in blocks) > 0
    assert sum(block.over_budget_bytes for block in blocks) == 0
