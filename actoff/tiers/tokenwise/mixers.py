"""Token mixers: their registry, the modes that see them in forward and serve them in a re-run,
and the slicing of a block's inputs for that re-run.

The re-run itself, and why it gives the same rows: Note [token-wise re-run] in
actoff.tiers.tokenwise.slices.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from actoff.rerun.dropout import dropout_call, sliced_dropout
from actoff.rerun.state import with_status

from .tokens import changed_dim, unique_dim

if TYPE_CHECKING:
    from .split import Split

__all__ = [
    "RerunMismatch",
    "mixer_token_dim",
    "register_token_mixer",
]  # and helpers for actoff.tiers.tokenwise.slices

# Each mixer and the token dimension of its output (None: the unique dimension of length S).
_MIXERS: dict[Callable[..., Any], int | None] = {F.scaled_dot_product_attention: -2}
_lock = threading.Lock()


class RerunMismatch(RuntimeError):
    """The re-run did not save what the forward saved (count, shape or a mixer)."""


def register_token_mixer(fn: Callable[..., Any], *, token_dim: int | None = None) -> Callable[..., Any]:
    """Declare ``fn`` a token mixer (like attention): token-wise recompute serves its output rows
    from the stored output instead of calling it. Returns the function to call from then on.
    ``token_dim`` is the token dimension of its output (e.g. ``-3`` for flash-attn's
    ``(B, S, heads, D)``); by default the unique dimension of the sequence's length.

    torch functions are registered as they are; a Python function (a flash-attn kernel, say) is
    wrapped so that actoff can see its calls, and the wrapper is returned: use that.

    Example:
        >>> import torch, actoff
        >>> def my_attention(q, k, v):
        ...     return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> my_attention = actoff.register_token_mixer(my_attention)
        >>> q = torch.randn(1, 2, 8, 4)
        >>> my_attention(q, q, q).shape
        torch.Size([1, 2, 8, 4])
    """
    if not callable(fn):
        raise TypeError(f"register_token_mixer expects a function, got {type(fn).__name__}")
    if fn in _MIXERS:
        return fn
    if isinstance(fn, torch._C._FunctionBase) or type(fn).__name__ == "builtin_function_or_method":
        wrapped = fn
    else:

        def dispatcher(*args: Any, **kwargs: Any) -> tuple:
            return tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))

        wrapped = torch.overrides.wrap_torch_function(dispatcher)(fn)
    with _lock:
        _MIXERS[wrapped] = token_dim
    return wrapped


def mixer_token_dim(fn: Callable[..., Any], output: Any, seq_len: int) -> int | None:
    """Token dimension of a mixer's output, or ``None`` if it has none we can trust."""
    if not isinstance(output, torch.Tensor):
        return None
    dim = _MIXERS.get(fn)
    if dim is None:
        return unique_dim(tuple(output.shape), seq_len)
    dim = dim % output.dim()
    return dim if output.shape[dim] == seq_len else None


class CaptureMode(TorchFunctionMode):
    """Forward pass of a token-wise run: notes each mixer call and keeps its output whole.

    ``split`` is the run's token-wise state: it counts ``in_mixer``, knows ``seq_len``, takes
    ``capture_mixer_output`` and, when its ``mixer_watches`` is a list, a stopwatch per call.
    """

    def __init__(self, split: Split) -> None:
        super().__init__()
        self.split = split
        self.watching: contextlib.AbstractContextManager = contextlib.nullcontext()

    def __enter__(self) -> CaptureMode:
        # A function scope: the modules it runs are learned, each one's state taken before it runs
        # (their parameters and buffers are not activations: `actoff.params.learned`).
        start = self.split.start
        self.watching = start.watching() if start is not None else contextlib.nullcontext()
        self.watching.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.watching.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        split = self.split
        if func not in _MIXERS:
            dropout = dropout_call(func, args, kwargs)
            if dropout is not None and not split.in_mixer:  # Note [dropout in a re-run]
                split.dropouts.append((tuple(dropout[0].shape), tuple(dropout[0].stride())))
            return func(*args, **kwargs)
        if not torch.is_grad_enabled():  # a reentrant checkpoint's forward: nothing is saved
            split.saved_elsewhere = "no grad"
            return func(*args, **kwargs)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        hooks = getattr(top[0], "__self__", None) if top is not None else None
        # The run's own hooks, or those its measuring runs inside (Note [measuring where the host
        # is small], actoff.runtime.placements.measuring), which give each save to the run first.
        if hooks is not split.run and getattr(hooks, "run", None) is not split.run:
            # Another hooks context inside the scope (torch's checkpoint) takes what the block
            # saves: its output is nobody's to serve (Note [under checkpointing], actoff.runtime.enclosing).
            split.saved_elsewhere = top[0] if top is not None else "no hooks"
            return func(*args, **kwargs)
        split.in_mixer += 1
        watch = None if split.mixer_watches is None else split.run.backend.stopwatch().start()
        try:
            output = func(*args, **kwargs)
        finally:
            split.in_mixer -= 1
        if watch is not None:  # the auto policy's attention time
            split.mixer_watches.append(watch.stop())
        split.capture_mixer_output(output, mixer_token_dim(func, output, split.seq_len))
        return output


