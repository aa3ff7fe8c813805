"""What a re-run must leave as it found it: the caller's caches, the block's buffers,
attributes and forward hooks.

Note [re-runs leave no trace]: a re-run (the probe in a block's first backward, the
recompute of dropped rows in every backward) runs the block's forward again, and nothing it does
may reach the caller or the model; the program wrote one forward per call, and that is what it
gets:
- a key/value cache given to the block (a Hugging Face ``Cache``) is replaced by ``None`` for
  the re-run (`without_caches`), so attention does not append the re-run rows to it (a
  training forward would return a cache longer than its tokens, and a cache fed to the next
  chunk would hand over those rows too). Without a cache the block runs as it does with
  ``use_cache=False``: the keys a cache would add feed attention only, whose output the
  re-run serves from what forward stored. A block whose saves depend on the cache is seen
  by the probe (another count or shape) and placed whole.
- the block's modules are its module's submodules, or for a function scope every module its
  forward ran (noted during that forward) with theirs.
- buffers of those modules that the re-run changed (BatchNorm's running statistics and its
  counter, a write through ``.data``: compared by value) get the forward's values back, and a
  buffer rebound is bound back (`left_as_found`).
- attributes the re-run sets on those modules (``self.l_aux`` of a mixture of experts, a
  statistic logged in forward) are restored to the forward's values, graphs included,
  attributes it adds are removed, lists and dictionaries they hold get their items back (an
  auxiliary loss appended to ``self.aux_losses``; one level deep: a list inside a dictionary
  keeps what was appended to it), and tensors up to 1 MiB held as attributes, or in the lists
  and dictionaries they hold, get their values back (``self.tally += 1``,
  ``self.scales[0].mul_(0.5)``): the loss that reads them after forward reads the forward's. So
  are the attributes of plain objects given to the block. Deeper, to three levels (`Reached`),
  lists, dictionaries, deques and objects' attributes get their items back, and small tensors
  their values (a counter in ``self.stats["moe"]["tokens"]``).
- forward hooks of those modules do not fire (`forward_hooks_off`, Note [re-runs without
  forward hooks]).
Not undone, as with ``torch.utils.checkpoint`` (which re-runs a block in backward too): Python
side effects outside the block's modules and inputs, such as appending to a global list or one
the block closes over, printing, or counting calls in an object the block reaches otherwise.
Those run once more in backward for each re-run (never in forward: Note [probe in the
first backward], actoff.tiers.tokenwise.split).

Note [re-runs without forward hooks]: the forward hooks of the block's submodules do not
fire in a re-run: it is not a forward the user's program made. A hook that records outputs
(Hugging Face's output capture: router logits, attentions, hidden states) would record the
re-run's rows as one more layer, and a mixture-of-experts model's auxiliary loss would count
it. A hook that changes an output changes the forward's saves, so the probe finds a mismatch and
the block is placed whole. Pre-hooks still run (they may gather parameters or set weights). The
hooks are lifted from the modules while a re-run runs, so another thread running the same
modules then misses them too.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from .reached import (
    _ATTRIBUTE_VALUES_UP_TO,
    _NEVER_BOUND_BACK,
    _TORCH_OWN,
    Reached,
    _modules_of,
    holds_large,
    large,
    put_back,
    settle,
)

__all__ = [
    "Found",
    "forward_hooks_off",
    "hooks_inside",
    "is_cache",
    "left_as_found",
    "without_caches",
]


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a key/value cache the block would write into: an instance of
    Hugging Face's ``transformers.cache_utils.Cache`` (found by name, so transformers is not
    imported).

    >>> is_cache(None), is_cache(torch.zeros(1))
    (False, False)
    """
    return any(
        kind.__name__ == "Cache" and kind.__module__.startswith("transformers.")
        for kind in type(value).__mro__
    )


def without_caches(values: list[Any]) -> list[Any]:
    """The flattened inputs of a block for a re-run: caches (`is_cache`) replaced by ``None``
    (Note [re-runs leave no trace])."""
    return [None if is_cache(value) else value for value in values]


