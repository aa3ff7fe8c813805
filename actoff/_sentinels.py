"""Sentinel rows: every step, token-wise recompute is checked against rows kept at forward time.

Note [sentinel rows]: the probe checks a block's token locality once per module and conditions
(Note [plans per module and conditions], actoff._plans), on the weights of that step; it cannot
see a path that a weight switches off. A block that adds a scan over tokens (a cumulative sum, a
state-space layer, a convolution over tokens) through a gate that starts at zero, as gates and
adapters often do, matches its probe exactly; once the gate has learned a value, its recomputed
rows miss what the tokens before them contributed: wrong gradients, with nothing said. So every
step, forward keeps copies of a few recomputed rows of every split record: the first two of the
range (they lack the most tokens before them) and its last. Backward checks the re-forward
against them before any row is used: one wait for the device per block and step, and three rows
per record of memory. On a difference the rows are recomputed from the first token (exact: that
re-forward has every token the forward had), the block is placed whole under these conditions
from then on, and a warning says why. If even those rows differ, the block computes something
else in backward (changed weights or state, nondeterministic operations): an error, since
training must not go on with a wrong activation. ``ACTOFF_VERIFY`` adds a copy of one whole
recomputed range every ``verify_interval`` steps, checked the same way.

A range that starts at the first token (``recompute``: every token re-run) lacks nothing and
keeps no sentinels.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from . import _replay
from ._policy import whole_tier

__all__ = ["checked_replay", "keep"]


def keep(tokenwise: Any, start: int, stop: int) -> None:
    """At forward: copies of the rows of ``[start, stop)`` that backward checks, for each of the
    records ``tokenwise`` (an actoff._tokenwise.TokenwiseRun) splits, in ``tokenwise.checks``."""
    run = tokenwise.run
    if start > 0:  # rows re-run without the tokens before them
        rows = sorted({start, min(start + 1, stop - 1), stop - 1})
        picked = torch.tensor(rows, device=run.device)
        for record in tokenwise.split_records:
            kept = record.canon.view(record.layout.flat(record.device_tensor.detach()))
            copy = kept.index_select(record.canon.dim, picked)
            tokenwise.checks.append((record.index, picked - start, copy))
    if run.config.verify and run.step.number % run.config.verify_interval == 0:
        record = tokenwise.split_records[0]  # ACTOFF_VERIFY: one whole range, in host memory
        kept = record.canon.view(record.layout.flat(record.device_tensor.detach()))
        tokenwise.checks.append(
            (record.index, None, kept.narrow(record.canon.dim, start, stop - start).cpu())
        )


def checked_replay(tokenwise: Any, start: int, stop: int) -> dict[int, torch.Tensor]:
    """At backward: the recomputed rows ``[start, stop)`` of every split record (by record index),
    checked against the copies `keep` made; recomputed from the first token on a difference."""
    rows = _replay.replay(tokenwise, start, stop)
    if not tokenwise.checks or not _differ(tokenwise, rows):
        tokenwise.checks.clear()
        return rows
    run = tokenwise.run
    dims = {record.index: record.canon.dim for record in tokenwise.split_records}
    whole = _replay.replay(tokenwise, 0, stop)
    rows = {index: tensor.narrow(dims[index], start, stop - start) for index, tensor in whole.items()}
    if _differ(tokenwise, rows):
        raise RuntimeError(
            f"actoff: recomputed token rows [{start}, {stop}) of a saved activation of block "
            f"{run.name!r} differ from the copy kept at forward time, even recomputed from the first "
            "token: the block computed something else in backward (changed weights or state, "
            "nondeterministic ops). The step cannot continue with this activation."
        )
    tokenwise.checks.clear()
    reason = (
        f"its recomputed token rows [{start}, {stop}) differed from the forward's though its first "
        "step's probe matched: it mixes tokens outside a registered token mixer (a scan, a cumulative "
        "sum, a convolution over tokens) through weights that were zero then"
    )
    tokenwise.learned.plans.pop(tokenwise.conditions, None)
    tokenwise.learned.verdicts[tokenwise.conditions] = reason
    warnings.warn(
        f"actoff: block {run.name!r}: {reason}. This step recomputed them from the first token; under "
        f"these conditions the block is placed whole ({whole_tier(run.config)}) from now on. Gradients "
        "stay exact. To recompute it token-wise, register the function that mixes tokens with "
        "actoff.register_token_mixer.",
        RuntimeWarning,
        stacklevel=2,
    )
    return rows


def _differ(tokenwise: Any, rows: dict[int, torch.Tensor]) -> bool:
    """Whether any kept copy differs from the same rows of ``rows`` (one wait for the device)."""
    dims = {record.index: record.canon.dim for record in tokenwise.split_records}
    pairs = []
    for index, picked, kept in tokenwise.checks:
        replayed = rows[index].detach()
        if picked is None:  # a whole range, kept in host memory
            pairs.append((kept, replayed.cpu()))
        else:
            pairs.append((kept, replayed.index_select(dims[index], picked)))
    return _replay.rows_differ(pairs)
