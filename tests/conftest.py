"""Test setup: skip what this machine cannot run (and say why); a fresh actoff per test."""

import contextlib
import os
import zlib

import pytest
import torch

import actoff
import actoff.config
from actoff.testing import simulated_device

_KEEP_ENV = {"ACTOFF_BUILD_EXT", "ACTOFF_RUN_SLOW", "ACTOFF_TEST_NVME_DIR", "ACTOFF_SIM_DEVICE"}
#: ACTOFF_SIM_DEVICE=1 runs every test on the simulated asynchronous device (a fresh one per
#: test, seeded by the test's name; subprocesses inherit the setting).
SIM_DEVICE = os.environ.get("ACTOFF_SIM_DEVICE", "0").lower() in ("1", "true", "yes", "on")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    run_slow = os.environ.get("ACTOFF_RUN_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(
                pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
            )
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: set ACTOFF_RUN_SLOW=1 to run it"))


@pytest.fixture(autouse=True)
def fresh_actoff(monkeypatch, request):
    """Each test starts from default settings (no ACTOFF_* from the caller) and no state."""
    for key in list(os.environ):
        if key.startswith("ACTOFF_") and key not in _KEEP_ENV:
            monkeypatch.delenv(key)
    actoff.set_config(actoff.Config())
    actoff.reset()
    if (SIM_DEVICE and "no_sim_device" not in request.keywords) or "sim_device" in request.keywords:
        device = simulated_device(
            seed=zlib.crc32(request.node.nodeid.encode()) % 10_000,
            track_memory="no_sim_memory" not in request.keywords,
        )
    else:
        device = contextlib.nullcontext()
    with device:
        yield
        actoff.reset()
    actoff.config._global_config = None


@pytest.fixture
def nvme_dir(tmp_path):
    """A directory for the NVMe tier: ACTOFF_TEST_NVME_DIR (a real NVMe mount) or a temp dir."""
    base = os.environ.get("ACTOFF_TEST_NVME_DIR")
    if base:
        path = os.path.join(base, f"actoff-test-{os.getpid()}-{os.urandom(4).hex()}")
        os.makedirs(path)
        yield path
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)
    else:
        path = tmp_path / "nvme"
        path.mkdir()
        yield str(path)
