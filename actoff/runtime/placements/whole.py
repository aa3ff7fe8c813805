"""Whole placements: every saved tensor kept on the device as it is (``keep``), or stored whole on
the policy's tier (``cpu``, ``nvme``: the base `Placement` itself)."""

from __future__ import annotations

from .base import Placement

__all__ = ["KeptPlacement", "WholePlacement"]

#: Every record stored whole on the policy's tier (Note [placements]).
WholePlacement = Placement


class KeptPlacement(Placement):
    """Saves stay on the device as they are, with no record (Note [kept as is],
    actoff.runtime.hooks): nothing to place, fetch or release."""

    name = "keep"
    keeps_as_is = True
    stores_whole = False

    def place(self) -> None:
        """Nothing moves."""
