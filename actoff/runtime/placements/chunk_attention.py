"""Attention in a chunked block's runs (Note [chunked backward] in
actoff.runtime.placements.chunked): the forward's watch, which refuses a block that cannot run in
token chunks, and the backward's, which takes attention's keys and values or serves a chunk's
attention against every key up to its end."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.overrides import TorchFunctionMode

from actoff.rerun.dropout import dropout_call
from actoff.rerun.state import RngState

__all__ = ["ChunkMismatchError", "ChunkMode", "ChunkedShapeError", "KeysTaken", "Watch"]

_ATTENTION = F.scaled_dot_product_attention
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class ChunkedShapeError(ValueError):
    """A block the chunked placement cannot run in token chunks (Note [chunked backward])."""


class ChunkMismatchError(RuntimeError):
    """A chunk's re-run did not give the forward's rows (Note [chunked backward])."""


class KeysTaken(BaseException):
    """Ends a keys-pass run at attention: the rest of the block is not needed."""


def _attention_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = {**dict(zip(_SDPA_NAMES, args, strict=False)), **kwargs}
    bound.setdefault("attn_mask", None)
    bound.setdefault("dropout_p", 0.0)
    bound.setdefault("is_causal", False)
    bound.setdefault("scale", None)
    bound.setdefault("enable_gqa", False)
    return bound


class Watch(TorchFunctionMode):
    """The forward: notes attention's calls and refuses what cannot run in chunks.

    As a survey (``survey=True``: the auto policy's measuring forward, which runs with grad) it
    raises nothing: the first refusal is kept in ``refused``, attention's key and value bytes and
    its one autograd node's in ``kv_bytes`` and ``node_bytes`` (Note [the chunked placement in the
    plan] in actoff.budget), and only leaves are checked for gradients (every result of a forward
    with grad takes them)."""

    def __init__(self, name: str, seq_len: int, known: list[torch.Tensor], *, survey: bool = False) -> None:
        super().__init__()
        self.name, self.seq_len, self.calls, self.survey = name, seq_len, 0, survey
        self.known = {id(tensor) for tensor in known}  # the inputs and weights it takes gradients for
        self.refused: str | None = None
        self.kv_bytes = self.node_bytes = 0
        self.rng: RngState | None = None  # a survey's: the generators before the forward

    def refuse(self, found: str) -> ChunkedShapeError:
        return ChunkedShapeError(
            f"actoff: block {self.name!r} cannot run its backward in token chunks: {found}. The chunked "
            "placement needs one causal scaled_dot_product_attention over the block's own tokens, without "
            "a mask or dropout, and token-local ops elsewhere (Note [chunked backward]); place this block "
            "with 'checkpoint' or 'cpu' instead."
        )

    def object_to(self, found: str) -> None:
        """Refuse ``found``: raised, or kept as a survey's first (``refused``)."""
        if not self.survey:
            raise self.refuse(found)
        self.refused = self.refused or found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ATTENTION:
            self._attention(_attention_args(args, kwargs))
        elif dropout_call(func, args, kwargs) is not None:
            self.object_to("it draws dropout in training")
        # Its gradients are taken for the block's inputs and parameters only: any other tensor that
        # takes gradients (a weight of another module, reached past the block's own) would get none.
        # A survey's forward runs with grad: a view made under no_grad there (a tiled module's check
        # of its rows) reports requires_grad as a leaf would, and nothing reaches it through this call.
        quiet = self.survey and not torch.is_grad_enabled()
        for value in pytree.tree_leaves((args, kwargs)):
            if (
                isinstance(value, torch.Tensor)
                and value.requires_grad
                and (value.is_leaf or not self.survey)
                and id(value) not in self.known
                and id(value._base) not in self.known  # a view of a weight (an expert's, transposed)
                and not (quiet and value._base is not None)
            ):
                self.object_to(
                    f"it uses a tensor of shape {list(value.shape)} that takes gradients and is neither an "
                    "input nor a parameter of the block"
                )
        return func(*args, **kwargs)

    def _attention(self, bound: dict[str, Any]) -> None:
        self.calls += 1
        if self.calls > 1:
            self.object_to("it calls scaled_dot_product_attention more than once")
        q, k, v = (bound[name] for name in ("query", "key", "value"))
        # One query against one key is causal either way: transformers' SDPA call passes
        # is_causal only for more than one query, as a chunk of one token has.
        one = q.shape[-2] == 1 and k.shape[-2] == 1
        if bound["attn_mask"] is not None or not (bound["is_causal"] or one):
            self.object_to("its attention is not causal, or has an explicit mask (padding, packing)")
        if bound["dropout_p"]:
            self.object_to(f"its attention has dropout (p={bound['dropout_p']})")
        lengths = {t.shape[-2] for t in (q, k, v)}
        if lengths != {self.seq_len}:
            self.object_to(
                f"its attention's sequences are {sorted(lengths)} long, the block's {self.seq_len}"
            )
        self.kv_bytes = sum(t.numel() * t.element_size() for t in (k, v))  # as the keys pass keeps them
        # Its node saves q, k, v and its output in the dtype it computes in (autocast's, where on);
        # the gradients of q, k, v come back in their own dtypes, the output's in the computed one.
        device = q.device.type
        size = (
            torch.get_autocast_dtype(device).itemsize
            if torch.is_autocast_enabled(device)
            else q.element_size()
        )
        out = q.numel() // max(q.shape[-1], 1) * v.shape[-1]
        grads = sum(t.numel() * t.element_size() for t in (q, k, v))
        self.node_bytes = (q.numel() + k.numel() + v.numel() + 2 * out) * size + grads

    def finish(self, rng: RngState | None) -> None:
        """After the forward: a block that called attention not exactly once is refused, and one
        that drew random numbers since ``rng`` (`random`)."""
        if self.calls != 1:
            self.object_to("it does not call scaled_dot_product_attention")
        self.random(rng)

    def random(self, rng: RngState | None) -> None:
        """A block that drew random numbers since ``rng`` is refused: its runs in chunks would draw
        others (dropout of another kind, noise, a layer dropped at random)."""
        if rng is not None and rng.drawn_since():
            self.object_to("it draws random numbers in its forward")


