"""The checkpoint placement: a block's inputs stored (on the host by default), the whole block
run again in backward, attention included.

Note [offloaded checkpoint]: the block runs inside PyTorch's reentrant checkpoint, under the
scope's hooks: reentrant checkpointing saves the block's tensor inputs with
``save_for_backward`` and runs the body without grad, so the scope's records are the inputs
alone, placed like any record (copied to the host off the compute stream, fetched back when
backward reaches the next block: the prefetch that PyTorch's ``save_on_cpu`` around a
checkpoint does not do). In backward the checkpoint unpacks them and runs the body again
with grad, RNG and autocast state restored, with actoff switched off: the recompute is not a
scope. Reentrant checkpointing runs its backward only if an input requires grad, or the
block's parameters would get no gradient without a word (a frozen embedding before the first
block): a zero-size leaf that requires grad is passed along, always. Tensors in keyword
arguments become positional inputs (reentrant checkpointing takes no keywords), so they are
stored, and come back, like the rest.

The run again in backward leaves the block's modules as the forward left them (Note [re-runs
leave no trace] in actoff.rerun.isolation): forward hooks do not fire, and buffers and
attributes it changes are given back when the checkpoint's backward node is done (the run's own
backward reads the buffers as the run left them: BatchNorm saves its running statistics), so
blocks sharing a module each give back their own changes, in turn. A block given a key/value cache is not checkpointed: run
again with the cache it would write its rows into the cache once more, and without it attention
would see other keys (PyTorch's checkpoint has the same limit, which is why Hugging Face turns the
cache off under gradient checkpointing). Such a block is placed whole, with one warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from actoff.rerun.isolation import forward_hooks_off, is_cache, left_as_found

from .base import Call, Placement

if TYPE_CHECKING:
    from ..step import ScopeRun

__all__ = ["CheckpointPlacement"]


class CheckpointPlacement(Placement):
    """Only the block's inputs stored (on the policy's tier), the whole block run again in backward
    (Note [offloaded checkpoint])."""

    name = "checkpoint"
    needs_call = True

    def forward(self, call: Call) -> Any:
        return run_checkpointed(self.run, call.fn, call.args, call.kwargs, call.module)


def run_checkpointed(
    run: ScopeRun, fn: Callable[..., Any], args: tuple, kwargs: dict, module: torch.nn.Module | None = None
) -> Any:
    """``fn(*args, **kwargs)`` (the scope of ``module``, if one) under reentrant checkpointing
    (Note [offloaded checkpoint]) as ``run``; the caller has installed the scope's saved-tensor
    hooks. The run again in backward is timed (the run's ``recompute_ms``)."""
    runtime = run.runtime
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if any(is_cache(leaf) for leaf in leaves):
        runtime.warn_once(
            "checkpoint:cache",
            f"actoff: block {run.name!r} (and others like it) is given a key/value cache: run again "
            "in backward it would write the cache a second time, so it is not checkpointed; its "
            "activations are placed whole instead (pass use_cache=False in training to checkpoint it).",
        )
        return fn(*args, **kwargs)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    inputs = [leaves[i] for i in where]
    # The body lives as long as the graph: it must not hold the inputs, or they stay on the
    # device until backward (Note [offloaded checkpoint]).
    skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    del leaves, args, kwargs
    backward_always = torch.empty(0, requires_grad=True)
    entered: list = []  # the runs again in backward whose changes are still to give back

    def body(_always: torch.Tensor, *tensors: torch.Tensor) -> Any:
        values = list(skeleton)
        for index, tensor in zip(where, tensors, strict=True):
            values[index] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        # The forward runs the body without grad; backward runs it again with grad.
        watch = run.backend.stopwatch().start() if torch.is_grad_enabled() else None
        runtime.thread.disabled += 1  # the recompute in backward is not a scope
        try:
            if watch is None:
                return fn(*call_args, **call_kwargs)
            # Note [re-runs leave no trace]; given back once this run's own backward is over
            # (it still reads the buffers it used: BatchNorm's statistics), by `given_back`.
            found = left_as_found(module, values)
            found.__enter__()
            entered.append(found)
            with forward_hooks_off(module):
                return fn(*call_args, **call_kwargs)
        finally:
            runtime.thread.disabled -= 1
            if watch is not None:
                with runtime.lock:
                    run.account("recompute_ms", watch.stop())

    output = torch.utils.checkpoint.checkpoint(body, backward_always, *inputs, use_reentrant=True)
    node = next(
        (t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn), None
    )
    if node is not None:  # else no backward reaches the block, and it is never run again

        def given_back(*_: Any) -> None:
            # Right after the checkpoint's backward, which ran the block's own: not at the end
            # of the whole backward, when every block's buffer copies, attributes and inputs
            # would have been held, and blocks sharing a module would give back in the wrong order.
            while entered:
                entered.pop().__exit__(None, None, None)

        node.register_hook(given_back)
    return output
