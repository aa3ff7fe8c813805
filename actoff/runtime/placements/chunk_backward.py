"""A chunked block's backward (Note [chunked backward] in actoff.runtime.placements.chunked): the
keys pass, the chunks from the last, the check of each chunk's rows, and the probe of a block's
first backward.

Note [the chunked probe]: a chunk's outputs are checked against the forward's, but an op that
mixes tokens outside attention may leave the outputs as they were and still change the gradients
(a token shift behind a projection that starts at zero). So the first backward of a block under
new conditions (its module, the dtype, autocast) also runs the block's first ``2 x chunk`` tokens
both ways, whole and in two chunks, from the same output gradients, and compares every gradient:
causal attention makes those tokens' outputs the whole sequence's, and a block that is
token-local but for attention gives the same gradients either way, within reassociation. A block
that does not stops the step with an error; the probe costs two short runs once.

Note [a chunked forward]: the forward runs in chunks too, as backward does (the keys pass, then
each chunk's attention against the keys up to its end, without grad): the device holds the block's
input and output and the keys and values at full length, and one chunk's activations, where a
whole forward holds every activation of the block at once (2.1 KB per token on the 8B proxy, the
bound once the backward was chunked). A block given a key/value cache runs its forward whole: the
cache is written once, with every row.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from actoff.rerun.again import StateAtStart
from actoff.rerun.state import ForwardState, RngState
from actoff.tiers.tokenwise.mixers import slice_inputs
from actoff.tiers.tokenwise.probes import ModuleProbes
from actoff.tiers.tokenwise.tokens import unique_dim

from .chunk_attention import ChunkMismatchError, ChunkMode, KeysTaken

if TYPE_CHECKING:
    from ..step import ScopeRun

__all__ = ["Block", "backward", "forward", "learned", "probed", "row_sums", "token_dim", "whole"]


@dataclass
class Block:
    """What backward needs of a chunked run: the call's structure (tensors left out: they are the
    saved inputs), which inputs take gradients, the weights, the forward's state and its rows."""

    run: ScopeRun
    fn: Callable[..., Any]
    module: torch.nn.Module
    skeleton: list[Any]
    spec: Any
    where: list[int]  # the flat positions of the tensor inputs
    statuses: list[str | None]  # each flat value's autograd status (Note [re-run state])
    grads_for: list[int]  # indexes into `where` of the inputs that take gradients
    params: list[torch.nn.Parameter]
    state: ForwardState
    seq_len: int
    token_dim: int
    chunk: int
    half: bool = False
    has_cache: bool = False  # given a key/value cache: its forward runs whole (Note [a chunked forward])
    falls_back: bool = False  # Note [a chunked block the plan misjudged] (actoff.runtime.placements.chunked)
    rng: RngState | None = None  # the generators before its forward (`whole` draws what it drew)
    timed: list[Any] | None = None  # in backward: each run's stopwatch (the run's ``recompute_ms``)
    inputs_grew: bool = False  # a call added to a list or dictionary it was given (`call`)
    began: StateAtStart | None = None  # Note [runs again start where the forward did] (`call`)
    out_spec: Any = None
    out_dims: list[int | None] = field(default_factory=list)  # per output leaf: its token dim
    rows: list[torch.Tensor | None] = field(default_factory=list)  # per output leaf: `row_sums`
    kept: list[Any] = field(default_factory=list)  # per output leaf: itself, where not a gradient's

    def values(self, tensors: tuple[torch.Tensor, ...]) -> list[Any]:
        values = list(self.skeleton)
        for index, tensor in zip(self.where, tensors, strict=True):
            values[index] = tensor
        return values

    def call(self, values: list[Any]) -> Any:
        """The block on ``values`` under the forward's autocast (not its backward: autograd is
        called outside this) and the caller's grad mode; in backward from the state its forward
        began with, where that forward changed it (each chunk's call, not the first one's only)."""
        if self.began is not None:
            self.began.restore()
        args, kwargs = pytree.tree_unflatten(values, self.spec)
        grad = torch.is_grad_enabled()  # the caller's: the forward's grad mode is not restored
        watch = self.run.backend.stopwatch().start() if self.timed is not None else None
        try:
            with self.state.restored(), torch.set_grad_enabled(grad):
                return self.fn(*args, **kwargs)
        finally:
            if watch is not None:
                self.timed.append(watch.stop())
            # The call got copies of the lists and dictionaries it was given: what it added to
            # them would reach no caller (Note [state a chunked forward changes] in .chunked).
            after = pytree.tree_leaves((args, kwargs))
            self.inputs_grew |= len(after) != len(values) or any(
                a is not b for a, b in zip(after, values, strict=True)
            )

    def chunks(self) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk, self.seq_len)) for a in range(0, self.seq_len, self.chunk)]

    def sliced(self, values: list[Any], start: int, stop: int) -> tuple[list[Any], list[torch.Tensor]]:
        """The call's values on tokens ``[start, stop)``; the inputs that take gradients made leaves."""
        sliced = slice_inputs(values, self.statuses, self.seq_len, self.token_dim, start, stop)
        leaves = []
        for index in self.grads_for:
            leaf = sliced[self.where[index]].detach().requires_grad_()
            sliced[self.where[index]] = leaf
            leaves.append(leaf)
        return sliced, leaves


