"""Offload scopes: `offload` (class, instance or function), `offload_` (in place) and `no_offload`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from actoff.config import Config, get_config, keywords_of
from actoff.module_classes import ModuleClasses, class_matcher, nothing_matched
from actoff.owners import ByOwner
from actoff.policy import OPTIONAL_SETTINGS, ignored_settings, read_by
from actoff.runtime.runtime import get_runtime

__all__ = ["no_offload", "offload", "offload_"]

T = TypeVar("T")
_SPEC_ATTR = "__actoff_scope__"


class _ScopeSpec:
    """What a decorated object needs at call time: its config source and a block name."""

    def __init__(
        self,
        config: Config | None,
        overrides: dict[str, object],
        name: str | None,
        caller: str | None = "offload",
    ) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"{caller}(config=...) expects an actoff.Config, got {type(config).__name__}")
        # Validate overrides now (a typo fails at decoration, not mid-step), on top of what the
        # call will resolve them on: the process's settings (ACTOFF_NVME_DIR, say) count. A bad
        # one is named as the keyword passed, not as its environment variable.
        base = config or get_config()
        if overrides and caller:
            with keywords_of(caller):
                resolved = base.replace(**overrides)
            _warn_ignored(caller, resolved, overrides)
        self.config = config
        self.overrides = overrides
        self.name = name
        self._names: ByOwner[str] = ByOwner()  # by instance, forgotten when it dies
        self._counter = itertools.count()
        self._resolved: tuple[Config, Config] | None = None  # the last base seen, resolved
        self._checked: Config | None = None  # the last base `_warn_unread` saw

    def resolve(self) -> Config:
        base = self.config if self.config is not None else get_config()
        if base is not self._checked:  # a new source of settings: its unread ones are said
            self._checked = base
            _warn_unread(base, self.overrides)
        if not self.overrides:
            return base
        cached = self._resolved  # Note [pack is hot] (actoff.runtime.hooks): replaced once per base
        if cached is None or cached[0] is not base:
            cached = self._resolved = (base, base.replace(**self.overrides))
        return cached[1]

    def block_name(self, module: torch.nn.Module | None, default: str) -> str:
        if self.name is not None:
            return self.name
        if module is None:
            return default
        name = self._names.get(module)
        if name is None:  # instances of a decorated class: Block#0, Block#1, ... by first call
            name = self._names.put(module, f"{type(module).__name__}#{next(self._counter)}")
        return name


def _warn_ignored(caller: str, config: Config, overrides: dict[str, object]) -> None:
    """Settings passed as keywords that the policy does not read: said, never dropped unsaid."""
    ignored = ignored_settings(config.policy, overrides)
    if ignored:
        given = ", ".join(f"{name}={overrides[name]!r}" for name in ignored)
        readers = "; ".join(
            f"{name} is read by policy {' or '.join(map(repr, read_by(name)))}" for name in ignored
        )
        warnings.warn(
            f"actoff: {caller}({given}) has no effect under policy={config.policy!r} ({readers})",
            UserWarning,
            stacklevel=4,
        )


_UNREAD_SAID: set[tuple[str, str]] = set()  # (policy, setting) pairs said once per process


def _warn_unread(base: Config, overrides: dict[str, object]) -> None:
    """Settings given in the environment, ``set_config`` or a ``Config`` (those off their default)
    that the policy in force does not read, said once each (keywords are said at decoration)."""
    policy = overrides.get("policy", base.policy)
    defaults = {field.name: field.default for field in dataclasses.fields(Config)}
    changed = [
        name for name in OPTIONAL_SETTINGS if name not in overrides and getattr(base, name) != defaults[name]
    ]
    for name in ignored_settings(policy, changed):
        if (policy, name) not in _UNREAD_SAID:
            _UNREAD_SAID.add((policy, name))
            readers = " or ".join(map(repr, read_by(name)))
            warnings.warn(
                f"actoff: ACTOFF_{name.upper()} (Config.{name})={getattr(base, name)!r} has no effect under "
                f"policy {policy!r}: it is read by policy {readers}",
                UserWarning,
                stacklevel=5,
            )


def offload(
    obj: T | None = None,
    *,
    config: Config | None = None,
    name: str | None = None,
    **overrides: object,
) -> T | Callable[[T], T]:
    """Make a block an offload scope: what its forward saves for backward is managed by actoff.

    ``obj`` may be an ``nn.Module`` subclass (every instance becomes a scope), an instance
    (that module only; returned as is) or a function. Settings come from ``config``, else
    the process-wide `actoff.get_config` (``ACTOFF_*`` variables), with ``overrides`` applied
    on top. Nested scopes, ``torch.no_grad()``, eval mode and `no_offload` run untouched.

    Example:
        >>> import torch, actoff
        >>> @actoff.offload(policy="cpu", min_bytes=0)
        ... class Block(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.linear = torch.nn.Linear(8, 8)
        ...     def forward(self, x):
        ...         return self.linear(x).relu()
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> Block()(x).sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])
    """
    if obj is None:
        return lambda target: offload(target, config=config, name=name, **overrides)
    return _scope(obj, _ScopeSpec(config, overrides, name))


def _scope(obj: T, spec: _ScopeSpec) -> T:
    """``obj`` made a scope of ``spec`` (see `offload`)."""
    if isinstance(obj, type):
        if not issubclass(obj, torch.nn.Module):
            raise TypeError(
                f"offload() takes an nn.Module subclass, a module or a function; got class {obj.__name__}"
            )
        original = getattr(obj.forward, "__wrapped__", obj.forward)
        obj.forward = _wrap_method(original, spec)  # type: ignore[method-assign]
        return obj
    if isinstance(obj, torch.nn.Module):
        module = obj
        previous = module.__dict__.get("forward")
        original = getattr(previous, "__wrapped__", None) or type(module).forward
        module.forward = types.MethodType(_wrap_method(original, spec), module)
        return obj  # type: ignore[return-value]
    if callable(obj):
        original = getattr(obj, "__wrapped__", obj) if hasattr(obj, _SPEC_ATTR) else obj
        default = getattr(original, "__qualname__", repr(original))

        eager, compiled = _entry_points()

        @functools.wraps(original)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            # Note [compile] (actoff.scope.compile): a graph break around a compiled body.
            if torch.compiler.is_compiling():
                return compiled(spec, None, default, original, args, kwargs)
            return eager(spec, None, default, original, args, kwargs)

        setattr(scoped, _SPEC_ATTR, spec)
        return scoped  # type: ignore[return-value]
    raise TypeError(
        f"offload() takes an nn.Module subclass, a module or a function; got {type(obj).__name__}"
    )


def _wrap_method(original: Callable[..., Any], spec: _ScopeSpec) -> Callable[..., Any]:
    eager, compiled = _entry_points()

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Note [compile] (actoff.scope.compile): a graph break around a compiled body.
        if torch.compiler.is_compiling():
            return compiled(spec, self, type(self).__name__, original, args, kwargs)
        return eager(spec, self, type(self).__name__, original, args, kwargs)

    setattr(forward, _SPEC_ATTR, spec)
    return forward


def _entry_points() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The eager and the compiled scope call; imported when the first scope is made, as they
    import Dynamo (actoff.scope.compile)."""
    from .compile import compiled_scope, eager_scope

    return eager_scope, compiled_scope


