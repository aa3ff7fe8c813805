"""The saved-tensor hooks of an offload scope: the pack hook (`PackHook.pack`, a scope run's
method) turns each tensor autograd saves into what autograd holds, and `unpack` gives the
tensor back: a `Handle` to a record, an `AliasHandle` to a view of a record's bytes
(Note [views of one storage]), or under ``keep`` the tensor itself with its version
(Note [kept as is]).
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from actoff.params import param_like
from actoff.tiers.base import KEEP
from actoff.tiers.record import Record, TensorGeometry, modified_error

if TYPE_CHECKING:
    from .step import ScopeRun

__all__ = ["AliasHandle", "Handle", "PackHook", "unpack"]

_finalizing = sys.is_finalizing


class Handle:
    """What autograd stores instead of a saved tensor. Dropping it releases the record."""

    __slots__ = ("record",)

    def __init__(self, record: Record) -> None:
        self.record = record

    def __del__(self) -> None:
        # At interpreter shutdown module globals may be gone: nothing is left to return then.
        if _finalizing is not None and not _finalizing():
            self.record.run.runtime.lock.release_when_safe(self.record)


# Note [views of one storage]: a view saved after a record of the same tensor (the same root:
# its `_base`, or itself), lying inside that record's span, is served from the record
# (`AliasHandle`: the record's tensor seen with the view's size, stride and offset), not made a
# record of its own. Autograd often saves several views of one tensor's bytes (softmax-then-
# matmul attention saves its weights and a 3-D view of them; SDPA's output and the output
# projection's input): as separate records they would be copied, held and fetched once each.
# One root means one version counter, so the record's version check sees a change through
# either. Kept apart: tensors sharing bytes but not a counter (``set_``), views outside the span
# (q, k, v of one fused projection), compact records, token-wise runs (records split by token)
# and views with a lazy bit (Note [lazy bits]).
class AliasHandle:
    """What autograd stores for another view of a record's bytes (Note [views of one storage]):
    the record's handle (kept alive by it) and the view's place in the record's span."""

    __slots__ = ("delta", "handle", "size", "stride")

    def __init__(self, handle: Handle, delta: int, tensor: torch.Tensor) -> None:
        self.handle = handle
        self.size, self.stride, self.delta = tensor.shape, tensor.stride(), delta