def token_dim(tensor: torch.Tensor, seq_len: int, configured: int) -> int | None:
    """The token dimension of ``tensor`` as the re-runs slice it (`slice_inputs`' rule)."""
    if tensor.dim() > configured and tensor.shape[configured] == seq_len:
        return configured
    return unique_dim(tuple(tensor.shape), seq_len)


def row_sums(tensor: torch.Tensor, dim: int, step: int | None = None) -> torch.Tensor:
    """Per token, the sum of its values and of their magnitudes, in float32: ``(rows, 2)``;
    ``step`` tokens at a time (None: all at once). Their float32 copies and magnitudes are its
    temporaries: on a whole block's output, two of them at full length were the chunked forward's
    peak on the 8B proxy (1 KiB a token of its 1.8; results/cpu-2026-12-04-row-sums).

    >>> x = torch.arange(6.0).reshape(3, 2) - 2
    >>> row_sums(x, 0, step=2).tolist()
    [[-3.0, 3.0], [1.0, 1.0], [5.0, 5.0]]
    """
    length = tensor.shape[dim]
    step = length if step is None else max(1, step)
    sums = []
    for start in range(0, length, step):
        part = tensor.detach().narrow(dim, start, min(step, length - start))
        rows = part.float().movedim(dim, 0).reshape(part.shape[dim], -1)
        sums.append(torch.stack((rows.sum(1), rows.abs().sum(1)), dim=1))
    return sums[0] if len(sums) == 1 else torch.cat(sums)


class _Grads:
    """The gradients a chunked backward gathers: the inputs' (rows written chunk by chunk, made at
    the first), the weights' (summed over chunks) and the keys' and values'."""

    def __init__(
        self, block: Block, tensors: list[torch.Tensor], keys: torch.Tensor, vals: torch.Tensor
    ) -> None:
        self.block, self.tensors = block, tensors
        self.inputs: list[torch.Tensor | None] = [None] * len(tensors)
        self.params: list[torch.Tensor | None] = [None] * len(block.params)
        self.keys, self.vals = torch.zeros_like(keys), torch.zeros_like(vals)

    def take(self, found: tuple, start: int, stop: int) -> None:
        """Gradients of a chunk's leaves (its inputs, in `grads_for` order) and of the weights."""
        block = self.block
        count = len(block.grads_for)
        for index, grad in zip(block.grads_for, found[:count], strict=True):
            if grad is not None:
                if self.inputs[index] is None:
                    self.inputs[index] = torch.zeros_like(self.tensors[index])
                dim = token_dim(self.tensors[index], block.seq_len, block.token_dim)
                self.inputs[index].narrow(dim, start, stop - start).add_(grad)
        for i, grad in enumerate(found[count : count + len(block.params)]):
            if grad is not None:
                self.params[i] = grad if self.params[i] is None else self.params[i].add_(grad)


