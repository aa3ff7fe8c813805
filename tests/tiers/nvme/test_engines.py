"""I/O engines: the C++ engine and its Python twin behave the same, errors included."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import actoff
from actoff.device.base import CpuBackend
from actoff.memory.host_arena import HostArena
from actoff.tiers.nvme import store
from actoff.tiers.nvme.engines import CppEngine, PythonEngine
from actoff.tiers.nvme.store import open_engine

ENGINES = ["python"] + (["cpp"] if actoff.HAS_EXTENSION else [])


@pytest.fixture(params=ENGINES)
def engine(request, tmp_path):
    path = str(tmp_path / "engine.bin")
    made = CppEngine(path, 4) if request.param == "cpp" else PythonEngine(path, 4)
    yield made
    made.close()


def test_many_outstanding_requests_round_trip(engine):
    generator = torch.Generator().manual_seed(0)
    blocks = [
        torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=generator)
        for n in torch.randint(1, 300_000, (64,), generator=generator)
    ]
    offsets, at = [], 0
    for block in blocks:
        offsets.append(at)
        at += block.numel() + 13  # unaligned offsets: the buffered path
    engine.reserve(at)
    writes = [engine.pwrite(b, b.numel(), o) for b, o in zip(blocks, offsets, strict=True)]
    assert [w.wait() for w in writes] == [b.numel() for b in blocks]
    backs = [torch.empty_like(b) for b in blocks]
    reads = [engine.pread(b, b.numel(), o) for b, o in zip(backs, offsets, strict=True)]
    for read in reads:
        read.wait()
    assert all(torch.equal(a, b) for a, b in zip(blocks, backs, strict=True))
    assert all(w.done() for w in writes)


def test_aligned_requests_round_trip(engine):
    arena = HostArena(CpuBackend())
    slot, back = arena.alloc(1 << 20), arena.alloc(1 << 20)
    slot.raw().copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    engine.pwrite(slot.raw(), 1 << 20, 8192).wait()
    engine.pread(back.raw(), 1 << 20, 8192).wait()
    assert torch.equal(slot.raw(), back.raw())


def test_cpp_engine_uses_o_direct_where_the_file_system_allows(tmp_path):
    if not actoff.HAS_EXTENSION:
        pytest.skip("the C++ extension is not built (ACTOFF_BUILD_EXT=0)")
    engine = CppEngine(str(tmp_path / "d.bin"), 2)
    # tmpfs refuses O_DIRECT; ext4/xfs (this machine's /tmp) accept it.
    fs_type = subprocess.run(
        ["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True
    ).stdout.strip()
    if fs_type != "tmpfs":
        assert engine.direct, f"O_DIRECT refused on {fs_type}"
    assert engine.name.startswith("posix (C++ engine")
    engine.close()


def test_short_read_raises_with_path_offset_and_size(engine):
    data = torch.ones(1000, dtype=torch.uint8)
    engine.pwrite(data, 1000, 0).wait()
    back = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(
        OSError, match=rf"pread of 4096 bytes at offset 0 of {engine.path} is a short read: 1000 of 4096"
    ):
        engine.pread(back, 4096, 0).wait()


def test_requests_after_close_fail_cleanly(tmp_path):
    for made in [PythonEngine(str(tmp_path / "p.bin"), 1)] + (
        [CppEngine(str(tmp_path / "c.bin"), 1)] if actoff.HAS_EXTENSION else []
    ):
        made.close()
        future = made.pwrite(torch.ones(8, dtype=torch.uint8), 8, 0)
        assert future.done()
        with pytest.raises(OSError, match="engine is closed"):
            future.wait()


@pytest.mark.parametrize("kind", ENGINES)
def test_real_write_error_from_a_file_size_limit(kind, tmp_path):
    # RLIMIT_FSIZE makes the kernel fail writes past the limit with EFBIG (Python ignores
    # SIGXFSZ), a real OS error in the engine's worker thread.
    script = textwrap.dedent(f"""
        import resource, torch
        from actoff.tiers.nvme.engines import CppEngine, PythonEngine
        engine = {"CppEngine" if kind == "cpp" else "PythonEngine"}({str(tmp_path / "x.bin")!r}, 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            engine.pwrite(torch.ones(200000, dtype=torch.uint8), 200000, 0).wait()
        except OSError as error:
            print("ERRNO", error.errno, error)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "ERRNO 27" in out and "File too large" in out and "x.bin" in out


def test_reserve_preallocates(engine):
    engine.reserve(3 << 20)
    assert engine.file_size() == 3 << 20
    assert os.stat(engine.path).st_blocks * 512 >= 3 << 20  # real blocks, not a sparse file


def test_open_engine_picks_posix_without_kvikio_io(tmp_path, monkeypatch):
    # The probe is made to say no: on a GPU machine with kvikio installed it says yes (and
    # test_kvikio.py's test_probe_works_and_auto_picks_kvikio covers that side).
    monkeypatch.setattr(store, "check_kvikio", lambda directory: (False, "kvikio cannot do I/O here"))
    engine = open_engine(str(tmp_path / "auto.bin"), "auto")
    assert engine.name.startswith("posix")
    engine.close()


@pytest.mark.slow  # 2 GiB written and read back, twice the memory: seconds, not milliseconds
@pytest.mark.parametrize("kind", ENGINES)
def test_a_request_past_2_31_bytes_round_trips_sealed(kind, nvme_dir):
    # Lengths past 2**31 (a million tokens of an 8B model's block inputs): one pwrite moves at
    # most 0x7ffff000 bytes on Linux, so the engine loops, and sizes and the seal's CRC32C run
    # past a signed 32-bit int. The request starts at 4096 and ends past 2**31 + 4096, on an odd
    # size (the buffered descriptor takes the unaligned request; offsets past 2**32 and the
    # O_DIRECT path: test_a_request_at_an_offset_past_2_32_round_trips).
    nbytes = 2**31 + 12_345
    path = os.path.join(nvme_dir, "large.bin")
    engine = CppEngine(path, 2) if kind == "cpp" else PythonEngine(path, 2)
    data = torch.empty(nbytes, dtype=torch.uint8)
    data[: 2**20].random_(0, 256)
    data[-(2**20) :].random_(0, 256)  # the bytes past 2**31 differ from those before it
    write = engine.pwrite(data, nbytes, 4096, 11)
    assert write.wait() == nbytes and write.checksum() is not None
    back = torch.zeros(nbytes, dtype=torch.uint8)
    assert engine.pread(back, nbytes, 4096, 11, write.checksum()).wait() == nbytes
    assert torch.equal(back[-(2**20) :], data[-(2**20) :]) and torch.equal(back[: 2**20], data[: 2**20])
    at = 2**31 + 7  # one byte changed past 2**31
    os.pwrite(engine.file.fd, bytes([int(data[at]) ^ 0xFF]), 4096 + at)
    with pytest.raises(OSError, match="read bytes that are not the ones written"):
        engine.pread(back, nbytes, 4096, 11, write.checksum()).wait()
    engine.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_a_request_at_an_offset_past_2_32_round_trips(kind, nvme_dir):
    # A sparse file: 4 KiB at 4 GiB + 4 KiB, aligned (the C++ engine's O_DIRECT descriptor takes
    # it), sealed. A 32-bit offset would land the bytes at 4096 instead (the file's start).
    path = os.path.join(nvme_dir, "far.bin")
    engine = CppEngine(path, 2) if kind == "cpp" else PythonEngine(path, 2)
    raw = torch.empty(3 * 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    data = raw[start : start + 4096].random_(0, 256)
    offset = 2**32 + 4096
    write = engine.pwrite(data, 4096, offset, 5)
    assert write.wait() == 4096
    assert os.path.getsize(path) == offset + 4096
    with open(path, "rb") as file:
        file.seek(offset)
        assert file.read(4096) == bytes(data.tolist())
        file.seek(4096)
        assert file.read(4096) in (b"", bytes(4096))  # nothing landed at the offset's low 32 bits
    back = torch.zeros(3 * 4096, dtype=torch.uint8)
    aligned = back[-back.data_ptr() % 4096 :][:4096]
    assert engine.pread(aligned, 4096, offset, 5, write.checksum()).wait() == 4096
    assert torch.equal(aligned, data)
    engine.close()
