"""The auto policy's measuring placement (Note [measuring at the floor] in actoff.runtime.auto):
every saved tensor streamed to the host as it is saved, the block's bytes sorted for the plan.

Note [measuring where the host is small]: measuring copies a block's every save to the host, so
a host budget (``ACTOFF_HOST_BUDGET``) smaller than a block's saves would leave the rest on the
device, and a measuring step would run over the device budget before auto had a figure to plan
with (1.9-2x it under a 1 MiB host budget). Under a host budget the measured block therefore runs
inside PyTorch's non-reentrant checkpoint, with its saves going first to the scope's pack hook
(measured, sorted, copied to the host where the budget has room, as always); the records the
host refuses are let go when the block's forward ends, and backward gets them by running the
block again (the checkpoint's placeholder). The step then holds about what a ``checkpoint`` step
holds, the least any plan holds without host memory (tests/runtime/test_measuring.py). The
checkpoint matches the run again's saves to its placeholders by their order, so every save gets
one (`_HostOrRunAgain.pack`); those of saves the host took die at once, and the checkpoint skips
them in the run again. A block whose forward writes into an input or a tensor it saved, or calls a
collective, would not give the same values run again: its refused records stay on the device,
counted in ``over_budget_bytes`` and said once, and its gradients stay exact (a changed saved
tensor then raises autograd's error, as without actoff). A block with forward hooks is not run
again at all: the run again calls none (Note [hooks that change outputs] in .checkpoint).

Note [measuring where only chunks fit]: the measuring forward holds no more than the least any
placement holds in forward, but its backward brings back attention's node whole (its saves and
gradients at full length): at a length only the chunked placement fits, the first step would run
out of memory before auto had a figure. So once a measured block's forward has run, where its
survey found nothing the chunked placement refuses, and the device's peak in the block's forward
(its transients stand for those of backward's nodes, which the model does not hold) and
attention's node (`BlockCost.node_bytes`) go over the budget less the first plan's headroom
while chunks hold less (`actoff.budget.least`), the run goes on in chunks: the measured forward's
output is dropped (its records go with its graph), the block runs again as the chunked placement
runs it (without grad, its input saved, backward in token chunks), and its output is the step's.
The auto policy takes the measured forward's figures (`MeasuredForward`) and reads the step as a
chunked one. Only a block whose second forward starts from what the first found: its measured
forward changed no buffer, attribute or tensor (by version) of the block's modules or of its
inputs (`Found`: an auxiliary loss kept on the module would also hold the measured graph), wrote
into no input, called no collective, drew no random number (the survey refuses those); no forward
hook inside the block (one that writes an output in place, or hooks its gradient, would act on
the measured forward alone; the block's own hooks fire outside the scope, once; Hugging Face's
output capture counts only while its model records what it captures); a key/value cache
it was given held no rows it reads, and the second forward gets none (the first wrote its rows:
Note [a cache in checkpointed training]). The second forward gives back what it changes, and
starts from a clean table of saved tensors (the measured records' handles go with the graph).
The measured forward's time is the block's (the second is not timed). A block whose measured
forward keeps a tensor that requires grad outside its output (an auxiliary loss on the module,
or added to a list it is given) is refused by the survey: in chunks it would have no graph (Note
[state a chunked forward changes] in .chunked). Not under a host budget
too small for a block (Note [measuring where the host is small]). What it cannot see: a side
effect outside the block's modules and inputs (a collector of auxiliary losses held elsewhere
gets the second forward's too).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from actoff.rerun import isolation
from actoff.rerun.reached import Reached
from actoff.tiers.record import Record, State
from actoff.tiers.tokenwise.mixers import CaptureMode, CollectiveWatch

from ..hooks import AliasHandle, Handle, unpack
from .base import Call, Placement
from .checkpoint import has_forward_hooks, holds_rows_read, run_checkpointed
from .chunk_attention import Watch
from .chunked import ChunkedPlacement, MeasuredForward, keeps, survey, surveyed
from .tokenwise import TokenwisePlacement

if TYPE_CHECKING:
    from ..step import ScopeRun

__all__ = ["MeasuringPlacement"]


class MeasuringPlacement(TokenwisePlacement):
    """The auto policy's measuring steps (Note [measuring at the floor] in actoff.runtime.auto):
    every record streamed whole as it is saved, as the ``stream`` placement with windows of none,
    at the least device memory; the block's saves sorted into classes (its inputs, what its token
    mixers saved, the token-local rest) for the plan, and its forward watched for collectives.
    Nothing is split or probed. Under a host budget, what the host refuses is run again in backward
    (Note [measuring where the host is small])."""

    name = "measuring"
    asks_recompute = False  # type: ignore[assignment]  # it measures: nothing is asked of it

    def __init__(self, run: ScopeRun) -> None:
        super().__init__(run)
        self.streams_out = self.tier.fetches  # Note [copy out at pack]
        self.hooks: _HostOrRunAgain | None = None
        # Whether the chunked placement would take the block (Note [the chunked placement in the
        # plan] in actoff.budget): the forward surveyed, raising nothing.
        self.chunk_survey: Watch | None = None

    def forward(self, call: Call) -> Any:
        if not self.active:
            return call.run()
        self.chunk_survey = watch = survey(self.run, call)
        leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
        runs_again = self._runs_again(call)
        # What a second forward would start from (Note [measuring where only chunks fit]), and
        # what the forward keeps (a tensor kept there has no graph in chunks: the survey refuses
        # it). A cache is not: the second forward gets none (`_in_chunks`).
        found = isolation.Found(call.module, isolation.without_caches(leaves)) if not runs_again else None
        reached = Reached(call.module, isolation.without_caches(leaves))
        may_chunk = found is not None and self._may_chunk(call, leaves)  # before the forward writes a cache
        versions = [(leaf, leaf._version) for leaf in leaves if isinstance(leaf, torch.Tensor)]
        with CaptureMode(self.split), CollectiveWatch(self.split), watch:
            output = call.run() if not runs_again else self._forward_inside_checkpoint(call)
        self.split.writes_unrestorable()  # never run again, then (`rerun_unsafe`)
        self.split.start = None  # nothing runs again from it
        surveyed(watch, output, self.run.config.token_dim)
        kept = reached.kept(requiring_grad=True)  # with grad here: a logged statistic is detached
        if kept:
            watch.object_to(keeps(kept))
        after = pytree.tree_leaves((call.args, call.kwargs))
        if len(after) != len(leaves) or any(a is not b for a, b in zip(after, leaves, strict=True)):
            watch.object_to("its forward changes a list or dictionary it is given")
        unchanged = may_chunk and not found.changed() and not reached.changed()
        unchanged = unchanged and all(leaf._version == version for leaf, version in versions)
        unchanged = unchanged and not watch.refused and self.split.collective is None
        if unchanged and self.run.runtime.auto.only_chunks_fit(self.run, watch):
            del output  # its graph, and with it the measured records
            return self._in_chunks(call, watch, leaves, spec)
        return output

    def _may_chunk(self, call: Call, leaves: list[Any]) -> bool:
        """Whether the run may go on in chunks, as far as can be told before its forward: a budget
        to fit, grad on, a module without forward hooks inside, no cache holding rows it reads."""
        module = call.module
        if self.run.runtime.auto.budget(self.run) is None or not torch.is_grad_enabled() or module is None:
            return False
        if isolation.hooks_inside(module):
            return False  # a hook inside the block would see the measured forward's tensors alone
        return not any(isolation.is_cache(leaf) and holds_rows_read(leaf, module) for leaf in leaves)

    def _in_chunks(self, call: Call, watch: Watch, leaves: list[Any], spec: Any) -> Any:
        """The block run again as the chunked placement runs it, as the run's placement from now
        on; the measured forward's figures go with it (Note [measuring where only chunks fit])."""
        run = self.run
        run.runtime.auto.forward_ends(run)  # the measured forward's time: the second is not the block's
        measured = MeasuredForward(self.saved_by_class(0), watch, self.split.mixer_watches)
        chunked = ChunkedPlacement(run, falls_back=True, measured=measured)
        chunked.streams_out = self.streams_out  # as the runtime set it for the run (``keep_last``)
        with run.runtime.lock:
            unneeded = self.seal()
            run.dedup.clear()  # they held the measured records' handles: the records go with
            run.spans.clear()  # the measured graph
        del unneeded
        run.place(chunked)
        if any(isolation.is_cache(leaf) for leaf in leaves):  # written by the measured forward, once
            args, kwargs = pytree.tree_unflatten(isolation.without_caches(leaves), spec)
            call = Call(call.fn, args, kwargs, call.module)
        with isolation.left_as_found(call.module, leaves), isolation.forward_hooks_off(call.module):
            return chunked.forward(call)

    def _runs_again(self, call: Call) -> bool:
        """Whether the block runs inside the checkpoint (Note [measuring where the host is
        small]): a host budget, copies at pack (not a run ``keep_last`` keeps), grad on, and no
        forward hook in the block, which the run again would not call (Note [re-runs leave no
        trace] in actoff.rerun.isolation): a hook that changes an output would change the saves
        after it."""
        run = self.run
        if run.config.host_budget is None or run.backend.host_resident or not self.streams_out:
            return False
        return torch.is_grad_enabled() and not has_forward_hooks(call.module)

    def _forward_inside_checkpoint(self, call: Call) -> Any:
        run = self.run
        inputs = [
            leaf for leaf in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(leaf, torch.Tensor)
        ]
        versions = [tensor._version for tensor in inputs]
        self.hooks = hooks = _HostOrRunAgain(run)
        try:
            output = run_checkpointed(
                run, call.fn, call.args, call.kwargs, call.module, lambda: hooks, lambda: False
            )
        finally:
            # The checkpoint's frame holds the inputs' handles, whose records hold the run: the
            # run must not hold the frame back (Note [no cycle through autograd]).
            self.hooks = hooks.run = None
        changed = any(tensor._version != version for tensor, version in zip(inputs, versions, strict=True))
        written = self.split.writes_unrestorable()  # a parameter: what is run again would differ
        if changed:  # the checkpoint's copies of the inputs are stale, and never read: nothing runs again
            self.split.writes_inputs = True
            for record in run.records[: hooks.before]:
                if record.changed():
                    run.runtime.release(record)
        refused = list(hooks.refused.values())
        why = (
            "writes into an input in place"
            if changed
            else "writes into a parameter, or a tensor over 1 MiB, in forward"
            if written
            else "writes into a tensor it saved"  # autograd's version check says so in backward
            if any(record.changed() for record in refused)
            else f"calls {self.split.collective}"
            if self.split.collective is not None
            else ""
        )
        if refused and why:
            self._keep_refused(refused, why)
        else:
            for record in refused:
                run.runtime.release(record)  # its bytes go now: the run again brings them back
        return output

    def _keep_refused(self, refused: list[Record], why: str) -> None:
        """The block's forward would not give the same values run again: what the host refused
        stays on the device, said (Note [measuring where the host is small]); counted when its
        placement tries the host again (`place`)."""
        run = self.run
        run.stats.run_again_bytes -= sum(record.geometry.nbytes for record in refused)
        run.warn_once(
            "measuring:kept",
            f"actoff: auto measures block {run.name!r} (and any others like it) with the saved tensors "
            f"the host budget (ACTOFF_HOST_BUDGET) cannot take on the device: the block {why}, so it "
            "cannot be run again in backward for them (Note [measuring where the host is small]). "
            "Gradients stay exact; the measuring steps may exceed the device budget. Raise "
            "ACTOFF_HOST_BUDGET to hold a block's saved tensors.",
        )

    def host_refused(self, record: Record) -> bool:
        hooks = self.hooks
        if hooks is None or not hooks.packing:
            return False
        hooks.refused[id(record)] = record
        self.run.stats.run_again_bytes += record.geometry.nbytes
        return True

    def seal(self) -> list[object]:
        if not self.active:
            return []
        split = self.split
        split.writes_inputs = split.writes_inputs or any(
            isinstance(v, Record) and v.changed() for v in split.inputs
        )
        unneeded, split.owned = split.owned, []  # nothing is re-run: what only actoff held goes
        return unneeded

    def place(self) -> None:
        Placement.place(self)

    def records(self) -> tuple[Record, ...]:
        return tuple(self.run.records)

    def reached(self) -> None:
        """Nothing to probe."""

    def saved_by_class(self, input_bytes: int) -> tuple[int, int, int, bool] | None:
        if not self.active:
            return Placement.saved_by_class(self, input_bytes)
        split = self.split
        total = sum(record.geometry.nbytes for record in self.run.records)
        inputs = {id(v): v.geometry.nbytes for v in split.inputs if isinstance(v, Record)}
        stored_inputs = sum(inputs.values())
        mixers = sum(r.geometry.nbytes for r in self.run.records if r.whole and id(r) not in inputs)
        return stored_inputs, mixers, max(total - stored_inputs - mixers, 0), False


