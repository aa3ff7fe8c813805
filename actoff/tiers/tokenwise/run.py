"""Token-wise runs: a block's activations split by token range between host, NVMe and recompute.

A `TokenwiseRun` is the token-wise state of one scope run (``run.tokenwise``): what the
re-forward needs (inputs kept whole, the function, the RNG state, the mixer's outputs), the
ranges, the records it splits, and the packed rows it stores. It is also the tier of its
split records: their `materialize` rebuilds them, stored rows scattered back and dropped
rows recomputed (actoff.tiers.tokenwise.reforward), checked every step against a few rows kept at forward time
(Note [sentinel rows], actoff.tiers.tokenwise.sentinels). Runs whose policy never splits have no such object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from actoff.policy import token_fractions, whole_tier
from actoff.tiers.base import Tier
from actoff.tiers.record import Record, State, param_like, serve

from . import reforward, sentinels
from .mixers import autograd_status
from .pack import pack_rows, scatter_rows
from .probes import ModuleProbes, ProbeResult, conditions, transferred
from .tokens import TokenRanges, base_info, token_ranges

if TYPE_CHECKING:
    from actoff.device.base import Stopwatch
    from actoff.runtime.hooks import Handle
    from actoff.runtime.measured import BlockKey
    from actoff.runtime.runtime import Runtime
    from actoff.runtime.step import ScopeRun

__all__ = ["TokenwiseRun"]


# Note [probe in the first backward]: a block's body runs once per forward call, as the
# program wrote it. What the probe learns (the token dimension of each saved tensor, and
# whether recomputed rows match) it learns in the backward of the first step under new
# conditions, where backward re-runs blocks anyway: that step stores the run whole (its
# whole tier), keeps the inputs and mixer outputs, and at the run's first unpack, with
# every record fetched back, re-runs the block on its last tokens and compares
# (actoff.tiers.tokenwise.reforward.probe). The next step under the same conditions splits.
# A re-forward in forward would run the block twice per call: a module that counts, logs or
# collects an auxiliary loss in forward would see two calls, and what it set on itself
# would be the re-forward's. If backward never reaches the run, the kept inputs go when its
# probed records do. A new length is served by the probe of another (Note [a probe serves
# other lengths], actoff.tiers.tokenwise.probes).


class TokenwiseRun(Tier):
    """The token-wise state of a scope run, and the tier of the records it splits."""

    name = "tokenwise"

    def __init__(self, run: ScopeRun) -> None:
        self.run = run
        self.events: list[int] = []  # record index per non-parameter save, -1: not a record
        self.in_mixer = 0
        self.collective: str | None = None  # first collective outside a mixer (CollectiveWatch)
        self.touched: list[torch.nn.Module] = []  # a function scope's modules (CaptureMode)
        # Input shape and strides of each dropout: Note [dropout in a re-forward]
        self.dropouts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.saved_elsewhere: object = None  # a checkpoint's hooks, or "no grad": Note [under checkpointing]
        self.seq_len = 0
        # What probes learned about the run's module, the key of the conditions it runs under,
        # and the probe result for them if there is one yet
        # (Note [probes per module and conditions], actoff.tiers.tokenwise.probes).
        self.learned: ModuleProbes | None = None
        self.conditions: tuple = ()
        self.any_length: tuple = ()  # the key of these conditions at every length
        self.probed: ProbeResult | None = None
        self.fn: Callable[..., Any] | None = None
        self.module: torch.nn.Module | None = None  # its forward hooks are lifted in re-forwards
        self.input_spec: pytree.TreeSpec | None = None  # pytree structure of (args, kwargs)
        self.inputs: list[Any] = []  # their flattened leaves: Record, or the value itself
        self.input_status: list[str | None] = []  # autograd_status of each input at capture
        # (Record or tensor, token dim, autograd_status): the re-forward serves its rows alike
        self.mixer_outputs: list[tuple[Any, int | None, str | None]] = []
        self.grad_enabled = True  # the forward's grad mode and autocast state (reforward.forward_state)
        self.autocast: tuple = ()
        self.owned: list[Handle] = []  # handles actoff holds for inputs and mixer outputs
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.ranges: TokenRanges | None = None
        self.children: list[Record] = []  # packed rows, one record per stored tier
        self.bundles: dict[str, tuple[Record, list[int], tuple[int, int]]] = {}
        self.split_records: list[Record] = []
        self.split_live = 0
        self.split_pending = 0
        self.recomputed_rows: dict[int, torch.Tensor] | None = None
        # Note [sentinel rows] (actoff.tiers.tokenwise.sentinels): (record index, rows picked in the range or
        # None for all of them, the copy kept at forward time).
        self.checks: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        self.probe_pending: dict[int, Record] = {}  # Note [probe in the first backward]: what it checks
        # The token mixers' calls in forward, timed for the auto policy (None: not timed)
        self.mixer_watches: list[Stopwatch] | None = None

    # ------------------------------------------------------------------ forward
    def capture(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        module: torch.nn.Module | None,
        key: BlockKey | None = None,
    ) -> bool:
        """What the re-forward needs: the inputs (kept whole), the function, the RNG state; and
        what probes learned about ``module`` (or ``fn`` when the scope is a function) under
        these conditions (``key``: computed already, by the auto policy). False when the run is
        placed whole: the block input has no token dimension, or the block cannot be
        recomputed under these conditions."""
        run = self.run
        token_dim = run.config.token_dim
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or first.dim() <= token_dim:
            return False
        self.seq_len = first.shape[token_dim]
        owner = module if module is not None else fn
        self.learned = run.runtime.probe_results.setdefault(owner, ModuleProbes)
        if key is not None:
            values, self.input_spec, self.conditions = key.values, key.spec, key.conditions
            self.grad_enabled, self.autocast = key.grad_enabled, key.autocast
        else:
            # Inputs may nest (Hugging Face passes position_embeddings=(cos, sin)): flatten them.
            values, self.input_spec = pytree.tree_flatten((args, kwargs))
            self.grad_enabled, self.autocast = torch.is_grad_enabled(), reforward.autocast_state(run.device)
            self.conditions = conditions(values, self.input_spec, module, self.grad_enabled, self.autocast)
        self.any_length = conditions(  # Note [a probe serves other lengths]
            values, self.input_spec, module, self.grad_enabled, self.autocast, self.seq_len
        )
        if self.conditions in self.learned.verdicts:
            return False
        self.probed = self.learned.results.get(self.conditions)
        self.fn, self.module = fn, module
        self.input_status = [autograd_status(value) for value in values]
        self.inputs = [self.keep_whole(value) for value in values]
        cuda_state = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None
        self.rng = (torch.get_rng_state(), cuda_state)
        return True

    def classify(self, record: Record, tensor: torch.Tensor) -> None:
        """A new record of the forward: the mixer's saves are not recomputed (stored whole);
        others may be split, found through their view or its base."""
        if self.in_mixer:
            record.whole = True
        else:
            record.base_info = base_info(tensor)

    def keep_whole(self, value: Any) -> Any:
        """A record (stored whole, held by actoff) for a block input or mixer output tensor, or
        the value itself when actoff would not offload it (small, a parameter, not a tensor)."""
        if not isinstance(value, torch.Tensor):
            return value
        run = self.run
        # Held directly: a detached alias (Note [no cycle through autograd]).
        if type(value) is not torch.Tensor or value.device != run.device:
            return value.detach()
        storage = value.untyped_storage().data_ptr() if value.numel() else 0
        if (
            value.numel() == 0
            or value.layout != torch.strided
            or param_like(value, storage, run.param_storages)
            or value.numel() * value.element_size() < run.config.min_bytes
        ):
            return value.detach()
        handle = run.handle_for(value, storage, value.numel() * value.element_size())
        handle.record.whole = True
        self.owned.append(handle)
        return handle.record

    def capture_mixer_output(self, output: Any, token_dim: int | None) -> None:
        self.mixer_outputs.append((self.keep_whole(output), token_dim, autograd_status(output)))

    # ------------------------------------------------------------------ sealing
    def prepare(self, runtime: Runtime) -> None:
        """Choose the ranges and the records to split, with what a probe learned about the
        module under these conditions (Note [probes per module and conditions]); with nothing
        learned yet the run is placed whole and probed in its backward (Note [probe in the first
        backward]). A run that ends with no split records is placed whole."""
        run, config = self.run, self.run.config
        if self.saved_elsewhere is not None:
            return  # checkpointed inside the scope: its inputs only, placed whole
        candidates = [r for r in run.records if not r.whole and not r.geometry.compact]
        fractions = token_fractions(config, run.auto_fractions)
        self.ranges = token_ranges(self.seq_len, *fractions)
        if not candidates or self.ranges.cpu_end == self.seq_len:
            return  # nothing to split (or every token to host memory): whole
        learned, probed = self.learned, self.probed
        if probed is not None and probed.saves != self.saves():
            # Same key, other saves: the block changed in a way the key cannot see (say, its
            # attention implementation switched in place). Placed whole; the next call probes
            # afresh, watched for collectives (this forward was not: see CollectiveWatch).
            del learned.results[self.conditions]
            return
        if probed is None:
            probed = self.from_another_length()
            if probed is None:
                self.probe_later(candidates)
                return
            learned.results[self.conditions] = probed
        for record in candidates:
            canon = probed.canons.get(record.index)
            if canon is not None:
                record.canon = canon
                self.split_records.append(record)

    def from_another_length(self) -> ProbeResult | None:
        """The probe of these conditions at another length, fitted to this forward's saves, if
        they differ by their length only (Note [a probe serves other lengths])."""
        other = self.learned.any_length.get(self.any_length)
        if other is None:
            return None
        views = {r.index: ((r.geometry.size, r.geometry.stride), r.base_info) for r in self.run.records}
        return transferred(other, self.saves(), views, self.seq_len)

    def probe_later(self, candidates: list[Record]) -> None:
        """Place the run whole and probe it in its backward (Note [probe in the first backward])."""
        if self.collective is not None:  # never re-run it, not even to probe: see CollectiveWatch
            self.fall_back(
                f"its forward calls the collective {self.collective} outside a token mixer, and a "
                "re-forward on one rank's token slice would call it again (register the function "
                "that communicates, e.g. a sequence-parallel attention, with actoff.register_token_mixer)"
            )
            return
        self.probe_pending = {record.index: record for record in candidates}

    def probe_now(self) -> None:
        """The run's first unpack in backward (the runtime's lock held): probe it with its
        records served, record what it learned, and let go of the inputs and mixer outputs."""
        run, candidates = self.run, list(self.probe_pending.values())
        self.probe_pending = {}
        try:
            run.stats.probes += 1
            originals = {record.index: serve(record) for record in candidates}
            canons, reason = reforward.probe(self, candidates, originals)
            del originals
            if canons is None:
                self.fall_back(reason)
            else:
                result = ProbeResult(canons, self.saves())
                self.learned.results[self.conditions] = self.learned.any_length[self.any_length] = result
        finally:
            self.owned.clear()

    def fall_back(self, reason: str) -> None:
        """Place the module whole under these conditions from now on; warn once per module."""
        self.learned.fall_back(self.conditions, self.run.name, whole_tier(self.run.config), reason)

    def released_record(self, record: Record) -> None:
        """A record of the run was released: a probe still waiting for it has nothing to check
        once all its records are gone (a graph dropped without backward)."""
        pending = self.probe_pending
        if pending and pending.pop(record.index, None) is record and not pending:
            self.owned.clear()

    def saves(self) -> tuple:
        """What the forward saved, in order: the record of each save (-1: not a record), each
        record's geometry and whether it stays whole, and the mixer calls. Equal on two forwards
        when a probe result of one fits the other."""
        records = tuple(
            (r.geometry.size, r.geometry.stride, r.geometry.dtype, r.whole) for r in self.run.records
        )
        return (tuple(self.events), records, len(self.mixer_outputs))

    def place_split(self, tiers: dict[str, Tier]) -> None:
        """Pack the stored token rows of every split record into one buffer per tier."""
        run, ranges = self.run, self.ranges
        for tier, (low, high) in (("cpu", (0, ranges.cpu_end)), ("nvme", (ranges.cpu_end, ranges.nvme_end))):
            if high <= low:
                continue
            views = [
                r.canon.view(r.geometry.flat(r.device_tensor)).narrow(r.canon.dim, low, high - low)
                for r in self.split_records
            ]
            buffer, offsets = pack_rows(views)
            # Negative indices tell the packed records apart (their device arena keys).
            child = Record(buffer, run, -1 - len(self.children), tiers["keep"])
            run.step.live += 1
            run.live += 1
            self.children.append(child)
            self.bundles[tier] = (child, offsets, (low, high))
            tiers[tier].place(child)
        start, stop = ranges.recompute
        if stop > start:
            sentinels.keep(self, start, stop)
        for record in self.split_records:
            record.split = ranges
            record.tier = self
            record.device_tensor = None  # the packed copies hold what is stored
            record.to(State.OFFLOADING)
            record.to(State.OFFLOADED)
        self.split_live = len(self.split_records)

    # ------------------------------------------------------------------ the tier of split records
    def materialize(self, record: Record) -> torch.Tensor:
        """A split record again: stored rows scattered back, dropped rows recomputed."""
        run, geometry = self.run, record.geometry
        if self.recomputed_rows is None:
            for child in self.children:
                serve(child)
            start, stop = self.ranges.recompute
            watch = run.backend.stopwatch().start()
            self.recomputed_rows = sentinels.checked_recompute(self, start, stop) if stop > start else {}
            run.account("recompute_ms", watch.stop())
            self.split_pending = len(self.split_records)
        flat = run.device_buffer(geometry.pad + geometry.span, geometry.dtype, ("rebuild", record.index))
        canon = record.canon.view(flat, geometry.pad)
        position = self.split_records.index(record)
        for child, offsets, (low, high) in self.bundles.values():
            scatter_rows(
                child.device_tensor, [offsets[position]], [canon.narrow(record.canon.dim, low, high - low)]
            )
        start, stop = self.ranges.recompute
        if stop > start:
            rows = self.recomputed_rows.pop(record.index)
            canon.narrow(record.canon.dim, start, stop - start).copy_(rows)
        record.device_tensor = geometry.rebuild(flat)
        record.to(State.FETCHING)
        record.to(State.READY)
        self.split_pending -= 1
        if self.split_pending == 0:  # every split record rebuilt: drop the packed device copies
            for child in self.children:
                if child.state is State.OFFLOADING and child.device_tensor is not None:
                    # Served from the device (Note [forward what is still on the device]): the
                    # compute stream waits for its copy out, and the packed buffer goes.
                    child.tier.drop_forwarded(child)
                child.tier.evict(child)
        return record.device_tensor

    def release(self, record: Record) -> None:
        super().release(record)
        self.split_live -= 1
        if self.split_live == 0:  # nothing left to rebuild: the stored rows can go
            self.owned.clear()
            for child in self.children:
                self.run.runtime.release(child)

    def count(self, record: Record, bytes_per_tier: dict[str, int]) -> None:
        split = record.split
        row_bytes = record.geometry.nbytes // split.seq_len
        bytes_per_tier["cpu"] += row_bytes * split.cpu_end
        bytes_per_tier["nvme"] += row_bytes * (split.nvme_end - split.cpu_end)
        bytes_per_tier["recompute"] += row_bytes * split.recompute_len
