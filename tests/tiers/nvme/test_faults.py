"""Faults from outside: a spill file changed, truncated, replaced or left behind, and files
planted in a shared directory. Nothing wrong is ever used silently, and nothing is left.

Each case runs on the plain CPU device (records written straight from the tensor) and on the
simulated device (staged through host memory, as on a GPU). The spill file is reached the way
another program on the machine would reach it: through the process's open descriptors of a
file in the NVMe directory (it has no name there).
"""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from _helpers import ROOT, make_model

import actoff
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime
from actoff.tiers.nvme.store import NvmeStore

pytestmark = pytest.mark.nvme

DEVICES = [
    pytest.param("plain", marks=pytest.mark.no_sim_device),
    pytest.param("sim", marks=pytest.mark.sim_device),
]


def _spill_fd(nvme_dir: str) -> int:
    """A new read-write descriptor of the spill file in ``nvme_dir``, found among this process's
    descriptors (named or not: /proc shows ``<dir>/<name>``, with `` (deleted)`` once unlinked)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if os.path.dirname(target) == nvme_dir and stat.S_ISREG(info.st_mode) and info.st_size:
            return os.open(f"/proc/self/fd/{name}", os.O_RDWR)
    raise AssertionError(f"no spill file of {nvme_dir} is open")


def _forward(nvme_dir: str, **settings):
    """A step's forward under ``nvme``, every write finished; the loss and the runtime."""
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0, **settings)
    loss = model.loss(torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3)))
    runtime = get_runtime()
    runtime.flush()
    return loss, runtime


def _written(runtime) -> list:
    """The records whose bytes are in the file now (on the simulated device a record whose
    copy out had not ended when it was placed may still be in host memory)."""
    return [r for run in runtime.step.runs for r in run.all_records() if r.extent is not None]


def _sealed_error(nvme_dir: str) -> str:
    return (
        r"reading a saved activation of block 'layers\.\d' \(record \d+, step \d+\) back from NVMe failed: "
        rf".*pread of \d+ bytes at offset \d+ of {nvme_dir}/actoff-rank0-pid{os.getpid()}-[0-9a-f]+\.bin"
        r".* read bytes that are not the ones written there"
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", ["zeroed", "random bytes", "another record's bytes"])
def test_a_record_changed_on_disk_raises_before_backward_uses_it(nvme_dir, device, fault):
    # Found by a hostile-user test: a record zeroed between forward and backward gave
    # gradients off by 0.529 without a word, random bytes a NaN loss.
    loss, runtime = _forward(nvme_dir)
    records = _written(runtime)
    victim = records[len(records) // 2]
    nbytes = victim.geometry.nbytes
    fd = _spill_fd(nvme_dir)
    try:
        if fault == "zeroed":
            replacement = bytes(nbytes)
        elif fault == "random bytes":
            replacement = os.urandom(nbytes)
        else:  # a record of the same size elsewhere in the file: right length, wrong record
            other = next(r for r in records if r is not victim and r.geometry.nbytes == nbytes)
            replacement = os.pread(fd, nbytes, other.extent.offset)
        os.pwrite(fd, replacement, victim.extent.offset)
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match=_sealed_error(nvme_dir)):
        loss.backward()


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("compat", marks=pytest.mark.no_sim_device, id="compat-plain"),  # host buffers
        pytest.param("compat", marks=pytest.mark.sim_device, id="compat-sim"),  # staged host slots
        # device buffers, sealed on the device by the path they came through (the simulated
        # device's are CPU tensors: `test_the_simulated_gds_path_seals_on_the_device`)
        pytest.param("gds", marks=pytest.mark.sim_device, id="gds-sim"),
    ],
)
def test_a_record_changed_on_disk_raises_on_kvikio(nvme_dir, monkeypatch, mode):
    import _fake_kvikio

    monkeypatch.setenv("KVIKIO_COMPAT_MODE", "OFF" if mode == "gds" else "ON")
    _fake_kvikio.install(monkeypatch)
    loss, runtime = _forward(nvme_dir, io_backend="kvikio")
    assert actoff.stats().io_backend == ("kvikio (GDS)" if mode == "gds" else "kvikio (compat)")
    victim = _written(runtime)[0]
    fd = _spill_fd(nvme_dir)
    os.pwrite(fd, bytes(victim.geometry.nbytes), victim.extent.offset)
    os.close(fd)
    with pytest.raises(RuntimeError, match=_sealed_error(nvme_dir)):
        loss.backward()


