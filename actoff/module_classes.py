"""Which modules an entry point means: module classes given as classes or class names (as a
Hugging Face model's ``_no_split_modules`` lists them), one convention for `offload_` and
`tile_`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["ModuleClasses", "class_matcher", "nothing_matched"]

#: A module class, a class name, or a list or tuple of either (``offload_``'s ``block_cls``,
#: ``tile_``'s ``module_cls``).
ModuleClasses = type[torch.nn.Module] | str | Sequence[type[torch.nn.Module] | str]


def class_matcher(spec: object, argument: str) -> Callable[[torch.nn.Module, str], bool]:
    """``spec`` (`ModuleClasses`) as a test of a module and its qualified name: classes by
    ``isinstance``, names by the names of the module's class and its bases. Anything else raises
    a ``TypeError`` naming ``argument`` (``"offload_(block_cls=...)"``).

    Example:
        >>> import torch
        >>> matches = class_matcher(["Linear", torch.nn.ReLU], "tile_(module_cls=...)")
        >>> matches(torch.nn.Linear(2, 2), "0"), matches(torch.nn.ReLU(), "1"), matches(torch.nn.Tanh(), "2")
        (True, True, False)
    """
    items = list(spec) if isinstance(spec, (list, tuple, set, frozenset)) else [spec]
    classes, names = [], set()
    for item in items:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type) and issubclass(item, torch.nn.Module):
            classes.append(item)
        else:
            raise TypeError(
                f"{argument} takes an nn.Module subclass, a class name or a list of them (as a Hugging "
                f"Face model's _no_split_modules); got {item!r} ({type(item).__name__})"
            )
    kinds = tuple(classes)

    def matches(module: torch.nn.Module, qualified: str) -> bool:
        return isinstance(module, kinds) or any(kind.__name__ in names for kind in type(module).__mro__)

    return matches


def nothing_matched(caller: str, model: torch.nn.Module, what: str, outcome: str) -> ValueError:
    """The error of an entry point whose classes (``what``: ``"block_cls=['X']"``) matched no
    submodule of ``model``: it names the model's module classes, so the right name is one look
    away. ``outcome`` says what would not happen (``"offloaded"``).

    Example:
        >>> import torch
        >>> print(nothing_matched("tile_", torch.nn.Sequential(torch.nn.Linear(2, 2)), "module_cls='MLP'", "tiled"))
        tile_(): no submodule of Sequential matched module_cls='MLP'; nothing would be tiled. Its module classes: Linear, Sequential
    """
    classes = sorted({type(module).__name__ for module in model.modules()})
    return ValueError(
        f"{caller}(): no submodule of {type(model).__name__} matched {what}; nothing would be {outcome}. "
        f"Its module classes: {', '.join(classes)}"
    )
