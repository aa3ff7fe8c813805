"""Placements: what one scope run's saved tensors become, one class per kind (Note [placements]).

- `base`: the `Placement` interface (the lifecycle hooks the runtime calls) and `Call`, one call
  of a scope; the base class stores every record whole on the policy's tier (``cpu``, ``nvme``).
- `whole`: ``keep`` (saves left as they are) and the whole-tier placement.
- `tokenwise`: records split by token range, the dropped rows recomputed (``tokenwise``,
  ``recompute``).
- `checkpoint`: the block's inputs stored, the whole block run again in backward.
- `chunked`: the block's inputs stored, its backward run in token chunks (Note [chunked backward]).
- `measuring`: the auto policy's measuring steps (every save streamed, the bytes sorted).

The registry below maps the placement names of the policy table (actoff.policy) to classes:

>>> from actoff.policy import spec
>>> placement_class(spec("cpu").placement).__name__, placement_class(spec("recompute").placement).name
('Placement', 'tokenwise')
"""

from __future__ import annotations

import threading

from actoff import policy
from actoff.policy import PolicySpec

from .base import Call, Placement
from .checkpoint import CheckpointPlacement
from .chunked import ChunkedPlacement
from .tokenwise import TokenwisePlacement
from .whole import KeptPlacement, WholePlacement

__all__ = ["Call", "Placement", "placement_class", "register", "unregister"]

_CLASSES: dict[str, type[Placement]] = {
    "kept": KeptPlacement,
    "whole": WholePlacement,
    "tokenwise": TokenwisePlacement,
    "checkpoint": CheckpointPlacement,
    "chunked": ChunkedPlacement,
}
_lock = threading.Lock()


def placement_class(name: str) -> type[Placement]:
    """The placement class registered under ``name`` (a `PolicySpec.placement`)."""
    try:
        return _CLASSES[name]
    except KeyError:
        raise ValueError(
            f"actoff: no placement class is registered as {name!r} (registered: {sorted(_CLASSES)}); "
            "register one with actoff.runtime.placements.register"
        ) from None


def register(entry: PolicySpec, placement: type[Placement] | None = None) -> PolicySpec:
    """Add a policy: its entry in the policy table (Note [the policy table]) and, when it brings
    one, its placement class under ``entry.placement``. From then on ``ACTOFF_POLICY`` and
    ``offload_(policy=...)`` accept its name.

    Example:
        >>> from actoff.policy import PolicySpec
        >>> class Everything(Placement):
        ...     name = "everything"
        >>> _ = register(PolicySpec("everything", placement="everything", tier="cpu"), Everything)
        >>> from actoff import Config
        >>> Config(policy="everything").policy
        'everything'
        >>> unregister("everything")
    """
    if placement is not None:
        if not (isinstance(placement, type) and issubclass(placement, Placement)):
            raise TypeError(
                f"a placement class derives from actoff.runtime.placements.Placement, got {placement!r}"
            )
        with _lock:
            if _CLASSES.get(entry.placement, placement) is not placement:
                raise ValueError(f"another placement class is registered as {entry.placement!r}")
            _CLASSES[entry.placement] = placement
    elif entry.placement not in _CLASSES and not entry.planned:
        raise ValueError(
            f"policy {entry.name!r} names placement {entry.placement!r}, which is not registered"
        )
    return policy.register(entry)


def unregister(name: str) -> None:
    """Remove policy ``name`` added by `register` (and its placement class, if no other policy
    names it). Built-in policies stay."""
    with _lock:
        entry = policy.unregister(name)
        named = entry is not None and any(
            other.placement == entry.placement for other in policy.POLICIES.values()
        )
        if entry is not None and not named and entry.placement not in _BUILT_IN:
            _CLASSES.pop(entry.placement, None)


_BUILT_IN = frozenset(_CLASSES)
