"""Seals: the checksum every NVMe record is written with and read back against.

Note [sealed records]: bytes read back from a file are the bytes written there only as long as
nothing else touched the file. A record zeroed on disk between forward and backward gave
gradients off by 0.5 without a word, random bytes a NaN loss, and a spill file truncated while
writes were in flight was re-extended by them with a hole that read as zeros. So each write
gets a sequence number from its store and computes a seal of what it wrote: a checksum
seeded with the sequence number and the length (`seal_start`), so that bytes of another
record, or another length, never pass even where the bytes are equal; each read computes
the same over what it read and fails with ``EBADMSG`` on a difference, naming the file and
offset (the tier adds the block and step), before any gradient can use the bytes. Both run
in the engines' worker threads, where the bytes pass through the host anyway: the C++ engine
uses CRC32C on the CPU's vector or crc32 instructions (csrc/crc32c.h), the Python engine
``zlib.crc32``, kvikio's host buffers the fastest of the two, and kvikio's device buffers (GPUDirect Storage)
`device_seal`, a reduction on the device. ``ACTOFF_NVME_CHECKSUM=0`` turns seals off;
``ACTOFF_VERIFY`` checks more, in the training thread.
"""

from __future__ import annotations

import errno as errno_codes
import struct
import zlib
from collections.abc import Callable

import torch

try:
    import actoff._C as _C  # type: ignore[import-not-found]
except ImportError:  # pure-Python install
    _C = None

__all__ = ["device_seal", "fast_crc", "mismatch", "seal_start", "zlib_crc"]

Crc = Callable[..., int]  # crc(data, crc) -> crc, continuing a running crc

zlib_crc: Crc = zlib.crc32
#: The fastest host checksum here: the extension's CRC32C (csrc/crc32c.h) when it is built.
fast_crc: Crc = _C.crc32c if _C is not None else zlib.crc32


def seal_start(sequence: int, nbytes: int, crc: Crc = zlib_crc) -> int:
    """The running checksum a record's seal starts from: of its sequence number and length.

    >>> seal_start(1, 4096) != seal_start(2, 4096) != seal_start(1, 8192)
    True
    """
    return crc(struct.pack("<QQ", sequence, nbytes), 0)


def host_seal(data, sequence: int, nbytes: int, crc: Crc = zlib_crc) -> int:
    """The seal of ``nbytes`` of contiguous host ``data`` (a buffer) written as ``sequence``."""
    return crc(data, seal_start(sequence, nbytes, crc))


def mismatch(describe: str, found: int, sequence: int, expected: int) -> OSError:
    """The error of a read whose bytes fail their seal (the same words as the C++ engine's)."""
    return OSError(
        errno_codes.EBADMSG,
        f"{describe} read bytes that are not the ones written there: checksum {found:#010x}, write "
        f"{sequence} sealed {expected:#010x} (the file was changed, truncated or replaced after it "
        "was written)",
    )


_WORDS_PER_PASS = 1 << 22  # bounds the temporaries: 32 MiB of int64 weights at a time
_ODD = 0x9E3779B1  # odd, so every word's weight is odd: a change of any one word changes the sum


def device_seal(buffer: torch.Tensor, sequence: int, nbytes: int) -> int:
    """The seal of ``nbytes`` of a contiguous buffer, computed where it lives (the GPU for
    GPUDirect Storage): the sum, modulo 2**64, of its 32-bit words (and trailing bytes), each
    times an odd weight that depends on its position, the sequence number and the length.
    Integer sums do not depend on the order of the additions, so the device's reduction is
    deterministic. Weaker than a CRC against bursts, but every changed word, a zeroed range,
    a hole or another record's bytes change it.

    >>> data = torch.arange(100, dtype=torch.float32)
    >>> seal = device_seal(data, 7, 400)
    >>> data[3] = 0; seal == device_seal(data, 7, 400), seal == device_seal(data, 8, 400)
    (False, False)
    """
    raw = buffer.reshape(-1).view(torch.uint8)[:nbytes]
    seed = (sequence * _ODD + nbytes) % (1 << 62)
    words = nbytes // 4
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    body = raw[: 4 * words]
    if words and body.data_ptr() % 4:
        body = body.clone()  # 32-bit words need 4-byte alignment
    for begin in range(0, words, _WORDS_PER_PASS):
        count = min(_WORDS_PER_PASS, words - begin)
        values = body[4 * begin : 4 * (begin + count)].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        weights = torch.arange(begin, begin + count, dtype=torch.int64, device=raw.device)
        weights.mul_(2 * _ODD).add_(2 * seed + 1)  # odd, wrapping like every int64 product here
        total += (values * weights).sum()
    if nbytes % 4:
        tail = raw[4 * words :].to(torch.int64)
        weights = torch.arange(words, words + tail.numel(), dtype=torch.int64, device=raw.device)
        total += (tail * (weights * (2 * _ODD) + (2 * seed + 1))).sum()
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF
