"""The chunked placement: a block's input stored, its backward run in token chunks.

Note [chunked backward]: only the block's inputs are saved (placed on the policy's tier like any
record). The forward runs the block without grad (whole at first, then in chunks too: Note [a
chunked forward] in actoff.runtime.placements.chunk_backward); backward runs it again, chunk of
tokens by chunk, and takes each chunk's gradients before the next, so the device holds one chunk's
activations at a time (``chunk_tokens``), not the whole block's as a checkpoint does. This works
because every op of a pre-norm decoder block but attention is token-local: rows ``[a, b)`` of the
input give rows ``[a, b)`` of every activation. Attention is the one op that mixes tokens, and it
is exact by query chunks: a query's softmax runs over its own row of keys. So, in backward:

1. The keys pass: the block runs on each chunk without grad up to attention, whose keys and values
   (after the rotary embedding) are kept for every token; the rest of the block is not run.
2. The chunks from the last to the first: the block runs on the chunk with grad; attention is
   served from the chunk's queries against the keys and values of every token up to the chunk's
   end (the earlier ones from step 1 as leaves, the chunk's own from this run), the mask causal
   from the lower right. One ``autograd.grad`` takes the chunk's output gradients, plus the key
   and value gradients the later chunks gave its rows, back to the chunk's inputs and the
   weights; the earlier rows' key and value gradients are added to theirs. Going from the last
   chunk to the first, a chunk's keys have all their gradients when its turn comes: causal
   attention only lets later queries see them.

The full-length tensors of backward are the block's inputs and their gradient, its outputs'
gradient, and the keys and values with theirs: about ``3 H + 4 kv`` per token. Gradients are those
of the unchunked block up to float reassociation (weights' gradients summed over chunks; each
chunk's attention its own kernel call). Each chunk's output is checked against the forward's
(their per-token sums, kept from forward): a block whose re-run on a chunk does not give the
forward's rows (a token mixer other than attention, state that changes between calls) stops
the step with an error instead of training on wrong gradients.

The block must have that shape, and the forward says so before anything is trained: exactly one
call of ``torch.nn.functional.scaled_dot_product_attention``, causal, without a mask or dropout,
its queries, keys and values as long as the block's sequence, and no dropout elsewhere. A block
of another shape raises `ChunkedShapeError` naming what it found and the placements that take
it (``checkpoint``, ``cpu``). The re-runs leave the block as the forward left it (Note [re-runs
leave no trace] in actoff.rerun.isolation), without forward hooks, caches or the cache's rows.

Note [state a chunked forward changes]: the forward runs without grad, and once probed in chunks,
calling the block once per chunk and per keys pass. What a forward does outside its output is
therefore watched:
- a floating tensor it keeps outside its output would have no graph: a loss that reads it would
  give the weights no gradient, without a word. `Reached` walks what the forward can reach (the
  modules' attributes and buffers, the plain objects it is given, through sequences, sets,
  mappings and objects' attributes, callable ones and ``__slots__`` too, three levels deep)
  before and after it; a floating tensor bound since (``self.aux = ...``, an auxiliary loss
  appended to ``self.logs["aux"]`` or handed to a collector) or written in place, or a list or
  dictionary given to the block that it changed (the block's calls get copies of them), refuses
  the block (`ChunkedShapeError`, naming where). So does a detached statistic logged that way,
  and a running mean updated in place: without grad neither can be told from a loss. Where
  ``auto`` placed the block, its survey ran with grad and refused tensors that require it, so a
  tensor written in place there is state (next item).
- a forward hook or pre-hook inside the block (Hugging Face's output capture counts only while
  its model records what it captures) would see the forward without grad and in chunks, and an
  output it keeps (router logits for a load-balancing loss) would have no graph: refused.
- state it changes in place or rebinds otherwise (a counter, three levels down too) would change
  once per chunk: where a forward in chunks changed any (`Found`, `Reached`), it is given back and
  the block's forward runs whole from then on, said once and in ``stored_whole``, so the state
  changes once a call.
A refused forward gives back what it changed before the error (or, under ``auto``, before the
checkpoint runs in its place). The runs again in backward give back theirs (Note [re-runs leave
no trace]), and each is checked against the forward's rows, the probe's whole run and a failed
probe's whole block too: a block whose state changes its output (it scales by a weight it halves
each call) stops the step. Not seen: side effects outside the block's modules and inputs (a
global list, a closure), parameters changed in place (noticed as state, not given back), what
lies deeper than three levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.autograd.function import once_differentiable

from actoff.rerun.again import StateAtStart, run_again
from actoff.rerun.isolation import hooks_inside, is_cache, without_caches
from actoff.rerun.reached import Reached
from actoff.rerun.state import ForwardState, RngState, autograd_status

from .base import Call
from .checkpoint import CheckpointPlacement, holds_rows_read, refuse_unrestorable, run_checkpointed
from .chunk_attention import ChunkedShapeError, ChunkMismatchError, Watch
from .chunk_backward import Block, backward, learned, probed, row_sums, token_dim
from .chunk_backward import forward as chunked_forward

if TYPE_CHECKING:
    from ..step import ScopeRun

__all__ = [
    "ChunkMismatchError",
    "ChunkedPlacement",
    "ChunkedShapeError",
    "MeasuredForward",
    "keeps",
    "run_chunked",
    "survey",
    "surveyed",
]


class _ChunkedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block: Block, *tensors: torch.Tensor) -> Any:
        inputs = tensors[: len(block.where)]
        values = block.values(inputs)
        known = [*tensors, *block.params]
        watch = Watch(block.run.name, block.seq_len, known)
        start = StateAtStart(block.module, without_caches(values))
        try:
            output = _forward(block, values, known, watch, start)
            _kept_nothing(block, watch, start.reached)
        except ChunkedShapeError:
            start.restore()  # Note [state a chunked forward changes]
            raise
        leaves, block.out_spec = pytree.tree_flatten(output)
        for leaf in leaves:
            floating = isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
            dim = token_dim(leaf, block.seq_len, block.token_dim) if floating else None
            if floating and dim is None:
                raise watch.refuse(f"an output of shape {list(leaf.shape)} has no token dimension")
            block.out_dims.append(dim)
            block.rows.append(row_sums(leaf, dim, block.chunk) if dim is not None else None)
            block.kept.append(None if dim is not None else leaf)
        block.began = start.kept()  # each call in backward starts from it (`Block.call`)
        ctx.block = block
        ctx.save_for_backward(*inputs)  # through the scope's hooks: the run's records
        return tuple(leaf for leaf, dim in zip(leaves, block.out_dims, strict=True) if dim is not None)

    @staticmethod
    @once_differentiable  # its gradients are taken in chunks: no graph of them to differentiate again
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        block: Block = ctx.block
        values = without_caches(block.values(ctx.saved_tensors))
        given = iter(grads)
        out_grads = [next(given) if dim is not None else None for dim in block.out_dims]
        block.timed = []  # its runs again, as a checkpoint's (`recompute_ms`): not their gradients
        with run_again(block.module, values):  # each call from the forward's state: `Block.call`
            input_grads, param_grads = backward(block, values, out_grads)
        with block.run.runtime.lock:
            for ticket in block.timed:
                block.run.account("recompute_ms", ticket)
        block.timed = None
        return (None, *input_grads, *param_grads)


def _forward(
    block: Block, values: list[Any], known: list[torch.Tensor], watch: Watch, start: StateAtStart
) -> Any:
    """The block's output without grad: in chunks once a whole run and the probe have shown its
    shape (Note [a chunked forward]), else whole; state it changes in chunks as Note [state a
    chunked forward changes] says."""
    whole = block.chunk >= block.seq_len or block.has_cache or not probed(block, values)
    module = learned(block)  # a block that changes its state runs its forward whole, once a call
    if not whole and not module.changes_state:

        def each(length: int, sliced: list[Any]) -> Watch:
            tensors = [value for value in sliced if isinstance(value, torch.Tensor)]
            return Watch(block.run.name, length, [*known, *tensors])

        output = chunked_forward(block, values, each)
        watch.random(block.rng)
        found, reached = start.found, start.reached
        if not found.changed() and not reached.changed():
            return output
        del output
        found.restore()  # changed once a chunk: once, by the whole block, as without actoff
        reached.restore()
        module.changes_state = True
    if module.changes_state:  # said once, and in the statistics (``stored_whole``)
        block.run.placement.whole_because = (
            "its forward changes its own state (a counter, a statistic): run in chunks it would change it once "
            "a chunk, so its forward runs whole, once a call (its backward still in chunks)"
        )
        block.run.runtime.warn_once(
            f"chunked:state:{block.run.name}",
            f"actoff: block {block.run.name!r}: {block.run.placement.whole_because}.",
        )
    with watch:
        output = block.call(values)
    watch.finish(block.rng)
    refuse_unrestorable(block.run.name, start.unrestorable(), "chunked")
    return output


def _kept_nothing(block: Block, watch: Watch, reached: Reached) -> None:
    """Refuse a forward that kept a floating tensor outside its output (Note [state a chunked
    forward changes]): on the block's modules or what it was given, or in a list or dictionary
    given to it (the block got copies of those: the caller's would miss what it added)."""
    # Where auto placed it, its survey ran with grad and refused a tensor written in place that
    # requires grad: one written here is a statistic (a running mean), state as any other.
    kept = reached.kept(written=not block.falls_back)
    if kept:
        raise watch.refuse(keeps(kept))
    if block.inputs_grew:
        raise watch.refuse(
            "its forward changes a list or dictionary it is given: its calls get copies of them, so the "
            "caller's would not see the change"
        )


def keeps(kept: list[str]) -> str:
    """Why a block whose forward keeps tensors where ``kept`` says is refused (Note [state a
    chunked forward changes])."""
    return (
        f"its forward keeps a tensor outside its output ({', '.join(kept[:3])}): run without grad and in "
        "chunks, such a tensor has no graph (an auxiliary loss would give the weights none of its gradient)"
    )


def _checkpoints_itself(module: torch.nn.Module) -> bool:
    """Whether ``module`` checkpoints its own forward in training: a Hugging Face layer with
    gradient checkpointing on, or torch's ``CheckpointWrapper`` (found by name)."""
    hugging_face = getattr(module, "gradient_checkpointing", False) is True and module.training
    return hugging_face or type(module).__name__ == "CheckpointWrapper"


def _refusal(run: ScopeRun, call: Call, tensors: list[torch.Tensor]) -> str | None:
    """Why the call cannot run in chunks, seen before it runs (None: nothing seen)."""
    config = run.config
    if call.module is None:
        return (
            f"actoff: function scope {run.name!r} cannot run its backward in token chunks: the chunked "
            "placement takes the weights' gradients itself and needs the block's module. Offload the "
            "module (offload_ with block_cls) or use 'checkpoint'."
        )
    leaves = pytree.tree_leaves((call.args, call.kwargs))
    if any(is_cache(leaf) and holds_rows_read(leaf, call.module) for leaf in leaves):
        return (
            f"actoff: block {run.name!r} is given a key/value cache that already holds rows it reads; the "
            "chunked placement re-runs it without them. Place it with 'cpu' instead."
        )
    checkpointed = [type(sub).__name__ for sub in call.module.modules() if _checkpoints_itself(sub)]
    if checkpointed:
        return (
            f"actoff: block {run.name!r} cannot run its backward in token chunks: its {checkpointed[0]} runs "
            "its forward under activation checkpointing (Hugging Face's gradient_checkpointing_enable, a "
            "CheckpointWrapper), which would run it again outside the chunks. Turn that off "
            "(model.gradient_checkpointing_disable()): the chunked placement runs the block again itself; "
            "or place it with 'checkpoint', which composes with it."
        )
    hooked = hooks_inside(call.module)
    if hooked:
        return (
            f"actoff: block {run.name!r} cannot run its backward in token chunks: a forward hook on its "
            f"{hooked[0]} would see its forward run without grad and in chunks (an output it keeps, as Hugging "
            "Face's router-logit capture for the load-balancing loss does, would have no graph). Place it "
            "with 'checkpoint' or 'cpu', or remove the hook (Note [state a chunked forward changes])."
        )
    if not tensors or tensors[0].dim() <= config.token_dim:
        return f"actoff: block {run.name!r} has no tensor input with a token dimension"
    seq_len = tensors[0].shape[config.token_dim]
    for tensor in tensors:
        if tensor.requires_grad and token_dim(tensor, seq_len, config.token_dim) is None:
            return (
                f"actoff: block {run.name!r} takes a gradient for an input of shape {list(tensor.shape)} without "
                f"a token dimension of length {seq_len}; the chunked placement cannot split it. Use 'checkpoint'."
            )
    return None


def _ambiguous(tensors: list[torch.Tensor], seq_len: int) -> torch.Tensor | None:
    """An input with several dimensions as long as the sequence (the chunks cannot tell which to split)."""
    return next((t for t in tensors[1:] if sum(n == seq_len for n in t.shape) > 1), None)


def survey(run: ScopeRun, call: Call) -> Watch:
    """A watch for a forward run otherwise (the auto policy's measuring, with grad) that raises
    nothing and tells whether the chunked placement would take the block (``refused``: why not)
    and attention's bytes (Note [the chunked placement in the plan] in actoff.budget); its
    `surveyed` is called on the forward's output."""
    tensors = [
        leaf for leaf in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(leaf, torch.Tensor)
    ]
    found = _refusal(run, call, tensors)
    seq_len = tensors[0].shape[run.config.token_dim] if found is None else 0
    params = [] if call.module is None else [p for p in call.module.parameters() if p.requires_grad]
    watch = Watch(run.name, seq_len, [*tensors, *params], survey=True)
    watch.rng = RngState.capture(run.device)
    if found is None and _ambiguous(tensors, seq_len) is not None:
        found = "an input has several dimensions as long as the sequence"
    watch.refused = found
    return watch


def surveyed(watch: Watch, output: Any, token_dim_: int) -> None:
    """The end of a `survey`: attention called once, no random number drawn, every floating
    output with a token dimension."""
    watch.finish(watch.rng)
    for leaf in pytree.tree_leaves(output):
        floating = isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
        if floating and token_dim(leaf, watch.seq_len, token_dim_) is None:
            watch.object_to(f"an output of shape {list(leaf.shape)} has no token dimension")


def run_chunked(run: ScopeRun, call: Call) -> Any:
    """Run ``call`` as ``run`` under the chunked placement (Note [chunked backward]): the forward
    without grad, the inputs saved through the scope's hooks, the backward in token chunks."""
    config = run.config
    leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in where]
    found = _refusal(run, call, tensors)
    if found is not None:
        raise ChunkedShapeError(found)
    seq_len = tensors[0].shape[config.token_dim]
    ambiguous = _ambiguous(tensors, seq_len)
    if ambiguous is not None:  # Note [no silent downgrade]: said once, and in the statistics
        run.placement.whole_because = (
            f"an input of shape {list(ambiguous.shape)} has several dimensions as long as the sequence, "
            "so the chunks cannot tell which to split: the whole block runs again in backward"
        )
        run.runtime.warn_once(
            "chunked:ambiguous",
            f"actoff: block {run.name!r} (and any others like it) at {seq_len} tokens: "
            f"{run.placement.whole_because}, as a checkpoint. An attention mask given to the block ([..., S, "
            "S]: padding, packing, sliding windows) does so at every length; a causal block without one runs "
            "in chunks where no other dimension of its inputs is as long as the sequence.",
        )
        return run_checkpointed(run, call.fn, call.args, call.kwargs, call.module)
    state = ForwardState.now(tensors[0].device)
    block = Block(
        run=run,
        fn=call.fn,
        module=call.module,
        skeleton=[None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
        spec=spec,
        where=where,
        statuses=[autograd_status(leaf) for leaf in leaves],
        grads_for=[i for i, tensor in enumerate(tensors) if tensor.requires_grad],
        params=[p for p in call.module.parameters() if p.requires_grad],
        state=state,
        seq_len=seq_len,
        token_dim=config.token_dim,
        chunk=config.chunk_tokens,
        half=state.half_precision or tensors[0].dtype in (torch.float16, torch.bfloat16),
        has_cache=any(is_cache(leaf) for leaf in leaves),
        falls_back=run.placement.falls_back,
        rng=RngState.capture(run.device),
    )
    run.placement.rng = block.rng
    outputs = _ChunkedFunction.apply(block, *tensors, *block.params)
    block.skeleton = without_caches(block.skeleton)  # the forward wrote them; the re-runs get none
    done = iter(outputs)
    leaves_out = [
        next(done) if dim is not None else kept for dim, kept in zip(block.out_dims, block.kept, strict=True)
    ]
    return pytree.tree_unflatten(leaves_out, block.out_spec)


@dataclass
class MeasuredForward:
    """What the auto policy's measuring forward of a run took before the run went on in chunks
    (Note [measuring where only chunks fit] in actoff.runtime.placements.measuring): its bytes by
    class, its survey, and the token mixers' timers of its forward."""

    classes: tuple[int, int, int, bool] | None
    survey: Watch
    mixer_watches: list | None

    def mixers_ms(self) -> float | None:
        if self.mixer_watches is None:
            return None
        return sum(watch.synchronize() or watch.elapsed_ms() for watch in self.mixer_watches)


class ChunkedPlacement(CheckpointPlacement):
    """A checkpoint whose backward runs in token chunks (Note [chunked backward]): the block's
    inputs stored on the policy's tier.

    Note [a chunked block the plan misjudged]: the auto policy places a block ``chunked`` only
    where its measuring forward saw nothing the placement refuses (`survey`), but a survey sees a
    forward with grad, and the probe (Note [the chunked probe]) runs only in backward. So where
    auto placed it (``falls_back``), a refusal in forward runs the block as a checkpoint instead:
    nothing was saved yet, and the generators are set back to where the refused forward found
    them, so the checkpoint draws what a forward without actoff would, from the state the refused
    forward found (Note [state a chunked forward changes]). A failed probe takes the whole block's gradients from its stored
    inputs, the generators as its forward had them (its forward ran whole: a block runs in chunks
    only once probed). Either way ``refused`` says why, one warning per block says it, and the next
    plan leaves the block out of the chunked placement; that step holds a checkpoint's memory,
    over a budget only chunks fit. What still stops the step under auto, as under
    ``ACTOFF_POLICY=chunked``: a refusal for a block given a key/value cache (not run twice in
    forward), and a chunk whose rows differ from the forward's once the probe has passed (the
    forward ran in chunks then: no whole result to fall back on).
    """

    name = "chunked"
    # Note [no fetch ahead of chunks]: under a window of blocks (``prefetch_depth``), a chunked
    # block's inputs, its only records, come back at its own backward's first unpack, not at the
    # start of the block after it's (whatever that block's placement: the fetch queue stops at
    # such a run, and at the runs before it): fetched ahead they would lie on the device through
    # that block's whole backward, 1 KiB a token more on the 128 MiB proxy at its floor (9216
    # tokens against 10752 with ACTOFF_FETCH_WINDOW=0; results/cpu-2026-12-03-chunked-128-key-
    # blocks). Its backward then waits for that copy (its time not measured against a fetch
    # ahead). A window in bytes (``fetch_window``, and ``auto``'s plans) still fetches ahead
    # within its bytes.
    fetches_ahead = False

    def __init__(
        self, run: ScopeRun, *, falls_back: bool = False, measured: MeasuredForward | None = None
    ) -> None:
        super().__init__(run)
        self.falls_back = falls_back
        # What a measuring forward took before the run went on in chunks (Note [measuring where
        # only chunks fit] in actoff.runtime.placements.measuring): the auto policy reads it here.
        self.measured = measured
        self.rng: RngState | None = None  # the generators before its forward (`run_chunked`)
        self.refused: str | None = None  # why it ran otherwise (Note [a chunked block the plan misjudged])
        self.refused_every_length = False

    def forward(self, call: Call) -> Any:
        try:
            return run_chunked(self.run, call)
        except ChunkedShapeError as error:
            leaves = pytree.tree_leaves((call.args, call.kwargs))
            if not self.falls_back or any(is_cache(leaf) for leaf in leaves):
                raise
            self.say_refused(str(error))
            if self.rng is not None:  # what the refused forward drew, drawn again by the checkpoint's
                self.rng.set()
            return run_checkpointed(self.run, call.fn, call.args, call.kwargs, call.module)

    @property
    def chunk_survey(self) -> Watch | None:
        """The measuring forward's survey (None: the run was placed in chunks by a plan)."""
        return None if self.measured is None else self.measured.survey

    def saved_by_class(self, input_bytes: int) -> tuple[int, int, int, bool] | None:
        if self.measured is not None:
            return self.measured.classes
        return super().saved_by_class(input_bytes)

    def mixers_ms(self) -> float | None:
        return None if self.measured is None else self.measured.mixers_ms()

    def say_refused(self, why: str, *, every_length: bool = False) -> None:
        """Why it ran otherwise, kept for the next plan and said once (Note [a chunked block the
        plan misjudged]); ``every_length``: the refusal holds at the block's other lengths too (a
        failed probe: the block mixes tokens), where a forward's may be its length's own."""
        self.refused, self.refused_every_length = why, every_length
        self.run.runtime.warn_once(
            f"chunked refused:{self.run.name}",
            f"{why} (auto had placed it in token chunks: this step it runs whole, as a checkpoint, which "
            "may go over a budget only chunks fit, and the next plan leaves it out of the chunked placement)",
        )
