"""Test setup: skip what this machine cannot run (and say why); a fresh actoff per test."""

import contextlib
import json
import os
import time
import zlib

import pytest
import torch

import actoff
import actoff.config
from actoff.testing import simulated_device

_KEEP_ENV = {
    "ACTOFF_BUILD_EXT",
    "ACTOFF_RUN_SLOW",
    "ACTOFF_TEST_NVME_DIR",
    "ACTOFF_SIM_DEVICE",
    "ACTOFF_IO_BACKEND",
}
#: ACTOFF_IO_BACKEND=posix runs the NVMe tests on the C++ engine where kvikio is installed (a
#: test that names its backend keeps it); the default is auto.
IO_BACKEND = os.environ.get("ACTOFF_IO_BACKEND")
#: ACTOFF_SIM_DEVICE=1 runs every test on the simulated asynchronous device (a fresh one per
#: test, seeded by the test's name; subprocesses inherit the setting).
SIM_DEVICE = os.environ.get("ACTOFF_SIM_DEVICE", "0").lower() in ("1", "true", "yes", "on")


def pytest_addoption(parser):
    parser.addoption(
        "--jsonl",
        metavar="PATH",
        help="append a JSON line per test as it starts and one per phase that ends (flushed): a run cut "
        "short still names the test it was in and every failure so far",
    )


def _jsonl_write(config, record: dict) -> None:
    path = config.getoption("--jsonl")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


def pytest_runtest_logstart(nodeid, location):
    config = _CONFIG.get("config")
    if config is not None:
        _jsonl_write(config, {"test": nodeid, "event": "start"})


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if (
        config is None
        or (report.when == "setup" and report.passed)
        or (report.when == "teardown" and report.passed)
    ):
        return
    message = None
    if report.failed and report.longrepr is not None:
        message = str(getattr(report.longrepr, "reprcrash", None) or report.longrepr).splitlines()[-1][:500]
    _jsonl_write(
        config,
        {
            "test": report.nodeid,
            "event": report.when,
            "outcome": report.outcome,
            "seconds": round(report.duration, 3),
            "message": message,
        },
    )


_CONFIG: dict = {}


def pytest_configure(config):
    _CONFIG["config"] = config


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
        if "plain_pass_only" in item.keywords and SIM_DEVICE:
            item.add_marker(
                pytest.mark.skip(
                    reason="runs in the plain pass only: it chooses its device itself (its subprocesses, "
                    "or a simulated device of its own) or uses none, so the simulated-device pass would repeat it"
                )
            )
        elif ("no_sim_device" in item.keywords or "sim_device" in item.keywords) and SIM_DEVICE:
            # Its device is fixed by its marker, the same in both passes: the plain pass ran it.
            item.add_marker(
                pytest.mark.skip(reason="runs on the same device in both passes: the plain pass ran it")
            )


@pytest.fixture(autouse=True)
def fresh_actoff(monkeypatch, request):
    """Each test starts from default settings (no ACTOFF_* from the caller) and no state."""
    for key in list(os.environ):
        if key.startswith("ACTOFF_") and key not in _KEEP_ENV:
            monkeypatch.delenv(key)
    actoff.set_config(actoff.Config(io_backend=IO_BACKEND) if IO_BACKEND else actoff.Config())
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
