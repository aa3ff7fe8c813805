"""The kvikio adapter against kvikio 26's Python API: a stand-in here, the real package where
it is installed (its compat path on host buffers, with a stub CUDA driver where no CUDA device
is)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import _fake_kvikio
import pytest
import torch
from _helpers import ROOT, TESTS, assert_history_as_placed, assert_same_history, baseline_and_offloaded

import actoff
from actoff.runtime.runtime import get_runtime
from actoff.testing import simulated_device
from actoff.tiers.nvme.kvikio import KvikioEngine, check_kvikio
from actoff.tiers.nvme.store import open_engine


@pytest.fixture
def kvikio(monkeypatch):
    """kvikio 26's Python API (POSIX I/O on host buffers) as ``import kvikio``."""
    monkeypatch.delenv("KVIKIO_COMPAT_MODE", raising=False)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    return _fake_kvikio.install(monkeypatch)


def test_probe_works_and_auto_picks_kvikio(kvikio, tmp_path):
    assert actoff.kvikio_available()
    assert check_kvikio(str(tmp_path)) == (True, "kvikio (compat)")
    assert os.listdir(tmp_path) == []  # the probe file is gone
    engine = open_engine(str(tmp_path / "auto.bin"), "auto")
    assert isinstance(engine, KvikioEngine) and engine.name == "kvikio (compat)" and not engine.gds
    engine.close()


def test_probe_says_why_kvikio_cannot_do_io(kvikio, tmp_path, monkeypatch):
    def no_driver(self, *args, **kwargs):  # what kvikio does without a CUDA driver
        raise RuntimeError("libcuda.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(kvikio.CuFile, "pwrite", no_driver)
    ok, why = check_kvikio(str(tmp_path))
    assert not ok and "libcuda.so.1" in why
    engine = open_engine(str(tmp_path / "auto.bin"), "auto")
    assert engine.name.startswith("posix")
    engine.close()


def test_round_trip_is_bit_exact_with_many_outstanding_requests(kvikio, tmp_path):
    engine = open_engine(str(tmp_path / "k.bin"), "kvikio", num_threads=4)
    assert kvikio.defaults.get("num_threads") == 4  # raised from kvikio's default of 1
    generator = torch.Generator().manual_seed(0)
    blocks = [
        torch.randn(int(n), generator=generator).to(dtype)
        for n, dtype in zip(
            torch.randint(1, 200_000, (24,), generator=generator),
            [torch.float32, torch.bfloat16, torch.float16] * 8,
            strict=True,
        )
    ]
    offsets, at = [], 0
    for block in blocks:
        offsets.append(at)
        at += (block.numel() * block.element_size() + 4095) // 4096 * 4096
    engine.reserve(at)
    assert engine.file_size() == at
    writes = [engine.pwrite(b, b.numel() * b.element_size(), o) for b, o in zip(blocks, offsets, strict=True)]
    assert [w.wait() for w in writes] == [b.numel() * b.element_size() for b in blocks]
    assert all(w.done() and w.elapsed() > 0 for w in writes)  # seconds of I/O, once done
    backs = [torch.empty_like(b) for b in blocks]
    reads = [engine.pread(b, b.numel() * b.element_size(), o) for b, o in zip(backs, offsets, strict=True)]
    for read in reads:
        read.wait()
        read.wait()  # a second wait answers again: kvikio's get() is called once only
    for block, back in zip(blocks, backs, strict=True):
        assert torch.equal(block.view(torch.uint8), back.view(torch.uint8))
    engine.close()
    engine.close()  # idempotent, like the other engines


def test_futures_keep_their_buffer_alive_until_waited(kvikio, tmp_path):
    engine = open_engine(str(tmp_path / "k.bin"), "kvikio")
    data = torch.arange(1 << 16, dtype=torch.int32)
    future = engine.pwrite(data[: 1 << 15], 1 << 17, 0)  # a temporary view: only the future holds it
    assert future.wait() == 1 << 17
    back = torch.empty(1 << 15, dtype=torch.int32)
    engine.pread(back, 1 << 17, 0).wait()
    assert torch.equal(back, data[: 1 << 15])
    engine.close()


def test_name_and_gds_follow_kvikios_compat_mode(kvikio, tmp_path):
    with kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF):
        engine = KvikioEngine(str(tmp_path / "gds.bin"))
        assert engine.gds and engine.name == "kvikio (GDS)"
        engine.close()
    for mode in (kvikio.CompatMode.ON, kvikio.CompatMode.AUTO):  # AUTO: no cuFile in the stand-in
        with kvikio.defaults.set({"compat_mode": mode}):
            engine = KvikioEngine(str(tmp_path / "compat.bin"))
            assert not engine.gds and engine.name == "kvikio (compat)"
            engine.close()


