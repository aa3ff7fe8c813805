"""The checkpoint placement: a block's inputs stored (on the host by default), the whole block
run again in backward, attention included.

Note [offloaded checkpoint]: the block runs inside PyTorch's non-reentrant checkpoint, under the
scope's hooks. Non-reentrant checkpointing saves the block's tensor inputs through the hooks in
force around it (ours: `_CheckpointFrame.save_inputs`) and everything the body saves through its
own, which keep nothing but a placeholder; so the scope's records are the inputs alone, placed
like any record (copied to the host off the compute stream, fetched back when backward reaches
the next block: the prefetch that PyTorch's ``save_on_cpu`` around a checkpoint does not do). The
body runs with grad, so its outputs are autograd's own, whatever their structure (a dict, a list,
nested tuples: an MoE block's router logits, an auxiliary loss), and ``torch.autograd.grad``,
``backward(inputs=...)`` and DDP's ``find_unused_parameters`` work as without actoff. At the first
unpack of a placeholder in backward the checkpoint unpacks the inputs and runs the body again,
RNG and autocast state restored, and serves the rest from that run. Every tensor argument,
keyword ones included, is passed positionally: the checkpoint holds keyword arguments in a
closure until backward, which would keep them on the device.

The run again in backward leaves the block's modules as the forward left them (Note [re-runs
leave no trace] in actoff.rerun.isolation): forward hooks do not fire, and buffers and attributes it
changes are given back as soon as it ends, before the next block's run again (blocks sharing a
module each give back their own changes, in turn).

Note [runs again start where the forward did]: a block may change state in forward that its
output depends on (a scale it halves each call, a counter it divides by). Run again on the state
the forward left, it would save other tensors, and the gradients would be wrong without a word
(PyTorch's checkpoint has this hole; its shape check cannot tell). The state the forward begins
with is taken before it (`StateAtStart`: attributes, containers' items three levels deep, and
buffers and tensors up to 1 MiB by value, as `left_as_found` takes them) and kept until backward:
copies up to 64 KiB whole (another forward of the block before this one's backward, a block
called twice a step, may change what this one did not), larger ones where the forward changed
them, the others watched by version (written since: the run again stops). Each run again
(`run_again`: the checkpoint's, a token-wise re-run, each chunk of a chunked backward) starts from
it and gives back the state it found. Not copied, so refused at the scope's exit, naming the
block, what was written and the fix (`refuse_unrestorable`; placed whole by the token-wise
placements, never planned to run again by ``auto``): a parameter written in forward (weights
are too large to copy; an embedding's ``max_norm`` renormalisation is not a change: run again,
its rows are looked up as the forward left them) and a tensor over 1 MiB written in place. A
tensor over 1 MiB *bound* in forward (``self.last = h.detach()``, ``self.stats = {"last": h}``:
an activation logged per block) is not held until backward, nor a container holding one: a
block that reads such a tensor before binding a new one runs again on the new one. A function
scope's modules are unknown before its forward: each module it runs has its state taken before
its first forward in the scope (`StateAtStart.watching`), and is what its runs again give back.
Its forward hooks are watched from then on, as a module scope's are (Note [hooks that change
outputs]). What its own code (or a module it ran before) writes of a module before running it
is in that state, and would be written once more in the run again: there an in-place write into
a parameter, buffer or tensor attribute of a module not yet run stops the step before it lands,
naming it and the fix (placed whole by the token-wise policies, whose probe fails on it); an
attribute bound anew to another value (``m.scale = m.scale * 0.5``, ``m.factor *= 0.5``) and a
write the guard cannot see but a version counter can are caught at the module's first forward.
What a module that ran writes of its own is its forward's (a BatchNorm two branches share). Not
seen, as `left_as_found` does not see them: globals, closures, what lies deeper than three
levels, what a function scope writes of a module it never runs, and writes through ``.data`` by
an operator called past PyTorch's function dispatch (``torch.ops.aten.mul_``, numpy): put such
writes inside the module's forward, or offload the module itself.

Note [a cache in checkpointed training]: Hugging Face models keep ``use_cache=True`` in training,
so every forward hands its blocks a fresh, empty key/value cache. The block runs in forward with
the caller's cache and writes its rows into it once, as without actoff. The run again in
backward gets no cache (the skeleton's caches are dropped once the forward has run): with an
empty cache, attention's keys are the block's own rows either way, so it saves the same tensors
(``tests/runtime/test_checkpoint.py`` compares every gradient bit for bit), the caller's cache is
not written twice, and the graph does not hold the caller's cache until backward. A cache that
already holds rows the block reads (a second chunk fed the first chunk's cache) is another
matter: run again without them attention would see other keys, and with them it would write
them once more (PyTorch's checkpoint has the same limit, which is why Hugging Face turns the
cache off under gradient checkpointing). Such a block is placed whole, with one warning. The
rows a block reads are those of its cache layers, named by its submodules' ``layer_idx`` (as
Hugging Face's attention modules name theirs); a block that names none reads the whole cache.

Note [inputs changed in place]: the run again starts from the inputs as the forward got them. A
block that writes into one of its inputs (``x.mul_(2)``) leaves the stored input changed: run
again from it, the block would compute something else, and the gradients would be wrong without
a word. The inputs' versions are taken before the body runs and compared when it ends; a changed
one stops the step at the scope's exit with an error naming the block and the fix (the body's
saves are placeholders: nothing else was kept to fall back on).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from actoff.rerun.again import StateAtStart, StateChangedError, run_again
from actoff.rerun.isolation import is_cache, without_caches

from .base import Call, Placement

if TYPE_CHECKING:
    from ..step import ScopeRun

__all__ = [
    "CheckpointPlacement",
    "HookChangedOutputError",
    "InputChangedError",
    "StateChangedError",
    "has_forward_hooks",
    "holds_rows_read",
    "refuse_unrestorable",
]


class InputChangedError(RuntimeError):
    """A checkpointed block wrote into one of its inputs (Note [inputs changed in place])."""


class HookChangedOutputError(RuntimeError):
    """A forward hook in a checkpointed block changed an output (Note [hooks that change outputs])."""


# Note [hooks that change outputs]: the run again in backward does not call the block's forward
# hooks (Note [re-runs without forward hooks] in actoff.rerun.isolation). A hook that returns a
# value replaces its module's output in forward, so run again without it the block would save
# other tensors, and the checkpoint's shape check cannot tell: wrong gradients without a word.
# While a checkpointed block runs its forward, its forward hooks are watched: one that returns a
# value stops the step at the scope's exit with an error naming it and the fix. Hooks that only
# look (Hugging Face's output capture) return None and are not called again.
def has_forward_hooks(module: torch.nn.Module | None) -> bool:
    """Whether ``module`` or one of its submodules has a forward hook (None: a function scope,
    whose modules are not known before it runs: True).

    >>> layer = torch.nn.Linear(2, 2)
    >>> before = has_forward_hooks(torch.nn.Sequential(layer))
    >>> _ = layer.register_forward_hook(lambda *_: None)
    >>> before, has_forward_hooks(torch.nn.Sequential(layer)), has_forward_hooks(None)
    (False, True, True)
    """
    return module is None or any(sub._forward_hooks for sub in module.modules())


@contextlib.contextmanager
def _hooks_watched(module: torch.nn.Module | None, changed: list[str]) -> Any:
    """While the forward runs, the forward hooks of ``module``'s modules note in ``changed`` the
    modules whose output one of them replaced (Note [hooks that change outputs]). Yields a
    function that watches another module's too (a function scope's, as its forward runs them).

    >>> layer, changed = torch.nn.Linear(2, 2), []
    >>> _ = layer.register_forward_hook(lambda module, args, output: output * 2)
    >>> with _hooks_watched(torch.nn.Sequential(layer), changed):
    ...     _ = layer(torch.ones(2))
    >>> changed
    ['Linear']
    """
    originals: dict[int, tuple[torch.nn.Module, Any]] = {}

    def wrap(sub: torch.nn.Module, hook: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            result = hook(*args, **kwargs)
            if result is not None:
                changed.append(type(sub).__name__)
            return result

        return noted

    def watch(root: torch.nn.Module) -> None:
        for sub in root.modules():
            if sub._forward_hooks and id(sub) not in originals:
                originals[id(sub)] = (sub, sub._forward_hooks)
                sub._forward_hooks = collections.OrderedDict(
                    (key, wrap(sub, hook)) for key, hook in sub._forward_hooks.items()
                )

    if module is not None:
        watch(module)
    try:
        yield watch
    finally:
        for sub, hooks in originals.values():
            added = [(key, hook) for key, hook in sub._forward_hooks.items() if key not in hooks]
            sub._forward_hooks = hooks
            hooks.update(added)  # registered while the forward ran: kept, as without actoff


class CheckpointPlacement(Placement):
    """Only the block's inputs stored (on the policy's tier), the whole block run again in backward
    (Note [offloaded checkpoint])."""

    name = "checkpoint"
    needs_call = True
    asks_recompute = True  # type: ignore[assignment]  # a constant here

    def forward(self, call: Call) -> Any:
        return run_checkpointed(self.run, call.fn, call.args, call.kwargs, call.module)


def run_checkpointed(
    run: ScopeRun,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    module: torch.nn.Module | None = None,
    inside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    runs_again: Callable[[], bool] = lambda: True,
) -> Any:
    """``fn(*args, **kwargs)`` (the scope of ``module``, if one) under non-reentrant checkpointing
    (Note [offloaded checkpoint]) as ``run``; the caller has installed the scope's saved-tensor
    hooks. The run again in backward is timed (the run's ``recompute_ms``). ``inside`` makes the
    context the body runs in, in forward, inside the checkpoint's hooks; ``runs_again`` says after
    the forward whether anything the body saved is left to the checkpoint (else a changed input
    harms nothing: nothing runs again)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if any(is_cache(leaf) and holds_rows_read(leaf, module) for leaf in leaves):
        run.placement.whole_because = "it is given a key/value cache that already holds rows it reads"
        run.runtime.warn_once(
            "checkpoint:cache",
            f"actoff: block {run.name!r} (and others like it) is given a key/value cache that already "
            "holds rows it reads: run again in backward it would write them a second time, so it is "
            "not checkpointed; its activations are placed whole instead (a cache that is empty when "
            "the block begins is checkpointed; Note [a cache in checkpointed training]).",
        )
        return fn(*args, **kwargs)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    inputs = [leaves[i] for i in where]
    versions = [tensor._version for tensor in inputs]
    # The body lives as long as the graph: it must not hold the inputs, or they stay on the
    # device until backward (Note [offloaded checkpoint]).
    skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    del leaves, args, kwargs

    def body(*tensors: torch.Tensor) -> Any:
        values = list(skeleton)
        for index, tensor in zip(where, tensors, strict=True):
            values[index] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        return fn(*call_args, **call_kwargs)

    again = _RunAgain(run, module, skeleton)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return inside(), again

    start = StateAtStart(module, without_caches(skeleton))
    changed_output: list[str] = []
    with _hooks_watched(module, changed_output) as watch, start.watching(watch):
        output = torch.utils.checkpoint.checkpoint(
            body, *inputs, use_reentrant=False, context_fn=contexts, determinism_check="default"
        )
    if runs_again():  # Note [runs again start where the forward did]
        refuse_unrestorable(run.name, start.unrestorable(), "checkpoint")
    again.began = start.kept()
    # The forward wrote the caller's caches; the run again gets none (Note [a cache in
    # checkpointed training]), and the graph stops holding them.
    skeleton[:] = without_caches(skeleton)
    changed = [tensor for tensor, version in zip(inputs, versions, strict=True) if tensor._version != version]
    if changed and runs_again():  # Note [inputs changed in place]
        tensor = changed[0]
        raise InputChangedError(
            f"actoff: block {run.name!r} wrote into its input (a tensor of shape {list(tensor.shape)} "
            f"and dtype {tensor.dtype}) in place: the checkpoint placement runs the block again from its "
            "inputs in backward and would start from the changed one, giving wrong gradients. Clone the "
            "input before changing it inside the block (x = x.clone()), or place this block with a "
            "policy that stores what it saves (cpu)."
        )
    if changed_output and runs_again():  # Note [hooks that change outputs]
        raise HookChangedOutputError(
            f"actoff: a forward hook in block {run.name!r} (on a {changed_output[0]}) changed its module's "
            "output: the checkpoint placement runs the block again in backward without its forward "
            "hooks and would save other tensors, giving wrong gradients. Fold the change into the "
            "module's forward, or place this block with a policy that stores what it saves (cpu)."
        )
    return output


def refuse_unrestorable(block: str, written: list[str], placement: str) -> None:
    """Stop where ``block``'s forward wrote what a run again cannot start from as it was
    (`StateAtStart.unrestorable`: a parameter, a tensor over 1 MiB written in place), under a
    ``placement`` that runs it again (Note [runs again start where the forward did]).

    >>> refuse_unrestorable("layers.0", [], "checkpoint")  # nothing written: nothing said
    >>> refuse_unrestorable("layers.0", ["parameter 'scale'"], "checkpoint")
    Traceback (most recent call last):
    ...
    actoff.rerun.again.StateChangedError: actoff: block 'layers.0' wrote into its parameter 'scale' in forward: the checkpoint placement runs the block again from the value the forward left (parameters and tensors over 1 MiB are not copied to run again from) and would give wrong gradients. Change it outside the forward (a parameter in the optimizer step), keep the changing value in a buffer, or place this block with a policy that stores what it saves (cpu).
    """
    if written:
        raise StateChangedError(
            f"actoff: block {block!r} wrote into its {written[0]} in forward: the {placement} placement "
            "runs the block again from the value the forward left (parameters and tensors over 1 MiB "
            "are not copied to run again from) and would give wrong gradients. Change it outside the "
            "forward (a parameter in the optimizer step), keep the changing value in a buffer, or "
            "place this block with a policy that stores what it saves (cpu)."
        )


def holds_rows_read(cache: Any, module: torch.nn.Module | None) -> bool:
    """Whether ``cache`` holds rows the block of ``module`` reads (Note [a cache in checkpointed
    training]): rows in the cache layers its submodules name by ``layer_idx``, or in any layer
    when it names none. A cache without Hugging Face's ``layers`` counts as holding rows.

    >>> holds_rows_read(object(), torch.nn.Linear(2, 2))  # not Hugging Face's: counted as holding rows
    True
    """
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return True
    subs = module.modules() if module is not None else ()
    named = {sub.layer_idx for sub in subs if isinstance(getattr(sub, "layer_idx", None), int)}
    read = [layers[index] for index in sorted(named) if index < len(layers)] if named else layers
    return any(_layer_holds_rows(layer) for layer in read)


def _layer_holds_rows(layer: Any) -> bool:
    if not getattr(layer, "is_initialized", False):
        return False  # created lazily at the first write: nothing written yet
    length = getattr(layer, "get_seq_length", None)
    return length is None or length() > 0  # a layer with a state but no length: rows all the same


class _RunAgain:
    """Around the run again in backward: timed (``recompute_ms``), leaving no trace (Note [re-runs
    leave no trace]). Scopes inside it pass through: they run under the checkpoint's hooks. Made
    with the forward and entered at each run again (a retained graph's second backward, too)."""

    def __init__(self, run: ScopeRun, module: torch.nn.Module | None, skeleton: list[Any]) -> None:
        self.run, self.module, self.skeleton = run, module, skeleton
        self.entered: list[tuple[Any, contextlib.ExitStack]] = []
        self.began: StateAtStart | None = None  # Note [runs again start where the forward did]

    def __enter__(self) -> None:
        watch = self.run.backend.stopwatch().start()
        stack = contextlib.ExitStack()
        stack.enter_context(run_again(self.module, self.skeleton, self.began, self.run.name))
        self.entered.append((watch, stack))

    def __exit__(self, *exc: object) -> None:
        watch, stack = self.entered.pop()
        try:
            stack.__exit__(*exc)
        finally:
            with self.run.runtime.lock:
                self.run.account("recompute_ms", watch.stop())