@pytest.mark.sim_device
def test_the_simulated_gds_path_seals_on_the_device(nvme_dir, monkeypatch):
    # With GDS the engine is handed device buffers (`pread_device`/`pwrite_device`), whose seal
    # is computed where they live (`seals.device_seal`); a changed record must fail that seal.
    import _fake_kvikio

    import actoff.tiers.nvme.kvikio as engine

    monkeypatch.setenv("KVIKIO_COMPAT_MODE", "OFF")
    _fake_kvikio.install(monkeypatch)
    used = []
    for name in ("device_seal", "host_seal"):
        real = getattr(engine, name)
        monkeypatch.setattr(
            engine, name, lambda *a, _real=real, _name=name, **k: (used.append(_name), _real(*a, **k))[1]
        )
    loss, runtime = _forward(nvme_dir, io_backend="kvikio")
    assert actoff.stats().io_backend == "kvikio (GDS)"
    victim = _written(runtime)[0]
    fd = _spill_fd(nvme_dir)
    os.pwrite(fd, bytes(victim.geometry.nbytes), victim.extent.offset)
    os.close(fd)
    with pytest.raises(RuntimeError, match=_sealed_error(nvme_dir)):
        loss.backward()
    assert used and set(used) == {"device_seal"}, sorted(set(used))


@pytest.mark.parametrize("device", DEVICES)
def test_a_hole_left_by_truncation_raises(nvme_dir, device):
    # The file truncated, then extended again by a later write (what writes in flight did on the
    # simulated device): the records below read as zeros, not as a short read.
    loss, runtime = _forward(nvme_dir)
    last = max(_written(runtime), key=lambda r: r.extent.offset)
    fd = _spill_fd(nvme_dir)
    try:
        kept = os.pread(fd, last.geometry.nbytes, last.extent.offset)
        os.ftruncate(fd, 0)
        os.pwrite(fd, kept, last.extent.offset)
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match=_sealed_error(nvme_dir)):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_a_truncation_while_writes_are_in_flight_raises(nvme_dir, device, monkeypatch):
    # The last block's writes held in their I/O worker; the file truncated meanwhile; the writes
    # then land and extend the file again over a hole where the earlier blocks' records were,
    # which read as zeros (the simulated device's gradients were off by 2.3e-3, no error).
    import actoff.tiers.nvme.engines as engines
    from actoff.tiers.record import State

    monkeypatch.setattr(engines, "_C", None)  # the Python engine, whose workers we can hold
    original, decided, release, threshold = (
        engines.PythonEngine._run,
        threading.Event(),
        threading.Event(),
        [0],
    )

    def run(self, op, view, nbytes, offset, *rest):
        if op == "pwrite":
            decided.wait(30)
            if offset >= threshold[0]:
                release.wait(30)
        return original(self, op, view, nbytes, offset, *rest)

    monkeypatch.setattr(engines.PythonEngine, "_run", run)
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir=nvme_dir, min_bytes=0, io_backend="posix")
    loss = model.loss(torch.randint(0, 256, (2, 33)))
    runs = get_runtime().step.runs
    threshold[0] = min(r.extent.offset for r in runs[-1].all_records() if r.extent is not None)
    decided.set()
    for block in runs:  # earlier blocks: written; the last block: its writes started, held
        for record in block.all_records():
            if record.state is State.OFFLOADING and record.copy_ticket is not None:
                record.copy_ticket.synchronize()  # its copy out ended: the write may start
            if record.state is State.OFFLOADING:
                record.tier.advance(record, force=True, finish=block is not runs[-1])
    fd = _spill_fd(nvme_dir)
    os.ftruncate(fd, 0)
    os.close(fd)
    release.set()
    with pytest.raises(RuntimeError, match=_sealed_error(nvme_dir)):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_checksums_can_be_switched_off(nvme_dir, device):
    # ACTOFF_NVME_CHECKSUM=0: what the file holds is used (the README says what that risks).
    loss, runtime = _forward(nvme_dir, nvme_checksum=False)
    victim = _written(runtime)[0]
    fd = _spill_fd(nvme_dir)
    os.pwrite(fd, bytes(victim.geometry.nbytes), victim.extent.offset)
    os.close(fd)
    loss.backward()  # no error: nothing checks