def offload_(
    model: torch.nn.Module,
    *,
    block_cls: ModuleClasses | None = None,
    filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
    config: Config | None = None,
    **overrides: object,
) -> torch.nn.Module:
    """Make every matching submodule of ``model`` an offload scope, in place; return ``model``.

    Give exactly one of ``block_cls`` or ``filter_fn(module, qualified_name) -> bool``.
    ``block_cls`` is a class (``LlamaDecoderLayer``), a class name (``"LlamaDecoderLayer"``) or a
    list of them, such as a Hugging Face model's ``_no_split_modules``; a name matches a module
    whose class or a base class has that name. Each scope is named by its qualified name
    (``layers.3``) in `actoff.stats`. Works on unmodified modules: only their ``forward``
    attribute is set.

    Example:
        >>> import torch, actoff
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        >>> _ = actoff.offload_(model, block_cls="Linear", policy="keep")
        >>> model(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload_() takes an nn.Module, got {type(model).__name__}")
    if (block_cls is None) == (filter_fn is None):
        raise TypeError("offload_() needs exactly one of block_cls=... or filter_fn=(module, name) -> bool")
    _ScopeSpec(config, overrides, None, caller="offload_")  # validated and warned once, here
    matches = class_matcher(block_cls, "offload_(block_cls=...)") if block_cls is not None else filter_fn
    matched = 0
    for qualified, module in model.named_modules():
        if matches(module, qualified):  # type: ignore[misc]
            _scope(module, _ScopeSpec(config, overrides, qualified or type(module).__name__, caller=None))
            matched += 1
    if matched == 0:
        if block_cls is None:
            raise ValueError(
                f"offload_(): no submodule of {type(model).__name__} matched filter_fn; nothing would be offloaded"
            )
        raise nothing_matched("offload_", model, f"block_cls={block_cls!r}", "offloaded")
    return model


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Run a region without actoff (e.g. the output head): saved tensors stay where they are.

    Example:
        >>> import torch, actoff
        >>> with actoff.no_offload():
        ...     y = torch.randn(3, requires_grad=True).exp()
    """
    state = get_runtime().thread
    state.disabled += 1
    try:
        yield
    finally:
        state.disabled -= 1
