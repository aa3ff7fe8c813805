"""Chunked LM-head cross-entropy: the loss of a causal LM without ever holding the full logits.

At 500K tokens the logits of a 128K vocabulary are ~128 GB in float16 (twice that once upcast
to float32 for the loss). `chunked_cross_entropy` computes head and loss one token chunk at a
time and keeps only the hidden states; `chunked_loss_` makes a Hugging Face causal LM use it.

Note [chunked loss]: `_ChunkedCrossEntropy` saves the hidden states (through
``ctx.save_for_backward``), the labels and the head. Forward computes each chunk's logits
under ``no_grad``, upcasts them to float32 and adds the chunk's summed cross-entropy.
Backward recomputes each chunk's logits with grad enabled (under the forward's autocast
settings), differentiates the chunk's loss, writes that chunk's rows of the hidden-state
gradient and adds its head-weight gradient to a float32 sum. Labels are shifted and ignored
exactly as Hugging Face's ``ForCausalLMLoss`` does (pad with ``ignore_index``, take
``[..., 1:]``; divide the sum by the non-ignored count or ``num_items_in_batch``).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.nn.functional as F

from .chunking import AutocastState, check_chunking, chunk_bounds, let_go_landed

__all__ = ["chunked_cross_entropy", "chunked_loss_"]

_SPEC_ATTR = "_actoff_chunked_loss"


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        bounds: list[tuple[int, int]],
        ignore_index: int,
    ) -> torch.Tensor:
        # hidden (N, H), weight (V, H), bias (V,) or None, labels (N,)
        autocast = AutocastState.capture(hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, stop in bounds:
            let_go_landed()  # Note [let go as copies land] in actoff.runtime.step
            logits = F.linear(hidden[start:stop], weight, bias)  # (n, V): one chunk's logits
            total += F.cross_entropy(
                logits.float(), labels[start:stop], ignore_index=ignore_index, reduction="sum"
            )
        ctx.autocast, ctx.bounds, ctx.ignore_index = autocast, bounds, ignore_index
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, labels, *([bias] if bias is not None else []))
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, *rest = ctx.saved_tensors
        bias = rest[0] if ctx.has_bias else None
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None  # (N, H)
        # Float32 sums: a bf16 head would lose the later chunks' small terms.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_weight else None  # (V, H)
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants_bias else None  # (V,)
        # Fresh leaves: the recompute's graph ends at them, not in the caller's graph.
        weight_leaf = weight.detach().requires_grad_(wants_weight)
        bias_leaf = bias.detach().requires_grad_(wants_bias) if bias is not None else None
        for start, stop in ctx.bounds:
            let_go_landed()
            rows = hidden[start:stop].detach().requires_grad_(wants_hidden)  # (n, H)
            with torch.enable_grad(), ctx.autocast.restore():
                logits = F.linear(rows, weight_leaf, bias_leaf)  # (n, V)
                loss = F.cross_entropy(
                    logits.float(), labels[start:stop], ignore_index=ctx.ignore_index, reduction="sum"
                )
            inputs = [
                t
                for t, wanted in ((rows, wants_hidden), (weight_leaf, wants_weight), (bias_leaf, wants_bias))
                if wanted
            ]
            grads = list(torch.autograd.grad(loss, inputs, grad_total))
            if wants_hidden:
                grad_hidden[start:stop] = grads.pop(0)  # type: ignore[index]
            if wants_weight:
                grad_weight.add_(grads.pop(0))  # type: ignore[union-attr]
            if wants_bias:
                grad_bias.add_(grads.pop(0))  # type: ignore[union-attr]
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),  # type: ignore[union-attr]
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunks: int | None = None,
    max_tokens: int | None = None,
    ignore_index: int = -100,
    shift: bool = True,
    bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` against ``labels``, computed over
    token chunks so that only one chunk's logits ever exist (in forward and in backward).

    ``hidden`` is ``(..., S, H)`` and ``labels`` ``(..., S)`` (e.g. ``(B, S, H)`` and ``(B, S)``);
    ``weight`` is the head's ``(V, H)``. With ``shift=True`` token t predicts label t+1, as in
    Hugging Face (``labels`` padded with ``ignore_index`` and taken from 1 on); with
    ``shift=False`` labels are used as given. Logits are upcast to float32 for the loss; the
    result is the float32 mean over labels that are not ``ignore_index`` (NaN if all are, as in
    torch), or the sum divided by ``num_items_in_batch`` when given. Give one of ``chunks``
    (nearly equal parts of the B×S tokens) or ``max_tokens`` (rows of logits per chunk).

    Example:
        >>> import torch, actoff
        >>> hidden = torch.randn(2, 16, 8, requires_grad=True)
        >>> head = torch.nn.Linear(8, 32, bias=False)
        >>> labels = torch.randint(0, 32, (2, 16))
        >>> loss = actoff.chunked_cross_entropy(hidden, head.weight, labels, chunks=4)
        >>> full = torch.nn.functional.cross_entropy(head(hidden)[:, :-1].reshape(-1, 32), labels[:, 1:].reshape(-1))
        >>> torch.allclose(loss, full)
        True
    """
    chunks, max_tokens = check_chunking(chunks, max_tokens, what="chunked_cross_entropy()")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"chunked_cross_entropy(): hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not "
            "match: expected hidden (..., S, H) and labels (..., S)"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"chunked_cross_entropy(): weight {tuple(weight.shape)} is not (V, H) with H = {hidden.shape[-1]}"
        )
    if shift:  # Hugging Face's ForCausalLMLoss: pad, then shift, so hidden is never sliced (copied)
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    labels = labels.reshape(-1).to(hidden.device)  # (N,)
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H): a view when hidden is contiguous
    bounds = chunk_bounds(labels.numel(), chunks=chunks, max_tokens=max_tokens)
    total = _ChunkedCrossEntropy.apply(hidden, weight, bias, labels, bounds, ignore_index)
    if num_items_in_batch is None:
        return total / (labels != ignore_index).sum()  # the mean of F.cross_entropy, NaN when 0/0
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class _LossSpec:
    """A wrapped causal LM's settings and the forward it wraps."""

    def __init__(
        self,
        chunks: int | None,
        max_tokens: int | None,
        ignore_index: int,
        inner: Any,
        labels_position: int | None,
    ) -> None:
        self.chunks = chunks
        self.max_tokens = max_tokens
        self.ignore_index = ignore_index
        self.inner = inner  # a previous instance forward, else None: the class's
        self.labels_position = labels_position  # index of ``labels`` among positional arguments


