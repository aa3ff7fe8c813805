"""Token plans: what a probe learned about a block, kept per module and per the conditions it ran
under, and forgotten when the module dies.

Note [probes per module and conditions]: what a probe (actoff.tiers.tokenwise.slices.probe)
learned, the token dimension of each tensor a block saves and whether recomputed rows match,
is used only for the same owner (the module, or a function scope's function), held by identity
and weakly (`ByOwner`), under the same `actoff.rerun.conditions.conditions` key, for a forward that saves the same tensors. Applied to another module it
is wrong without a sound: a model rebuilt with the same layer names but with dropout would
recompute other masks (wrong gradients), one with eager attention would re-run attention on a
slice (a crash in backward). Under other conditions (a smaller last batch, autocast on,
adapters unfrozen, a dropout put in eval mode) or other saves (an attention implementation
switched in place) the records no longer line up. A block that cannot be recomputed under some
conditions is placed whole under them, with one warning per module.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from actoff.owners import Recent

from .tokens import Canon

#: Conditions a module's probe results are kept for (the most recent).
KEYS_KEPT = 32

__all__ = ["ModuleProbes", "ProbeResult", "transferred"]


@dataclass
class ProbeResult:
    """A verified probe: the token view of each record it splits (by record index), and what
    the forward it was probed on saved (`actoff.tiers.tokenwise.split.Split.saves`)."""

    canons: dict[int, Canon]
    saves: tuple


# Note [a probe serves other lengths]: a block saves the same tensors at every length, longer or
# shorter along their token dimension, so the probe of one length serves the others: where a
# forward under the same conditions but for the length (`conditions` with ``seq_len``) saved
# the same records in the same order, with the same dtypes and ranks, and each split record's
# token view differs from the probed one in its token dimension only (`transferred`), it is
# split at once. Nothing is taken on trust: the re-run checks every record's shape, and
# backward checks each step's recomputed rows against the rows kept in forward (Note [sentinel
# rows]); a difference recomputes from the first token, exact, and places the block whole under
# those conditions. Without it a run whose length changes every step would store whole forever,
# each length waiting for its own probe (Note [probe in the first backward]).
def transferred(
    result: ProbeResult, saves: tuple, views: dict[int, tuple[tuple, tuple | None]], seq_len: int
) -> ProbeResult | None:
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

    # Each keeps its most recent keys (Note [what a key keeps] in actoff.rerun.conditions).
    results: dict[tuple, ProbeResult] = field(default_factory=lambda: Recent(KEYS_KEPT))
    verdicts: dict[tuple, str] = field(
        default_factory=lambda: Recent(KEYS_KEPT)
    )  # placed whole under these, and why
    any_length: dict[tuple, ProbeResult] = field(default_factory=lambda: Recent(KEYS_KEPT))
    warned: bool = False  # one fallback warning per module, whatever the conditions
    # The chunked placement's: the conditions its probe passed under (Note [the chunked probe]),
    # and whether a forward in chunks changed the module's state (Note [state a chunked forward changes]).
    chunks_probed: set[tuple] = field(default_factory=set)
    changes_state: bool = False

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
