"""CUDA's stream API for actoff.device.base.StreamBackend: torch.cuda streams, events, pinned memory."""

from __future__ import annotations

import torch

from actoff.budget import cuda_budget

__all__ = ["CudaStreams", "SampledPeak"]


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

    def host_empty(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        # A failed cudaHostAlloc (pinned memory capped, as on WSL2) raises a RuntimeError; the
        # host arena then asks for pageable memory (Note [pageable fallback]).
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def release_host_cache(self) -> None:
        # torch's caching host allocator keeps freed pinned blocks until asked to let go.
        empty = getattr(torch._C, "_host_emptyCache", None) or getattr(
            torch.accelerator, "empty_host_cache", None
        )
        if empty is not None:
            empty()

    def check_host_reuse(self, buffer: torch.Tensor, action: str) -> None:
        pass  # the runtime orders host reuse itself (Note [host slot reuse])

    def default_budget(self) -> int:
        return cuda_budget(torch.cuda.get_device_properties(self.device).total_memory)

    def memory_watch(self) -> SampledPeak:
        return SampledPeak(self.device)

    def memory_peak(self, reset: bool = False) -> int | None:
        try:
            peak = torch.cuda.max_memory_allocated(self.device)
            if reset:
                torch.cuda.reset_peak_memory_stats(self.device)
        except RuntimeError:  # a custom allocator (ACTOFF_ALLOCATOR=replay) keeps no statistics
            return None
        return peak


class SampledPeak:
    """The most bytes torch's allocator held at the moments sampled since `reset` (the
    ``auto`` policy samples at every block's entry, exit and first unpack in backward).

    Sampled, not torch's own peak counter: ``torch.cuda.reset_peak_memory_stats`` is the
    program's to call, and resetting it every step would break the program's own figures.
    Peaks inside a block are missed; the ``auto`` policy's model of the blocks covers them
    (Note [memory outside the blocks] in actoff.budget)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = self.live()

    def counted(self) -> bool:
        return True

    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def sample(self) -> None:
        self.peak = max(self.peak, self.live())

    def reset(self) -> None:
        self.peak = self.live()
