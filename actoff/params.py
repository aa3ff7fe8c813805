"""What counts as a parameter, never an activation: a module's parameters and buffers, their views
(by storage: layers save transposed views of their weights), and leaves that require grad."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["first_forwards", "lazy", "learned", "param_like", "param_storages"]


def param_storages(module: torch.nn.Module | None) -> set[int]:
    """Storages of the module's parameters and buffers: never offloaded, views included.

    >>> layer = torch.nn.Linear(2, 2)
    >>> layer.weight.untyped_storage().data_ptr() in param_storages(layer)
    True
    """
    storages: set[int] = set()
    if module is None:
        return storages
    # Note [pack is hot] (actoff.runtime.hooks): the modules' own dictionaries, read at every scope
    # call, not `parameters()`'s generators (under half the time; the same tensors).
    for sub in module.modules():
        for tensors in (sub._parameters, sub._buffers):
            for tensor in tensors.values():
                if tensor is not None and not torch.nn.parameter.is_lazy(tensor):  # a lazy one: none yet
                    storages.add(tensor.untyped_storage().data_ptr())
    return storages


def param_like(tensor: torch.Tensor, storage: int, param_storages: set[int]) -> bool:
    """Parameters, buffers and their views (by storage), and leaves that require grad.

    >>> weight = torch.nn.Parameter(torch.ones(2, 2))
    >>> param_like(weight.t(), 0, set()), param_like(torch.ones(2), 0, set())
    (True, False)
    """
    if storage in param_storages or (tensor.is_leaf and tensor.requires_grad):
        return True
    base = tensor._base
    return base is not None and base.is_leaf and base.requires_grad


@contextlib.contextmanager
def learned(storages: set[int], module: torch.nn.Module | None) -> Iterator[None]:
    """Around a function scope's forward (``module`` None): the parameters and buffers of each
    module it runs join ``storages`` before that module's forward (`first_forwards`), as a
    module scope's are known from the start: a frozen weight a layer saves is not copied out as
    an activation.

    >>> storages, layer = set(), torch.nn.Linear(2, 2)
    >>> with learned(storages, None):
    ...     _ = layer(torch.ones(2))
    >>> layer.weight.untyped_storage().data_ptr() in storages
    True
    """
    if module is not None:
        yield
        return
    with first_forwards(lambda sub: storages.update(param_storages(sub))):
        yield


@contextlib.contextmanager
def first_forwards(each: Callable[[torch.nn.Module], None]) -> Iterator[None]:
    """Each module this thread runs, not inside one it ran before, handed to ``each`` before its
    first forward here (a forward pre-hook on every module, first among the global ones; a lazy
    module's own pre-hook, which makes its parameters, runs after this one: see `lazy`).

    >>> seen, layer = [], torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> with first_forwards(lambda module: seen.append(type(module).__name__)):
    ...     _ = layer(torch.ones(2))
    ...     _ = layer(torch.ones(2))
    >>> seen
    ['Sequential']
    """
    seen: set[int] = set()
    thread = threading.get_ident()

    def first_forward(sub: torch.nn.Module, args: object) -> None:
        if id(sub) not in seen and threading.get_ident() == thread:
            seen.update(id(inner) for inner in sub.modules())
            each(sub)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
    # Before any global pre-hook registered earlier: one that writes a module's weights acts
    # after its state is taken, in the forward and in a run again alike.
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    if isinstance(hooks, collections.OrderedDict) and handle.id in hooks:
        hooks.move_to_end(handle.id, last=False)
    try:
        yield
    finally:
        handle.remove()


def lazy(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module in it still has parameters to make (``nn.LazyLinear``).

    >>> lazy(torch.nn.LazyLinear(2)), lazy(torch.nn.Linear(2, 2))
    (True, False)
    """
    kind = torch.nn.modules.lazy.LazyModuleMixin
    return any(isinstance(sub, kind) and sub.has_uninitialized_params() for sub in module.modules())
