"""The token-wise tier: where a split record lives between forward and backward, and how it is
rebuilt. Stateless, as every tier: a split record's state is its `Split` (``record.split``).

At placement the stored token rows of every split record are gathered into one buffer per tier
(host, NVMe), copied out as records of their own; in backward a split record is rebuilt from
them, its dropped rows recomputed by re-running the block on them (actoff.tiers.tokenwise.slices),
checked every step against a few rows kept at forward time (Note [sentinel rows],
actoff.tiers.tokenwise.sentinels).
"""

from __future__ import annotations

import torch

from actoff.tiers.base import Tier
from actoff.tiers.record import Record, State, serve
from actoff.tiers.registry import tier_named

from . import sentinels, slices
from .probes import ProbeResult
from .rows import gather_rows, scatter_rows
from .split import Split

__all__ = ["TOKENWISE", "TokenwiseTier"]


class TokenwiseTier(Tier):
    """Split records: their stored rows in packed records of other tiers, the rest recomputed."""

    name = "tokenwise"

    # ------------------------------------------------------------------ forward
    def place_split(self, split: Split) -> None:
        """Gather the stored token rows of every record ``split`` splits into one buffer per tier
        and start their copies out; the split records move here, to be rebuilt in backward."""
        run, ranges = split.run, split.ranges
        for tier, (low, high) in (("cpu", (0, ranges.cpu_end)), ("nvme", (ranges.cpu_end, ranges.nvme_end))):
            if high <= low:
                continue
            views = [
                r.canon.view(r.geometry.flat(r.device_tensor)).narrow(r.canon.dim, low, high - low)
                for r in split.records
            ]
            buffer, offsets = gather_rows(views)
            # Negative indices tell the packed records apart (their device arena keys).
            child = Record(buffer, run, -1 - len(split.children), tier_named("keep"))
            run.adopt(child)
            split.children.append(child)
            split.bundles[tier] = (child, offsets, (low, high))
            tier_named(tier).place(child)
        start, stop = ranges.recompute
        if stop > start:
            sentinels.keep(split, start, stop)
        for record in split.records:
            record.split = split
            record.tier = self
            record.device_tensor = None  # the packed copies hold what is stored
            record.to(State.OFFLOADING)
            record.to(State.OFFLOADED)
        split.split_live = len(split.records)

    def probe(self, split: Split) -> None:
        """The run's first unpack in backward (the runtime's lock held): probe it with its
        records served (Note [probe in the first backward], actoff.tiers.tokenwise.split), record
        what it learned, and let go of the inputs and mixer outputs."""
        candidates = list(split.probe_pending.values())
        split.probe_pending = {}
        try:
            split.run.stats.probes += 1
            originals = {record.index: serve(record) for record in candidates}
            canons, reason = slices.probe(split, candidates, originals)
            del originals
            if canons is None:
                split.fall_back(reason)
            else:
                learned, result = split.learned, ProbeResult(canons, split.saves())
                learned.results[split.conditions] = learned.any_length[split.any_length] = result
        finally:
            split.owned.clear()

    # ------------------------------------------------------------------ backward
    def materialize(self, record: Record) -> torch.Tensor:
        """A split record again: stored rows scattered back, dropped rows recomputed."""
        split = record.split
        run, geometry = split.run, record.geometry
        if split.recomputed_rows is None:
            for child in split.children:
                serve(child)
            start, stop = split.ranges.recompute
            watch = run.backend.stopwatch().start()
            split.recomputed_rows = sentinels.checked_recompute(split, start, stop) if stop > start else {}
            run.account("recompute_ms", watch.stop())
            split.split_pending = len(split.records)
        flat = run.device_buffer(geometry.pad + geometry.span, geometry.dtype, ("rebuild", record.index))
        canon = record.canon.view(flat, geometry.pad)
        position = split.records.index(record)
        for child, offsets, (low, high) in split.bundles.values():
            scatter_rows(
                child.device_tensor, [offsets[position]], [canon.narrow(record.canon.dim, low, high - low)]
            )
        start, stop = split.ranges.recompute
        if stop > start:
            rows = split.recomputed_rows.pop(record.index)
            canon.narrow(record.canon.dim, start, stop - start).copy_(rows)
        record.device_tensor = geometry.rebuild(flat)
        record.to(State.FETCHING)
        record.to(State.READY)
        split.split_pending -= 1
        if split.split_pending == 0:  # every split record rebuilt: drop the packed device copies
            for child in split.children:
                if child.state is State.OFFLOADING and child.device_tensor is not None:
                    # Served from the device (Note [forward what is still on the device]): the
                    # compute stream waits for its copy out, and the packed buffer goes.
                    child.tier.drop_forwarded(child)
                child.tier.evict(child)
        return record.device_tensor

    def release(self, record: Record) -> None:
        super().release(record)
        split = record.split
        split.split_live -= 1
        if split.split_live == 0:  # nothing left to rebuild: the stored rows can go
            split.owned.clear()
            for child in split.children:
                split.run.release(child)

    def count(self, record: Record, bytes_per_tier: dict[str, int]) -> None:
        ranges = record.split.ranges
        row_bytes = record.geometry.nbytes // ranges.seq_len
        bytes_per_tier["cpu"] += row_bytes * ranges.cpu_end
        bytes_per_tier["nvme"] += row_bytes * (ranges.nvme_end - ranges.cpu_end)
        bytes_per_tier["recompute"] += row_bytes * ranges.recompute_len


TOKENWISE = TokenwiseTier()