class _Attributes:
    """An object's attributes as they are now, to give them back: each binding, and the items of
    the lists and dictionaries they hold (an auxiliary loss appended to ``self.aux_losses``)."""

    def __init__(self, owner: Any, own: frozenset[str] = frozenset()) -> None:
        self.owner, self.own = owner, own
        self.bindings = dict(vars(owner))
        self.items = {
            name: list(value) if type(value) is list else dict(value)
            for name, value in self.bindings.items()
            if name not in own and type(value) in (list, dict)
        }
        # For `changed`: the versions of the tensors bound, and of those the lists and dictionaries hold.
        self.versions = _versions([value for name, value in self.bindings.items() if name not in own])
        # Of those, the small ones (a counter, a running statistic, a scale kept in a list): their
        # values, for writes in place (``self.tally += 1``, ``self.state[0].mul_(0.5)``).
        self.values = [
            (tensor, tensor.detach().clone())
            for tensor, _ in self.versions
            if tensor.numel() * tensor.element_size() <= _ATTRIBUTE_VALUES_UP_TO
        ]

    def changed(self) -> bool:
        """Whether a binding, a list's or dictionary's items, a tensor's version (one bound, or an
        item) or a small tensor's values differ now."""
        now, bindings = vars(self.owner), self.bindings
        if now.keys() != bindings.keys() or any(now[name] is not value for name, value in bindings.items()):
            return True
        if any(not _same(bindings[name], items) for name, items in self.items.items()):
            return True
        if any(tensor._version != version for tensor, version in self.versions):
            return True
        return any(not torch.equal(tensor.detach(), copy) for tensor, copy in self.values)

    def trim(self, watched: list) -> None:
        """Drop what only `changed` needs, copies `settle` lets go, and what holds tensors over
        1 MiB (`holds_large`) bound or held in their place since (`StateAtStart`: an activation
        logged in ``self.last`` or ``self.stats = {"last": h}`` is not held until backward)."""
        self.versions, self.values = [], settle(self.values, watched)
        now = vars(self.owner)
        for name, value in list(self.bindings.items()):
            if holds_large(value) and name in now and now[name] is not value:
                self.bindings[name] = now[name]
        for name, items in list(self.items.items()):
            if any(holds_large(item) for item in (items if type(items) is list else items.values())):
                del self.items[name]  # its items are left as they are then

    def restore(self) -> None:
        now, bindings = vars(self.owner), self.bindings
        for name in [name for name in now if name not in bindings]:
            del now[name]
        for name, value in bindings.items():
            if name not in _NEVER_BOUND_BACK and now.get(name, _MISSING) is not value:
                now[name] = value
        for tensor, copy in self.values:
            if not torch.equal(tensor.detach(), copy):
                put_back(tensor, copy)  # unversioned, as buffers are (`left_as_found`)
        for name, items in self.items.items():
            container = bindings[name]
            if not _same(container, items):  # by identity: tensors compared by value are ambiguous
                container.clear()
                if type(container) is list:
                    container.extend(items)
                else:
                    container.update(items)


def _versions(values: list[Any]) -> list[tuple[torch.Tensor, int]]:
    """The version of each tensor among ``values`` and the items of the lists and dictionaries
    among them (one level)."""
    found = []
    for value in values:
        items = value if type(value) is list else value.values() if type(value) is dict else (value,)
        found.extend((item, item._version) for item in items if isinstance(item, torch.Tensor))
    return found


def _same(now: list | dict, then: list | dict) -> bool:
    """Whether a list or dictionary holds the same objects (by identity) as a copy of it did."""
    if type(now) is list:
        return len(now) == len(then) and all(a is b for a, b in zip(now, then, strict=False))
    return now.keys() == then.keys() and all(now[key] is then[key] for key in then)


_MISSING = object()


