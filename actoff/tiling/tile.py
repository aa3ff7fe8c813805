"""Tiled token-local modules: `tile_` runs an MLP, a norm or a projection chunk by chunk along the tokens.

Offloading what autograd saves does not bound the *working* memory of one module: at 500K
tokens one 8B MLP's intermediate is ~14 GB per tensor while it is computed. A tiled module
computes its output one token chunk at a time and keeps nothing of a chunk but its share of
the output, so the peak is one chunk's intermediates (as Snowflake ALST's TiledMLP does).

Note [tiled recompute]: `_TiledFunction` saves only the module's input (and its pass-through
arguments) through ``ctx.save_for_backward``, so inside an offload scope the policy places
it like any other saved tensor. Forward runs each chunk under ``no_grad`` into a preallocated
output. Backward recomputes each chunk with grad enabled, under the autocast settings and the
RNG state of its forward (so a dropout mask is drawn again, identically), differentiates it,
writes that chunk's rows of the input gradient and adds its parameter gradients to a sum
over chunks. Rows of the input gradient do not mix across tokens, so they equal the untiled
module's up to the matrix kernels' choice for the row count; parameter gradients are sums
over chunks and differ by float reassociation.

Note [token-local check]: tiling is only right for a module whose output row t depends on
input row t alone. The first call checks it on a small window: rows [h, w) computed with and
without rows [0, h) before them must agree (a causal mixer, a mean over tokens or positions
built from ``arange`` inside the module all fail). A module that draws random numbers (dropout)
is checked in eval mode, since two calls never draw the same mask.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from actoff.config import Config, get_config
from actoff.module_classes import ModuleClasses, class_matcher, nothing_matched

from .chunking import AutocastState, RngState, check_chunking, chunk_bounds, let_go_landed

__all__ = ["tile_"]

_SPEC_ATTR = "_actoff_tile"
_CHECK_TOKENS = 16  # rows of the token-local check: small next to any chunk, enough to see mixing
# Largest relative difference between rows computed with and without the rows before them
# that still counts as token-local: matrix kernels chosen by row count reassociate sums.
_PROBE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
_PROBE_TOLERANCE_HALF = 5e-2  # bfloat16 and float16: a few units in the last place


class _TileSpec:
    """One tiled module's settings: its name, how to chunk, and the forward it wraps."""

    def __init__(
        self,
        name: str,
        chunks: int | None,
        max_tokens: int | None,
        token_dim: int,
        inner: Callable[..., Any] | None,
    ) -> None:
        self.name = name
        self.chunks = chunks
        self.max_tokens = max_tokens
        self.token_dim = token_dim
        self.inner = inner  # a previous instance forward (e.g. an offload scope), else the class's
        self.checked = False  # Note [token-local check] passed

    def forward_of(self, module: torch.nn.Module) -> Callable[..., Any]:
        return self.inner if self.inner is not None else types.MethodType(type(module).forward, module)

    def describe(self, module: torch.nn.Module) -> str:
        return f"{self.name} ({type(module).__name__})"