def _chunked_loss_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    spec: _LossSpec = self.__dict__[_SPEC_ATTR]
    forward = spec.inner if spec.inner is not None else types.MethodType(type(self).forward, self)
    args = list(args)  # type: ignore[assignment]
    labels = kwargs.pop("labels", None)
    if labels is None and spec.labels_position is not None and len(args) > spec.labels_position:
        labels, args[spec.labels_position] = args[spec.labels_position], None  # type: ignore[index]
    shift_labels = kwargs.get("shift_labels")
    if labels is None and shift_labels is None:
        return forward(*args, **kwargs)  # no loss wanted (generation, evaluation): real logits
    head = self.lm_head
    captured: list[torch.Tensor] = []  # the hidden states lm_head was called with
    placeholders: list[torch.Tensor] = []

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        # A (..., 0) placeholder stands in for the logits and costs nothing. If it is not the
        # very tensor that comes back as `logits`, the model transformed the logits.
        captured.append(hidden)
        placeholders.append(hidden.new_empty((*hidden.shape[:-1], 0)))
        return placeholders[-1]

    want_tuple = not kwargs.get("return_dict", getattr(getattr(self, "config", None), "return_dict", True))
    if want_tuple:
        kwargs["return_dict"] = True
    previous = head.__dict__.get("forward")
    head.forward = capture
    try:
        output = forward(*args, **kwargs)
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
    name = type(self).__name__
    if len(captured) != 1:
        raise RuntimeError(
            f"chunked_loss_: {name}.forward called lm_head {len(captured)} times; expected once"
        )
    if getattr(output, "logits", None) is not placeholders[0]:
        raise RuntimeError(
            f"chunked_loss_: {name} changes the logits after lm_head (softcapping, scaling) or does not "
            "return them; the chunked loss would skip that: remove chunked_loss_ from this model"
        )
    hidden = captured[0]
    loss = chunked_cross_entropy(
        hidden,
        head.weight,
        labels if shift_labels is None else shift_labels,
        chunks=spec.chunks,
        max_tokens=spec.max_tokens,
        ignore_index=spec.ignore_index,
        shift=shift_labels is None,
        bias=head.bias,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
    )
    fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
    result = type(output)(loss=loss, logits=None, **fields)
    return result.to_tuple() if want_tuple else result


