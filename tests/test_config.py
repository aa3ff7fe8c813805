"""Config: defaults, the ACTOFF_* reader, Python overrides, and an error for every bad value."""

import os

import pytest

import actoff
from actoff import Config, parse_size


def test_defaults_are_valid():
    config = Config()
    assert config.policy == "cpu"
    assert config.min_bytes == 64 * 1024
    assert config.host_budget is None
    assert config.pinned_budget is None  # no cap: pinned as long as the system gives it
    assert config.allocator == "caching"
    assert config.nvme_checksum is True  # every NVMe record sealed unless switched off


def test_from_env_reads_every_variable(tmp_path):
    env = {
        "ACTOFF_POLICY": "NVME",
        "ACTOFF_CPU_FRACTION": "0.25",
        "ACTOFF_NVME_FRACTION": "0.5",
        "ACTOFF_NVME_DIR": str(tmp_path),
        "ACTOFF_MIN_BYTES": "4KiB",
        "ACTOFF_KEEP_LAST": "2",
        "ACTOFF_PREFETCH_DEPTH": "0",
        "ACTOFF_HOST_BUDGET": "64GiB",
        "ACTOFF_PINNED_BUDGET": "1.5GiB",
        "ACTOFF_GPU_BUDGET": "70GB",
        "ACTOFF_PLANNER": "MIP",
        "ACTOFF_PLAN_CACHE": str(tmp_path / "plans"),
        "ACTOFF_IO_BACKEND": "posix",
        "ACTOFF_IO_THREADS": "8",
        "ACTOFF_VERIFY": "yes",
        "ACTOFF_NVME_CHECKSUM": "off",
        "ACTOFF_TOKEN_DIM": "0",
        "ACTOFF_ALLOCATOR": "REPLAY",
    }
    config = Config.from_env(env)
    assert config.policy == "nvme"
    assert (config.cpu_fraction, config.nvme_fraction) == (0.25, 0.5)
    assert config.min_bytes == 4096
    assert config.keep_last == 2
    assert config.prefetch_depth == 0
    assert config.host_budget == 64 * 2**30
    assert config.pinned_budget == 3 * 2**29
    assert config.gpu_budget == 70 * 10**9
    assert config.planner == "mip"
    assert config.io_threads == 8
    assert config.verify is True
    assert config.nvme_checksum is False
    assert config.token_dim == 0
    assert config.allocator == "replay"


def test_python_arguments_win_over_the_environment():
    config = Config.from_env({"ACTOFF_POLICY": "cpu", "ACTOFF_KEEP_LAST": "3"}, policy="keep")
    assert config.policy == "keep"
    assert config.keep_last == 3


