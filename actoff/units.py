"""Sizes: a byte count from text like ``64GiB``, and back to text as actoff prints it."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_size"]

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, what: str = "size", allow_bare: bool = False) -> int:
    """Parse a byte size such as ``"512MiB"``, ``"64GiB"`` or ``"1.5GB"`` into bytes.

    Binary units (KiB, MiB, GiB, TiB, and the short K, M, G, T) and decimal ones (KB, MB,
    GB, TB) are accepted, case-insensitively. A bare number is only accepted when
    ``allow_bare`` is true (for settings whose name already says "bytes").

    >>> parse_size("512MiB")
    536870912
    >>> parse_size("4096", allow_bare=True)
    4096
    """
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{what}={text!r} is not a size: write a number and a unit, e.g. '64GiB'")
    number, unit = match.group(1), match.group(2).lower()
    if not unit:
        if not allow_bare:
            raise ValueError(f"{what}={text!r} has no unit: write e.g. '{number}GiB' or '{number}MiB'")
        unit = "b"
    if unit not in _UNITS:
        raise ValueError(
            f"{what}={text!r} has an unknown unit {match.group(2)!r}: "
            "use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
        )
    return int(float(number) * _UNITS[unit])


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
