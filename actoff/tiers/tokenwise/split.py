"""A scope run's token-wise split: its saved activations divided by token range between host, NVMe
and recompute, and everything the rebuild in backward needs.

A `Split` is the token-wise state of one scope run, made and driven by the token-wise placement
(actoff.runtime.placements.tokenwise): what the re-run needs (inputs kept whole, the function,
the RNG state, the mixer's outputs), the ranges, the records it splits and the packed rows it
stores. Its split records name it (``record.split``) and live on the stateless token-wise tier
(actoff.tiers.tokenwise.tier), which rebuilds them in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from actoff.params import param_like
from actoff.policy import whole_tier
from actoff.rerun.again import StateAtStart
from actoff.rerun.conditions import FlatCall, conditions
from actoff.rerun.isolation import without_caches
from actoff.rerun.state import ForwardState, autograd_status
from actoff.tiers.record import Record

from .probes import ModuleProbes, ProbeResult, transferred
from .tokens import TokenRanges, base_info, token_ranges

if TYPE_CHECKING:
    import torch.utils._pytree as pytree

    from actoff.device.base import Stopwatch
    from actoff.tiers.run_view import RunView

__all__ = ["Split"]


# Note [probe in the first backward]: a block's body runs once per forward call, as the
# program wrote it. What the probe learns (the token dimension of each saved tensor, and
# whether recomputed rows match) it learns in the backward of the first step under new
# conditions, where backward re-runs blocks anyway: that step stores the run whole (its
# whole tier), keeps the inputs and mixer outputs, and at the run's first unpack, with
# every record fetched back, re-runs the block on its last tokens and compares
# (actoff.tiers.tokenwise.slices.probe, driven by actoff.tiers.tokenwise.tier). The next step under the same conditions splits.
# A re-run in forward would run the block twice per call: a module that counts, logs or
# collects an auxiliary loss in forward would see two calls, and what it set on itself
# would be the re-run's. If backward never reaches the run, the kept inputs go when its
# probed records do. A new length is served by the probe of another (Note [a probe serves
# other lengths], actoff.tiers.tokenwise.probes).


class Split:
    """The token-wise state of a scope run (``record.split`` of the records it splits)."""

    def __init__(self, run: RunView) -> None:
        self.run = run
        self.events: list[int] = []  # record index per non-parameter save, -1: not a record
        self.in_mixer = 0
        self.collective: str | None = None  # first collective outside a mixer (CollectiveWatch)
        self.writes_inputs = False  # the forward wrote into an input kept for the re-run
        self.writes_state = False  # it wrote what a re-run cannot start from: never run again
        # The state the forward began with, and what of it a re-run starts from (Note [runs again
        # start where the forward did] in actoff.runtime.placements.checkpoint).
        self.start: StateAtStart | None = None
        self.began: StateAtStart | None = None
        # Input shape and strides of each dropout: Note [dropout in a re-run]
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
        self.module: torch.nn.Module | None = None  # its forward hooks are lifted in re-runs
        self.input_spec: pytree.TreeSpec | None = None  # pytree structure of (args, kwargs)
        self.inputs: list[Any] = []  # their flattened leaves: Record, or the value itself
        self.input_status: list[str | None] = []  # autograd_status of each input at capture
        # (Record or tensor, token dim, autograd_status): the re-run serves its rows alike
        self.mixer_outputs: list[tuple[Any, int | None, str | None]] = []
        self.forward = ForwardState(True, ())  # Note [re-run state] (actoff.rerun.state)
        self.owned: list[object] = []  # handles actoff holds for inputs and mixer outputs
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.ranges: TokenRanges | None = None
        self.children: list[Record] = []  # packed rows, one record per stored tier
        self.bundles: dict[str, tuple[Record, list[int], tuple[int, int]]] = {}
        self.records: list[Record] = []
        self.split_live = 0
        self.split_pending = 0
        self.recomputed_rows: dict[int, torch.Tensor] | None = None
        # Note [sentinel rows] (actoff.tiers.tokenwise.sentinels): (record index, rows picked in
        # the range or None for all of them, the copy kept at forward time).
        self.checks: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        self.probe_pending: dict[int, Record] = {}  # Note [probe in the first backward]: what it checks
        # The token mixers' calls in forward, timed for the auto policy (None: not timed)
        self.mixer_watches: list[Stopwatch] | None = None

    # ------------------------------------------------------------------ forward
    def capture(
        self, fn: Callable[..., Any], module: torch.nn.Module | None, flat: FlatCall, learned: ModuleProbes
    ) -> bool:
        """What the re-run needs: the inputs (kept whole), the function, the RNG state; and what
        probes learned about the block (``learned``, its module's or its function's) under the
        call's conditions. False when the run is placed whole: the block input has no token
        dimension, or the block cannot be recomputed under these conditions."""
        run = self.run
        token_dim = run.config.token_dim
        first = next((value for value in flat.values if isinstance(value, torch.Tensor)), None)
        if first is None or first.dim() <= token_dim:
            run.placement.whole_because = (
                f"its first input has no token dimension (token_dim={token_dim}): nothing to split by token"
            )
            return False
        self.seq_len = first.shape[token_dim]
        self.learned, self.input_spec, self.forward = learned, flat.spec, flat.forward
        self.conditions = flat.conditions
        self.any_length = conditions(  # Note [a probe serves other lengths]
            flat.values, flat.spec, module, flat.forward.grad_enabled, flat.forward.autocast, self.seq_len
        )
        if self.conditions in learned.verdicts:
            run.placement.whole_because = learned.verdicts[self.conditions]
            return False
        self.probed = learned.results.get(self.conditions)
        self.fn, self.module = fn, module
        self.start = StateAtStart(module, without_caches(flat.values))
        self.input_status = [autograd_status(value) for value in flat.values]
        self.inputs = [self.keep_whole(value) for value in flat.values]
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
        nbytes = value.numel() * value.element_size()
        if (
            value.numel() == 0
            or value.layout != torch.strided
            or param_like(value, storage, run.param_storages)
            or nbytes < run.min_bytes
        ):
            return value.detach()
        record, handle = run.hold(value, nbytes)
        record.whole = True
        self.owned.append(handle)
        return record

    def capture_mixer_output(self, output: Any, token_dim: int | None) -> None:
        self.mixer_outputs.append((self.keep_whole(output), token_dim, autograd_status(output)))

    # ------------------------------------------------------------------ sealing
    def prepare(self, fractions: tuple[float, float]) -> None:
        """Choose the ranges (``fractions`` of the tokens to host and NVMe) and the records to
        split, with what a probe learned about the module under these conditions (Note [probes
        per module and conditions]); with nothing learned yet the run is placed whole and probed
        in its backward (Note [probe in the first backward]). A run that ends with no split
        records is placed whole."""
        written = self.writes_unrestorable()
        # The state the forward began with lives on as `began` only where a re-run may come.
        start, self.start = self.start, None
        if self.saved_elsewhere is not None:
            return  # checkpointed inside the scope: its inputs only, placed whole
        if any(isinstance(value, Record) and value.changed() for value in self.inputs):
            # Note [inputs changed in place] (actoff.runtime.placements.checkpoint): a re-run
            # would start from the changed input. Placed whole: every save of this forward is
            # here, and the inputs kept for a re-run go unread.
            self.writes_inputs = True
            self.fall_back(
                "it writes into its input in place, and a re-run would start from the changed input "
                "(clone the input inside the block to recompute it)"
            )
            return
        if written:
            return
        self.began = start.kept() if start is not None else None
        candidates = [r for r in self.run.records if not r.whole and not r.geometry.compact]
        self.ranges = token_ranges(self.seq_len, *fractions)
        if not candidates or self.ranges.cpu_end == self.seq_len:
            return  # nothing to split (or every token to host memory): whole
        learned, probed = self.learned, self.probed
        if probed is not None and probed.saves != self.saves():
            # Same key, other saves: fitted where they differ in sizes only (a packed batch's
            # metadata, Note [what a key keeps]); else the block changed in a way the key cannot
            # see (say, its attention implementation switched in place): placed whole, and the
            # next call probes afresh, watched for collectives (this one was not: CollectiveWatch).
            probed = self.fitted(probed)
            if probed is None:
                del learned.results[self.conditions]
                return
            learned.results[self.conditions] = probed
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
                self.records.append(record)

    def writes_unrestorable(self) -> bool:
        """Whether the forward wrote what a re-run cannot start from as it was (a parameter, a
        tensor over 1 MiB written in place: `StateAtStart.unrestorable`). Placed whole, said."""
        written = self.start.unrestorable() if self.start is not None and not self.writes_state else []
        if written:
            self.writes_state, self.start = True, None
            self.fall_back(
                f"it writes into its {written[0]} in forward, and a re-run would start from the changed "
                "value (change it outside the forward: a parameter in the optimizer step)"
            )
        return self.writes_state

    def from_another_length(self) -> ProbeResult | None:
        """The probe of these conditions at another length, fitted to this forward's saves, if
        they differ by their length only (Note [a probe serves other lengths])."""
        other = self.learned.any_length.get(self.any_length)
        return None if other is None else self.fitted(other)

    def fitted(self, result: ProbeResult) -> ProbeResult | None:
        """``result`` fitted to this forward's saves, if they differ from its in sizes only."""
        views = {r.index: ((r.geometry.size, r.geometry.stride), r.base_info) for r in self.run.records}
        return transferred(result, self.saves(), views, self.seq_len)

    def probe_later(self, candidates: list[Record]) -> None:
        """Place the run whole and probe it in its backward (Note [probe in the first backward])."""
        if self.collective is not None:  # never re-run it, not even to probe: see CollectiveWatch
            self.fall_back(
                f"its forward calls the collective {self.collective} outside a token mixer, and a "
                "re-run on one rank's token slice would call it again (register the function "
                "that communicates, e.g. a sequence-parallel attention, with actoff.register_token_mixer)"
            )
            return
        self.probe_pending = {record.index: record for record in candidates}

    def fall_back(self, reason: str) -> None:
        """Place the module whole under these conditions from now on; warn once per module."""
        self.run.placement.whole_because = reason
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

    @property
    def half_precision(self) -> bool:
        """Whether the block computes in half precision: under half-precision autocast, with a
        half-precision parameter or input. A float32 value computed from a bf16 product (a norm's
        statistics) may be a bf16 rounding off on fewer rows."""
        half = (torch.bfloat16, torch.float16)
        if self.forward.half_precision:
            return True
        if self.module is not None and any(p.dtype in half for p in self.module.parameters()):
            return True
        dtypes = (
            v.geometry.dtype if isinstance(v, Record) else getattr(v, "dtype", None) for v in self.inputs
        )
        return any(dtype in half for dtype in dtypes)
