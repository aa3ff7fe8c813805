"""Token chunks, and the forward-time state (autocast, RNG) that a chunk's backward recompute restores.

Shared by tiled modules (`actoff.tile_`) and the chunked loss (`actoff.chunked_cross_entropy`):
both run a computation chunk by chunk under ``no_grad`` in forward and recompute each chunk
with grad enabled in backward. The recompute must see what the forward saw, so the autocast
settings in force at forward are re-entered, and a chunk that drew random numbers draws the
same ones again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from actoff.rerun.state import RngState
from actoff.runtime.runtime import let_go_landed

__all__ = ["AutocastState", "RngState", "check_chunking", "chunk_bounds", "let_go_landed"]


def check_chunking(chunks: object, max_tokens: object, *, what: str) -> tuple[int | None, int | None]:
    """Validate that exactly one of ``chunks`` / ``max_tokens`` is a positive integer.

    ``what`` names the caller in the error (``"tile_()"``).

    >>> check_chunking(4, None, what="tile_()")
    (4, None)
    """
    if (chunks is None) == (max_tokens is None):
        raise TypeError(f"{what} needs exactly one of chunks=N or max_tokens=N, got {chunks=}, {max_tokens=}")
    for name, value in (("chunks", chunks), ("max_tokens", max_tokens)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what}: {name} must be an integer, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{what}: {name}={value} is out of range: expected an integer >= 1")
    return chunks, max_tokens  # type: ignore[return-value]


def chunk_bounds(
    length: int, *, chunks: int | None = None, max_tokens: int | None = None
) -> list[tuple[int, int]]:
    """Split ``length`` tokens into ``(start, stop)`` ranges: ``chunks`` nearly equal parts (sizes
    differ by at most one; never an empty part), or parts of at most ``max_tokens`` tokens.

    >>> chunk_bounds(10, chunks=3)
    [(0, 4), (4, 7), (7, 10)]
    >>> chunk_bounds(10, max_tokens=4)
    [(0, 4), (4, 8), (8, 10)]
    >>> chunk_bounds(2, chunks=5)
    [(0, 1), (1, 2)]
    """
    check_chunking(chunks, max_tokens, what="chunk_bounds()")
    if length <= 0:
        return []
    if chunks is not None:
        count = min(chunks, length)
        base, extra = divmod(length, count)
        sizes = [base + (1 if index < extra else 0) for index in range(count)]
    else:
        sizes = [min(max_tokens, length - start) for start in range(0, length, max_tokens)]  # type: ignore[arg-type]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings in force when a forward ran, re-entered around its recompute.

    Backward usually runs outside the user's ``torch.autocast`` block, so a recompute that
    did not re-enter it would compute in another dtype than the forward did (as
    ``torch.utils.checkpoint`` does, the CPU state is kept beside the device's).

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     state = AutocastState.capture(torch.device("cpu"))
    >>> with state.restore():
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    """

    device_type: str
    device_kwargs: dict[str, Any] | None  # None: the device is the CPU (or has no autocast)
    cpu_kwargs: dict[str, Any]

    @staticmethod
    def _kwargs(device_type: str) -> dict[str, Any]:
        return {
            "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }

    @classmethod
    def capture(cls, device: torch.device) -> AutocastState:
        device_type = device.type
        has_device_autocast = device_type != "cpu" and torch.amp.is_autocast_available(device_type)
        return cls(
            device_type=device_type,
            device_kwargs=cls._kwargs(device_type) if has_device_autocast else None,
            cpu_kwargs=cls._kwargs("cpu"),
        )

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.device_kwargs is not None:
                stack.enter_context(torch.autocast(self.device_type, **self.device_kwargs))
            stack.enter_context(torch.autocast("cpu", **self.cpu_kwargs))
            yield
