"""Token plans: what a probe learned about a block, kept per module and per the conditions it ran
under, and forgotten when the module dies.

Note [probes per module and conditions]: what a probe (actoff.tiers.tokenwise.reforward.probe)
learned, the token dimension of each tensor a block saves and whether recomputed rows match,
is used only for the same owner (the module, or a function scope's function), held by identity
and weakly (`ByOwner`), under the same `conditions` key, for a forward that saves the same tensors. Applied to another module it
is wrong without a sound: a model rebuilt with the same layer names but with dropout would
recompute other masks (wrong gradients), one with eager attention would re-run attention on a
slice (a crash in backward). Under other conditions (a smaller last batch, autocast on,
adapters unfrozen, a dropout put in eval mode) or other saves (an attention implementation
switched in place) the records no longer line up. A block that cannot be recomputed under some
conditions is placed whole under them, with one warning per module.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from .mixers import autograd_status
from .tokens import Canon

__all__ = ["ByOwner", "ModuleProbes", "ProbeResult", "conditions", "transferred"]

V = TypeVar("V")

# Non-tensor inputs kept by value in the key; others by type (a cache object, say).
_BY_VALUE = (bool, int, float, str, bytes, torch.dtype, torch.device)


def conditions(values: list[Any], spec: Any, module: torch.nn.Module | None, grad_enabled: bool,
               autocast: tuple, seq_len: int | None = None) -> tuple:  # fmt: skip
    """What decides what a block saves, as a hashable key (Note [probes per module and conditions]).

    ``values`` are the flattened inputs and ``spec`` their pytree structure; ``autocast`` is
    `actoff.tiers.tokenwise.reforward.autocast_state`. Tensors count by shape (batch included), strides, dtype,
    device and how they take part in autograd; other inputs by value when plain, else by type;
    the module by the training flag of every submodule and the dtype, ``requires_grad`` and
    shape of every parameter. With ``seq_len``, the key of every length
    (Note [a probe serves other lengths]): dimensions of that length count as "a length" and
    strides by their order.

    >>> x = torch.zeros(2, 8, 4)
    >>> key = conditions([x], None, None, True, ())
    >>> key == conditions([torch.ones(2, 8, 4)], None, None, True, ())  # values do not count
    True
    >>> key == conditions([torch.zeros(1, 8, 4)], None, None, True, ())  # a smaller batch does
    False
    >>> conditions([x], None, None, True, (), 8) == conditions([torch.zeros(2, 5, 4)], None, None, True, (), 5)
    True
    """
    inputs = tuple(_input_key(value, seq_len) for value in values)
    if module is None:
        return (spec, inputs, grad_enabled, autocast)
    training = tuple(m.training for m in module.modules())
    parameters = tuple((p.dtype, p.requires_grad, p.shape) for p in module.parameters())
    return (spec, inputs, grad_enabled, autocast, training, parameters)


def _input_key(value: Any, seq_len: int | None) -> Any:
    if isinstance(value, torch.Tensor):
        strides = value.stride() if value.layout == torch.strided else value.layout
        shape = tuple(value.shape)
        if seq_len is not None:
            shape = tuple(-1 if n == seq_len else n for n in shape)
            if value.layout == torch.strided:  # their order, and whether they are dense
                strides = (
                    tuple(sorted(range(value.dim()), key=lambda i: -value.stride(i))),
                    value.is_contiguous(),
                )
        return (shape, strides, value.dtype, value.device, autograd_status(value))
    if value is None or type(value) in _BY_VALUE:
        return value
    return type(value)


@dataclass
class ProbeResult:
    """A verified probe: the token view of each record it splits (by record index), and what
    the forward it was probed on saved (`actoff.tiers.tokenwise.run.TokenwiseRun.saves`)."""

    canons: dict[int, Canon]
    saves: tuple


# Note [a probe serves other lengths]: a block saves the same tensors at every length, longer or
# shorter along their token dimension, so the probe of one length serves the others: where a
# forward under the same conditions but for the length (`conditions` with ``seq_len``) saved
# the same records in the same order, with the same dtypes and ranks, and each split record's
# token view differs from the probed one in its token dimension only (`transferred`), it is
# split at once. Nothing is taken on trust: the re-forward checks every record's shape, and
# backward checks each step's recomputed rows against the rows kept in forward (Note [sentinel
# rows]); a difference recomputes from the first token, exact, and places the block whole under
# those conditions. Without it a run whose length changes every step would store whole forever,
# each length waiting for its own probe (Note [probe in the first backward]).
def transferred(result: ProbeResult, saves: tuple, views: dict[int, tuple[tuple, tuple | None]],
                seq_len: int) -> ProbeResult | None:  # fmt: skip
    """``result`` (probed at another length) for a forward of ``seq_len`` tokens that made
    ``saves``, or ``None`` where the saves differ by more than their length (Note [a probe serves
    other lengths]). ``views`` gives each record's ``((shape, stride), base)``, ``base`` as in
    `actoff.tiers.tokenwise.tokens.base_info`.

    >>> probed = ProbeResult({0: Canon((2, 8, 4), (32, 4, 1), 1)}, ((0,), (((2, 8, 4), (32, 4, 1), "f", False),), 0))
    >>> saves = ((0,), (((2, 5, 4), (20, 4, 1), "f", False),), 0)
    >>> transferred(probed, saves, {0: (((2, 5, 4), (20, 4, 1)), None)}, 5).canons[0]
    Canon(shape=(2, 5, 4), stride=(20, 4, 1), dim=1, on_base=False)
    """
    events, records, mixers = saves
    old_events, old_records, old_mixers = result.saves
    if events != old_events or mixers != old_mixers or len(records) != len(old_records):
        return None
    for (size, _, *rest), (old_size, _, *old_rest) in zip(records, old_records, strict=True):
        if rest != old_rest or len(size) != len(old_size):  # dtype and whether stored whole
            return None
    canons = {}
    for index, canon in result.canons.items():
        view, base = views[index]
        if canon.on_base and base is None:
            return None
        shape, stride = base if canon.on_base else view
        if len(shape) != len(canon.shape) or shape[canon.dim] != seq_len:
            return None
        if any(n != m for i, (n, m) in enumerate(zip(shape, canon.shape, strict=True)) if i != canon.dim):
            return None
        canons[index] = Canon(tuple(shape), tuple(stride), canon.dim, canon.on_base)
    return ProbeResult(canons, saves)


@dataclass
class ModuleProbes:
    """What probes learned about one module (or function), per `conditions` key, and the last
    result per key of every length (Note [a probe serves other lengths])."""

    results: dict[tuple, ProbeResult] = field(default_factory=dict)
    verdicts: dict[tuple, str] = field(default_factory=dict)  # placed whole under these, and why
    any_length: dict[tuple, ProbeResult] = field(default_factory=dict)
    warned: bool = False  # one fallback warning per module, whatever the conditions

    def fall_back(self, conditions: tuple, block: str, tier: str, reason: str) -> None:
        """Place the module whole (on ``tier``) under ``conditions`` from now on, and say why
        once per module."""
        self.verdicts[conditions] = reason
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"actoff: block {block!r} cannot be recomputed token-wise: {reason}. Its activations are "
                f"placed whole ({tier}) when it runs under these conditions (input shapes, dtypes, "
                "autocast, training flags); gradients stay exact.",
                RuntimeWarning,
                stacklevel=4,
            )


class ByOwner(Generic[V]):
    """Values keyed by an object's identity (never its name, hash or ``==``), each dropped when
    its object dies. Objects that take no weak reference are held (so their id stays theirs).

    >>> import gc
    >>> plans = ByOwner()
    >>> module = torch.nn.Linear(2, 2)
    >>> plans.put(module, "learned") and plans.get(module)
    'learned'
    >>> del module; _ = gc.collect()
    >>> len(plans)
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
