"""torch.compile: an offload scope is a graph break around its compiled block body.

Note [compile]
Dynamo never traces actoff: the scope's entry and exit, its hooks and `eager_scope` are
``torch.compiler.disable``d, so placement sees real tensors and concrete sizes only. A traced
runtime would be inlined into the graph: placement would see symbolic sizes, the pack hook fake
tensors, and objects made while tracing would be dropped half-built. actoff needs no part in
the graph (facts 1 and 2 below). `compiled_scope` is disabled non-recursively (fact 3), so the
block body between its entry and exit, `_call`, is still compiled by the user's backend;
identical blocks share its code object and guards, so one graph serves them all.
``fullgraph=True`` cannot hold a scope; Dynamo says so with `_GRAPH_BREAK_REASON`.

What torch (2.13) does that this relies on:

1. Saved-tensor hooks are deferred to run time: while Dynamo fakes an op and while AOTAutograd
   traces the joint graph, `_saved_tensors_hooks_set_tracing(True)` (torch/_dynamo/utils.py)
   keeps autograd from calling them on fake tensors.
2. At run time compiled code saves through the hooks active then: with AOTAutograd (aot_eager,
   inductor) the compiled autograd.Function's forward packs what its backward graph needs (the
   partitioner's choice, parameters and block inputs included); with the eager backend the
   graph's ops save one by one. Only hooks that are `fx.GraphModule`s are inlined into a graph
   (`maybe_install_saved_tensors_hooks_subgraphs`); ours are plain Python.
3. ``torch.compiler.disable(fn, recursive=False)``: calling ``fn`` while tracing is a graph
   break; ``fn``'s own frame runs as plain Python and the frames it calls are compiled again.
   With ``recursive=True`` nothing below it is compiled (a ``torch.compile``d callee still is).
4. A graph break inside a loop makes Dynamo run the frame holding the loop eagerly
   (`raise_loop_graph_break`): under ``torch.compile(model)`` the model's loop over its blocks
   runs eagerly, and Dynamo compiles the frames it calls, each block body among them.

The hooks are disabled too: autograd may call them while Dynamo's frame callback is on.
Outside tracing `eager_scope` is disabled as a whole: a frame Dynamo gave up on (a recompile
limit) still has its callees intercepted. Dynamo's ``recompile_limit`` (8 by default) counts
the block classes and shape variants, not the blocks.

A token-wise re-run runs a block eagerly under a torch-function mode that serves the
token mixer's output from the store, matching the i-th save of the re-run with the i-th save
of the forward; the saves of a compiled body are the partitioner's, not the eager ones. Such
runs are placed whole with one warning (`_enter`).

This module imports Dynamo (about a second, once, when the first scope is made); a training
step imports it anyway (``torch.optim`` does).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from actoff.config import Config
from actoff.policy import spec as policy_spec
from actoff.policy import whole_tier
from actoff.runtime.arguments import find_device
from actoff.runtime.hooks import unpack
from actoff.runtime.runtime import get_runtime
from actoff.runtime.step import ScopeRun

__all__ = ["ScopeSpec", "compiled_scope", "eager_scope"]

F = TypeVar("F", bound=Callable[..., Any])

_GRAPH_BREAK_REASON = (
    "an actoff offload scope is entered and left in Python (saved-tensor hooks, placement of "
    "saved activations), so it is a graph break around the block; the block body is still "
    "compiled. fullgraph=True cannot include it: drop fullgraph, or compile modules inside the blocks"
)


def _disable(reason: str, recursive: bool = True) -> Callable[[F], F]:
    """``torch.compiler.disable`` with a reason, where this torch version takes one."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return functools.partial(torch.compiler.disable, recursive=recursive, reason=reason)
    return functools.partial(torch.compiler.disable, recursive=recursive)


_PLAIN_PYTHON = "actoff's runtime runs as plain Python on real tensors (actoff.scope.compile, Note [compile])"


class ScopeSpec(Protocol):
    """What a scope call needs from its decoration (actoff.scope.offload._ScopeSpec)."""

    def block_name(self, module: torch.nn.Module | None, default: str) -> str: ...

    def resolve(self) -> Config: ...


def _call(module: torch.nn.Module | None, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    # The block body: the frame Dynamo compiles under `compiled_scope` (Note [compile]).
    return original(*args, **kwargs) if module is None else original(module, *args, **kwargs)


@_disable(_PLAIN_PYTHON)
def eager_scope(
    spec: ScopeSpec,
    module: torch.nn.Module | None,
    default_name: str,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    """Call ``original`` (a forward given ``module`` first, or a function) as an eager scope."""
    runtime = get_runtime()
    if runtime.passes_through(module):  # fast path: no config resolution, no device lookup
        return _call(module, original, args, kwargs)
    fn = original if module is None else functools.partial(original, module)
    return runtime.call(spec.block_name(module, default_name), spec.resolve(), module, fn, args, kwargs)


@_disable(_GRAPH_BREAK_REASON, recursive=False)
def compiled_scope(
    spec: ScopeSpec,
    module: torch.nn.Module | None,
    default_name: str,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    """`eager_scope` met while Dynamo traces: the block body runs compiled between an entry
    and an exit that Dynamo never sees (Note [compile])."""
    entered = _enter(spec, module, default_name, args, kwargs)
    if entered is None:
        return _call(module, original, args, kwargs)
    try:
        output = _call(module, original, args, kwargs)
    except BaseException:
        _exit(entered, failed=True)
        raise
    _exit(entered, failed=False)
    return output


@_disable(_PLAIN_PYTHON)
def _pack(tensor: torch.Tensor) -> Any:
    # The run on top of the thread's stack: the hooks are only installed while it is there.
    return get_runtime().thread.stack[-1].pack(tensor)


_unpack = _disable(_PLAIN_PYTHON)(unpack)


@_disable(_PLAIN_PYTHON)
def _enter(
    spec: ScopeSpec, module: torch.nn.Module | None, default_name: str, args: tuple, kwargs: dict
) -> tuple[ScopeRun, torch.autograd.graph.saved_tensors_hooks] | None:
    # Decided at run time, never at trace time: no_offload(), no_grad, eval mode and nesting
    # change from call to call without a guard Dynamo could see.
    runtime = get_runtime()
    if runtime.passes_through(module):
        return None
    name, config = spec.block_name(module, default_name), spec.resolve()
    if policy_spec(config.policy).splits_by_token:  # Note [the policy table]
        tier = whole_tier(config)
        runtime.warn_once(
            f"compile:{config.policy}:{tier}",
            f"actoff: policy {config.policy!r} does not recompute blocks that run inside "
            f"torch.compile (first: {name!r}): a token-wise re-run runs the block eagerly "
            "and matches its saves one by one with the forward's, while a compiled block body "
            f"saves what the compiler chose. Their activations are placed whole ({tier}) "
            "instead; gradients stay exact. Run those blocks uncompiled to recompute them.",
        )
    run = runtime.enter_scope(name, config, module, find_device(args, kwargs, module))  # no call: whole
    hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
    hooks.__enter__()
    return run, hooks


@_disable(_PLAIN_PYTHON)
def _exit(entered: tuple[ScopeRun, torch.autograd.graph.saved_tensors_hooks], failed: bool) -> None:
    run, hooks = entered
    hooks.__exit__(None, None, None)
    run.runtime.exit_scope(run, failed)
