"""Values keyed by an object's identity, dropped when the object dies: what actoff learns about a
module (probe results, the auto policy's measurements, settings said once) belongs to that module
object, never to its name (FIELD_NOTES: a module's name is not its identity)."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["ByOwner", "Recent"]

V = TypeVar("V")


class ByOwner(Generic[V]):
    """Values keyed by an object's identity (never its name, hash or ``==``), each dropped when
    its object dies. Objects that take no weak reference are held (so their id stays theirs).

    >>> import gc, torch
    >>> learned = ByOwner()
    >>> module = torch.nn.Linear(2, 2)
    >>> learned.put(module, "learned") and learned.get(module)
    'learned'
    >>> del module; _ = gc.collect()
    >>> len(learned)
    0
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, V]] = {}

    def get(self, owner: object) -> V | None:
        """The value of ``owner``, or ``None``."""
        found = self._entries.get(id(owner))
        if found is None:
            return None
        holder, value = found
        alive = holder() if isinstance(holder, weakref.ref) else holder
        return value if alive is owner else None

    def put(self, owner: object, value: V) -> V:
        """Set the value of ``owner`` (until ``owner`` dies); return ``value``."""
        key, entries = id(owner), self._entries

        def forget(ref: weakref.ref, key: int = key) -> None:
            if entries.get(key, (None,))[0] is ref:  # not a later owner's entry
                del entries[key]

        try:
            holder: Any = weakref.ref(owner, forget)
        except TypeError:
            holder = owner
        entries[key] = (holder, value)
        return value

    def setdefault(self, owner: object, factory: Callable[[], V]) -> V:
        """The value of ``owner``, made by ``factory()`` if it has none."""
        value = self.get(owner)
        return value if value is not None else self.put(owner, factory())

    def __len__(self) -> int:
        return len(self._entries)


K = TypeVar("K")


class Recent(collections.OrderedDict, Generic[K, V]):
    """A dict that keeps its ``limit`` most recently set or read entries: what is learned per
    conditions or per step of blocks stays bounded however many a run goes through (Note [what a
    key keeps] in actoff.rerun.conditions).

    >>> seen = Recent(limit=2)
    >>> seen["a"], seen["b"] = 1, 2
    >>> seen.get("a"); seen["c"] = 3
    1
    >>> list(seen)
    ['a', 'c']
    """

    def __init__(self, limit: int = 64) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def get(self, key: K, default: V | None = None) -> V | None:
        if key in self:
            self.move_to_end(key)
            return super().__getitem__(key)
        return default
