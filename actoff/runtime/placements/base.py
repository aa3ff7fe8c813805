"""The placement interface: the lifecycle hooks the runtime calls for every scope run.

Note [placements]: a placement is the object that decides, for one scope run, what its saved
tensors become. The runtime drives every run along one path and calls its placement at each
moment of the run's life, never asking which policy runs:

- ``capture(call)``: before the body runs, take what a re-run will need (inputs, RNG state).
- ``forward(call)``: run the block's body (under the scope's saved-tensor hooks, already
  installed); a placement may wrap it (checkpoint runs it without grad, token-wise watches its
  token mixers).
- at every save (the pack hook, Note [pack is hot]): ``keeps_as_is`` (no record: Note [kept as
  is]), ``shares_views`` (Note [views of one storage]) and, where ``notes_saves``, `note_save`
  and `classify` (token-wise: the order of the saves, and which are attention's).
- ``seal()``: the scope exits; decide what to place (returns what actoff let go of, dropped
  outside the runtime's lock).
- ``place()``: the run is older than ``keep_last``: start its copies out.
- ``reached()``: backward's first unpack in the run, after its records started coming back.
- ``backward_ended()``, ``released(record)``, ``let_go()`` (nothing of its step can run again),
  ``aborted()`` (an exception in the block).

A policy is an entry of the policy table (actoff.policy, Note [the policy table]) that names its
placement class; adding a policy is a `PolicySpec` and a subclass of `Placement`
(actoff.runtime.placements.register). The auto policy assigns each run one of the built-in
placements from its plan (actoff.runtime.auto).

Note [no silent downgrade]: a placement whose policy asks for activations to be recomputed
(`asks_recompute`: token-wise with fewer than all tokens stored, ``recompute``, ``checkpoint``)
and that stores them whole instead (the block cannot be re-run under its conditions, nothing of
it splits by token, a cache it must not write twice) sets ``whole_because``, and the reason is
said twice: once as a warning per cause when it first happens (the probe's verdict, the cache's
refusal, `TokenwisePlacement.say_whole`), and in every step's ``actoff.stats().blocks[name].
stored_whole``, so a log of the statistics shows it too. A tier that took nothing (the host
budget full) says so in ``over_budget_bytes`` and one warning (actoff.tiers.cpu); a budget plan
that could not fit in ``steps_over_budget`` (actoff.runtime.over_budget).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from actoff.policy import whole_tier
from actoff.rerun.conditions import FlatCall
from actoff.tiers.record import Record, State
from actoff.tiers.registry import tier_named

if TYPE_CHECKING:
    from actoff.tiers.base import Tier

    from ..step import ScopeRun

__all__ = ["Call", "Placement"]


@dataclass
class Call:
    """One call of a scope: its body and arguments (the block's module, or ``None`` for a function
    scope), flattened once when a placement or the auto policy asks (`flattened`)."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    module: torch.nn.Module | None
    flat: FlatCall | None = field(default=None, repr=False)

    @property
    def owner(self) -> Any:
        """What is learned about the block belongs to: its module, or a function scope's function."""
        return self.module if self.module is not None else self.fn

    def flattened(self, device: torch.device, token_dim: int) -> FlatCall:
        """The call flattened (`FlatCall`), computed at the first ask."""
        if self.flat is None:
            self.flat = FlatCall.of(self.args, self.kwargs, self.module, device, token_dim)
        return self.flat

    def run(self) -> Any:
        """The body, as the program called it."""
        return self.fn(*self.args, **self.kwargs)