def test_an_unchanged_file_reads_back_exactly_with_seals(nvme_dir):
    from _helpers import assert_same_history, baseline_and_offloaded

    expected, actual = baseline_and_offloaded(2, policy="nvme", nvme_dir=nvme_dir, min_bytes=0)
    assert_same_history(expected, actual)


def _run_child(nvme_dir: str) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import actoff
        from _helpers import make_model
        from actoff.reference import Block
        model = make_model()
        actoff.offload_(model, block_cls=Block, policy="nvme", nvme_dir={nvme_dir!r}, min_bytes=0)
        loss = model.loss(torch.randint(0, 256, (2, 33)))
        actoff.runtime.runtime.get_runtime().flush()
        print("written", flush=True)
        sys.stdin.read()  # until killed
    """)
    return subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_a_run_killed_with_sigkill_leaves_nothing(nvme_dir):
    child = _run_child(nvme_dir)
    try:
        assert child.stdout.readline().strip() == "written"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()
        child.stdin.close()
        child.stdout.close()
    assert os.listdir(nvme_dir) == []


def test_files_of_dead_processes_are_reclaimed_at_start(nvme_dir):
    # A process killed between creating its file and unlinking it (the instant where a file
    # system without O_TMPFILE has a name) leaves a file; the next process removes it.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    leftovers = [f"actoff-rank0-pid{dead}-0123abcd.bin", f".actoff-probe-{dead}-140000"]
    alive = [f"actoff-rank0-pid{os.getppid()}-0123abcd.bin", "notes.txt"]  # a live process's; not ours
    for name in leftovers + alive:
        with open(os.path.join(nvme_dir, name), "w") as handle:
            handle.write("x")
    store = NvmeStore(nvme_dir, backend="posix")
    store.close()
    assert sorted(os.listdir(nvme_dir)) == sorted(alive)


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "named-then-unlinked"])
def test_spill_files_are_private_and_never_follow_a_symlink(nvme_dir, tmp_path, tmpfile):
    import actoff.tiers.nvme.files as files

    target = tmp_path / "victim.txt"
    target.write_text("keep me")
    name = "actoff-rank0-pid1-planted.bin"
    os.symlink(target, os.path.join(nvme_dir, name))
    if tmpfile:
        spill = files.SpillFile.anonymous(nvme_dir, name)
        assert stat.S_IMODE(os.fstat(spill.fd).st_mode) == 0o600
        spill.close()
    else:
        with pytest.raises(FileExistsError):
            files.SpillFile.anonymous(nvme_dir, name, tmpfile=False)
        spill = files.SpillFile.anonymous(nvme_dir, "actoff-rank0-pid1-fresh.bin", tmpfile=False)
        assert stat.S_IMODE(os.fstat(spill.fd).st_mode) == 0o600 and not spill.named
        spill.close()
    assert target.read_text() == "keep me"
    assert sorted(os.listdir(nvme_dir)) == [name]  # only the planted link


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "named-then-unlinked"])
def test_the_kvikio_probe_never_follows_a_symlink(nvme_dir, tmp_path, monkeypatch, tmpfile):
    import _fake_kvikio

    from actoff.tiers.nvme.kvikio import check_kvikio

    _fake_kvikio.install(monkeypatch)
    if not tmpfile:
        import actoff.tiers.nvme.files as files

        monkeypatch.setattr(files, "_TMPFILE", 0)
    target = tmp_path / "victim.bin"
    target.write_bytes(b"keep me")
    planted = os.path.join(nvme_dir, f".actoff-probe-{os.getpid()}-{threading.get_ident()}")
    os.symlink(target, planted)
    ok, why = check_kvikio(nvme_dir)
    assert target.read_bytes() == b"keep me"
    assert ok if tmpfile else "File exists" in why
    assert os.listdir(nvme_dir) == [os.path.basename(planted)]