class _RecomputedSave:
    """What autograd holds for a save the host refused: the scope's handle (served while its
    record lives) and the checkpoint's placeholder (once the record is released)."""

    __slots__ = ("holder", "packed")

    def __init__(self, packed: Handle | AliasHandle, holder: Any) -> None:
        self.packed, self.holder = packed, holder


class _HostOrRunAgain:
    """The saved-tensor hooks around a measured block's body, inside the checkpoint's (Note
    [measuring where the host is small]): each save gets the checkpoint's placeholder and then
    the scope's pack; the placeholder is kept only where the host refused the record."""

    def __init__(self, run: ScopeRun) -> None:
        self.run: ScopeRun | None = run  # while the body runs
        self.refused: dict[int, Record] = {}  # the records the host refused, by id
        self.packing = False
        self.before = 0
        self._hooks: contextlib.AbstractContextManager | None = None
        self._outer: tuple[Any, Any] | None = None

    def __enter__(self) -> None:
        self.before = len(self.run.records)  # the block's inputs, as the checkpoint saved them
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc: object) -> None:
        hooks, self._hooks = self._hooks, None  # no cycle through its bound methods: the frame
        hooks.__exit__(*exc)  # it holds goes with backward, not with the collector

    def pack(self, tensor: torch.Tensor) -> Any:
        holder = self._outer[0](tensor)  # every save, in order: the run again matches them so
        self.packing = True
        try:
            packed = self.run.pack(tensor)
        finally:
            self.packing = False
        kind = type(packed)
        record = packed.record if kind is Handle else packed.handle.record if kind is AliasHandle else None
        if record is None or id(record) not in self.refused:
            return packed
        return _RecomputedSave(packed, holder)

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is _RecomputedSave:
            inner = packed.packed
            record = inner.record if type(inner) is Handle else inner.handle.record
            if record.state is State.RELEASED:
                return self._outer[1](packed.holder)
            return unpack(inner)
        return unpack(packed)