def chunked_loss_(
    model: torch.nn.Module,
    *,
    chunks: int | None = None,
    max_tokens: int | None = None,
    ignore_index: int = -100,
) -> torch.nn.Module:
    """Make a Hugging Face causal LM compute its loss with `chunked_cross_entropy`, in place;
    return ``model``.

    For models with an ``lm_head`` (an ``nn.Linear``) whose ``forward(input_ids, ...,
    labels=...)`` returns a ``ModelOutput`` with ``loss`` and ``logits`` (``LlamaForCausalLM``
    and its kin). When ``labels`` (or ``shift_labels``) are given, the full logits are never
    computed: the output's ``loss`` is the chunked loss (equal to Hugging Face's
    ``ForCausalLMLoss``, ``num_items_in_batch`` included) and its ``logits`` is ``None``.
    Without labels the model runs unchanged. A model that transforms the logits after
    ``lm_head`` (Gemma-2's softcapping, Cohere's scaling) is refused on its first call with
    labels, since the chunked loss would skip that transform.

    Example:
        >>> import torch, actoff, transformers
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> model = actoff.chunked_loss_(transformers.LlamaForCausalLM(config), max_tokens=8)
        >>> tokens = torch.randint(0, 64, (1, 24))
        >>> output = model(input_ids=tokens, labels=tokens)
        >>> output.logits is None, output.loss.shape
        (True, torch.Size([]))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"chunked_loss_() takes an nn.Module, got {type(model).__name__}")
    chunks, max_tokens = check_chunking(chunks, max_tokens, what="chunked_loss_()")
    name = type(model).__name__
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        found = "no lm_head" if head is None else f"an lm_head of type {type(head).__name__}"
        raise TypeError(
            f"chunked_loss_() needs a causal LM with an nn.Linear lm_head; {name} has {found}. For another "
            "model, call actoff.chunked_cross_entropy(hidden, head.weight, labels, ...) on its hidden states"
        )
    loss_function = getattr(type(model), "loss_function", None)
    if loss_function is not None:
        loss_name = getattr(getattr(model, "loss_function", None), "__name__", None)
        if loss_name not in (None, "ForCausalLMLoss"):
            raise TypeError(
                f"chunked_loss_(): {name} computes its loss with {loss_name}, not the causal-LM "
                "cross-entropy (ForCausalLMLoss) that the chunked loss reproduces"
            )
    previous = model.__dict__.get(_SPEC_ATTR)
    inner = previous.inner if previous is not None else model.__dict__.get("forward")
    try:
        parameters = list(inspect.signature(type(model).forward).parameters)
        labels_position = parameters.index("labels") - 1  # minus self
    except (TypeError, ValueError):
        labels_position = None
    model.__dict__[_SPEC_ATTR] = _LossSpec(chunks, max_tokens, ignore_index, inner, labels_position)
    model.forward = types.MethodType(_chunked_loss_forward, model)
    return model
