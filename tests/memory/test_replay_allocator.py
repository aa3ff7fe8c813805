"""The replay allocator's library (actoff/libactoff_replay.so, actoff.memory.replay_allocator): built where
nvcc is, exporting its C entry points; nothing thrown across them; install refused with the fix."""

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

import actoff
from actoff.memory import replay_allocator

LIBRARY = os.path.join(os.path.dirname(actoff.__file__), "libactoff_replay.so")
ENTRY_POINTS = [
    "actoff_replay_malloc", "actoff_replay_free", "actoff_replay_abi_version", "actoff_replay_stat_names",
    "actoff_replay_begin_record", "actoff_replay_begin_step", "actoff_replay_end_step", "actoff_replay_copy_log",
    "actoff_replay_set_plan", "actoff_replay_clear_plan", "actoff_replay_stats", "actoff_replay_reset_peak",
    "actoff_replay_error", "actoff_replay_check_driver",
]  # fmt: skip


def _nvcc():
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable) and os.access(os.path.join(os.environ[variable], "bin", "nvcc"), os.X_OK):
            return True
    return shutil.which("nvcc") is not None


needs_library = pytest.mark.skipif(
    not _nvcc() or os.environ.get("ACTOFF_BUILD_EXT", "1") == "0",
    reason="no nvcc (CUDA_HOME, CUDA_PATH, PATH): the replay allocator library is not built",
)


@needs_library
def test_library_is_built_and_exports_only_its_entry_points():
    assert os.path.exists(LIBRARY), "nvcc is here but actoff/libactoff_replay.so was not built: rebuild"
    library = ctypes.CDLL(LIBRARY)  # loads without libcudart (static runtime) and without a GPU
    for name in ENTRY_POINTS:
        assert hasattr(library, name), name
    if shutil.which("nm"):
        out = subprocess.run(
            ["nm", "-D", "--defined-only", LIBRARY], capture_output=True, text=True, check=True
        )
        exported = sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip())
        assert exported == sorted(ENTRY_POINTS)  # no core, no static CUDA runtime symbols


@needs_library
@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the entry points where there is no CUDA driver")
def test_entry_points_record_errors_and_never_throw():
    library = ctypes.CDLL(LIBRARY)
    library.actoff_replay_malloc.restype = ctypes.c_void_p
    library.actoff_replay_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    library.actoff_replay_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    library.actoff_replay_error.restype = ctypes.c_size_t
    message = ctypes.create_string_buffer(1024)
    library.actoff_replay_error(message, len(message), 1)  # start clean

    assert library.actoff_replay_malloc(0, 0, None) is None  # 0 bytes: null, not an error
    assert library.actoff_replay_error(message, len(message), 0) == 0
    assert library.actoff_replay_malloc(1024, 0, None) is None  # no driver: null and recorded
    library.actoff_replay_free(0x1000, 64, 0, None)
    assert library.actoff_replay_begin_record(64) == -1  # device out of range
    assert library.actoff_replay_error(message, len(message), 1) == 3
    assert message.value.startswith(b"actoff_replay_malloc(device 0): cudaGetDevice failed: ")
    assert library.actoff_replay_error(message, len(message), 0) == 0  # cleared


# ---------------------------------------------------------------- install() and its refusals


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA: another refusal applies")
def test_install_refuses_on_a_torch_without_cuda():
    with pytest.raises(RuntimeError, match=r"^ACTOFF_ALLOCATOR=replay: this PyTorch build has no CUDA"):
        actoff.install_replay_allocator()
    assert not replay_allocator.installed()


def test_install_refuses_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(
        RuntimeError,
        match=r"CUDA is already initialised in this process.*Set ACTOFF_ALLOCATOR=replay in the environment "
        r"before the process starts.*actoff.install_replay_allocator\(\) before any CUDA tensor is created",
    ):
        actoff.install_replay_allocator()


def test_install_refuses_without_the_library(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(replay_allocator, "library_path", lambda: None)
    with pytest.raises(
        RuntimeError,
        match=r"actoff/libactoff_replay.so was not built.*nvcc.*python setup.py build_ext --inplace",
    ):
        actoff.install_replay_allocator()


def test_install_refuses_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(replay_allocator, "library_path", lambda: LIBRARY)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"no CUDA device is visible"):
        actoff.install_replay_allocator()


@needs_library
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA driver")
def test_install_refuses_when_the_library_cannot_use_the_driver(monkeypatch):
    # As on a GPU machine whose driver is older than the toolkit actoff was built with.
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(
        RuntimeError,
        match=r"libactoff_replay.so \(CUDA runtime 13\.\d+\) cannot use this CUDA driver \(none\): "
        r"cudaGetDeviceCount failed: .*Update the driver, or rebuild actoff",
    ):
        actoff.install_replay_allocator()
    assert not replay_allocator.installed()
    replay_allocator.check(replay_allocator.load_library(LIBRARY))  # the probe's error was taken, not left


def test_import_with_replay_set_installs_or_keeps_the_refusal_and_never_initialises_cuda():
    code = (
        "import torch, actoff\n"
        "from actoff.memory import replay_allocator\n"
        "print(torch.cuda.is_initialized(), replay_allocator.installed())\n"
        "print(replay_allocator.refusal())\n"
    )
    env = {**os.environ, "ACTOFF_ALLOCATOR": "replay"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    first, reason = out.stdout.splitlines()[:2]
    if torch.cuda.is_available() and os.path.exists(LIBRARY):
        assert first == "False True"
    else:
        assert first == "False False"
        assert reason.startswith("ACTOFF_ALLOCATOR=replay: ")  # kept for the first CUDA step


def test_figures_without_the_allocator_are_zero():
    stats = actoff.replay_allocator_stats()
    assert isinstance(stats, actoff.AllocatorStats)
    assert not stats.installed and stats.fallbacks == 0 and stats.peak_bytes == 0


@needs_library
@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the entry points where there is no CUDA driver")
def test_the_python_face_of_the_entry_points():
    library = replay_allocator.load_library(LIBRARY)
    replay_allocator.check(library)  # start clean
    engine = replay_allocator.CudaEngine(library, 0)
    figures = {field for field in actoff.AllocatorStats.__dataclass_fields__}
    assert set(engine.names) <= figures  # every figure the C side reports has its field
    engine.begin_record()
    engine.end_step()
    assert engine.log() == []
    engine.set_plan([], [], 0)  # an empty plan needs no arena, hence no CUDA
    assert engine.stats()["plans"] == 1
    with pytest.raises(
        RuntimeError,
        match=r"the replay allocator recorded 1 error\(s\); the first: actoff_replay_set_plan\(device 0\): "
        r"cudaGetDevice failed",
    ):
        engine.set_plan([4096], [0], 4096)  # an arena needs the device
    replay_allocator.check(library)  # raised once, then cleared
