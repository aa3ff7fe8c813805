"""What autograd holds for a tensor a scope saved, and the unpack hook that gives it back: a
`Handle` to a record, an `AliasHandle` to a view of a record's bytes (Note [views of one
storage]), or under ``keep`` the tensor itself with its version (Note [kept as is]). The pack
side is `actoff.runtime.step.ScopeRun.pack`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from actoff.tiers.record import Record, modified_error

__all__ = ["AliasHandle", "Handle", "unpack"]

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


# Note [views of one storage]: autograd may save several views of one tensor's bytes. Attention
# written as softmax then matmul (PyTorch's math SDPA, what a GPU runs for float32 with grouped KV
# heads; eager attention) saves its weights as the softmax's output and again as a 3-D view for
# the batched product. As two records they were copied twice each way, held twice on the host and
# fetched twice in backward: on the simulated device with the math backend (16 small layers, 1024
# tokens, batch 2) `cpu` copied 2716 MiB per step of 1692 MiB of distinct bytes, and lowered the
# peak by 0.52 of what it copied (0.40 on an H100). A view saved after a record of the same tensor
# (the same root: its `_base`, or itself), inside that record's span, is served from it
# (`AliasHandle`: the record's tensor again, seen with the view's size, stride and offset): one
# copy, the same bytes (there: 1692 MiB, 0.87). One root means one version counter, so the
# record's version check sees a change through either. Kept apart: tensors that share bytes but
# not a counter (``set_``: exact dedup checks the root too), views outside the span (q, k, v of
# one fused projection), gappy (compact) records and token-wise runs (records split by tokens);
# views with a lazy conjugate bit are never records (Note [lazy bits], actoff.runtime.step). The
# reference block saves its attention output twice too: SDPA's output, and a view of it as the
# output projection's input.
class AliasHandle:
    """What autograd stores for another view of a record's bytes (Note [views of one storage]):
    the record's handle (kept alive by it) and the view's place in the record's span."""

    __slots__ = ("delta", "handle", "size", "stride")

    def __init__(self, handle: Handle, delta: int, tensor: torch.Tensor) -> None:
        self.handle = handle
        self.size, self.stride, self.delta = tensor.shape, tensor.stride(), delta


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


# Note [kept as is]: under the ``keep`` policy a run's saved tensors never move, so they need
# no Record, Handle or release (the state machine, the runtime's lock at every unpack and
# release: most of what actoff cost per saved tensor). Its pack hook returns a tuple of a
# detached alias (Note [no cycle through autograd]), the version it was saved at and the run;
# autograd frees it with the graph like any saved tensor. Unpack checks the version (Note
# [version check]) and, at the run's first unpack of a backward, tells the runtime backward has
# reached the run (`ScopeRun.reached`: the end-of-backward callback, the previous run's prefetch).
# Statistics count the tensor at pack. Runs kept for other reasons (``keep_last``, no room)
# are records on the keep tier: they can still be placed.
def _unpack_kept(alias: torch.Tensor, version: int, run: Any) -> torch.Tensor:  # run: a ScopeRun
    if alias._version != version:
        raise modified_error(alias.shape, alias.dtype, run.name, alias._version, version)
    step = run.step  # a first unpack outside backward (grad_fn._saved_self) queued nothing
    if not run.fetch_issued or not step.callback_queued or (run.index and step.runs[run.index - 1].fetching):
        with run.runtime.lock:
            run.reached()
    return alias