def test_a_larger_thread_pool_set_by_the_user_is_kept(kvikio, tmp_path):
    kvikio.defaults.set("num_threads", 16)
    KvikioEngine(str(tmp_path / "k.bin"), num_threads=4).close()
    assert kvikio.defaults.get("num_threads") == 16


def test_short_read_raises_with_path_offset_and_size(kvikio, tmp_path):
    engine = open_engine(str(tmp_path / "k.bin"), "kvikio")
    engine.pwrite(torch.ones(1000, dtype=torch.uint8), 1000, 0).wait()
    future = engine.pread(torch.empty(4096, dtype=torch.uint8), 4096, 0)
    with pytest.raises(
        OSError, match=rf"pread of 4096 bytes at offset 0 of {engine.path} is a short read: 1000 of 4096"
    ):
        future.wait()
    assert future.elapsed() == 0.0  # a failed request reports no I/O time
    engine.close()


def test_requests_after_close_fail_cleanly(kvikio, tmp_path):
    engine = open_engine(str(tmp_path / "k.bin"), "kvikio")
    engine.close()
    future = engine.pwrite(torch.ones(8, dtype=torch.uint8), 8, 4096)
    assert future.done()
    with pytest.raises(
        OSError, match=r"pwrite of 8 bytes at offset 4096 of .*k.bin failed: the I/O engine is closed"
    ):
        future.wait()


