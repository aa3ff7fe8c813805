"""What a block's forward reaches outside its output (`Reached`): Note [state a chunked forward
changes] in actoff.runtime.placements.chunked, and the deeper levels of Note [re-runs leave no
trace] in actoff.rerun.isolation."""

from __future__ import annotations

import collections
import collections.abc
import functools
import types
import weakref
from typing import Any

import torch

__all__ = ["Reached", "holds_large", "large", "put_back", "settle"]

# torch's own attributes of every module (parameters, buffers, submodules, hook tables): the
# parameters and submodules are never bound back (a pre-hook may rebind parameters, as FSDP
# does), buffers are kept apart (`left_as_found`), the rest only by identity.
_TORCH_OWN = frozenset(torch.nn.Module().__dict__)
# The forward hooks' table is `forward_hooks_off`'s to lift and give back: bound back by a
# restore inside a run again, it would turn them on there.
_NEVER_BOUND_BACK = frozenset({"_parameters", "_modules", "_buffers", "_forward_hooks"})


#: Tensors held as plain attributes up to this size get their values back (larger ones their binding).
_ATTRIBUTE_VALUES_UP_TO = 1 << 20


def _modules_of(module: torch.nn.Module | None, touched: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules a re-run may change: ``module``'s, or for a function scope (``None``) those
    its forward ran (``touched``), with their submodules, each once."""
    roots = [module] if module is not None else touched
    found: dict[int, torch.nn.Module] = {}
    for root in roots:
        for sub in root.modules():
            found.setdefault(id(sub), sub)
    return list(found.values())


def large(value: Any) -> bool:
    """Whether ``value`` is a tensor over `_ATTRIBUTE_VALUES_UP_TO` bytes (no copy of it is taken)."""
    return isinstance(value, torch.Tensor) and value.numel() * value.element_size() > _ATTRIBUTE_VALUES_UP_TO


def holds_large(value: Any) -> bool:
    """Whether ``value`` is a tensor over 1 MiB (`large`) or a list, tuple or dictionary holding
    one (one level): what a state kept from forward to backward should not hold once unbound."""
    if isinstance(value, (list, tuple)):
        return any(large(item) for item in value)
    if isinstance(value, dict):
        return any(large(item) for item in value.values())
    return large(value)


#: Copies up to this size are kept from forward to backward whether or not the forward changed
#: them (a counter, a statistic: another forward of the block may change them before this one's
#: backward); larger ones only where it did, the others watched by version (`settle`).
_ALWAYS_KEPT_UP_TO = 64 << 10


def settle(
    values: list[tuple[torch.Tensor, torch.Tensor]], watched: list
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Of ``(tensor, copy)`` pairs taken before a forward, those to keep for its runs again:
    small ones, and those the forward changed; the others go, their tensors' versions added to
    ``watched`` (``(weak reference, version)``)."""
    kept = []
    with torch.no_grad():
        for tensor, copy in values:
            try:
                same = torch.equal(tensor.detach(), copy)
            except (NotImplementedError, RuntimeError):
                same = False
            if copy.numel() * copy.element_size() <= _ALWAYS_KEPT_UP_TO or not same:
                kept.append((tensor, copy))
            else:
                watched.append((weakref.ref(tensor), tensor._version))
    return kept


def put_back(tensor: torch.Tensor, copy: torch.Tensor) -> None:
    """Give ``tensor`` the values of ``copy`` through ``.data`` (unversioned), its shape too where
    the forward changed it (an observer's statistics sized at their first call)."""
    if tensor.shape == copy.shape and tensor.dtype == copy.dtype:
        tensor.data.copy_(copy)
    else:
        tensor.data = copy.clone()


class Reached:
    """What a block's forward can reach outside its output, as it is now: the buffers and
    attributes of ``module``'s modules and the plain objects among the flattened ``inputs``,
    through sequences, sets, mappings and objects' attributes (``__dict__`` or ``__slots__``), up
    to `_DEPTH` levels. `kept` names the floating tensors the forward bound or wrote since,
    `changed` tells whether anything walked differs, `restore` gives back the containers' items
    and small tensors' values.

    >>> layer = torch.nn.Linear(2, 2)
    >>> layer.logs = {"losses": []}
    >>> reached = Reached(layer, [])
    >>> layer.logs["losses"].append(layer(torch.ones(2)).square().mean())
    >>> reached.kept(), reached.changed(), (reached.restore(), layer.logs)[1]
    (["Linear.logs['losses'][0]"], True, {'losses': []})
    """

    def __init__(
        self, module: torch.nn.Module | None, inputs: list[Any], touched: list[torch.nn.Module] = ()
    ) -> None:
        self.modules = _modules_of(module, touched)
        self.inputs = [value for value in inputs if _walkable(value)]
        self.containers: list[tuple[Any, Any]] = []  # each container walked, with its items then
        tensors = self._walk(self.containers)
        self.then = {id(tensor): (tensor, tensor._version) for _, tensor in tensors}
        # Small tensors' values (a counter two levels down), for writes in place.
        self.values = [
            (tensor, tensor.detach().clone())
            for _, tensor in tensors
            if tensor.layout == torch.strided
            and tensor.numel() * tensor.element_size() <= _ATTRIBUTE_VALUES_UP_TO
        ]

    def _walk(self, containers: list | None = None) -> list[tuple[str, torch.Tensor]]:
        into = _Walk([], {}, containers)
        for sub in self.modules:
            kind = type(sub).__name__
            for name, value in vars(sub).items():
                if name not in _TORCH_OWN:
                    into.reach(value, f"{kind}.{name}", _DEPTH)
            for name, buffer in sub._buffers.items():
                into.reach(buffer, f"{kind}.{name}", 0)
        for value in self.inputs:
            into.reach(value, f"a given {type(value).__name__}", _DEPTH)
        return into.found

    def kept(self, *, requiring_grad: bool = False, written: bool = True) -> list[str]:
        """Where the floating tensors bound since (``written``: or written in place;
        ``requiring_grad``: only those that require it) are held (``Class.attribute[0]``)."""
        kept = []
        for where, tensor in self._walk():
            if not tensor.is_floating_point() or (requiring_grad and not tensor.requires_grad):
                continue
            then = self.then.get(id(tensor))
            if then is None or then[0] is not tensor or (written and then[1] != tensor._version):
                kept.append(where)
        return kept

    def changed(self) -> bool:
        """Whether a container walked holds other items, or a tensor walked is new or written."""
        if any(not _same_items(container, items) for container, items in self.containers):
            return True
        if any(not torch.equal(tensor.detach(), copy) for tensor, copy in self.values):
            return True
        for _, tensor in self._walk():
            then = self.then.get(id(tensor))
            if then is None or then[0] is not tensor or then[1] != tensor._version:
                return True
        return False

    def written(self, skip: set[int]) -> list[str]:
        """Where the tensors walked then (but those whose ids are in ``skip``) are held that were
        written in place since, with no copy of their values taken (over 1 MiB)."""
        copied = {id(tensor) for tensor, _ in self.values} | skip
        return [
            where
            for where, tensor in self._walk()
            if id(tensor) not in copied
            and self.then.get(id(tensor), (None,))[0] is tensor
            and self.then[id(tensor)][1] != tensor._version
        ]

    def trim(self, watched: list) -> None:
        """Keep what `restore` needs (`settle`), but not containers holding tensors over 1 MiB
        (`holds_large`): an activation logged in ``self.stats["last"]`` is not held until backward
        (such a container is left as it is when run again)."""
        self.then = {}
        self.values = settle(self.values, watched)
        self.containers = [
            (container, items)
            for container, items in self.containers
            if not any(holds_large(item) for item in (items.values() if isinstance(items, dict) else items))
        ]

    def restore(self) -> None:
        """Give the containers walked their items back, and small tensors their values, at every
        depth walked (`Found` gives back the modules' attributes and buffers)."""
        for container, items in self.containers:
            if _same_items(container, items):
                continue
            if isinstance(container, dict) or (hasattr(container, "clear") and hasattr(container, "update")):
                container.clear()
                container.update(items)
            elif isinstance(container, _Slots):
                for name, _ in container.items():
                    if name not in items:
                        delattr(container.owner, name)
                for name, value in items.items():
                    setattr(container.owner, name, value)
            else:  # a list or deque
                container.clear()
                container.extend(items)
        with torch.no_grad():
            for tensor, copy in self.values:
                if not torch.equal(tensor.detach(), copy):
                    put_back(tensor, copy)


#: How deep `Reached` looks: ``self.aux``, ``self.logs["losses"][0]``, ``self.holder.stats.loss``.
_DEPTH = 3
#: A container longer than this whose first this-many items are plain values (ints, strings) is
#: not walked further (a table of token counts).
_PLAIN_PREFIX = 64
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


class _Slots:
    """An object's ``__slots__`` attributes, as a container `Reached` walks and gives back."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def items(self) -> list[tuple[str, Any]]:
        names = [name for kind in type(self.owner).__mro__ for name in getattr(kind, "__slots__", ())]
        return [(name, getattr(self.owner, name)) for name in names if hasattr(self.owner, name)]


def _same_items(container: Any, items: Any) -> bool:
    if isinstance(container, _Slots):
        now = dict(container.items())
        return now.keys() == items.keys() and all(now[key] is items[key] for key in items)
    if isinstance(container, collections.abc.Mapping):
        return container.keys() == items.keys() and all(container[key] is items[key] for key in items)
    return len(container) == len(items) and all(a is b for a, b in zip(container, items, strict=False))


def _walkable(value: Any) -> bool:
    """An object whose attributes a forward might set: not a tensor, module, class, function,
    method, module of code or model configuration (a ``...Config``: Hugging Face's hold a hundred
    settings behind a slow ``__getattribute__``, two thirds of a layer's walk; a callable object, a
    collector of losses, is walked).

    >>> class LlamaConfig: pass
    >>> class Collector: pass
    >>> _walkable(LlamaConfig()), _walkable(Collector()), _walkable(torch.nn.Linear(1, 1))
    (False, True, False)
    """
    return (
        (hasattr(value, "__dict__") or hasattr(type(value), "__slots__"))
        and not isinstance(value, (torch.Tensor, torch.nn.Module, type, types.ModuleType, functools.partial))
        and not isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType))
        and not type(value).__name__.endswith("Config")
    )


class _Walk:
    """One walk of `Reached`: the tensors found (each once), the most depth each object was
    reached with (an object reached again with more depth is walked again), the containers."""

    def __init__(self, found: list, depths: dict[int, int], containers: list | None) -> None:
        self.found, self.depths, self.containers = found, depths, containers
        self.tensors: set[int] = set()

    def reach(self, value: Any, where: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in self.tensors:
                self.tensors.add(id(value))
                self.found.append((where, value))
            return
        if depth <= 0 or isinstance(value, _PLAIN) or self.depths.get(id(value), -1) >= depth:
            return
        first = id(value) not in self.depths
        self.depths[id(value)] = depth
        if isinstance(value, collections.abc.Mapping):
            pairs = list(value.items())
            self._keep(first, value, dict(pairs))
        elif isinstance(value, (list, tuple, collections.deque, set, frozenset)):
            pairs = list(enumerate(value))
            if isinstance(value, (list, collections.deque)):
                self._keep(first, value, [item for _, item in pairs])
        elif _walkable(value):
            owner = vars(value) if hasattr(value, "__dict__") else _Slots(value)
            pairs = list(owner.items())
            if hasattr(type(value), "__slots__") and hasattr(value, "__dict__"):
                pairs += _Slots(value).items()
            self._keep(first, owner, dict(pairs))
        else:
            return
        if len(pairs) > _PLAIN_PREFIX and all(isinstance(item, _PLAIN) for _, item in pairs[:_PLAIN_PREFIX]):
            return
        for key, item in pairs:
            self.reach(
                item,
                f"{where}[{key!r}]"
                if not isinstance(key, str) or isinstance(value, collections.abc.Mapping)
                else f"{where}.{key}",
                depth - 1,
            )

    def _keep(self, first: bool, container: Any, items: Any) -> None:
        if first and self.containers is not None:
            self.containers.append((container, items))