class _TiledCall:
    """What one call of a tiled module needs in forward and again in backward."""

    def __init__(
        self,
        module: torch.nn.Module,
        spec: _TileSpec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        length: int,
    ) -> None:
        self.module = module
        self.spec = spec
        self.forward = spec.forward_of(module)
        self.dim = spec.token_dim
        self.bounds = chunk_bounds(length, chunks=spec.chunks, max_tokens=spec.max_tokens)
        # Pass-through arguments (everything but the first): tensors among them are saved for
        # backward (so the offload policy places them too); the rest are kept as they are.
        self.leaves, self.treespec = tree_flatten((args[1:], kwargs))
        self.tensor_slots = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.grad_slots = [i for i in self.tensor_slots if self.leaves[i].requires_grad]
        self.autocast: AutocastState | None = None
        self.rng: list[RngState] = []

    def call(self, rows: torch.Tensor, leaves: list[Any]) -> Any:
        rest, kwargs = tree_unflatten(leaves, self.treespec)
        # A chunk of a (B, S, H) input along S is strided when B > 1, and modules flatten their
        # input with .view (Hugging Face's mixture-of-experts blocks): hand them rows of their own,
        # as an untiled call with a contiguous input would see.
        return self.forward(rows.contiguous(), *rest, **kwargs)

    def forward_chunks(self, x: torch.Tensor, *, keep_rng: bool) -> torch.Tensor:
        out = None
        for start, stop in self.bounds:
            let_go_landed()  # Note [let go as copies land] in actoff.runtime.step
            if keep_rng:
                self.rng.append(RngState.capture(x.device))
            piece = self.call(x.narrow(self.dim, start, stop - start), self.leaves)
            if not isinstance(piece, torch.Tensor):
                raise TypeError(
                    f"actoff.tile_: {self.spec.describe(self.module)} returned {type(piece).__name__}; "
                    "a tiled module must return one tensor"
                )
            if out is None:
                shape = list(piece.shape)
                shape[self.dim] = x.shape[self.dim]
                out = piece.new_empty(shape)  # (B, S, H): the only full-length tensor a chunk writes
            out.narrow(self.dim, start, stop - start).copy_(piece)
        assert out is not None  # bounds is never empty: the length was checked
        return out


class _TiledFunction(torch.autograd.Function):
    """Forward chunk by chunk under no_grad; backward recomputes and differentiates each chunk.

    Inputs: the call, the token-major input, the trainable parameters, then the pass-through
    tensors that require grad (their gradients are summed over chunks).
    """

    @staticmethod
    def forward(ctx: Any, call: _TiledCall, x: torch.Tensor, *grad_inputs: torch.Tensor) -> torch.Tensor:
        call.autocast = AutocastState.capture(x.device)
        out = call.forward_chunks(x, keep_rng=True)
        ctx.call = call
        ctx.save_for_backward(x, *(call.leaves[i] for i in call.tensor_slots))
        for slot in call.tensor_slots:  # only the saved copies may keep them: the policy places those
            call.leaves[slot] = None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _TiledCall = ctx.call
        x, *saved = ctx.saved_tensors
        leaves = list(call.leaves)
        for slot, tensor in zip(call.tensor_slots, saved, strict=True):
            # A fresh leaf per pass-through tensor that needs a gradient: the recompute's graph
            # ends there instead of running into the caller's graph.
            leaves[slot] = tensor.detach().requires_grad_(True) if slot in call.grad_slots else tensor
        wants_x = ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if wants_x else None
        targets = [*call.params, *(leaves[i] for i in call.grad_slots)]
        sums: list[torch.Tensor | None] = [None] * len(targets)
        assert call.autocast is not None
        for (start, stop), rng in zip(call.bounds, call.rng, strict=True):
            let_go_landed()
            rows = x.narrow(call.dim, start, stop - start).detach().requires_grad_(wants_x)
            with torch.enable_grad(), call.autocast.restore(), rng.restore():
                piece = call.call(rows, leaves)
            inputs = ([rows] if wants_x else []) + targets
            grads = torch.autograd.grad(
                piece, inputs, grad_out.narrow(call.dim, start, stop - start), allow_unused=True
            )
            if wants_x:
                grad_x.narrow(call.dim, start, stop - start).copy_(grads[0])  # type: ignore[union-attr]
                grads = grads[1:]
            for index, grad in enumerate(grads):
                if grad is None:
                    continue
                # Sum in float32 at least: bf16 parameters would lose the small chunks' terms.
                if sums[index] is None:
                    sums[index] = grad.to(torch.promote_types(grad.dtype, torch.float32), copy=True)
                else:
                    sums[index].add_(grad)  # type: ignore[union-attr]
        grads_out = [None if s is None else s.to(t.dtype) for s, t in zip(sums, targets, strict=True)]
        return (None, grad_x, *grads_out)


