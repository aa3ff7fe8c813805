"""Records: one saved activation each, with an explicit, checked state machine.

::

    RESIDENT --offload--> OFFLOADING --copy done--> OFFLOADED --fetch--> FETCHING --> READY
       |                      |                        ^                              |
       |                      |                        +--------- evict --------------+
       +----------------------+------------------------+---- release ---> RELEASED

A record also knows how to rebuild its tensor exactly: the bytes copied are the storage span
the view covers (so strides, expanded dimensions and overlaps come back as they were); views
with large gaps are copied compactly instead (values exact, strides contiguous).
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from actoff.device.base import Ticket
    from actoff.memory.host_arena import Slot

    from .base import Tier
    from .nvme.store import Extent, NvmeStore
    from .run_view import RunView
    from .tokenwise.split import Split
    from .tokenwise.tokens import Canon

__all__ = ["Record", "RecordStateError", "State", "TensorGeometry", "modified_error", "serve"]


class State(enum.Enum):
    RESIDENT = "resident"  # the device tensor is held, nothing copied
    OFFLOADING = "offloading"  # copy out in flight; the device tensor is still held
    OFFLOADED = "offloaded"  # only the offloaded copy exists
    FETCHING = "fetching"  # copy back in flight
    READY = "ready"  # a device tensor is available for unpack
    RELEASED = "released"  # everything returned; unpack is an error


_TRANSITIONS: dict[State, frozenset[State]] = {
    State.RESIDENT: frozenset({State.OFFLOADING, State.RELEASED}),
    # OFFLOADING -> FETCHING: a staged NVMe record whose write is still running is served
    # from its staging slot (Note [staged writes free the device early]).
    State.OFFLOADING: frozenset({State.OFFLOADED, State.RESIDENT, State.FETCHING, State.RELEASED}),
    State.OFFLOADED: frozenset({State.FETCHING, State.RELEASED}),
    State.FETCHING: frozenset({State.READY, State.RELEASED}),
    State.READY: frozenset({State.OFFLOADED, State.RELEASED}),
    State.RELEASED: frozenset(),
}


class RecordStateError(RuntimeError):
    """A record was asked to make a transition its state machine forbids (an actoff bug)."""


# Alignment (in bytes) that a restored tensor keeps relative to the original, so kernels
# that pick a path by pointer alignment (vectorised loads, fused attention) pick the same.
_KEEP_ALIGNMENT = 256


class TensorGeometry:
    """How to copy a strided tensor's bytes out and rebuild an identical view."""

    __slots__ = ("compact", "dtype", "itemsize", "nbytes", "numel", "pad", "size", "span", "stride")

    # Note [pack is hot] (actoff.runtime.hooks): built for every record; contiguity is asked of torch.
    def __init__(self, tensor: torch.Tensor) -> None:
        self.size = size = tensor.shape  # a torch.Size: a tuple
        self.stride = stride = tensor.stride()
        self.dtype = dtype = tensor.dtype
        self.itemsize = itemsize = dtype.itemsize
        self.numel = numel = tensor.numel()
        if tensor.is_contiguous():
            span = numel
        else:
            span = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if numel else 0
        # Gappy views (e.g. every 4th column) would copy mostly unused bytes: go compact.
        self.compact = compact = span > 2 * numel
        self.span = span = numel if compact else span
        self.pad = 0 if compact else tensor.storage_offset() % max(1, _KEEP_ALIGNMENT // itemsize)
        self.nbytes = span * itemsize  # bytes moved when the tensor is offloaded

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """The 1-D span to copy out of ``tensor`` (a view when possible)."""
        if self.compact:
            return tensor.reshape(-1)
        return tensor.as_strided((self.span,), (1,), tensor.storage_offset())

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor again, from a 1-D buffer holding ``pad`` spare elements then the span."""
        if self.compact:
            return flat[self.pad :].view(self.size)
        return flat.as_strided(self.size, self.stride, self.pad)


def modified_error(
    size: Sequence[int], dtype: torch.dtype, block: str, version: int, expected: int
) -> RuntimeError:
    """Autograd's error for a saved tensor modified in place, naming the block that saved it.

    >>> str(modified_error((2, 3), torch.float32, "layers.0", 2, 1)).split(":")[0]
    'one of the variables needed for gradient computation has been modified by an inplace operation'
    """
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a tensor of shape {list(size)} and dtype {dtype} saved in block "
        f"{block!r} is at version {version}; expected version {expected} instead (caught by "
        "actoff, which saves it). Avoid the in-place operation, or clone the tensor before "
        "modifying it."
    )


class Record:
    """One saved activation: where its bytes are and what state it is in."""

    __slots__ = (
        "__weakref__",
        "base_info",
        "canon",
        "checksum",
        "copy_source",
        "copy_ticket",
        "device_tensor",
        "extent",
        "fetch_ticket",
        "geometry",
        "host_slot",
        "index",
        "refused",
        "run",
        "saved_version",
        "source",
        "split",
        "state",
        "store",
        "tier",
        "unpacks",
        "uses",
        "whole",
        "write_future",
    )

    def __init__(self, tensor: torch.Tensor, run: RunView, index: int, tier: Tier | None = None) -> None:
        self.geometry = TensorGeometry(tensor)
        self.run = (
            run  # the scope run that saved it, as its tiers see it (Note [tiers see a view of their run])
        )
        self.index = index  # position among the run's records (pack order)
        self.refused = False  # the host budget refused it (counted once, however often it is tried)
        self.state = State.RESIDENT
        # Where its bytes live: the tier owns every move of the record.
        self.tier = tier
        # Note [no cycle through autograd]: a detached alias (same storage, no grad_fn). The
        # tensor itself would link record -> tensor -> grad_fn -> saved variable -> handle ->
        # record, a cycle through C++ that Python's collector cannot see: a graph dropped
        # without backward (an exception, a forward with no backward) would never be freed.
        self.device_tensor: torch.Tensor | None = tensor.detach()
        # Note [version check]: saved_tensors_hooks turn off autograd's own check that a
        # saved tensor was not modified in place, so actoff makes it. The detached alias
        # shares the tensor's version counter (a weak reference to the tensor would not do:
        # a local is dead by backward while a view of it can still change its bytes). It is
        # checked whenever actoff reads the bytes or lets the alias go: the copy out issued
        # and done, and unpack. Bytes copied out before a change are the saved ones.
        self.source = weakref.ref(tensor)  # the tensor while it lives (forwarding, too)
        self.saved_version = tensor._version
        # Set by the tiers (actoff.tiers.base): a host arena slot, an NVMe extent in its store,
        # and the device tickets of copies in flight.
        self.host_slot: Slot | None = None
        self.extent: Extent | None = None
        self.store: NvmeStore | None = None
        self.copy_ticket: Ticket | None = None
        self.fetch_ticket: Ticket | None = None
        self.write_future: object | None = None  # NVMe write (or read, while FETCHING)
        self.copy_source: torch.Tensor | None = None  # held while a copy reads it
        self.checksum: int | None = None  # crc32 of the offloaded bytes (ACTOFF_VERIFY)
        # Token-wise placement (actoff.tiers.tokenwise): the token-dimension view of the span,
        # whether the record must stay whole (block input, mixer saves), and its split once split.
        self.canon: Canon | None = None
        # (shape, stride) of a merged view's base, for token dims
        self.base_info: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.whole = False
        self.split: Split | None = None
        # Saves served by it (its own and those deduplicated onto it) and, in the backward under
        # way, its unpacks: once every save has unpacked it, a record still back is kept by a
        # retained graph only (Note [fetch per saved tensor] in actoff.runtime.fetch).
        self.uses = 1
        self.unpacks = 0

    def to(self, state: State) -> None:
        """Move to ``state``; raise `RecordStateError` if the machine forbids it."""
        if state not in _TRANSITIONS[self.state]:
            raise RecordStateError(
                f"actoff internal error: record {self.index} of block {self.run.name!r} "
                f"cannot go from {self.state.value} to {state.value}"
            )
        self.state = state

    def check_version(self) -> None:
        """Raise autograd's in-place error if the saved tensor was modified since it was saved
        (Note [version check]); a released record holds nothing to read."""
        if self.changed():
            alias = self._alias()
            raise modified_error(
                self.geometry.size, self.geometry.dtype, self.run.name, alias._version, self.saved_version
            )

    def changed(self) -> bool:
        """Whether the saved tensor was modified in place since it was saved (Note [version check])."""
        if self.state is State.RELEASED:
            return False
        alias = self._alias()
        return alias is not None and alias._version != self.saved_version

    def _alias(self) -> torch.Tensor | None:
        alias = None
        if self.state in (State.RESIDENT, State.OFFLOADING):  # later: a copy brought back
            alias = self.device_tensor if self.device_tensor is not None else self.copy_source
        if alias is None:
            alias = self.source()  # the tensor itself, while it lives
        return alias

    def what(self) -> str:
        """The record in messages: ``block 'layers.3' record 5 (shape [2, 32, 64] float32)``."""
        return (
            f"block {self.run.name!r} record {self.index} "
            f"(shape {list(self.geometry.size)} {str(self.geometry.dtype).removeprefix('torch.')})"
        )

    def live_source(self) -> torch.Tensor | None:
        """The original tensor when it is still alive elsewhere (forwarding, no copy needed)."""
        return self.source()


def serve(record: Record) -> torch.Tensor:
    """The device tensor of ``record`` for compute, from wherever it is now."""
    state = record.state
    if state is State.RESIDENT:  # the common case first (Note [pack is hot])
        return record.device_tensor
    if state is State.OFFLOADING and record.device_tensor is None:
        return record.tier.materialize(record)  # its bytes left the device already
    if state is State.OFFLOADING or state is State.READY:
        if state is State.OFFLOADING:
            record.run.stats.forwarded += 1
        return record.device_tensor
    if state is State.RELEASED:
        raise RuntimeError(
            f"actoff internal error: a saved tensor of block {record.run.name!r} was "
            "unpacked after it was released"
        )
    if state is State.OFFLOADED:
        live = record.live_source()
        if live is not None:  # forwarding: the original is still alive, serve it
            record.run.stats.forwarded += 1
            return live
    return record.tier.materialize(record)
