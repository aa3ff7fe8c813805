"""Memory of the simulated device: poison for what a copy has not written yet, and the live
and peak bytes of the storages a simulated run allocates, with an optional capacity past which
allocation fails as a GPU's would.

Part of the simulated device (`actoff.device.sim.device`); `actoff.testing.simulated_device` turns it
on around a block of code, and the long-context benchmark reads its peak on a CPU.

Note [copy sources and the allocator]: a queued copy to the host holds its source only until
the compute stream has waited for it; it reads a snapshot taken when queued, outside this
memory. That is what CUDA's caching allocator does: once the compute stream has waited for the
copy, it hands the source's memory to new work as soon as its owner drops it, whether the copy
has run or not. Until that wait the copy holds the source itself (its ``device_alias``), the
hazard the race checker watches. A storage counts as long as anything holds it, so keeping the
source until the copy ran would make late copies look as if offloading saved no device memory.

Note [block sizes]: a storage counts as many bytes as CUDA's caching allocator would take for it:
its size rounded up to a multiple of 512 (nothing for an empty one). Counted exactly, a run
of many small tensors would look smaller than the same bytes in one buffer, which a GPU rounds
the same way (actoff's device arena, Note [a buffer per wave]).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BLOCK", "DeviceMemory", "PeakWatch", "poison"]

#: CUDA's caching allocator hands out multiples of this many bytes (Note [block sizes]).
BLOCK = 512


def poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with 0xFF bytes (NaN for floating types, -1 for integers)."""
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous():
        tensor.view(-1).view(torch.uint8).fill_(255)
    elif tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(-1 if tensor.dtype != torch.bool else True)


class DeviceMemory(TorchDispatchMode):
    """Live and peak bytes of the simulated device: storages allocated on the CPU while the
    mode is active (host buffers are allocated outside it). It counts storages, not tensors:
    views and in-place results share their input's storage and add nothing. Sizes are rounded
    up to 512 bytes as on CUDA (Note [block sizes]).

    >>> memory = DeviceMemory()
    >>> with memory:
    ...     x = torch.ones(256)  # 1 KiB
    ...     y = x[:128]  # a view: nothing new
    ...     z = torch.ones(3)  # 12 bytes: one 512-byte block
    >>> memory.live, memory.peak
    (1536, 1536)
    >>> del x, y, z
    >>> memory.live
    0
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes, until the storage dies
        self._lock = threading.Lock()
        # Weak references without callbacks: read under the lock, which a WeakSet's removals
        # (running finalizers, `_free` among them) would take again.
        self._watches: list[weakref.ref[PeakWatch]] = []
        self.entered = 0  # the mode's depth: counting only while it is above 0

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak = self.live

    def watch(self) -> PeakWatch:
        """A peak of its own, reset apart from ``peak`` (which the program owns)."""
        watch = PeakWatch(self)
        with self._lock:
            self._watches = [ref for ref in self._watches if ref() is not None]
            self._watches.append(weakref.ref(watch))
        return watch

    def __enter__(self) -> DeviceMemory:
        self.entered += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.entered -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = None
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            if id(storage) in self._sizes:
                continue
            if inputs is None:  # storages of the inputs: a view or in-place result is not new
                inputs = {
                    id(t.untyped_storage())
                    for t in pytree.tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                }
            if id(storage) not in inputs:
                self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        size = -(-storage.nbytes() // BLOCK) * BLOCK  # not _arena.align_up: an import circle
        with self._lock:
            if self.capacity is not None and self.live + size > self.capacity:
                raise torch.OutOfMemoryError(
                    f"simulated device out of memory: tried to allocate {size} bytes with "
                    f"{self.live} of {self.capacity} bytes in use (ACTOFF_SIM_DEVICE_MEMORY "
                    "sets the capacity)"
                )
            key = id(storage)
            self._sizes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            for ref in self._watches:
                watch = ref()
                if watch is not None and self.live > watch.peak:
                    watch.peak = self.live
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)


class PeakWatch:
    """The most bytes a `DeviceMemory` held at once since `reset`: the auto policy's window
    (one step) on the simulated device, kept apart from the memory's own ``peak``, which the
    program (a benchmark's phases) resets as it likes.

    >>> memory = DeviceMemory()
    >>> watch = memory.watch()
    >>> with memory:
    ...     x = torch.ones(256)
    >>> memory.reset_peak(); del x
    >>> watch.counted(), watch.peak, memory.peak
    (False, 1024, 1024)
    """

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        self.peak = memory.live

    def counted(self) -> bool:
        """Whether the device's memory is being counted now (its mode entered)."""
        return self.memory.entered > 0

    def live(self) -> int:
        return self.memory.live

    def sample(self) -> None:
        """Nothing to do: every allocation updates the peak."""

    def reset(self) -> None:
        """Start a new window from the bytes live now."""
        self.peak = self.memory.live
