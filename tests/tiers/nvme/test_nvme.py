"""NVMe tier: extents, the store's file, exact training, and every fault path with real OS errors."""

import copy
import gc
import itertools
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import ROOT, assert_same_history, baseline_and_offloaded, make_model, train

import actoff
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime
from actoff.tiers.nvme.store import ExtentAllocator, NvmeStore

pytestmark = pytest.mark.nvme


def test_extent_allocator_never_overlaps_and_coalesces():
    rng = random.Random(0)
    extents = ExtentAllocator()
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            extents.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(extents.alloc(rng.randrange(1, 50_000)))
        spans = sorted((e.offset, e.offset + e.size) for e in live)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(e.offset % 4096 == 0 and e.size % 4096 == 0 for e in live)
    for extent in live:
        extents.free(extent)
    assert extents._free == [(0, extents.end)]  # fully coalesced
    assert extents.live_bytes == 0


def test_store_round_trip_and_removal(nvme_dir):
    store = NvmeStore(nvme_dir, backend="posix")
    assert os.path.basename(store.path).startswith(f"actoff-rank0-pid{os.getpid()}-")
    assert os.listdir(nvme_dir) == []  # Note [spill files die with the process]: no name on disk
    data = torch.randn(10_000)
    extent, future = store.write(data, data.numel() * 4)
    future.wait()
    back = torch.empty_like(data)
    store.read(back, extent, data.numel() * 4).wait()
    assert torch.equal(back, data)
    store.close()
    assert os.listdir(nvme_dir) == []


@pytest.mark.parametrize("keep_last", [0, 1])
@pytest.mark.parametrize("fused_qkv", [False, True], ids=["separate_qkv", "fused_qkv"])
def test_nvme_policy_bit_exact(nvme_dir, keep_last, fused_qkv):
    expected, actual = baseline_and_offloaded(
        4,
        model_changes={"fused_qkv": fused_qkv},
        policy="nvme",
        nvme_dir=nvme_dir,
        min_bytes=0,
        keep_last=keep_last,
        io_backend="posix",  # where kvikio is installed too (a GPU machine): the engine asserted below
    )
    assert_same_history(expected, actual)
    stats = actoff.stats()
    tiers = stats.blocks["layers.0"].bytes_per_tier
    # On an asynchronous device (the simulated one), a record whose copy out had not ended
    # when backward reached it is served from its staging slot and counts as host bytes
    # (Note [staged writes free the device early]); on a plain CPU device every byte is on disk.
    assert tiers["nvme"] > 0 and tiers["nvme"] + tiers["cpu"] == stats.blocks["layers.0"].bytes_saved
    assert stats.nvme_file_bytes > 0 and stats.io_backend.startswith("posix")


def test_nvme_with_verify_is_exact(nvme_dir):
    expected, actual = baseline_and_offloaded(2, policy="nvme", nvme_dir=nvme_dir, min_bytes=0, verify=True)
    assert_same_history(expected, actual)


def test_cpu_tier_with_verify_is_exact():
    expected, actual = baseline_and_offloaded(2, policy="cpu", min_bytes=0, verify=True)
    assert_same_history(expected, actual)


def test_file_stops_growing_after_the_first_step(nvme_dir):
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    train(model, 1)
    store = get_runtime().stores.stores()[0]
    growths, size = store.growths, store.file_size()
    train(model, 3)
    assert store.growths == growths and store.file_size() == size
    assert store.extents.live_bytes == 0  # every extent returned at the end of backward