class ChunkMode(TorchFunctionMode):
    """A re-run on tokens ``[start, stop)``: attention's keys and values written into ``keys`` and
    ``values`` (the keys pass: the run then ends), or attention served from the chunk's queries
    against their rows up to ``stop``, as leaves (``served``; Note [chunked backward]). Given
    ``into``, full-length buffers for the keys' and values' gradients, the two-call attention adds
    its key and value gradients there in backward and gives the leaves none (Note [a chunk's key
    gradients in place])."""

    def __init__(
        self,
        start: int,
        stop: int,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.start, self.stop, self.keys, self.values, self.into = start, stop, keys, values, into
        self.taken: tuple[torch.Tensor, torch.Tensor] | None = None  # this chunk's k, v
        self.served: list[torch.Tensor] = []  # the leaves attention read: keys and values up to stop

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _ATTENTION:
            return func(*args, **kwargs)
        bound = _attention_args(args, kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        self.taken = (k, v)
        if self.keys is None:
            raise KeysTaken
        # The chunk's own rows too: the keys pass wrote them, the same kernels on the same rows.
        k, v = (t[..., : self.stop, :].detach().requires_grad_() for t in (self.keys, self.values))
        self.served = [k, v]
        device = q.device.type
        if torch.is_autocast_enabled(device):  # as autocast casts them for the forward's call
            dtype = torch.get_autocast_dtype(device)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        extra = {"scale": bound["scale"], "enable_gqa": bound["enable_gqa"]}
        if not self.start:
            return _ATTENTION(q, k, v, is_causal=True, **extra)
        if q.device.type == "cuda":
            return _lower_right_kernel(q, k, v, self.stop - self.start, extra)
        if q.device.type == "cpu" and _flash_takes(q, k, v, extra["enable_gqa"]):  # its kernels: CPU only
            return _CausalTail.apply(q, k, v, {**extra, "into": self.into})
        return _RowBlocks.apply(q, k, v, extra)


def _lower_right_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, extra: dict
) -> torch.Tensor:
    """The chunk's attention through PyTorch's lower-right causal bias, which its CUDA kernels take
    without a mask in memory. Grouped keys (``enable_gqa``) go as they are where the flash kernel
    takes the call (half precision on a recent GPU: it reads a key head for its query heads);
    the memory-efficient kernel does not take them, and SDPA would fall back to the math kernel,
    with rows x keys scores in memory, so there the keys and values are repeated per query head (their
    bytes, and their gradients', times the group size for the chunk's call: 32 KB per token of
    Llama-3.1-8B's keys up to the chunk's end). Its CUDA test passed on an H200 (2026-12-04,
    bf16 with grouped keys); which branch ran there was not recorded."""
    groups = q.shape[-3] // k.shape[-3]
    if (
        extra["enable_gqa"]
        and groups > 1
        and not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True))
    ):
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        extra = {**extra, "enable_gqa": False}
    # Imported here: the module pulls in Dynamo, a second of every `import actoff` otherwise.
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(rows, k.shape[-2])
    return _ATTENTION(q, k, v, attn_mask=mask, **extra)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    """Whether PyTorch's CPU flash kernels take these shapes as SDPA does: 4-D, rows contiguous
    in their last dimension, one batch size, one head size, as many key as value heads, as many query heads or (``gqa``) a multiple, a
    dtype they compute in (else `_RowBlocks`: 3-D or 5-D calls, value heads of another size as in
    multi-head latent attention, keys broadcast over the batch or the heads)."""
    tensors = (q, k, v)
    if not all(t.dim() == 4 and t.dtype in _FLASH_DTYPES and t.stride(-1) == 1 for t in tensors):
        return False
    heads, key_heads = q.shape[1], k.shape[1]
    return (
        len({t.shape[0] for t in tensors}) == 1
        and len({t.shape[-1] for t in tensors}) == 1
        and key_heads == v.shape[1]
        and (heads == key_heads or (gqa and heads % key_heads == 0))
    )