def test_get_config_reads_os_environ_once(monkeypatch):
    monkeypatch.setenv("ACTOFF_POLICY", "keep")
    actoff.set_config()
    assert actoff.get_config().policy == "keep"
    monkeypatch.setenv("ACTOFF_POLICY", "cpu")
    assert actoff.get_config().policy == "keep"  # read once, frozen


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        Config().policy = "keep"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "ACTOFF_POLICY",
            "fast",
            "ACTOFF_POLICY.*'fast'.*keep, recompute, cpu, nvme, tokenwise, checkpoint, chunked, auto",
        ),
        ("ACTOFF_HOST_BANDWIDTH", "fast", "ACTOFF_HOST_BANDWIDTH.*not a size"),
        ("ACTOFF_CPU_FRACTION", "1.5", "ACTOFF_CPU_FRACTION.*out of range"),
        ("ACTOFF_CPU_FRACTION", "-0.1", "ACTOFF_CPU_FRACTION.*out of range"),
        ("ACTOFF_NVME_FRACTION", "half", "ACTOFF_NVME_FRACTION.*'half' is not a number"),
        ("ACTOFF_MIN_BYTES", "12XB", "ACTOFF_MIN_BYTES.*unknown unit 'XB'"),
        ("ACTOFF_MIN_BYTES", "lots", "ACTOFF_MIN_BYTES.*not a size"),
        ("ACTOFF_HOST_BUDGET", "64", "ACTOFF_HOST_BUDGET.*no unit.*'64GiB'"),
        ("ACTOFF_HOST_BUDGET", "64 parsecs", "ACTOFF_HOST_BUDGET.*unknown unit"),
        ("ACTOFF_GPU_BUDGET", "-4GiB", "ACTOFF_GPU_BUDGET.*not a size"),
        (
            "ACTOFF_PINNED_BUDGET",
            "2",
            r"ACTOFF_PINNED_BUDGET \(Config.pinned_budget\)='2' has no unit.*'2GiB'",
        ),
        ("ACTOFF_PINNED_BUDGET", "lots", "ACTOFF_PINNED_BUDGET.*not a size"),
        ("ACTOFF_PINNED_BUDGET", "-1GiB", "ACTOFF_PINNED_BUDGET.*not a size"),
        ("ACTOFF_KEEP_LAST", "-1", "ACTOFF_KEEP_LAST.*out of range"),
        ("ACTOFF_KEEP_LAST", "two", "ACTOFF_KEEP_LAST.*'two' is not an integer"),
        ("ACTOFF_IO_THREADS", "0", "ACTOFF_IO_THREADS.*>= 1"),
        ("ACTOFF_PREFETCH_DEPTH", "-1", "ACTOFF_PREFETCH_DEPTH.*>= 0"),
        ("ACTOFF_PLANNER", "optimal", "ACTOFF_PLANNER.*mip, greedy, off"),
        ("ACTOFF_IO_BACKEND", "gds", "ACTOFF_IO_BACKEND.*auto, kvikio, posix"),
        (
            "ACTOFF_ALLOCATOR",
            "cuda",
            r"ACTOFF_ALLOCATOR \(Config.allocator\)='cuda' is not valid: expected one of caching, replay",
        ),
        ("ACTOFF_VERIFY", "maybe", "ACTOFF_VERIFY.*not a boolean"),
        (
            "ACTOFF_NVME_CHECKSUM",
            "crc",
            r"ACTOFF_NVME_CHECKSUM \(Config.nvme_checksum\)='crc' is not a boolean",
        ),
        ("ACTOFF_POLCY", "cpu", "ACTOFF_POLCY is not an actoff setting"),
        ("ACTOFF_IO_TIMEOUT", "0", "ACTOFF_IO_TIMEOUT.*seconds > 0"),
        ("ACTOFF_IO_TIMEOUT", "soon", "ACTOFF_IO_TIMEOUT.*'soon' is not a number"),
        ("ACTOFF_VERIFY_INTERVAL", "0", "ACTOFF_VERIFY_INTERVAL.*>= 1"),
        ("ACTOFF_TOKEN_DIM", "-1", "ACTOFF_TOKEN_DIM.*>= 0"),
        ("ACTOFF_HOST_BANDWIDTH", "25", "ACTOFF_HOST_BANDWIDTH.*no unit"),
        ("ACTOFF_MIN_BYTES", "-5", "ACTOFF_MIN_BYTES.*not a size"),
    ],
)
def test_bad_values_name_the_variable_and_what_is_allowed(variable, value, message):
    with pytest.raises(ValueError, match=message):
        Config.from_env({variable: value})