def keys_pass(block: Block, values: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's keys and values for every token, chunk by chunk (step 1 of Note [chunked backward])."""
    full: list[torch.Tensor] = []
    with torch.no_grad():
        for start, stop in block.chunks():
            mode = ChunkMode(start, stop, None, None)
            try:
                with mode:
                    block.call(block.sliced(values, start, stop)[0])
            except KeysTaken:
                pass
            if mode.taken is None:
                raise ChunkMismatchError(
                    f"actoff: block {block.run.name!r} did not call attention in a re-run"
                )
            if not full:
                full = [
                    torch.empty((*t.shape[:-2], block.seq_len, t.shape[-1]), dtype=t.dtype, device=t.device)
                    for t in mode.taken
                ]
            for gathered, rows in zip(full, mode.taken, strict=True):
                gathered[..., start:stop, :].copy_(rows)
    return full[0], full[1]


def forward(block: Block, values: list[Any], watch: Callable[[int, list[Any]], Any]) -> Any:
    """The block's output, run in chunks as its backward will be (Note [a chunked forward]): the
    keys pass, then each chunk's rows written into full-length outputs. ``watch(length, sliced)``
    makes the mode that checks each chunk's run (actoff.runtime.placements.chunk_attention.Watch)."""
    keys, vals = keys_pass(block, values)
    full: list[Any] = []
    spec = None
    for start, stop in block.chunks():
        # Note [let go as copies land] in actoff.runtime.step
        block.run.step.let_go_landed(block.run.runtime.lock)
        sliced = slice_inputs(values, block.statuses, block.seq_len, block.token_dim, start, stop)
        mode = ChunkMode(start, stop, keys, vals)
        with mode, watch(stop - start, sliced) as watched:
            leaves, spec = pytree.tree_flatten(block.call(sliced))
        if watched.calls != 1:
            raise watched.refuse("it does not call scaled_dot_product_attention once in a chunk")
        if not full:
            full = [_full_rows(leaf, block, stop - start) for leaf in leaves]
        for gathered, leaf in zip(full, leaves, strict=True):
            if isinstance(gathered, torch.Tensor) and gathered is not leaf:
                dim = token_dim(leaf, stop - start, block.token_dim)
                gathered.narrow(dim, start, stop - start).copy_(leaf)
    return pytree.tree_unflatten(full, spec)


def _full_rows(leaf: Any, block: Block, length: int) -> Any:
    """A full-length buffer for a chunk's output ``leaf`` (a float tensor with a token dimension),
    else the leaf itself."""
    if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
        return leaf
    dim = token_dim(leaf, length, block.token_dim)
    if dim is None:
        return leaf
    shape = list(leaf.shape)
    shape[dim] = block.seq_len
    return leaf.new_empty(shape)


def backward(block: Block, values: list[Any], out_grads: list[torch.Tensor | None]) -> tuple[list, list]:
    """The inputs' and the weights' gradients of a chunked run (Note [chunked backward]), after
    the probe where the block's conditions are new (Note [the chunked probe])."""
    if not probed(block, values) and (block.grads_for or block.params):
        try:
            _probe(block, values, out_grads)
        except ChunkMismatchError as error:
            if not block.falls_back:
                raise
            block.run.placement.say_refused(str(error), every_length=True)
            return whole(block, values, out_grads)
        learned(block).chunks_probed.add(_conditions(block, values))
    grads = _chunks(block, values, out_grads)
    return grads.inputs, grads.params


def whole(block: Block, values: list[Any], out_grads: list[torch.Tensor | None]) -> tuple[list, list]:
    """The inputs' and the weights' gradients of the block run again whole, as a checkpoint's
    (Note [a chunked block the plan misjudged] in actoff.runtime.placements.chunked)."""
    sliced, leaves = block.sliced(values, 0, block.seq_len)
    with block.rng.restore() if block.rng is not None else contextlib.nullcontext():
        found = _run_and_take(block, sliced, leaves, out_grads)
    found = found or (None,) * (len(leaves) + len(block.params))
    inputs: list[torch.Tensor | None] = [None] * len(block.where)
    for index, grad in zip(block.grads_for, found, strict=False):
        inputs[index] = grad
    return inputs, list(found[len(leaves) :])


def _run_and_take(
    block: Block, values: list[Any], leaves: list[torch.Tensor], out_grads: list[torch.Tensor | None]
) -> tuple | None:
    """The block run on ``values`` with grad (its rows checked against the forward's), and the
    gradients of ``leaves`` and the weights from ``out_grads``; None where no output takes a gradient."""
    with torch.enable_grad():
        output = block.call(values)
    # Checked as a chunk's are: a block whose state changes its output (it scales by a tensor it
    # halves each call) gives other rows run again, and its gradients would be wrong.
    outs, grads = _chunk_outputs(block, output, out_grads, 0, block.seq_len)
    if not outs:
        return None
    return torch.autograd.grad(outs, [*leaves, *block.params], grads, allow_unused=True)


def _conditions(block: Block, values: list[Any]) -> tuple:
    return block.state.autocast, tuple(
        str(value.dtype) for value in values if isinstance(value, torch.Tensor)
    )


def learned(block: Block) -> ModuleProbes:
    """What this runtime learned about the block's module (forgotten by `actoff.reset`)."""
    return block.run.runtime.probe_results.setdefault(block.module, ModuleProbes)


def probed(block: Block, values: list[Any]) -> bool:
    """Whether the block passed its probe under these conditions (Note [the chunked probe])."""
    return _conditions(block, values) in learned(block).chunks_probed


def _chunks(block: Block, values: list[Any], out_grads: list[torch.Tensor | None]) -> _Grads:
    """Step 2 of Note [chunked backward]: the chunks from the last, each run with grad and taken
    back to its inputs and the weights: first from its outputs (giving the gradients of the keys
    and values it read), then from its own keys and values, whose gradients are complete then."""
    keys, vals = keys_pass(block, values)
    grads = _Grads(block, [values[position] for position in block.where], keys, vals)
    for start, stop in reversed(block.chunks()):
        sliced, leaves = block.sliced(values, start, stop)
        mode = ChunkMode(start, stop, keys, vals, (grads.keys, grads.vals))
        with torch.enable_grad(), mode:
            output = block.call(sliced)
        if len(mode.served) != 2:
            raise ChunkMismatchError(f"actoff: block {block.run.name!r} did not call attention in a re-run")
        outs, out_rows = _chunk_outputs(block, output, out_grads, start, stop)
        wrt = [*leaves, *block.params]
        found: tuple = ()
        if outs:
            found = torch.autograd.grad(
                outs, [*wrt, *mode.served], out_rows, allow_unused=True, retain_graph=True
            )
            grads.take(found, start, stop)
            for served, gathered in zip(found[len(wrt) :], (grads.keys, grads.vals), strict=True):
                if served is not None:
                    gathered[..., :stop, :].add_(served)
        own = [
            (rows, gathered[..., start:stop, :])
            for rows, gathered in zip(mode.taken, (grads.keys, grads.vals), strict=True)
        ]
        own = [(rows, grad) for rows, grad in own if rows.requires_grad]
        if own and wrt:
            found = torch.autograd.grad(
                [rows for rows, _ in own], wrt, [grad for _, grad in own], allow_unused=True
            )
            grads.take(found, start, stop)
        # The chunk's graph and gradients go now, not once the next chunk's run has built its own.
        del output, outs, out_rows, own, mode, sliced, leaves, wrt, found
    return grads


def _chunk_outputs(
    block: Block, output: Any, out_grads: list[torch.Tensor | None], start: int, stop: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The chunk's outputs that have gradients and their rows of those gradients; each output's
    rows checked against the forward's (Note [chunked backward]): the per-token sums, within
    float32 reassociation (half-precision rounding under autocast or in a half dtype) of the
    per-token sums of magnitudes (a row summing to about zero, as a normalised one, is still checked)."""
    leaves = pytree.tree_flatten(output)[0]
    if len(leaves) != len(block.out_dims):
        raise ChunkMismatchError(f"actoff: block {block.run.name!r} returned another structure in a re-run")
    outs, grads = [], []
    for leaf, dim, rows, grad in zip(leaves, block.out_dims, block.rows, out_grads, strict=True):
        if dim is None:
            continue
        expected = rows[start:stop]
        tolerance = (2e-2 if block.half else 1e-4) * (expected[:, 1] + expected[:, 1].mean() + 1e-30)
        if leaf.shape[dim] != stop - start or bool(
            ((row_sums(leaf, dim)[:, 0] - expected[:, 0]).abs() > tolerance).any()
        ):
            raise ChunkMismatchError(
                f"actoff: block {block.run.name!r} run again on tokens [{start}, {stop}) did not give the rows its "
                "forward gave: it mixes tokens outside attention, or changes between calls. Its gradients would "
                "be wrong; place it with 'checkpoint' or 'cpu' (Note [chunked backward])."
            )
        if grad is not None and leaf.requires_grad:
            outs.append(leaf)
            grads.append(grad.narrow(dim, start, stop - start))
    return outs, grads


def _probe_length(block: Block, values: list[Any]) -> int:
    """Up to ``2 x chunk`` tokens, at a length that no other dimension of an input has: the
    probe's chunks must tell the token dimension apart (rotary tables ``(S, head_dim)``)."""
    shapes = []
    for tensor in (value for value in values if isinstance(value, torch.Tensor)):
        dim = token_dim(tensor, block.seq_len, block.token_dim)
        shapes.append([n for i, n in enumerate(tensor.shape) if i != dim])
    length = min(block.seq_len, 2 * block.chunk)
    while length > 1 and any(length in shape for shape in shapes):
        length -= 1
    return length


def _probe(block: Block, values: list[Any], out_grads: list[torch.Tensor | None]) -> None:
    """The first ``2 x chunk`` tokens' gradients, whole and in two chunks (Note [the chunked probe])."""
    length = _probe_length(block, values)
    if length < 2:
        return
    short = dataclasses.replace(block, seq_len=length, chunk=(length + 1) // 2)
    prefix, leaves = block.sliced(values, 0, length)
    short_grads = [
        None if g is None else g.narrow(d, 0, length) for g, d in zip(out_grads, block.out_dims, strict=True)
    ]
    unchunked = _run_and_take(short, prefix, leaves, short_grads)
    if unchunked is None:
        return
    chunked = _chunks(short, [v.detach() if isinstance(v, torch.Tensor) else v for v in prefix], short_grads)
    rows = [
        (what, torch.zeros_like(wanted) if got is None else got, wanted)
        for what, got, wanted in zip(
            ["an input"] * len(leaves) + ["a weight"] * len(block.params),
            [chunked.inputs[i] for i in block.grads_for] + chunked.params,
            unchunked,
            strict=True,
        )
        if wanted is not None
    ]
    # A gradient that is zero in exact arithmetic (a key projection's bias: softmax does not see a
    # shift of a query's scores) is rounding noise either way: in float32 it is held to a hundredth
    # of the block's largest gradient, not to its own noise. Not in half precision, where that
    # floor (2.3e-4 of the largest) let a token shift behind a gate of 0.14% of it pass (a
    # review's reproducer): there such a block is refused, as before.
    largest = max((wanted.detach().abs().max().item() for _, _, wanted in rows), default=0.0)
    floor = 0.0 if block.half else 1e-2 * largest
    for what, got, wanted in rows:
        scale = max(wanted.detach().abs().max().item(), floor)
        # Reassociation: float32 sums in another order (1e-4 of the largest entry, 5e-7 seen);
        # half precision: each chunk's product rounded once more (6 roundings of 2**-8).
        if (got - wanted).abs().max().item() > (6 * 2**-8 if block.half else 1e-4) * scale + 1e-12:
            raise ChunkMismatchError(
                f"actoff: block {block.run.name!r} gives other gradients for {what} when its first {length} tokens "
                f"run in two chunks than when they run whole: it mixes tokens outside attention (a shift, a "
                "convolution, a running sum) or changes between calls. Place it with 'checkpoint' or 'cpu' "
                "(Note [the chunked probe])."
            )