def test_the_file_does_not_depend_on_when_copies_end(nvme_dir):
    """On a device with DMA a record is staged through host memory, and its write starts
    once the host sees its copy out end: in forward, or in backward, between the frees of
    later blocks' extents. A first step whose copies end late reused those extents; a later
    one whose copies ended early needed them all at once and grew the file (doubled it)
    after warm-up. Extents are taken when records are placed, so the file's layout is the
    same every step."""
    from actoff.testing import simulated_device

    model = make_model(num_layers=4)
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    with simulated_device(seed=11) as device:
        real_loss = model.loss

        def late_copies(tokens):  # no copy out ends before backward: writes start there
            device.drain()
            with device.hold(copies=True):
                return real_loss(tokens)

        model.loss = late_copies
        actual = train(model, 1)
        store = get_runtime().stores.stores()[0]
        growths, size = store.growths, store.file_size()
        model.loss = real_loss
        for layer in model.layers:  # every copy out ends before the next block: writes start in forward
            layer.register_forward_pre_hook(lambda module, args: device.drain())
        actual += train(model, 2)
    assert_same_history(train(reference, 1) + train(reference, 2), actual)
    assert (store.growths, store.file_size()) == (growths, size)
    assert store.extents.live_bytes == 0


def test_no_file_left_after_reset(nvme_dir):
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    train(model, 2)
    store = get_runtime().stores.stores()[0]
    assert os.listdir(nvme_dir) == [] and store.file_size() > 0  # in use, nameless
    spill = os.fstat(store.file.fd)
    actoff.reset()
    assert os.listdir(nvme_dir) == [] and store.file.fd == -1
    assert _fds_of(spill) == []  # every descriptor closed: the kernel freed the blocks


def _run_script(body: str, nvme_dir: str, check: bool = True) -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        f"""
        import sys, copy, torch, warnings
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import actoff
        from _helpers import make_model, train, assert_same_history
        from actoff.reference import Block
        NVME_DIR = {nvme_dir!r}
        """
    ) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=check)


def test_no_file_left_at_process_exit(nvme_dir):
    _run_script(
        """
        model = make_model()
        actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=NVME_DIR, min_bytes=0)
        train(model, 2)
        assert __import__("os").listdir(NVME_DIR) == []
        """,
        nvme_dir,
    )
    assert os.listdir(nvme_dir) == []


def test_no_file_left_after_an_uncaught_exception_mid_step(nvme_dir):
    result = _run_script(
        """
        model = make_model()
        actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=NVME_DIR, min_bytes=0)
        loss = model.loss(torch.randint(0, 256, (2, 33)))
        raise SystemError("crash between forward and backward")
        """,
        nvme_dir,
        check=False,
    )
    assert result.returncode != 0 and "crash between forward and backward" in result.stderr
    assert os.listdir(nvme_dir) == []


def test_write_failure_falls_back_with_one_warning_and_exact_gradients(nvme_dir):
    # A real EFBIG: the file may not grow past 64 KiB, far less than one step needs.
    result = _run_script(
        """
        import resource
        model = make_model()
        reference = copy.deepcopy(model)
        expected = train(reference, 3)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=NVME_DIR, min_bytes=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actual = train(model, 3)
        assert_same_history(expected, actual)
        messages = [str(w.message) for w in caught if "NVMe write failed" in str(w.message)]
        print("WARNINGS", len(messages))
        print(messages[0])
        print("FALLBACK", sum(b.write_fallback_bytes for b in actoff.stats().blocks.values()))
        """,
        nvme_dir,
    )
    assert "WARNINGS 1" in result.stdout
    assert "File too large" in result.stdout and "exact values" in result.stdout
    fallback = int(result.stdout.split("FALLBACK ")[1].split()[0])
    assert fallback > 0