class _CausalTail(torch.autograd.Function):
    """Causal attention of the last rows of a sequence (queries ``q``, every key up to their last)
    where no kernel takes the lower-right bias (off CUDA, shapes `_flash_takes`), through PyTorch's
    CPU flash kernels (the ones SDPA dispatches to there) in two calls merged by their log-sum-exp
    (Note [a chunk's attention in two calls]). Their backward takes the merged output and
    log-sum-exp: attention is not run again in backward. Grouped keys (``enable_gqa``) are not
    repeated for the earlier keys: a key head's query heads are folded into the rows (`_folded`).
    The outputs are SDPA's on the same rows, and the gradients, up to float reassociation."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict) -> torch.Tensor:
        groups = q.shape[-3] // k.shape[-3] if extra["enable_gqa"] else 1
        rows, before = q.shape[-2], k.shape[-2] - q.shape[-2]
        if before < 1:  # the kernel over no keys leaves its rows unset: `ChunkMode` serves these whole
            raise ValueError(
                f"_CausalTail needs keys before the {rows} query rows; it got {k.shape[-2]} keys"
            )
        earlier, earlier_sum = _FLASH(
            _folded(q, 0, rows, groups), k[..., :before, :], v[..., :before, :], scale=extra["scale"]
        )
        own_k, own_v = (_repeated(t[..., before:, :], groups) for t in (k, v))
        own, own_sum = _FLASH(q, own_k, own_v, is_causal=True, scale=extra["scale"])
        earlier, earlier_sum = _unfolded(earlier, groups), _unfolded(earlier_sum.unsqueeze(-1), groups)
        logsumexp = torch.logaddexp(earlier_sum, own_sum.unsqueeze(-1))
        out = (
            earlier * (earlier_sum - logsumexp).exp() + own * (own_sum.unsqueeze(-1) - logsumexp).exp()
        ).to(q.dtype)
        logsumexp = logsumexp.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        ctx.scale, ctx.groups, ctx.into = extra["scale"], groups, extra.get("into")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v, out, logsumexp = ctx.saved_tensors
        groups, scale = ctx.groups, ctx.scale
        rows, before = q.shape[-2], k.shape[-2] - q.shape[-2]
        grad = grad.contiguous()
        folded = [_folded(t, 0, rows, groups) for t in (grad, q, out)]
        folded_sum = _folded(logsumexp.unsqueeze(-1), 0, rows, groups).squeeze(-1).contiguous()
        # Into the step's buffers (`ChunkMode`'s ``into``), else into this call's own.
        into = ctx.into if ctx.into is not None else (torch.empty_like(k), torch.empty_like(v))
        add = ctx.into is not None
        # The calls' query gradients summed in float32 at least.
        wide = torch.promote_types(q.dtype, torch.float32)
        grad_q = torch.zeros(q.shape, dtype=wide, device=q.device)
        for first in range(0, before, KEY_BLOCK):
            last = min(before, first + KEY_BLOCK)
            earlier = _FLASH_BACKWARD(
                *folded[:2],
                k[..., first:last, :],
                v[..., first:last, :],
                folded[2],
                folded_sum,
                0.0,
                False,
                scale=scale,
            )
            grad_q.add_(_unfolded(earlier[0], groups))
            _put(into, first, last, earlier[1], earlier[2], add)
            del earlier
        own_k, own_v = (_repeated(t[..., before:, :], groups) for t in (k, v))
        own = _FLASH_BACKWARD(grad, q, own_k, own_v, out, logsumexp, 0.0, True, scale=scale)
        grad_q = grad_q.add_(own[0]).to(q.dtype)
        _put(into, before, k.shape[-2], _summed(own[1], groups), _summed(own[2], groups), add)
        if add:
            return grad_q, None, None, None
        return grad_q, *into, None


def _put(
    into: tuple[torch.Tensor, torch.Tensor],
    first: int,
    last: int,
    dk: torch.Tensor,
    dv: torch.Tensor,
    add: bool,
) -> None:
    """Key and value gradients of keys ``[first, last)`` added to, or written into, ``into``."""
    for buffer, grad in zip(into, (dk, dv), strict=True):
        if add:
            buffer[..., first:last, :].add_(grad)
        else:
            buffer[..., first:last, :].copy_(grad)


#: Earlier keys per flash backward call of a chunk's attention (Note [a chunk's key gradients
#: in place]): the call's key and value gradients are this many keys' at most.
KEY_BLOCK = 2048

# Note [a chunk's key gradients in place]: a chunk's attention reads every key up to its end, so
# its backward gives gradients for all of them: returned whole, they were two full-length
# tensors (and two more where the earlier keys' and the chunk's own were joined) on top of the
# step's running sums of the key and value gradients, which `_chunks` then added them to: about
# 2.7 KB a token of the 128 MiB proxy's 10 at its peak. So the earlier keys go to the flash
# backward KEY_BLOCK at a time (with the merged output and log-sum-exp each call's rows are
# exact: the key gradients are the same sums, the query gradients add over the calls, in float32
# at least), and each call's key and value gradients are added straight into the running sums,
# the leaves of the chunk's keys getting none. Called apart (a test), the gradients are returned.


# Note [a chunk's attention in two calls]: a chunk's rows see every earlier token's key and their
# own keys causally. Off CUDA no kernel takes the lower-right causal bias without a mask in memory,
# and a kernel given a mask computes every score it masks. So the chunk's attention is two flash
# calls: the earlier keys, none masked (the query heads of a key head folded into the rows, so
# grouped keys are read as they are), and the chunk's own keys, causal from the top left (which
# for a square is the lower right; these keys are repeated per query head, a chunk's worth). Each
# gives its output and log-sum-exp; the chunk's is their mix weighted by exp(lse_i - lse), with
# lse = logaddexp(lse_1, lse_2). In backward each call's kernel takes the merged output and
# log-sum-exp, which is what its rows' softmax was normalised by: the query gradients add, and the
# key and value gradients are each call's own keys'. No score is computed that a row does not see.


def _repeated(keys: torch.Tensor, groups: int) -> torch.Tensor:
    """Key heads repeated for the ``groups`` query heads each serves (unchanged for 1)."""
    return keys if groups == 1 else keys.repeat_interleave(groups, dim=-3)


def _summed(grads: torch.Tensor, groups: int) -> torch.Tensor:
    """`_repeated`'s gradients summed back to one per key head."""
    return grads if groups == 1 else grads.unflatten(-3, (grads.shape[-3] // groups, groups)).sum(-3)


def _folded(rows: torch.Tensor, a: int, b: int, groups: int) -> torch.Tensor:
    """Rows ``[a, b)`` of ``(..., query heads, rows, dim)``, each key head's ``groups`` query heads
    folded into its rows: ``(..., key heads, groups x (b - a), dim)``."""
    heads = rows.shape[-3]
    return rows[..., a:b, :].unflatten(-3, (heads // groups, groups)).flatten(-3, -2)


def _unfolded(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """`_folded`'s rows back to ``(..., query heads, rows, dim)``."""
    return rows.unflatten(-2, (groups, rows.shape[-2] // groups)).flatten(-4, -3)


def _row_blocks(q: torch.Tensor, k: torch.Tensor, groups: int) -> list[tuple[int, int]]:
    """Blocks of query rows whose masks hold about a million entries each."""
    rows, step = q.shape[-2], max(16, 2**20 // (k.shape[-2] * groups))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


class _RowBlocks(torch.autograd.Function):
    """`_CausalTail` for the shapes the CPU flash kernels do not take (`_flash_takes`): SDPA by
    blocks of query rows, each with its boolean mask, and in backward each block run again and its
    gradients taken at once (attention's forward twice there)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict) -> torch.Tensor:
        ctx.extra = extra
        ctx.save_for_backward(q, k, v)
        return torch.cat(
            [_ATTENTION(*_masked_rows(q, k, v, a, b), **extra) for a, b in _row_blocks(q, k, 1)], dim=-2
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v = ctx.saved_tensors
        grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
        for a, b in _row_blocks(q, k, 1):
            *rows, mask = _masked_rows(q, k, v, a, b)
            leaves = [t.detach().requires_grad_() for t in rows]
            with torch.enable_grad():
                out = _ATTENTION(*leaves, mask, **ctx.extra)
            found = torch.autograd.grad(out, leaves, grad[..., a:b, :])
            grads[0][..., a:b, :].copy_(found[0])
            grads[1][..., : rows[1].shape[-2], :].add_(found[1])
            grads[2][..., : rows[2].shape[-2], :].add_(found[2])
        return (*grads, None)


def _masked_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: int, b: int
) -> tuple[torch.Tensor, ...]:
    """Query rows ``[a, b)`` of the last ``q`` rows, the keys and values they see, and their boolean mask."""
    keys = k.shape[-2] - q.shape[-2] + b
    mask = torch.ones(b - a, keys, dtype=torch.bool, device=q.device).tril(diagonal=keys - (b - a))
    return q[..., a:b, :], k[..., :keys, :], v[..., :keys, :], mask