def test_sim_device_memory_is_a_size_and_needs_the_simulated_device():
    on = {"ACTOFF_SIM_DEVICE": "1"}
    assert Config.from_env({**on, "ACTOFF_SIM_DEVICE_MEMORY": "2GiB"}).sim_device_memory == 2 * 2**30
    assert Config.from_env({**on, "ACTOFF_SIM_DEVICE_MEMORY": "none"}).sim_device_memory is None
    assert Config(sim_device=True, sim_device_memory=4096).sim_device_memory == 4096
    for value, message in (
        ("2", r"ACTOFF_SIM_DEVICE_MEMORY \(Config.sim_device_memory\)='2' has no unit"),
        ("lots", "ACTOFF_SIM_DEVICE_MEMORY.*not a size"),
        ("2 parsecs", "ACTOFF_SIM_DEVICE_MEMORY.*unknown unit"),
        ("0GiB", "ACTOFF_SIM_DEVICE_MEMORY.*expected a size > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            Config.from_env({**on, "ACTOFF_SIM_DEVICE_MEMORY": value})
    # Without the simulated device there is nothing to cap: refused, naming the fix.
    with pytest.raises(
        ValueError,
        match=r"caps the simulated device, which is off: turn ACTOFF_SIM_DEVICE \(Config.sim_device\) on",
    ):
        Config.from_env({"ACTOFF_SIM_DEVICE_MEMORY": "2GiB"})
    with pytest.raises(TypeError, match="sim_device_memory"):
        Config(sim_device=True, sim_device_memory=1.5)


def test_fractions_over_one_are_rejected():
    with pytest.raises(ValueError, match=r"ACTOFF_CPU_FRACTION \+ ACTOFF_NVME_FRACTION = 0.7 \+ 0.5 > 1"):
        Config.from_env({"ACTOFF_CPU_FRACTION": "0.7", "ACTOFF_NVME_FRACTION": "0.5"})


@pytest.mark.parametrize(
    ("field", "value"),
    [("policy", 3), ("min_bytes", 1.5), ("keep_last", True), ("cpu_fraction", [0.5]), ("nvme_dir", 7)],
)
def test_wrong_python_types_raise_type_error(field, value):
    with pytest.raises(TypeError, match=field):
        Config(**{field: value})


def test_unknown_override_names_the_field():
    with pytest.raises(TypeError, match="no field 'polcy'"):
        Config.from_env({}, polcy="cpu")
    with pytest.raises(TypeError, match="no field 'polcy'"):
        Config().replace(polcy="cpu")


def test_keywords_are_named_as_the_keywords_of_the_call():
    with pytest.raises(TypeError, match="set_config\\(\\): got an unexpected keyword 'polcy'"):
        actoff.set_config(polcy="cpu")
    with pytest.raises(ValueError, match="set_config\\(\\): keep_last=-1 is out of range") as caught:
        actoff.set_config(keep_last=-1)
    assert "ACTOFF_" not in str(caught.value)


def test_nvme_policy_needs_a_directory():
    with pytest.raises(ValueError, match="ACTOFF_NVME_DIR"):
        Config(policy="nvme")


def test_nvme_dir_is_created_when_its_parent_exists(tmp_path):
    target = tmp_path / "spill"
    Config(policy="nvme", nvme_dir=str(target))
    assert target.is_dir()


def test_nvme_dir_errors_name_the_path(tmp_path):
    regular = tmp_path / "file.bin"
    regular.write_bytes(b"x")
    with pytest.raises(ValueError, match=f"ACTOFF_NVME_DIR.*{regular}.*regular file"):
        Config(nvme_dir=str(regular))
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(ValueError, match="does not exist and neither does its parent"):
        Config(nvme_dir=str(missing))


def test_nvme_dir_not_writable(tmp_path):
    # Root ignores permission bits, so use a directory no one can create files in.
    candidates = ["/proc/self", "/sys"]
    target = next((c for c in candidates if os.path.isdir(c)), None)
    if target is None:
        pytest.skip("no read-only directory on this system")
    with pytest.raises(ValueError, match=f"ACTOFF_NVME_DIR.*{target}.*not writable"):
        Config(nvme_dir=target)


def test_parse_size():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("2g") == 2 * 2**30
    assert parse_size("100", allow_bare=True) == 100
    with pytest.raises(ValueError, match="no unit"):
        parse_size("100")


def test_non_config_actoff_variables_are_ignored():
    Config.from_env({"ACTOFF_BUILD_EXT": "0", "ACTOFF_RUN_SLOW": "1"})


def test_set_config_rejects_other_types():
    with pytest.raises(TypeError, match="actoff.Config"):
        actoff.set_config({"policy": "cpu"})
