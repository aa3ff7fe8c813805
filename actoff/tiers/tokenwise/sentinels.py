"""Sentinel rows: every step, token-wise recompute is checked against rows kept at forward time.

Note [sentinel rows]: every step, backward checks each split record's recomputed rows against
copies of a few of them kept at forward time (the first two of the range, which lack the most
tokens before them, and its last) before any row is used. The probe checks token locality once
per module and conditions (Note [probes per module and conditions], actoff.tiers.split.probes),
on that step's weights: it cannot see a path a weight switches off. A scan over tokens (a
cumulative sum, a state-space layer, a convolution over tokens) behind a gate that starts at
zero matches its probe exactly; once the gate has learned a value, recomputed rows miss what
the tokens before them contributed: wrong gradients, with nothing said. The check is a sample:
a difference confined to rows between the kept ones (data-dependent routing) goes unseen.

The cost is one wait for the device per block and step, and three rows per record. Rows are
compared within float32 reassociation of each value plus the rows' mean magnitude (a large
feature does not hide the others), or within a bf16 rounding when the block computes in half
precision: autocast, weights or inputs (`actoff.tiers.split.slices.rows_differ`,
`actoff.tiers.split.slices.low_precision`). On a difference the rows are recomputed from
the first token (exact: that re-run has every token the forward had; only rows
``[start, stop)`` of it are kept), the block is placed whole under these conditions from then
on, and a warning says why, once per block. If the rows recomputed from the first token differ
too, the block computes something else in backward (changed weights or state, nondeterministic
operations): an error, since training must not go on with a wrong activation. ``ACTOFF_VERIFY``
adds a copy of one whole recomputed range every ``verify_interval`` steps, checked the same way.

A range that starts at the first token (``recompute``: every token re-run) lacks nothing and
keeps no sentinels.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from actoff.policy import whole_tier

from . import slices
from .mixers import RerunMismatch

if TYPE_CHECKING:
    from .split import Split

__all__ = ["checked_recompute", "keep"]


def keep(split: Split, start: int, stop: int) -> None:
    """At forward: copies of the rows of ``[start, stop)`` that backward checks, for each of the
    records ``split`` splits, in ``split.checks``."""
    run = split.run
    if start > 0:  # rows re-run without the tokens before them
        picked = tuple(sorted({0, min(1, stop - start - 1), stop - start - 1}))
        for record in split.records:
            kept = record.canon.view(record.geometry.flat(record.device_tensor.detach()))
            copy = _rows(kept.narrow(record.canon.dim, start, stop - start), record.canon.dim, picked)
            split.checks.append((record.index, picked, copy))
    if run.config.verify and run.step_number % run.config.verify_interval == 0:
        record = split.records[0]  # ACTOFF_VERIFY: one whole range, in host memory
        kept = record.canon.view(record.geometry.flat(record.device_tensor.detach()))
        whole = kept.narrow(record.canon.dim, start, stop - start).to("cpu", copy=True)
        split.checks.append((record.index, None, whole))


def checked_recompute(split: Split, start: int, stop: int) -> dict[int, torch.Tensor]:
    """At backward: the recomputed rows ``[start, stop)`` of every split record (by record index),
    checked against the copies `keep` made; recomputed from the first token on a difference."""
    mismatch = None
    try:
        rows = slices.recompute(split, start, stop)
    except RerunMismatch as error:
        # Saved other tensors on the slice than the forward did (a probe of another length that
        # does not fit this one: Note [a probe serves other lengths]): from the first token, the
        # re-run is the forward itself.
        if start == 0:
            raise
        rows, mismatch = None, str(error)
    if rows is not None and (not split.checks or not _differ(split, rows)):
        split.checks.clear()
        return rows
    run = split.run
    del rows  # before the re-run from the first token, which keeps only rows [start, stop)
    rows = slices.recompute(split, 0, stop, keep_from=start)
    if _differ(split, rows):
        raise RuntimeError(
            f"actoff: recomputed token rows [{start}, {stop}) of a saved activation of block "
            f"{run.name!r} differ from the copy kept at forward time, even recomputed from the first "
            "token: the block computed something else in backward (changed weights or state, "
            "nondeterministic ops). The step cannot continue with this activation."
        )
    split.checks.clear()
    if mismatch is not None:
        reason = f"its re-run on token rows [{start}, {stop}) did not save what the forward saved: {mismatch}"
    else:
        reason = (
            f"its recomputed token rows [{start}, {stop}) differed from the forward's though its first "
            "step's probe matched: it mixes tokens outside a registered token mixer (a scan, a cumulative "
            "sum, a convolution over tokens) through weights that were zero then, or its kernels round "
            "otherwise on fewer rows"
        )
    learned = split.learned
    first = split.conditions not in learned.verdicts  # not already by a run of an earlier step
    learned.results.pop(split.conditions, None)
    learned.any_length.pop(split.any_length, None)  # other lengths are probed on their own
    learned.verdicts[split.conditions] = reason
    learned.warned = True  # one warning per module: a probe of it that fails later says nothing
    if first:
        warnings.warn(
            f"actoff: block {run.name!r}: {reason}. This step recomputed them from the first token; "
            f"under these conditions the block is placed whole ({whole_tier(run.config)}) from now "
            "on. Gradients stay exact. To recompute it token-wise, register the function that mixes "
            "tokens with actoff.register_token_mixer.",
            RuntimeWarning,
            stacklevel=2,
        )
    return rows


def _differ(split: Split, rows: dict[int, torch.Tensor]) -> bool:
    """Whether any kept copy differs from the same rows of ``rows`` (one wait for the device)."""
    dims = {record.index: record.canon.dim for record in split.records}
    pairs = []
    for index, picked, kept in split.checks:
        recomputed = rows[index].detach()
        if picked is None:  # a whole range, kept in host memory
            pairs.append((kept, recomputed.cpu()))
        else:
            pairs.append((kept, _rows(recomputed, dims[index], picked)))
    return slices.rows_differ(pairs, half=split.half_precision)


def _rows(tensor: torch.Tensor, dim: int, picked: tuple[int, ...]) -> torch.Tensor:
    """Rows ``picked`` of ``tensor`` along ``dim``, copied (no index tensor: nothing to copy to the
    device, which would wait for it)."""
    return torch.cat([tensor.narrow(dim, row, 1) for row in picked], dim)
