"""What a scope call's arguments and module say: the device it runs on."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["find_device"]


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