class Placement:
    """What one scope run's saved tensors become (Note [placements]). This base class stores every
    record whole on the policy's tier: the ``cpu`` and ``nvme`` policies' placement."""

    #: Shown in messages and statistics.
    name: ClassVar[str] = "whole"
    #: Saves get no record: autograd holds the tensors as they are (Note [kept as is]).
    keeps_as_is: ClassVar[bool] = False
    #: Runs the block's body again, so a compiled body (whose saves are the compiler's) cannot
    #: take it: such runs get the policy's whole-tier placement (actoff.scope.compile).
    needs_call: ClassVar[bool] = False
    #: Places every record whole on its tier as it is saved (Note [copy out at pack]): a subclass
    #: that chooses per record says False.
    stores_whole: ClassVar[bool] = True
    #: Under a window of blocks (``prefetch_depth``), its records start coming back at the first
    #: unpack of a run after it: False where they come back at its own (chunked: Note [no fetch
    #: ahead of chunks] in actoff.runtime.placements.chunked).
    fetches_ahead: ClassVar[bool] = True

    def __init__(self, run: ScopeRun, tier: str | None = None) -> None:
        self.run = run
        self.tier: Tier = tier_named(tier if tier is not None else whole_tier(run.config))
        # Views inside a record's span are served from it (Note [views of one storage]).
        self.shares_views = True
        # The pack hook calls `note_save` and `classify` (a token-wise run's order of saves).
        self.notes_saves = False
        # Its copies out finish before the next block runs, not alongside it (auto's measuring
        # steps: Note [measuring at the floor] in actoff.runtime.auto).
        self.finish_copies_first = False
        # Each record's copy out starts at pack (Note [copy out at pack]); the runtime turns it off
        # for the runs ``keep_last`` keeps and where nothing leaves the device.
        self.streams_out = self.stores_whole and self.tier.fetches
        # Why the run stored whole (Note [no silent downgrade]) what its policy re-runs ("": it
        # ran as asked, or its policy re-runs nothing).
        self.whole_because = ""

    # ------------------------------------------------------------------ forward
    def capture(self, call: Call) -> None:
        """Before the body runs (and before the auto policy times it): take what a re-run needs."""

    def forward(self, call: Call) -> Any:
        """Run the block's body (the scope's saved-tensor hooks are installed)."""
        return call.run()

    def note_save(self, index: int) -> None:
        """The pack hook saw a save: the record ``index`` it became (-1: not a record)."""

    def classify(self, record: Record, tensor: torch.Tensor) -> None:
        """A new record of the forward, from ``tensor``."""

    def seal(self) -> list[object]:
        """The scope exits (the runtime's lock held): decide what to place. Returns what actoff
        held and no longer needs, for the caller to drop outside the lock."""
        return []

    def place(self) -> None:
        """Start moving the run's records off the device (the run is older than ``keep_last``)."""
        tier = self.tier
        for record in self.run.records:
            if record.state is State.RESIDENT:
                tier.place(record)

    def records(self) -> tuple[Record, ...]:
        """Every record the run's bytes live in: its own and any a tier made for it."""
        return tuple(self.run.records)

    # ------------------------------------------------------------------ backward
    def reached(self) -> None:
        """Backward's first unpack in the run, after its records started coming back."""

    def backward_ended(self) -> None:
        """The backward that reached the run is over (retain_graph may bring another)."""

    def released(self, record: Record) -> None:
        """One of the run's records was released."""

    def let_go(self) -> None:
        """Nothing of the run's step can run again: let go of what a re-run would need."""

    def aborted(self) -> None:
        """An exception inside the block: nothing will be placed."""

    def host_refused(self, record: Record) -> bool:
        """The host budget had no room for ``record``: True where the placement takes care of it
        (auto's measuring, Note [measuring where the host is small]); else it stays on the device."""
        return False

    @property
    def in_mixer(self) -> bool:
        """Whether the block is inside a token mixer's call now (its saves are the mixer's)."""
        return False

    # ------------------------------------------------------------------ for the auto policy
    @property
    def asks_recompute(self) -> bool:
        """Whether the run's policy asks for some of its activations to be recomputed (a re-run
        of the block in backward), not stored: Note [no silent downgrade]."""
        return False

    @property
    def splits(self) -> bool:
        """Whether the run splits records by token (else it stores them whole or keeps them)."""
        return False

    @property
    def rerun_unsafe(self) -> bool:
        """Whether running the block again would not give its forward's values: its forward
        called a collective outside a token mixer (a re-run on one rank would call it again),
        wrote into an input in place (Note [inputs changed in place]) or into a parameter (Note
        [runs again start where the forward did])."""
        return False

    def saved_by_class(self, input_bytes: int) -> tuple[int, int, int, bool] | None:
        """The run's saved bytes by class: inputs (``input_bytes`` of them, as the call's
        arguments said), attention's saves and what else is stored whole, the token-local rest;
        and whether it splits by token. None when it cannot tell yet."""
        total = sum(record.geometry.nbytes for record in self.run.records)
        input_total = min(input_bytes, total)
        return input_total, 0, total - input_total, False

    def time_mixers(self) -> None:
        """Time the token mixers' calls in this forward (`mixers_ms`), where the placement sees them."""

    def mixers_ms(self) -> float | None:
        """The token mixers' time in this forward, or None when not timed."""
        return None