def test_real_write_error_names_op_path_offset_and_size(tmp_path):
    # RLIMIT_FSIZE makes the kernel fail writes past the limit with EFBIG inside the stand-in's
    # worker thread; kvikio reports it as a RuntimeError, the adapter as an OSError.
    script = textwrap.dedent(f"""
        import resource, sys, torch
        sys.path.insert(0, {TESTS!r})
        import _fake_kvikio
        sys.modules["kvikio"], sys.modules["kvikio.defaults"] = _fake_kvikio.package(), _fake_kvikio.defaults
        from actoff.tiers.nvme.store import open_engine
        engine = open_engine({str(tmp_path / "x.bin")!r}, "kvikio")
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            engine.pwrite(torch.ones(200000, dtype=torch.uint8), 200000, 8192).wait()
        except OSError as error:
            print("OSERROR", error)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert re.search(
        r"OSERROR \[Errno 5\] pwrite of 200000 bytes at offset 8192 of \S*x.bin failed: .*File too large",
        done.stdout,
    ), done.stdout + done.stderr


def test_nvme_tier_on_kvikio_is_bit_exact(kvikio, nvme_dir, monkeypatch):
    monkeypatch.setenv("ACTOFF_IO_BACKEND", "kvikio")
    actoff.set_config(actoff.Config.from_env())
    expected, actual = baseline_and_offloaded(3, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    assert_same_history(expected, actual)
    stats = actoff.stats()
    assert stats.io_backend == "kvikio (compat)"
    assert stats.blocks["layers.0"].bytes_per_tier["nvme"] == stats.blocks["layers.0"].bytes_saved > 0
    assert stats.nvme_file_bytes > 0


class _Gate:
    """A ticket that completes when the test says so (the compute stream reaching a point)."""

    def __init__(self) -> None:
        self.reached = threading.Event()

    def query(self) -> bool:
        return self.reached.is_set()

    def synchronize(self) -> None:
        self.reached.wait()


def test_device_requests_wait_for_their_ticket_and_never_run_on_the_callers_thread(kvikio, tmp_path):
    # (Note [direct device I/O]) kvikio would synchronise the default stream in the calling
    # thread, and its DMA follows no stream: the request starts only once its ticket is done.
    with kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF):  # the stand-in's "GDS active"
        engine = KvikioEngine(str(tmp_path / "gds.bin"))
    assert engine.takes_device_buffers
    data = torch.randn(3000)
    gate = _Gate()
    write = engine.pwrite_device(data, data.numel() * 4, 8192, after=gate)
    time.sleep(0.05)  # the device thread had every chance to start the request early
    assert kvikio.calls == [] and not write.done()
    gate.reached.set()
    assert write.wait() == data.numel() * 4
    back, gate = torch.empty_like(data), _Gate()
    read = engine.pread_device(back, data.numel() * 4, 8192, after=gate)
    time.sleep(0.05)
    assert len(kvikio.calls) == 1 and not read.done()
    gate.reached.set()
    read.wait()
    assert torch.equal(back, data)
    assert [(op, thread.startswith("actoff-gds")) for op, thread, _, _ in kvikio.calls] == [
        ("pwrite", True),
        ("pread", True),
    ]
    engine.close()
    late = engine.pwrite_device(data, 16, 0, after=None)
    with pytest.raises(OSError, match="the I/O engine is closed"):
        late.wait()


def test_engines_without_gds_refuse_device_requests(kvikio, tmp_path):
    for engine in (KvikioEngine(str(tmp_path / "compat.bin")), open_engine(str(tmp_path / "p.bin"), "posix")):
        assert not engine.takes_device_buffers
        with pytest.raises(NotImplementedError, match="host buffers only"):
            engine.pwrite_device(torch.ones(4), 16, 0, after=None)
        engine.close()


@pytest.mark.parametrize("mode", ["gds", "compat"])
@pytest.mark.parametrize("policy", ["nvme", "tokenwise"])
def test_on_a_device_with_dma_gds_takes_device_buffers_and_compat_stages(
    kvikio, nvme_dir, monkeypatch, mode, policy
):
    """On the simulated device (a device with DMA, on the CPU): with GDS active the engine is
    handed the device tensors, off the training thread, and a slow read is waited for; in
    compat mode every request goes through host staging slots. Both bit-exact under ``nvme``;
    ``tokenwise`` recomputes rows on fewer tokens: within float32 reassociation. Every step
    finishes its writes before backward (`Runtime.flush`): a record is then read back from its
    file unless its original tensor is still alive (forwarding), which the blocks'
    intermediates are not, so kvikio must be asked for a pread."""
    monkeypatch.setenv("KVIKIO_COMPAT_MODE", "OFF" if mode == "gds" else "ON")
    kvikio._reset()
    kvikio.io_delay_s = 0.002  # a slow disk: a read not waited for would leave garbage
    fractions = {"cpu_fraction": 0.25, "nvme_fraction": 0.5} if policy == "tokenwise" else {}
    staged = []  # per request: is its buffer host memory (a staging slot), asked when it is made
    submit = kvikio.CuFile._submit

    def spy(self, op, buf, *args):
        address = buf.__array_interface__["data"][0]
        staged.append(device.is_host(SimpleNamespace(data_ptr=lambda: address)))
        return submit(self, op, buf, *args)

    monkeypatch.setattr(kvikio.CuFile, "_submit", spy)
    with simulated_device(seed=3) as device:
        # tokenwise: a step more, as its first is the probe's, stored whole (Note [probe in the
        # first backward]).
        steps = 3 if policy == "tokenwise" else 2
        expected, actual = baseline_and_offloaded(
            steps,
            policy=policy,
            nvme_dir=nvme_dir,
            min_bytes=0,
            io_backend="kvikio",
            train_kwargs={"before_backward": lambda: get_runtime().flush()},
            **fractions,
        )
    assert_history_as_placed(expected, actual, recomputed=policy == "tokenwise")
    stats = actoff.stats()
    assert stats.io_backend == ("kvikio (GDS)" if mode == "gds" else "kvikio (compat)")
    assert sum(block.bytes_per_tier["nvme"] for block in stats.blocks.values()) > 0
    ops = [op for op, _, _, _ in kvikio.calls]
    assert set(ops) == {"pwrite", "pread"}, set(ops)  # the writes finished: backward reads back
    assert len(staged) == len(kvikio.calls)
    threads = {thread.split("_")[0] for _, thread, _, _ in kvikio.calls}
    if mode == "gds":
        assert not any(staged) and threads == {"actoff-gds"}
    else:
        assert all(staged) and "actoff-gds" not in threads


# A libcuda.so.1 whose every entry point answers CUDA_ERROR_NOT_INITIALIZED (3): kvikio then
# cannot use the GPU but its compat path runs on host buffers (FIELD_NOTES, "Our build and CI
# machines"). kvikio resolves these names with dlsym; versioned names are exported too.
_STUB_NAMES = [
    "cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetAttribute",
    "cuCtxCreate", "cuCtxDestroy", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuCtxGetCurrent",
    "cuCtxGetDevice", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuMemHostAlloc",
    "cuMemFreeHost", "cuMemHostRegister", "cuMemHostUnregister", "cuMemcpyHtoDAsync",
    "cuMemcpyDtoHAsync", "cuMemcpyAsync", "cuMemcpyBatchAsync", "cuPointerGetAttribute",
    "cuPointerGetAttributes", "cuMemGetAddressRange", "cuStreamSynchronize", "cuStreamCreate",
    "cuStreamDestroy", "cuEventSynchronize", "cuEventCreate", "cuEventDestroy", "cuEventRecord",
    "cuEventQuery", "cuLaunchHostFunc", "cuGetProcAddress",
]  # fmt: skip
_STUB_SOURCE = (
    'static const char *msg = "CUDA_ERROR_NOT_INITIALIZED (actoff test stub)";\n'
    "int cuGetErrorName(int e, const char **s) { *s = msg; return 0; }\n"
    "int cuGetErrorString(int e, const char **s) { *s = msg; return 0; }\n"
    + "".join(
        f"int {name}{suffix}() {{ return 3; }}\n"
        for name in _STUB_NAMES
        for suffix in ("", "_v2", "_v3", "_v4")
    )
)


@pytest.mark.skipif(
    importlib.util.find_spec("kvikio") is None,
    reason="the real kvikio package is not installed (pip install actoff[nvme]); the stand-in tests cover the adapter",
)
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CUDA device is here (the stub driver is for machines without one; beside a real one the "
    "child hung for minutes on an H200, 2026-12-04); test_nvme.py's test_nvme_on_cuda_is_exact[kvikio] "
    "runs the real kvikio on such a machine",
)
def test_real_kvikio_compat_path_with_a_stub_driver(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stub libcuda.so.1")
    (tmp_path / "stub.c").write_text(_STUB_SOURCE)
    libdir = tmp_path / "lib"
    libdir.mkdir()
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(libdir / "libcuda.so.1"), str(tmp_path / "stub.c")],
        check=True,
    )
    script = textwrap.dedent(f"""
        import torch
        from actoff.tiers.nvme.kvikio import check_kvikio
        from actoff.tiers.nvme.store import open_engine
        ok, name = check_kvikio({str(tmp_path)!r})
        assert ok, name
        engine = open_engine({str(tmp_path / "k.bin")!r}, "kvikio")
        data = torch.randn(1 << 20)
        engine.pwrite(data, data.numel() * 4, 4096).wait()
        back = torch.empty_like(data)
        engine.pread(back, data.numel() * 4, 4096).wait()
        assert torch.equal(back, data)
        print("OK", engine.name)
        engine.close()
    """)
    # KVIKIO_COMPAT_MODE=ON, never OFF: without GDS opening a file would spin in libcufile.
    env = {**os.environ, "LD_LIBRARY_PATH": f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "KVIKIO_COMPAT_MODE": "ON", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0 and "OK kvikio (compat)" in done.stdout, done.stdout + done.stderr[-3000:]
