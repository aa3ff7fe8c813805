"""What a scope call's arguments and module say: the device it runs on and the storages of
the module's parameters and buffers (never offloaded)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["find_device", "param_storages"]


def param_storages(module: torch.nn.Module | None) -> set[int]:
    """Storages of the module's parameters and buffers: never offloaded, views included."""
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


def find_device(args: tuple, kwargs: dict, module: torch.nn.Module | None) -> torch.device:
    """The scope's device: of the first tensor argument, else of the module's parameters."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return item.device
        if isinstance(item, (list, tuple)):
            stack[:0] = item
        elif isinstance(item, dict):
            stack[:0] = item.values()
    if module is not None:
        for tensor in module.parameters():
            return tensor.device
    return torch.device("cpu")
