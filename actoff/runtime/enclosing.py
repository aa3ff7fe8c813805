"""Scopes under activation checkpointing: the saved-tensor hooks contexts around a scope (torch's
checkpoint, ``save_on_cpu``) and calls made during backward (a reentrant checkpoint's recompute).

Note [under checkpointing]: autograd hands each saved tensor to the innermost saved-tensor hooks
context only, so a scope opened inside another context would take every tensor from it:
inside ``torch.utils.checkpoint`` (non-reentrant) checkpoint then saw nothing, recomputed
nothing and held nothing, and actoff stored the whole block instead, with nothing said. So:
- a scope entered inside another context (`enclosing`: checkpoint's forward or recompute,
  ``save_on_cpu``, a hooks context of the user's) passes through, with one warning per kind of
  context: the block's saved tensors are that context's.
- a scope entered while autograd runs a backward pass (a reentrant checkpoint recomputing the
  block: its saves are used at once) passes through too, with one warning: offloading them
  would copy out what the next moment copies back, and each recompute would count as a step.
- a checkpoint inside the scope composes: checkpoint saves the block's inputs through actoff's
  hooks (non-reentrant: `_CheckpointFrame.save_inputs`; reentrant: ``ctx.save_for_backward``)
  and actoff places them by its policy, which is what offloaded checkpointing is. Hugging Face's
  gradient checkpointing is of this kind (its layers checkpoint their ``forward``), and so is
  ``offload_(model, block_cls=CheckpointWrapper)``. Under the token-wise policies nothing else
  is saved: the block is placed whole, its inputs only, with one warning, as storing rows
  or attention outputs would cost more than checkpoint's recompute
  (actoff.tiers.tokenwise.split: ``saved_elsewhere``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from actoff.policy import whole_tier

if TYPE_CHECKING:
    from actoff.config import Config

__all__ = ["enclosing", "hooks_kind", "warn_checkpointed", "warn_enclosed"]


def hooks_kind(pack: object) -> str:
    """What installed the saved-tensor hooks whose pack hook is ``pack``, in words.

    >>> with torch.autograd.graph.save_on_cpu():
    ...     pack, _ = torch._C._autograd._top_saved_tensors_default_hooks(False)
    >>> hooks_kind(pack)
    'torch.autograd.graph.save_on_cpu'
    """
    name = getattr(pack, "__qualname__", type(pack).__qualname__)
    if "_checkpoint_hook" in name:
        return "torch.utils.checkpoint (non-reentrant)"
    if "_recomputation_hook" in name:
        return "torch.utils.checkpoint's recompute in backward"
    if name.startswith("save_on_cpu"):
        return "torch.autograd.graph.save_on_cpu"
    return f"a saved-tensor hooks context ({getattr(pack, '__module__', '?')}.{name})"


def enclosing() -> str | None:
    """Why a scope called now must pass through (Note [under checkpointing]), or ``None``: the
    kind of an enclosing saved-tensor hooks context, or that autograd is running a backward pass.

    >>> enclosing() is None
    True
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None:
        return hooks_kind(top[0])
    if torch._C._current_graph_task_id() != -1:
        return "during backward"
    return None


def warn_enclosed(
    warn_once: Callable[[str, str], None], module: torch.nn.Module | None, context: str
) -> None:
    """One warning per kind: a scope left to an enclosing hooks context or to backward."""
    what = f"{type(module).__name__} blocks" if module is not None else "function scopes"
    if context == "during backward":
        warn_once(
            "enclosing:backward",
            f"actoff: {what} run during backward (a reentrant torch.utils.checkpoint recomputing "
            "them, say): their saved tensors are used at once, so actoff leaves them on the device. "
            "To offload what checkpoint keeps (the inputs), make the checkpointed module the "
            "offload scope (offload_(model, block_cls=CheckpointWrapper)).",
        )
    elif "recompute" not in context:  # checkpoint's recompute: its forward has warned
        warn_once(
            f"enclosing:{context}",
            f"actoff: {what} run inside {context}, which gets every tensor they save: actoff "
            "leaves them to it (its own hooks inside would take the tensors from it and switch it "
            "off). To offload what checkpoint keeps (the inputs), make the checkpointed module the "
            "offload scope (offload_(model, block_cls=CheckpointWrapper)).",
        )


def warn_checkpointed(
    warn_once: Callable[[str, str], None], config: Config, name: str, elsewhere: object
) -> None:
    """A token-wise run whose body checkpoints itself (``elsewhere``: the checkpoint's pack hook,
    or ``"no grad"`` for a reentrant one), once per policy and kind of checkpoint."""
    context = "a reentrant torch.utils.checkpoint" if elsewhere == "no grad" else hooks_kind(elsewhere)
    warn_once(
        f"checkpointed:{config.policy}:{context}",
        f"actoff: policy {config.policy!r}: the body of block {name!r} (and of others like "
        f"it) runs under {context}, which saves only the block's inputs and recomputes the rest in "
        f"backward: actoff places those inputs ({whole_tier(config)}) and recomputes nothing token-wise, "
        "which would store more (attention's output, token rows). Gradients stay exact.",
    )