def _run_tiled(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    spec: _TileSpec = module.__dict__[_SPEC_ATTR]
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"actoff.tile_: {spec.describe(module)} was called without a tensor as its first positional "
            "argument; a tiled module splits its first argument along the tokens, so pass it positionally"
        )
    if x.dim() <= spec.token_dim:
        raise ValueError(
            f"actoff.tile_: {spec.describe(module)} got an input of shape {tuple(x.shape)}, which has no "
            f"token dimension {spec.token_dim}; set token_dim= (1 for (B, S, H), 0 for (S, B, H))"
        )
    length = x.shape[spec.token_dim]
    if length == 0:
        return spec.forward_of(module)(*args, **kwargs)
    call = _TiledCall(module, spec, args, kwargs, length)
    if not spec.checked:
        spec.checked = _check_token_local(call, x)
    grad_inputs = [*call.params, *(call.leaves[i] for i in call.grad_slots)]
    if not torch.is_grad_enabled() or not (x.requires_grad or grad_inputs):
        with torch.no_grad():  # nothing to differentiate: chunked forward only
            return call.forward_chunks(x, keep_rng=False)
    return _TiledFunction.apply(call, x, *grad_inputs)


def _tiled_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _run_tiled(self, args, kwargs)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for sub, training in modes:
            sub.training = training


def _check_token_local(call: _TiledCall, x: torch.Tensor) -> bool:
    """Note [token-local check]. True once checked; False if the input is too short to check."""
    dim, length = call.dim, x.shape[call.dim]
    if length < 2:
        return False
    window = min(length, _CHECK_TOKENS)
    half = window // 2
    what = call.spec.describe(call.module)
    rng = RngState.capture(x.device)

    def rows_with_and_without_prefix() -> tuple[Any, Any]:
        whole = call.call(x.narrow(dim, 0, window), call.leaves)
        tail = call.call(x.narrow(dim, half, window - half), call.leaves)
        return whole, tail

    try:
        with torch.no_grad(), rng.restore():  # the check leaves the caller's RNG stream untouched
            whole, tail = rows_with_and_without_prefix()
            if not rng.same_as(RngState.capture(x.device)):
                with _eval_mode(call.module):  # dropout: two calls never draw the same mask
                    whole, tail = rows_with_and_without_prefix()
    except Exception as error:
        raise ValueError(
            f"actoff.tile_: {what} failed on a slice of its tokens ({type(error).__name__}: {error}). "
            f"tile_ splits only the first argument along dim {dim} and passes the others whole, so a "
            "module with other token-aligned arguments (a mask, positions) cannot be tiled; leave it out"
        ) from error
    for result in (whole, tail):
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"actoff.tile_: {what} returned {type(result).__name__}; a tiled module must "
                "return one tensor"
            )
    if tail.dim() <= dim or whole.shape[dim] != window or tail.shape[dim] != window - half:
        raise ValueError(
            f"actoff.tile_: {what} is not token-local: for {window} input rows along dim {dim} it returned "
            f"shape {tuple(whole.shape)}; a tiled module must return one output row per input row"
        )
    expected = whole.narrow(dim, half, window - half).float()
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    difference = ((tail.float() - expected).abs().max() / scale).item()
    tolerance = _PROBE_TOLERANCE.get(whole.dtype, _PROBE_TOLERANCE_HALF)
    if not difference <= tolerance:  # NaN fails too
        raise ValueError(
            f"actoff.tile_: {what} is not token-local: output rows {half}..{window} along dim {dim} change "
            f"(max relative difference {difference:.3g} > {tolerance:g}) when the rows before them are left "
            "out. Tiling computes each token chunk on its own, so only modules whose output row t depends "
            "on input row t alone (MLPs, norms, projections) can be tiled: leave this module out of "
            "tile_()'s module_cls / filter_fn (attention mixes tokens: offload it instead)"
        )
    return True


def _resolve(chunks: int | None, max_tokens: int | None, config: Config) -> tuple[int | None, int | None]:
    if chunks is not None or max_tokens is not None:  # tile_() arguments win over the settings
        return check_chunking(chunks, max_tokens, what="tile_()")
    if config.tile_chunks is None and config.tile_max_tokens is None:
        raise TypeError(
            "tile_() needs chunks=N or max_tokens=N, or one of ACTOFF_TILE_CHUNKS / ACTOFF_TILE_MAX_TOKENS "
            "(Config.tile_chunks / Config.tile_max_tokens)"
        )
    return config.tile_chunks, config.tile_max_tokens