class PackHook:
    """The pack side of a scope run (`actoff.runtime.step.ScopeRun` is one): skips what is not
    an activation, deduplicates, and makes records. Uses the run's ``records``, ``dedup``,
    ``spans``, ``stats``, settings and placement (Note [placements]: ``keeps_as_is``,
    ``shares_views``, ``notes_saves``)."""

    # Note [pack is hot]: runs for every saved tensor; keep it to a few attribute reads.
    # Note [lazy bits]: a view with PyTorch's lazy conjugate or negation bit (``k.mH``) is never
    # a record: it is left to autograd as it is (it holds the storage it views anyway). Its
    # values are not its bytes, so a record of it would share the dedup key of the tensor it
    # views (and be served that tensor), and the NVMe tier would write the raw bytes: wrong
    # gradients for complex attention.
    def pack(self, tensor: torch.Tensor) -> Any:
        if self.runtime.thread.disabled:
            return tensor
        placement = self.placement
        notes = placement.notes_saves
        nbytes = tensor.numel() * tensor.element_size()
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or tensor.device != self.device
            or nbytes == 0
            or tensor.is_conj()  # Note [lazy bits]
            or tensor.is_neg()
        ):
            if isinstance(tensor, torch.nn.Parameter):
                self.stats.skipped_param_bytes += nbytes
                return tensor
            self.stats.skipped_other_bytes += nbytes
            if notes:
                placement.note_save(-1)
            return tensor
        storage = tensor.untyped_storage().data_ptr()
        if param_like(tensor, storage, self.param_storages):
            self.stats.skipped_param_bytes += nbytes
            return tensor
        if nbytes < self.min_bytes:
            self.stats.skipped_small_bytes += nbytes
            if notes:
                placement.note_save(-1)
            return tensor
        handle = self.handle_for(tensor, storage, nbytes)
        if notes:
            placement.note_save(handle.record.index)
        return handle

    def handle_for(self, tensor: torch.Tensor, storage: int, nbytes: int) -> Any:
        """The handle of ``tensor``'s record (under ``keep``: Note [kept as is]), new or
        deduplicated: the same view of the same bytes, or a view inside a record's span
        (Note [views of one storage]), of the same tensor (one version counter)."""
        # The storage offset is part of the key: q/k/v views of one fused projection share a
        # storage and must not collide. The version keeps a modified tensor apart; the root
        # keeps apart tensors that share bytes but not a version counter (``set_``).
        key = (storage, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, tensor._version)
        root = tensor._base if tensor._base is not None else tensor
        found = self.dedup.get(key)
        if found is not None and found[1]() is root:
            self.stats.dedup_hits += 1
            packed = found[0]
            kind = type(packed)
            if kind is Handle:
                packed.record.uses += 1
            elif kind is AliasHandle:
                packed.handle.record.uses += 1
            return packed
        placement = self.placement
        shares_views = placement.shares_views
        inside = self._inside(tensor, storage, root) if shares_views else None
        ref = weakref.ref(root)
        if placement.keeps_as_is:  # counted as records would be: a view inside a span is a hit
            packed = self._keep(tensor, nbytes, storage, ref, inside is not None)
            self.dedup[key] = (packed, ref)
            return packed
        if inside is not None:
            self.stats.dedup_hits += 1
            inside[0].record.uses += 1
            alias = AliasHandle(*inside, tensor)
            self.dedup[key] = (alias, ref)
            return alias
        record = Record(tensor, self, len(self.records), KEEP)
        if placement.notes_saves:
            placement.classify(record, tensor)
        self.records.append(record)
        self.step.live += 1
        self.live += 1
        handle = Handle(record)
        self.dedup[key] = (handle, ref)
        if shares_views and not record.geometry.compact:  # Note [views of one storage]
            self._note_span(tensor, storage, ref, handle, record.geometry.span)
        if placement.streams_out:  # Note [copy out at pack]
            self.stream_out(record)
        return handle

    def _note_span(
        self, tensor: torch.Tensor, storage: int, ref: weakref.ref, handle: Handle | None, span: int
    ) -> None:
        # The first span of a storage stays, unless its root is dead: the allocator gave its
        # address to a new tensor (a record's copy out landed and its device tensor went), and a
        # stale entry would keep the new tensor's views from being served by its record. Which
        # records die before the next saves depends on the copies' timing, so that left a step's
        # records, and with them both arenas' plans, varying from step to step.
        start, spans_key = tensor.storage_offset(), (storage, tensor.dtype, tensor._version)
        found = self.spans.get(spans_key)
        if found is None or found[3]() is None:
            self.spans[spans_key] = (handle, start, start + span, ref)

    def _inside(
        self, tensor: torch.Tensor, storage: int, root: torch.Tensor
    ) -> tuple[Handle | None, int] | None:
        """(Note [views of one storage]) The handle of a record of this run whose span holds
        ``tensor`` (a view of ``root``, as the record's is) and where in it, or None."""
        found = self.spans.get((storage, tensor.dtype, tensor._version))
        if found is None:
            return None
        handle, start, end, its_root = found
        offset = tensor.storage_offset()
        last = offset + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        if start <= offset and last < end and its_root() is root:
            return handle, offset - start
        return None

    def _keep(
        self, tensor: torch.Tensor, nbytes: int, storage: int, ref: weakref.ref, inside: bool
    ) -> tuple[torch.Tensor, int, ScopeRun]:
        stats = self.stats
        if inside:
            stats.dedup_hits += 1
        else:
            span, compact = tensor.numel(), False
            if not tensor.is_contiguous():
                geometry = TensorGeometry(tensor)
                span, compact, nbytes = geometry.span, geometry.compact, geometry.nbytes  # as a record's
            if not compact:
                self._note_span(tensor, storage, ref, None, span)
            stats.tensors += 1
            stats.bytes_saved += nbytes
            stats.bytes_per_tier["keep"] += nbytes
        return (tensor.detach(), tensor._version, self)


def unpack(packed: Any) -> torch.Tensor:
    """The unpack hook: a handle's tensor from the runtime, a kept tensor checked, anything
    else as it is."""
    kind = type(packed)
    if kind is Handle:
        record = packed.record
        return record.run.runtime.unpack(record)
    if kind is tuple:
        return _unpack_kept(*packed)
    if kind is AliasHandle:
        record = packed.handle.record
        base = record.run.runtime.unpack(record)
        return base.as_strided(packed.size, packed.stride, base.storage_offset() + packed.delta)
    return packed


# Note [kept as is]: under the ``keep`` policy a run's saved tensors never move, so they get no
# Record, Handle or release: no state machine, no runtime lock at every unpack and release.
# The pack hook returns (a detached alias (Note [no cycle through autograd]), the version it was
# saved at, the run), which autograd frees with the graph like any saved tensor. Unpack checks
# the version (Note [version check]) and, at the run's first unpack of a backward, tells the
# runtime backward has reached the run (`ScopeRun.reached`: the end-of-backward callback, the
# earlier runs' prefetch), which a record's unpack would otherwise do. Statistics count the
# tensor at pack. Runs kept for other reasons (``keep_last``, no room) are records on the keep
# tier: they can still be placed.
def _unpack_kept(alias: torch.Tensor, version: int, run: ScopeRun) -> torch.Tensor:
    if alias._version != version:
        raise modified_error(alias.shape, alias.dtype, run.name, alias._version, version)
    step = run.step  # a first unpack outside backward (grad_fn._saved_self) queued nothing
    if not run.window_issued or not step.callback_queued or step.fetches.busy:
        with run.runtime.lock:
            run.reached(None)  # and the window moves on (Note [fetch per saved tensor])
    return alias
