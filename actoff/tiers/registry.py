"""Policy names to tiers: the one table that says which tier object a whole-tensor policy uses.

>>> from actoff.tiers.registry import tier_named
>>> tier_named("cpu").name, tier_named("keep").name, tier_named("nvme").name
('cpu', 'keep', 'nvme')
"""

from __future__ import annotations

from .base import KEEP, Tier
from .cpu import CPU
from .nvme.tier import NVME

__all__ = ["TIERS", "tier_named"]

#: Whole-tensor tiers by name: the names of `actoff.policy.whole_tier` and of the statistics.
TIERS: dict[str, Tier] = {tier.name: tier for tier in (KEEP, CPU, NVME)}


def tier_named(name: str) -> Tier:
    """The tier object of a whole-tensor policy name (``keep``, ``cpu``, ``nvme``)."""
    try:
        return TIERS[name]
    except KeyError:
        raise ValueError(f"actoff internal error: no tier named {name!r} (known: {sorted(TIERS)})") from None
