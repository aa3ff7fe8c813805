"""What counts as a parameter, never an activation: a module's parameters and buffers, their views
(by storage: layers save transposed views of their weights), and leaves that require grad."""

from __future__ import annotations

import torch

__all__ = ["param_like", "param_storages"]


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
                if tensor is not None:
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