def _plain_object(value: Any) -> bool:
    """An input whose attributes a block might set: not a tensor, module, class or function."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (torch.Tensor, torch.nn.Module, type))
        and not callable(value)
    )


class Found:
    """The state a block's forward may change, as it is now (Note [re-runs leave no trace]): the
    buffers of ``module``'s modules (``None``: a function scope, whose forward ran the modules
    ``touched``), values and bindings, their attributes, and the attributes of the plain objects
    among the flattened ``inputs``. `restore` gives it back; `changed` tells whether it differs.

    >>> norm = torch.nn.BatchNorm1d(2)
    >>> found = Found(norm, [])
    >>> _ = norm(torch.randn(4, 2))
    >>> found.changed(), (found.restore(), found.changed())[1], int(norm.num_batches_tracked)
    (True, False, 0)
    """

    def __init__(
        self,
        module: torch.nn.Module | None,
        inputs: list[Any],
        touched: list[torch.nn.Module] = (),
        copies: bool | None = None,
    ) -> None:
        self.kept: list[_Attributes] = [_Attributes(value) for value in inputs if _plain_object(value)]
        self.buffers = []
        modules = _modules_of(module, touched)
        self.parameters = _versions([list(sub._parameters.values()) for sub in modules])  # for `changed`
        with torch.no_grad():
            for sub in modules:
                self.kept.append(_Attributes(sub, _TORCH_OWN))
                bound = dict(sub._buffers)
                # A copy of each buffer's values, written back where the re-run changed them: by
                # value, as writes through ``.data`` and BatchNorm's kernel leave the version as it was.
                # ``copies`` False (`StateAtStart`): of those up to 1 MiB only (`unrestorable` names others written).
                values = [
                    (buffer, buffer.clone())
                    for buffer in bound.values()
                    if buffer is not None and (copies is not False or not large(buffer))
                ]
                self.buffers.append((sub, bound, values))

    def changed(self) -> bool:
        """Whether the state differs now (also where it cannot be compared: a sparse tensor)."""
        if any(parameter._version != version for parameter, version in self.parameters):
            return True
        try:
            with torch.no_grad():
                if any(attributes.changed() for attributes in self.kept):
                    return True
                return any(
                    not _same(sub._buffers, bound)
                    or any(not torch.equal(buffer, copy) for buffer, copy in values)
                    for sub, bound, values in self.buffers
                )
        except (NotImplementedError, RuntimeError):
            return True

    def trim(self, watched: list) -> None:
        """Drop what only `changed` needs, copies `settle` lets go (their versions added to
        ``watched``), and buffers over 1 MiB rebound since (`StateAtStart`)."""
        for attributes in self.kept:
            attributes.trim(watched)
        for sub, bound, _ in self.buffers:
            for name, buffer in list(bound.items()):
                if large(buffer) and sub._buffers.get(name) is not buffer:
                    bound[name] = sub._buffers.get(name)  # rebound: as `_Attributes.trim`
        self.buffers = [(sub, bound, settle(values, watched)) for sub, bound, values in self.buffers]
        self.parameters = []

    def restore(self) -> None:
        with torch.no_grad():
            for attributes in self.kept:
                attributes.restore()
            for sub, bound, values in self.buffers:
                sub._buffers.clear()
                sub._buffers.update(bound)
                for buffer, copy in values:
                    if not torch.equal(buffer, copy):
                        # The forward's values again, through .data: what saved them is at
                        # their version, and sees them as it saved them.
                        put_back(buffer, copy)


@contextlib.contextmanager
def left_as_found(
    module: torch.nn.Module | None, inputs: list[Any], touched: list[torch.nn.Module] = ()
) -> Iterator[None]:
    """Run a re-run of ``module`` (``None``: a function scope, whose forward ran the modules
    ``touched``) on the flattened ``inputs`` and give back what it changed (`Found`, Note
    [re-runs leave no trace]).

    >>> norm = torch.nn.BatchNorm1d(2)
    >>> with left_as_found(norm, []):
    ...     norm.stat = norm(torch.randn(4, 2)).mean()
    >>> int(norm.num_batches_tracked), hasattr(norm, "stat")
    (0, False)
    """
    found, reached = Found(module, inputs, touched), Reached(module, inputs, touched)
    # Not held while suspended: a checkpointed block's run again stays open until its backward
    # node is done (actoff.runtime.placements.checkpoint), and its inputs would stay on the device as long.
    del inputs
    try:
        yield
    finally:
        found.restore()
        reached.restore()


def hooks_inside(module: torch.nn.Module) -> list[str]:
    """The submodules of ``module`` (not ``module`` itself, whose hooks fire outside its forward)
    with a forward hook or pre-hook that may act in its forward, by class: Hugging Face's output
    capture is left out while the model's forward records nothing it captures (it returns at once then).

    >>> block = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> _ = block.register_forward_hook(lambda *_: None)
    >>> before = hooks_inside(block)
    >>> _ = block[0].register_forward_hook(lambda *_: None)
    >>> before, hooks_inside(block)
    ([], ['Linear'])
    """
    return [
        type(sub).__name__
        for sub in module.modules()
        if sub is not module
        and (sub._forward_pre_hooks or any(not _idle_capture(hook) for hook in sub._forward_hooks.values()))
    ]


def _idle_capture(hook: Any) -> bool:
    """Whether ``hook`` is Hugging Face's output capture and its model's forward now records
    nothing under its key (found by name, so transformers is not imported)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    if capturing is None or getattr(hook, "__module__", None) != capturing.__name__:
        return False
    try:
        key = dict(zip(hook.__code__.co_freevars, hook.__closure__ or (), strict=True))["key"].cell_contents
        collected = capturing._active_collector.get()
    except (AttributeError, KeyError, LookupError, TypeError, ValueError):
        return False  # another version's hook: taken as acting
    return collected is None or key not in collected


@contextlib.contextmanager
def forward_hooks_off(module: torch.nn.Module | None, touched: list[torch.nn.Module] = ()) -> Iterator[None]:
    """The forward hooks of ``module`` and its submodules (a function scope, ``None``: of the
    modules its forward ran, ``touched``) do not fire inside the block (Note [re-runs
    without forward hooks]).

    >>> layer = torch.nn.Linear(2, 2)
    >>> _ = layer.register_forward_hook(lambda *_: print("hook"))
    >>> with forward_hooks_off(torch.nn.Sequential(layer)):
    ...     _ = layer(torch.ones(2))
    >>> _ = layer(torch.ones(2))
    hook
    """
    lifted = []
    for sub in _modules_of(module, touched):
        if sub._forward_hooks:
            lifted.append((sub, sub._forward_hooks))
            sub._forward_hooks = collections.OrderedDict()
    try:
        yield
    finally:
        for sub, hooks in lifted:
            sub._forward_hooks = hooks
