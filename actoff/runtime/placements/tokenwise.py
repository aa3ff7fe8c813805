"""The token-wise placement: a block's activations split by token range between host, NVMe and
recompute (the ``tokenwise`` and ``recompute`` policies, and the auto policy's ``tokenwise:A``).

The run's token-wise state is a `Split` (actoff.tiers.tokenwise.split), its split records live on
the token-wise tier (actoff.tiers.tokenwise.tier); this placement drives them along the run's life:
the inputs and the RNG captured before the body runs, the token mixers watched while it runs,
the split decided at the scope's exit, the probe in the first backward (Note [probe in the first
backward]). A block that cannot be split under its conditions is placed whole.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from actoff.policy import token_fractions
from actoff.tiers.record import Record
from actoff.tiers.tokenwise.mixers import CaptureMode, CollectiveWatch
from actoff.tiers.tokenwise.probes import ModuleProbes
from actoff.tiers.tokenwise.split import Split
from actoff.tiers.tokenwise.tier import TOKENWISE

from ..enclosing import warn_checkpointed
from .base import Call, Placement

if TYPE_CHECKING:
    import torch

    from ..step import ScopeRun

__all__ = ["TokenwisePlacement"]


class TokenwisePlacement(Placement):
    """Records split by token range, the dropped rows recomputed in backward (Note [token-wise
    re-run], actoff.tiers.tokenwise.slices). ``planned``: the token fractions the auto policy's
    plan gives the run (None: the policy's own, or none while auto measures)."""

    name = "tokenwise"
    needs_call = True
    stores_whole = False

    def __init__(
        self, run: ScopeRun, tier: str | None = None, planned: tuple[float, float] | None = None
    ) -> None:
        super().__init__(run, tier)
        self.planned = planned
        self.split = Split(run)
        self.active = True  # False: nothing to slice, or not under these conditions (placed whole)
        self.notes_saves, self.shares_views = True, False

    # ------------------------------------------------------------------ forward
    def capture(self, call: Call) -> None:
        """Before the body runs: what a re-run needs, and what probes learned of the block."""
        run = self.run
        learned = run.runtime.probe_results.setdefault(call.owner, ModuleProbes)
        if not self.split.capture(
            call.fn, call.module, call.flattened(run.device, run.config.token_dim), learned
        ):
            self.active = False  # placed whole: the pack hook treats it as such
            self.notes_saves, self.shares_views = False, True
            if (
                self.asks_recompute and self.split.conditions not in learned.verdicts
            ):  # else said at the verdict
                self.say_whole("no-token-dim")

    def forward(self, call: Call) -> Any:
        if not self.active:
            return call.run()
        split = self.split
        # A block about to be probed is watched for collectives (CollectiveWatch).
        watch = CollectiveWatch(split) if split.probed is None else contextlib.nullcontext()
        with CaptureMode(split), watch:
            return call.run()

    def note_save(self, index: int) -> None:
        split = self.split
        if not split.in_mixer:
            split.events.append(index)

    def classify(self, record: Record, tensor: torch.Tensor) -> None:
        self.split.classify(record, tensor)

    @property
    def asks_recompute(self) -> bool:
        return sum(token_fractions(self.run.config, self.planned)) < 1.0

    def say_whole(self, key: str) -> None:
        """One warning per cause (Note [no silent downgrade]): the run's block, and why."""
        run = self.run
        run.runtime.warn_once(
            f"whole:{key}",
            f"actoff: block {run.name!r} (and any others like it) recomputes nothing under the "
            f"{run.config.policy!r} policy: {self.whole_because}. Its activations are stored whole "
            f"({self.tier.name}); gradients stay exact. actoff.stats().blocks[name].stored_whole says "
            "so per block.",
        )

    def seal(self) -> list[object]:
        if not self.active:
            return []
        run, split = self.run, self.split
        split.prepare(token_fractions(run.config, self.planned))
        if split.saved_elsewhere is not None:
            warn_checkpointed(run.runtime.warn_once, run.config, run.name, split.saved_elsewhere)
        if split.records or split.probe_pending:
            return []
        if split.saved_elsewhere is not None:  # said by `warn_checkpointed`
            self.whole_because = (
                "its body runs under a checkpoint inside the scope: its inputs only are stored"
            )
        elif self.asks_recompute and not self.whole_because:
            self.whole_because = (
                "none of its saved tensors could be split by token under these conditions (each is "
                "smaller than min_bytes, a parameter, or has no token dimension at the input's length)"
            )
            self.say_whole("nothing-split")
        # Nothing will be re-run: inputs and mixer outputs only actoff holds go now.
        unneeded, split.owned = split.owned, []
        return unneeded

    def place(self) -> None:
        split = self.split
        splits = self.splits
        if splits:
            TOKENWISE.place_split(split)
        super().place()  # what stays whole: inputs, attention's saves, records not split
        if self.active and not splits and not split.probe_pending:
            split.owned.clear()  # nothing will be recomputed: inputs and mixer outputs go

    def records(self) -> tuple[Record, ...]:
        if not self.active:
            return tuple(self.run.records)
        return (*self.run.records, *self.split.children)

    # ------------------------------------------------------------------ backward
    def reached(self) -> None:
        if self.active and self.split.probe_pending:
            TOKENWISE.probe(self.split)  # Note [probe in the first backward]

    def backward_ended(self) -> None:
        self.split.recomputed_rows = None

    def released(self, record: Record) -> None:
        if self.active:
            self.split.released_record(record)

    def let_go(self) -> None:
        # Nothing of the step can be rebuilt now: the forward it would re-run holds its module
        # (a deleted model is freed at once), and the inputs and mixer outputs it holds as they
        # are (those under min_bytes, a rotary table, say) go now, not when the collector breaks
        # the step's cycles: held till then, they sat on the device into the next step.
        split = self.split
        split.fn = split.module = split.began = split.start = None  # the state holds the modules
        split.inputs, split.mixer_outputs = [], []

    def aborted(self) -> None:
        self.split.owned.clear()

    @property
    def in_mixer(self) -> bool:
        return self.active and self.split.in_mixer > 0

    # ------------------------------------------------------------------ for the auto policy
    @property
    def splits(self) -> bool:
        return self.active and bool(self.split.records)

    @property
    def probe_passed(self) -> bool:
        """Whether the block may be recomputed token-wise under these conditions (its probe, run
        in this step's backward or learned before, passed)."""
        split = self.split
        return self.active and split.learned is not None and split.conditions in split.learned.results

    @property
    def rerun_unsafe(self) -> bool:
        split = self.split
        return self.active and (split.collective is not None or split.writes_inputs or split.writes_state)

    def saved_by_class(self, input_bytes: int) -> tuple[int, int, int, bool] | None:
        split = self.split
        if not self.active:
            return super().saved_by_class(input_bytes)
        if split.probe_pending:
            return None  # stored whole, probed in its backward: the next step sorts its bytes
        if split.records:
            total = sum(record.geometry.nbytes for record in self.run.records)
            inputs = {id(v): v.geometry.nbytes for v in split.inputs if isinstance(v, Record)}
            local = sum(record.geometry.nbytes for record in split.records)
            stored = sum(inputs.values())
            return stored, total - stored - local, local, True
        if split.ranges is not None and split.ranges.cpu_end == split.seq_len:
            return None
        return super().saved_by_class(input_bytes)

    def time_mixers(self) -> None:
        self.split.mixer_watches = []

    def mixers_ms(self) -> float | None:
        watches = self.split.mixer_watches
        if not self.active or watches is None:
            return None
        total = 0.0
        for watch in watches:
            watch.synchronize()
            total += watch.elapsed_ms()
        return total
