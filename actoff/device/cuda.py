"""CUDA's stream API for actoff.device.base.StreamBackend: torch.cuda streams, events, pinned memory."""

from __future__ import annotations

import torch

__all__ = ["CudaStreams"]


class CudaStreams:
    """Streams and events of one CUDA device, in the shape StreamBackend expects."""

    #: Host buffers come from torch's caching pinned allocator (Note [pinned footprint]).
    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release_host_cache(self) -> None:
        # torch's caching host allocator keeps freed pinned blocks until asked to let go.
        empty = getattr(torch._C, "_host_emptyCache", None) or getattr(
            torch.accelerator, "empty_host_cache", None
        )
        if empty is not None:
            empty()

    def check_host_reuse(self, buffer: torch.Tensor, action: str) -> None:
        pass  # the runtime orders host reuse itself (Note [host slot reuse])
