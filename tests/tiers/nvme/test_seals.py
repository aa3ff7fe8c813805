"""Seals (Note [sealed records]): the checksums, and the engines that compute and check them."""

import os
import struct

import pytest
import torch

import actoff
from actoff.tiers.nvme import seals
from actoff.tiers.nvme.engines import CppEngine, PythonEngine

ENGINES = ["python"] + (["cpp"] if actoff.HAS_EXTENSION else [])
needs_extension = pytest.mark.skipif(not actoff.HAS_EXTENSION, reason="the C++ extension is not built")


def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _crc32c_methods() -> list[str]:
    if not actoff.HAS_EXTENSION:
        return []
    from actoff import _C

    return list(_C.crc32c_methods())


@needs_extension
@pytest.mark.parametrize("method", ["avx512", "sse4.2", "portable"])
def test_crc32c_is_castagnolis_on_every_length_and_alignment(method):
    from actoff import _C

    if method not in _crc32c_methods():
        pytest.skip(f"this CPU cannot run the {method} CRC32C (it has: {', '.join(_crc32c_methods())})")
    assert _C.crc32c(b"123456789", 0, method) == 0xE3069283  # the standard check value
    # Reaches every path: the three-stream blocks of 8192 and 256 bytes, the 256-byte folding
    # loop, its 64- and 16-byte tails, the unaligned head and the last bytes.
    data = os.urandom(3 * 8192 + 3 * 256 + 77)
    reference = _crc32c_reference(data)
    assert _C.crc32c(data, 0, "portable") == reference  # the bitwise definition, once
    spans = [(0, len(data)), (1, len(data)), (3, 3 * 8192 + 5), (5, 900), (7, 8), (0, 511), (0, 512)]
    spans += [
        (start, start + 512 + 256 * k + 64 * j + 16 * i + tail)
        for start in (0, 9)
        for k in (0, 3)
        for j in (0, 2)
        for i in (0, 3)
        for tail in (0, 15)
    ]
    for start, stop in spans:
        piece = data[start:stop]
        crc = (start * 0x9E3779B1 + stop) & 0xFFFFFFFF  # a crc carried in, not only zero
        assert _C.crc32c(piece, crc, method) == _C.crc32c(piece, crc, "portable"), (start, stop)
    assert _C.crc32c(data[100:], _C.crc32c(data[:100], 0, method), method) == reference  # it continues
    assert _C.seal_start(5, 4096) == _crc32c_reference(struct.pack("<QQ", 5, 4096))


@needs_extension
def test_crc32c_names_the_methods_it_has_when_asked_for_another():
    from actoff import _C

    assert _C.crc32c_methods()[-1] == "portable"  # every CPU has the tables
    with pytest.raises(ValueError, match=r"no method 'sse5'.*it has: .*portable"):
        _C.crc32c(b"abc", 0, "sse5")


def test_seals_tell_apart_bytes_records_and_lengths():
    data = os.urandom(4096)
    seal = seals.host_seal(data, 1, 4096)
    assert seal == seals.host_seal(data, 1, 4096)
    assert seal != seals.host_seal(data, 2, 4096)  # the same bytes as another write
    assert seal != seals.host_seal(bytes(4096), 1, 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_device_seals_see_a_changed_word_a_swap_a_hole_and_another_record(dtype):
    data = (
        torch.randn(1001).to(dtype) if dtype != torch.uint8 else torch.randint(0, 256, (1001,), dtype=dtype)
    )
    nbytes = data.numel() * data.element_size()
    seal = seals.device_seal(data, 3, nbytes)
    assert seal == seals.device_seal(data.clone(), 3, nbytes)
    assert seal != seals.device_seal(data, 4, nbytes)
    for change in ("word", "swap", "hole", "tail"):
        other = data.clone().view(torch.uint8)
        if change == "word":
            other[8] ^= 1
        elif change == "swap":
            other[:4], other[4:8] = other[4:8].clone(), other[:4].clone()
            if torch.equal(other, data.view(torch.uint8)):
                continue
        elif change == "hole":
            other[100:600] = 0
        else:
            other[-1] ^= 0x80
        assert seal != seals.device_seal(other, 3, nbytes), change
    unaligned = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]  # a view 1 byte past alignment
    unaligned.copy_(data.view(torch.uint8))
    assert seals.device_seal(unaligned, 3, nbytes) == seal


@pytest.mark.gpu
def test_device_seals_agree_between_a_gpu_and_the_host():
    data = torch.randint(0, 256, (3 * 2**22 + 13,), dtype=torch.uint8)  # more than one pass
    assert seals.device_seal(data.cuda(), 9, data.numel()) == seals.device_seal(data, 9, data.numel())


@pytest.mark.parametrize("kind", ENGINES)
def test_engines_seal_in_their_workers_and_refuse_other_bytes(kind, tmp_path):
    path = str(tmp_path / "sealed.bin")
    engine = CppEngine(path, 2) if kind == "cpp" else PythonEngine(path, 2)
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    write = engine.pwrite(data, data.numel(), 4096, 7)
    assert write.wait() == data.numel() and write.checksum() is not None
    back = torch.empty_like(data)
    engine.pread(back, data.numel(), 4096, 7, write.checksum()).wait()
    assert torch.equal(back, data)
    unsealed = engine.pwrite(data, data.numel(), 0)
    unsealed.wait()
    assert unsealed.checksum() is None
    with pytest.raises(
        OSError, match=r"offset 4096 of .*sealed\.bin read bytes that are not the ones written"
    ):
        engine.pread(back, data.numel(), 4096, 8, write.checksum()).wait()  # another write's number
    os.pwrite(engine.file.fd, b"\0" * 16, 4096 + 100)
    with pytest.raises(OSError, match="write 7 sealed") as caught:
        engine.pread(back, data.numel(), 4096, 7, write.checksum()).wait()
    assert caught.value.errno == 74  # EBADMSG
    engine.close()