def tile_(
    model: torch.nn.Module,
    *,
    module_cls: ModuleClasses | None = None,
    filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
    chunks: int | None = None,
    max_tokens: int | None = None,
    token_dim: int | None = None,
    config: Config | None = None,
) -> torch.nn.Module:
    """Run every matching token-local submodule of ``model`` chunk by chunk along the tokens,
    in place; return ``model``.

    Give exactly one of ``module_cls`` or ``filter_fn(module, qualified_name) -> bool``.
    ``module_cls`` is a class (``LlamaMLP``), a class name (``"LlamaMLP"``) or a list of them, as
    `offload_`'s ``block_cls``. Give one of ``chunks`` (split the tokens into N nearly equal
    parts) or ``max_tokens`` (at most N positions along ``token_dim`` per chunk; with a batch
    of B that is B × N rows); without either, ``ACTOFF_TILE_CHUNKS`` /
    ``ACTOFF_TILE_MAX_TOKENS`` from ``config`` (default: `actoff.get_config`) apply.
    ``token_dim`` defaults to the config's (1 for ``(B, S, H)``).

    A tiled module's working memory is one chunk's intermediates; only its input is saved for
    backward, where each chunk is recomputed (Note [tiled recompute]). The first positional
    argument is split; the others pass through whole. The first call refuses, naming the
    module, one that is not token-local. A module that draws random numbers (dropout) gets the
    same numbers again when its chunks are recomputed; its mask then depends on the chunking.
    A matched module's own submodules are not tiled again.

    Example:
        >>> import torch, actoff
        >>> from actoff.reference import MLP, ModelConfig, Transformer
        >>> model = Transformer(ModelConfig.preset("tiny"))
        >>> _ = actoff.tile_(model, module_cls=MLP, chunks=4)
        >>> model.loss(torch.randint(0, 256, (2, 33))).backward()
        >>> model.layers[0].mlp.up_proj.weight.grad.shape
        torch.Size([176, 64])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tile_() takes an nn.Module, got {type(model).__name__}")
    if (module_cls is None) == (filter_fn is None):
        raise TypeError("tile_() needs exactly one of module_cls=... or filter_fn=(module, name) -> bool")
    config = config if config is not None else get_config()
    if not isinstance(config, Config):
        raise TypeError(f"tile_(config=...) expects an actoff.Config, got {type(config).__name__}")
    chunks, max_tokens = _resolve(chunks, max_tokens, config)
    token_dim = config.token_dim if token_dim is None else config.replace(token_dim=token_dim).token_dim
    matches = class_matcher(module_cls, "tile_(module_cls=...)") if module_cls is not None else filter_fn
    tiled: list[str] = []
    for qualified, module in model.named_modules():
        if any(qualified.startswith(prefix + ".") or prefix == "" for prefix in tiled):
            continue  # inside a tiled module: its chunks are small already
        if not matches(module, qualified):  # type: ignore[misc]
            continue
        previous = module.__dict__.get(_SPEC_ATTR)
        inner = previous.inner if previous is not None else module.__dict__.get("forward")
        name = qualified or type(module).__name__
        module.__dict__[_SPEC_ATTR] = _TileSpec(name, chunks, max_tokens, token_dim, inner)
        module.forward = types.MethodType(_tiled_forward, module)
        tiled.append(qualified)
    if not tiled:
        what = f"module_cls={module_cls!r}" if module_cls is not None else "filter_fn"
        raise nothing_matched("tile_", model, what, "tiled")
    return model


def tiled_chunk_count(module: torch.nn.Module, length: int) -> int:
    """How many chunks a tiled ``module`` splits ``length`` tokens into (0 if it is not tiled).

    >>> import torch, actoff
    >>> mlp = actoff.tile_(torch.nn.Linear(4, 4), module_cls=torch.nn.Linear, max_tokens=3)
    >>> tiled_chunk_count(mlp, 10)
    4
    """
    spec = module.__dict__.get(_SPEC_ATTR)
    if spec is None:
        return 0
    return len(chunk_bounds(length, chunks=spec.chunks, max_tokens=spec.max_tokens)) if length else 0