def _fds_of(spill: os.stat_result) -> list[int]:
    """This process's descriptors of the file ``spill`` describes (the file has no name)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (info.st_dev, info.st_ino) == (spill.st_dev, spill.st_ino):
            fds.append(int(name))
    return fds


def test_pwrite_error_mid_step_keeps_values(nvme_dir):
    # Swap the store's descriptors for read-only ones: every later pwrite fails with EBADF
    # (kvikio's POSIX path words it "Operation not permitted").
    model = make_model()
    reference = copy.deepcopy(model)
    expected = train(reference, 1) + train(reference, 1)  # two calls: same tokens twice
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    actual = train(model, 1)
    store = get_runtime().stores.stores()[0]
    readonly = os.open(store.file.reopen_path(), os.O_RDONLY)
    fds = _fds_of(os.fstat(store.file.fd))
    assert fds
    for fd in fds:
        if fd != readonly:
            os.dup2(readonly, fd)
    with pytest.warns(
        RuntimeWarning, match="NVMe write failed.*(Bad file descriptor|Operation not permitted)"
    ):
        actual += train(model, 1)
    os.close(readonly)
    assert_same_history(expected, actual)


def test_truncated_file_raises_in_the_training_thread(nvme_dir):
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    loss = model.loss(torch.randint(0, 256, (2, 33)))
    get_runtime().flush()
    store = get_runtime().stores.stores()[0]
    os.ftruncate(store.file.fd, 0)
    with pytest.raises(
        RuntimeError,
        match=r"reading a saved activation of block 'layers\.\d' \(record \d+, step 0\) back from NVMe failed.*short read",
    ):
        loss.backward()


def test_corrupted_byte_is_detected_with_verify(nvme_dir):
    # Seals off: ACTOFF_VERIFY's own check in the training thread (seals: test_faults.py).
    model = make_model()
    actoff.offload_(
        model,
        block_cls=Block,
        policy="nvme",
        nvme_dir=nvme_dir,
        min_bytes=0,
        verify=True,
        nvme_checksum=False,
    )
    loss = model.loss(torch.randint(0, 256, (2, 33)))
    runtime = get_runtime()
    runtime.flush()
    record = runtime.step.runs[0].records[0]
    store = runtime.stores.stores()[0]
    byte = os.pread(store.file.fd, 1, record.extent.offset + 5)
    os.pwrite(store.file.fd, bytes([byte[0] ^ 0x40]), record.extent.offset + 5)
    with pytest.raises(RuntimeError, match="came back corrupted.*ACTOFF_VERIFY=1"):
        loss.backward()


def test_kvikio_backend_requires_the_package(nvme_dir):
    if actoff.kvikio_available():
        pytest.skip("kvikio is installed here")
    model = make_model()
    actoff.offload_(
        model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0, io_backend="kvikio"
    )
    with pytest.raises(ModuleNotFoundError, match="kvikio"):
        train(model, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("io_backend", ["posix", "kvikio"])
def test_nvme_on_cuda_is_exact(nvme_dir, io_backend):
    """On CUDA: staged through pinned memory (POSIX engine, kvikio in compat mode), or with
    GPUDirect Storage active, kvikio reading and writing the device tensors themselves."""
    if io_backend == "kvikio":
        from actoff.tiers.nvme.kvikio import check_kvikio

        ok, why = check_kvikio(nvme_dir)
        if not ok:
            pytest.skip(why)
    model = make_model().cuda()
    reference = copy.deepcopy(model)
    actoff.offload_(
        model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0, io_backend=io_backend
    )
    assert_same_history(train(reference, 3, seq=65), train(model, 3, seq=65))
    stats = actoff.stats()
    assert stats.io_backend.startswith(io_backend)
    print("nvme backend:", stats.io_backend)  # kvikio (GDS) or kvikio (compat): in the test log


def _python_engine(monkeypatch):
    import actoff.tiers.nvme.engines

    monkeypatch.setattr(
        actoff.tiers.nvme.engines, "_C", None
    )  # the Python engine, whose workers we can break


def test_a_write_worker_that_fails_falls_back(monkeypatch, nvme_dir):
    _python_engine(monkeypatch)
    from actoff.tiers.nvme.engines import PythonEngine

    original = PythonEngine._run

    def broken(self, op, *args):
        if op == "pwrite":
            raise RuntimeError("the I/O worker died")
        return original(self, op, *args)

    monkeypatch.setattr(PythonEngine, "_run", broken)
    expected, actual = None, None
    with pytest.warns(RuntimeWarning, match="NVMe write failed.*the I/O worker died"):
        expected, actual = baseline_and_offloaded(
            2, policy="nvme", nvme_dir=nvme_dir, min_bytes=0, io_backend="posix"
        )
    assert_same_history(expected, actual)


# A hung worker also holds back writes queued behind the hung reads: where backward waits for a
# write (a staged one still running), that write times out and falls back, with its warning.
@pytest.mark.filterwarnings("ignore:actoff. an NVMe write failed:RuntimeWarning")
def test_a_hung_read_raises_in_the_training_thread(monkeypatch, nvme_dir):
    _python_engine(monkeypatch)
    import threading

    from actoff.tiers.nvme.engines import PythonEngine

    original = PythonEngine._run
    release = threading.Event()

    def hanging(self, op, *args):
        if op == "pread":
            release.wait(30)
        return original(self, op, *args)

    monkeypatch.setattr(PythonEngine, "_run", hanging)
    model = make_model()
    settings = {"nvme_dir": nvme_dir, "min_bytes": 0, "io_timeout": 0.3, "io_backend": "posix"}
    actoff.offload_(model, block_cls=Block, policy="nvme", **settings)
    loss = model.loss(torch.randint(0, 256, (2, 33)))
    try:
        with pytest.raises(RuntimeError, match="back from NVMe failed.*hangs or died"):
            loss.backward()
        assert get_runtime().quarantine  # the buffers a hung read may still fill are never reused
    finally:
        release.set()


def test_sigterm_ends_the_process_and_leaves_nothing(nvme_dir):
    # No exit handler is needed to remove the file (it has no name), so actoff leaves SIGTERM
    # alone: its default action ends the process at once.
    result = _run_script(
        """
        import os, signal, time
        model = make_model()
        actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=NVME_DIR, min_bytes=0)
        loss = model.loss(torch.randint(0, 256, (2, 33)))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("still running")
        """,
        nvme_dir,
        check=False,
    )
    assert result.returncode == -15, (result.returncode, result.stderr)
    assert "still running" not in result.stdout
    assert os.listdir(nvme_dir) == []


def test_exception_mid_step_leaves_no_extent_and_next_steps_are_exact(nvme_dir):
    model = make_model()
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    layer = model.layers[1]
    original = layer.forward
    layer.forward = lambda *a, **k: (_ for _ in ()).throw(KeyError("boom"))
    with pytest.raises(KeyError):
        model.loss(torch.randint(0, 256, (2, 33)))
    layer.forward = original
    assert_same_history(train(reference, 2), train(model, 2))
    # The partial graph of the failed step (and its records) lives as long as the exception's
    # traceback frames, which sit in reference cycles: the cycle collector frees them.
    gc.collect()
    assert get_runtime().stores.stores()[0].extents.live_bytes == 0
    actoff.reset()
    assert os.listdir(nvme_dir) == []


@pytest.mark.plain_pass_only
def test_extents_past_4_gib_write_and_read_back_sealed(nvme_dir):
    """64-bit offsets in the NVMe store (a million tokens of an 8B model's block inputs are 256
    GB): an extent past 2**32 bytes of the file is written, sealed, read back and checked through
    the C++ engine, whose offsets are ``uint64_t``; a 32-bit offset anywhere would land the
    bytes 4 GiB lower, where the seal check fails. The first extent only moves the end of the
    file (allocated, never written; one pass: nothing here depends on the device)."""
    store = NvmeStore(nvme_dir, backend="posix")
    try:
        far, error = store.allocate(2**32 + 2**20)  # 4 GiB and 1 MiB: the file grows past 2**32
        assert error is None and far.offset == 0
        data = torch.arange(2**18, dtype=torch.int32)  # 1 MiB, every word its own index
        extent, future = store.write(data, data.numel() * 4)
        future.wait()
        assert extent.offset >= 2**32 + 2**20 and store.file_size() >= extent.offset + extent.size
        back = torch.zeros_like(data)
        store.read(back, extent, data.numel() * 4).wait()
        assert torch.equal(back, data)
        store.free(extent)
        store.free(far)
    finally:
        store.close()