_COLLECTIVE_NAMESPACES = frozenset(
    {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
)


class CollectiveWatch(TorchDispatchMode):
    """Forward of a block about to be probed: notes the first collective it calls outside a
    token mixer (``split.collective``), because a re-run would call it again.

    A re-run runs on one rank, on a slice, at a moment of that rank's choosing: a
    collective in it would wait for ranks that never call it, or gather rows of another
    size. Such blocks are placed whole unless the function that communicates (a
    sequence-parallel attention, say) is a registered token mixer, which the re-run
    serves from its stored output. Active on probe steps only: a dispatch mode costs a
    Python call per operator.
    """

    def __init__(self, split: Split) -> None:
        super().__init__()
        self.split = split  # the token-wise state: its ``collective`` and ``in_mixer``

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            self.split.collective is None
            and not self.split.in_mixer
            and func.namespace in _COLLECTIVE_NAMESPACES
        ):
            self.split.collective = str(func.overloadpacket)
        return func(*args, **(kwargs or {}))


class RerunMode(TorchFunctionMode):
    """Re-run of a token-wise run on rows ``[start, stop)`` of ``seq_len``: mixer calls
    return the stored output rows, in order; dropout calls draw the forward's masks (at the
    forward's input shapes and strides, ``dropouts``) and keep their rows (Note [dropout in a re-run])."""

    def __init__(
        self,
        outputs: list[torch.Tensor],
        dropouts: list[tuple[tuple, tuple]],
        seq_len: int,
        start: int,
        stop: int,
    ) -> None:
        super().__init__()
        self.outputs = outputs
        self.calls = 0
        self.dropouts, self.dropout_calls = dropouts, 0
        self.seq_len, self.start, self.stop = seq_len, start, stop

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _MIXERS:
            dropout = dropout_call(func, args, kwargs)
            if dropout is None:
                return func(*args, **kwargs)
            return self._dropout(func, args, kwargs, *dropout)
        if self.calls >= len(self.outputs):
            raise RerunMismatch("the re-run called the token mixer more often than the forward did")
        output = self.outputs[self.calls]
        self.calls += 1
        return output

    def _dropout(self, func, args, kwargs, x: torch.Tensor, p: float) -> torch.Tensor:
        if self.dropout_calls >= len(self.dropouts):
            raise RerunMismatch("the re-run called dropout more often than the forward did")
        full = self.dropouts[self.dropout_calls]
        full_shape = full[0]
        self.dropout_calls += 1
        if tuple(x.shape) == full_shape:  # every token (a re-run from the first): as it was
            return func(*args, **kwargs)
        dim = changed_dim(full_shape, tuple(x.shape), self.seq_len, self.stop - self.start)
        if dim is None:
            raise RerunMismatch(
                f"a dropout's input has shape {list(x.shape)} in the re-run, {list(full_shape)} in the forward"
            )
        return sliced_dropout(x, p, full, dim, self.start)


def rows_like(full: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` along ``dim`` as a new tensor with ``full``'s memory layout.

    The layout matters: it decides which later ``.contiguous()``/``reshape`` calls copy, and
    so what the next layers save (FIELD_NOTES: the recomputed attention output).
    """
    rows = full.narrow(dim, start, stop - start)
    order = sorted(range(full.dim()), key=lambda i: (-full.stride(i), i))  # outermost first
    strides = [0] * full.dim()
    step = 1
    for i in reversed(order):
        strides[i] = step
        step *= rows.shape[i]
    # A base tensor (not a permuted view): later views of it then have the same _base shape
    # as in the forward pass, where the mixer returned a base with these strides.
    out = torch.empty_strided(rows.shape, strides, dtype=full.dtype, device=full.device)
    out.copy_(rows)
    return out


def slice_inputs(
    values: list[Any], statuses: list[str | None], seq_len: int, token_dim: int, start: int, stop: int
) -> list[Any]:
    """Slice every tensor input along its token dimension (the configured one for the first
    tensor, else the unique dimension of length ``seq_len``, else, when several have that
    length, the configured one if it is among them); others pass as they are. ``statuses``
    (from `autograd_status` at capture) say how each took part in autograd.

    Several dimensions of length ``seq_len``: rotary tables ``(B, S, head_dim)`` at a length
    equal to the head dim. Passed whole, they broke the re-run and the block was placed
    whole at that length; a wrong guess cannot train either: the probe checks the rows."""
    out = []
    first = True
    for value, status in zip(values, statuses, strict=True):
        if isinstance(value, torch.Tensor):
            configured = value.dim() > token_dim and value.shape[token_dim] == seq_len
            dim = token_dim if first and configured else unique_dim(tuple(value.shape), seq_len)
            if dim is None and configured:
                dim = token_dim
            first = False
            if dim is not None:
                value = with_status(status, value.detach().narrow(dim, start, stop - start))
        out.append(value)
    return out
