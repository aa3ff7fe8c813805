"""The replay allocator's library (actoff/libactoff_replay.so, actoff._allocator): built where
nvcc is, exporting its C entry points; nothing thrown across them; install refused with the fix."""

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

import actoff

LIBRARY = os.path.join(os.path.dirname(actoff.__file__), "libactoff_replay.so")
ENTRY_POINTS = [
    "actoff_replay_malloc", "actoff_replay_free", "actoff_replay_abi_version", "actoff_replay_stat_names",
    "actoff_replay_begin_record", "actoff_replay_begin_step", "actoff_replay_end_step", "actoff_replay_copy_log",
    "actoff_replay_set_plan", "actoff_replay_clear_plan", "actoff_replay_stats", "actoff_replay_reset_peak",
    "actoff_replay_error",
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
