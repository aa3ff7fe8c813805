"""What the auto policy measures of a block and of each run: its key (module and conditions), its
bytes by class, its times (`forward_ms` and `attention_ms` are the one place measured times are
read: tests replace them), and its placements (Note [measuring at the floor] in
actoff.runtime.auto). A run's part of it (`AutoRun`) is the auto policy's, kept beside the run,
never on it."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from actoff.budget import BlockCost, Placement, Windows
from actoff.params import param_like
from actoff.policy import AutoDecision
from actoff.step_time import added_seconds, followings

if TYPE_CHECKING:
    from actoff.device.base import Stopwatch

    from .auto import StepPlan
    from .step import ScopeRun

__all__ = [
    "PROBE",
    "AutoRun",
    "BlockKey",
    "Measured",
    "attention_ms",
    "figures",
    "forward_ms",
    "input_bytes",
    "measured_s",
    "observe",
    "stand_in_forwards",
    "step_s",
    "timed_apart_from_waits",
]


#: The placement of a run that probes its block (Note [measuring at the floor] in actoff.runtime.auto).
PROBE = Placement("probe")


@dataclass(frozen=True)
class BlockKey:
    """A block call's identity for the auto policy: its owner (the module, or a function
    scope's function) and its `actoff.rerun.conditions.conditions`."""

    owner: Any
    conditions: tuple

    @property
    def ident(self) -> tuple:
        return (id(self.owner), self.conditions)


@dataclass
class AutoRun:
    """The auto policy's part of one run: its block's key, the placement its plan gave it (None:
    measuring) with the token fractions, and what the run measured. It holds its run weakly: the
    auto policy keeps it beside the run, in a map from the run (actoff.runtime.auto)."""

    run_ref: weakref.ref
    key: BlockKey
    placement: Placement | None
    fractions: tuple[float, float] | None
    classes: tuple[int, int, int, bool] | None = None  # bytes by class (`Placement.saved_by_class`)
    input_bytes: int = 0  # its tensor inputs' bytes, while it measures
    forward_watch: Stopwatch | None = None
    forward_timed: bool = False  # its watch stopped (Note [measuring where only chunks fit])

    @property
    def run(self) -> ScopeRun:
        return self.run_ref()


def forward_ms(state: AutoRun) -> float:
    """Measured forward time of a run's block, in milliseconds: its compute, less the time it
    waited for copies out (a copy window's waits, Note [copy out at pack]).

    One of the two places where the auto policy reads a measured time (with `attention_ms`):
    tests replace them to make decisions independent of the machine's load.
    """
    watch = state.forward_watch
    if watch is None:
        return 0.0
    watch.synchronize()
    elapsed = watch.elapsed_ms()
    compute = elapsed - state.run.stats.out_wait_ms
    # Waits timed as the whole forward (events that trail the host, as the simulated device's
    # do) leave no compute to tell: the elapsed time then stands for it, an upper bound, rather
    # than none (a block with no forward time is never planned). Note [a forward timed through
    # its waits].
    return compute if compute > 0.1 * elapsed else elapsed


# Note [a forward timed through its waits]: where a device's events trail the host (the
# simulated device's), a block whose forward waits on its own copies out for most of its time
# is timed as its whole elapsed time, waits included. That time is its forward to the model, and
# the model then hides that block's copies behind it: a streamed block looks free to stream, and
# stays streamed, while the step runs slower than the plan said (seen in the main run of
# 2026-11-28: auto at keep's peak streamed one block, predicted its blocks at 158 ms, and the
# step ran 136 ms over keep's). A forward timed apart from its waits is kept as the block's
# `Measured.compute_s`; a block that has none takes that of a block of the same shape (bytes by
# class) in the same step, where less. Blocks of one model are mostly of one shape; a block of a
# shape of its own keeps its upper bound.
#
# Note [a block's compute is its shape's least]: a block timed apart from its waits still times
# what its placement does on the compute thread where the device computes on the host (the
# simulated device, a CPU): each saved tensor's pack, and on the simulated device a snapshot of
# every copy out and the poisoning of its destination. In the main run (1024 tokens, 2 cores) a
# streamed block's forward read 48 to 61 ms where a kept block of the same shape read 29 to 31
# ms: `checkpoint`, priced at the block's forward, cost the model twice what it cost the step,
# and auto chose token-wise and streamed plans slower than `recompute`. So every block takes
# the least forward of its shape in the step: the same compute, timed with the least beside it.
def timed_apart_from_waits(state: AutoRun) -> bool:
    """Whether `forward_ms` told the run's compute from its waits for copies out (Note [a
    forward timed through its waits])."""
    watch = state.forward_watch
    if watch is None:
        return True
    watch.synchronize()  # `forward_ms` did, unless a test replaced it: its events may still run
    elapsed = watch.elapsed_ms()
    return elapsed - state.run.stats.out_wait_ms > 0.1 * elapsed


def stand_in_forwards(entries: list[Measured]) -> None:
    """(Note [a forward timed through its waits], Note [a block's compute is its shape's least])
    Every block takes the least forward time timed apart from waits of a block of its shape, where
    that is less than its own.

    >>> streamed = Measured("a", input_bytes=8, attention_bytes=4, local_bytes=16, forward_s=0.04)
    >>> kept = Measured("b", input_bytes=8, attention_bytes=4, local_bytes=16, forward_s=0.01, compute_s=0.01)
    >>> stand_in_forwards([streamed, kept]); streamed.forward_s
    0.01
    """
    clean: dict[tuple[int | None, int, int], float] = {}
    for entry in entries:
        if entry.compute_s is not None:
            shape = (entry.input_bytes, entry.attention_bytes, entry.local_bytes)
            clean[shape] = min(clean.get(shape, entry.compute_s), entry.compute_s)
    for entry in entries:
        stand_in = clean.get((entry.input_bytes, entry.attention_bytes, entry.local_bytes))
        if entry.forward_s is not None and stand_in is not None:
            entry.forward_s = min(entry.forward_s, stand_in)


def attention_ms(state: AutoRun) -> float | None:
    """Time of the token mixers' calls in the run's forward (milliseconds), or ``None`` when
    they were not timed (a run not token-wise)."""
    return state.run.placement.mixers_ms()


@dataclass
class Measured:
    """What steps measured of one block under one set of conditions, and its placements (one
    per call of the block in a step: a function scope may run several times)."""

    name: str
    steps: int = 0  # steps that ran the block under these conditions
    input_bytes: int | None = None  # bytes by class (None: not measured yet)
    attention_bytes: int = 0
    local_bytes: int = 0
    tokenwise: bool = False  # recomputable token-wise (its probe passed: Note [measuring at the floor])
    probed: bool = False  # its probe ran (in a step of its own)
    probe_next: bool = False  # the next step probes it
    rerun: bool = True  # its forward calls no collective outside a mixer, writes no input in place
    # Note [the chunked placement in the plan] (actoff.budget): why the chunked placement does not
    # take it ("" : it does; None: not surveyed yet), attention's keys and values and its node's
    # bytes, and the chunk's length in tokens.
    chunk_refusal: str | None = None
    kv_bytes: int = 0
    node_bytes: int = 0
    chunk_tokens: int = 0
    # Its measuring steps went on in chunks: only chunks fit (Note [measuring where only chunks
    # fit] in actoff.runtime.placements.measuring).
    chunks_only: bool = False
    forward_s: float | None = None  # the least warm forward time seen
    # The least warm forward time measured apart from waits (Note [a forward timed through its
    # waits]); None: every forward seen was timed through them.
    compute_s: float | None = None
    attention_share: float = 0.0  # attention's share of the forward, in the step of `forward_s`
    placements: list[Placement] = field(default_factory=list)
    fractions: list[tuple[float, float]] = field(default_factory=list)
    decisions: list[AutoDecision] = field(default_factory=list)
    windows: Windows = field(default_factory=Windows)  # the windows of the plan that placed it last
    # Note [other lengths planned ahead] (actoff.runtime.lengths): its key of every length, the
    # length and elements of its first tensor input, and whether its figures were scaled from
    # another length's (replaced by its own once measured).
    any_length: tuple | None = None
    tokens: int | None = None
    numel: int = 0
    scaled: bool = False

    @property
    def ready(self) -> bool:
        return self.input_bytes is not None and self.forward_s is not None

    def scaled_to(self, tokens: int, numel: int) -> Measured:
        """This block's figures at another length or batch (``tokens`` long, ``numel`` elements in
        its first input): bytes by the elements, the forward outside attention by the elements,
        attention's by the elements times the length (its work per query grows with the keys).

        >>> seen = Measured("b", 2, 10, 20, 30, forward_s=0.01, attention_share=0.5, tokens=4, numel=8)
        >>> twice = seen.scaled_to(8, 16)
        >>> (twice.input_bytes, twice.local_bytes), round(twice.forward_s, 4), round(twice.attention_share, 3)
        ((20, 60), 0.03, 0.667)
        """
        assert self.ready and self.tokens and self.numel
        linear = numel / self.numel
        attention_s = self.forward_s * self.attention_share * linear * tokens / self.tokens
        local_s = self.forward_s * (1.0 - self.attention_share) * linear
        return Measured(
            self.name,
            input_bytes=round(self.input_bytes * linear),
            attention_bytes=round(self.attention_bytes * linear),
            local_bytes=round(self.local_bytes * linear),
            tokenwise=self.tokenwise,
            probed=self.probed,
            rerun=self.rerun,
            chunk_refusal=self.chunk_refusal,
            kv_bytes=round(self.kv_bytes * linear),
            node_bytes=round(self.node_bytes * linear),
            chunk_tokens=self.chunk_tokens,
            chunks_only=self.chunks_only and tokens >= self.tokens,  # a shorter length may fit otherwise
            forward_s=attention_s + local_s,
            attention_share=attention_s / max(attention_s + local_s, 1e-12),
            any_length=self.any_length,
            tokens=tokens,
            numel=numel,
            scaled=True,
        )

    def cost(self) -> BlockCost:
        """Its figures for the plan (actoff.budget): the chunked placement open where its survey
        found nothing to refuse and it is longer than a chunk.

        >>> seen = Measured("b", 2, 10, 20, 30, forward_s=0.01, tokens=4096, chunk_refusal="", chunk_tokens=1024)
        >>> seen.cost().chunk_share, Measured("b", 2, 10, 20, 30, forward_s=0.01, tokens=4096).cost().chunk_share
        (0.25, None)
        """
        forward_s = self.forward_s or 0.0
        chunks = self.chunk_refusal == "" and self.tokens and self.chunk_tokens < self.tokens
        return BlockCost(
            forward_s,
            forward_s * self.attention_share,
            self.input_bytes or 0,
            self.attention_bytes,
            self.local_bytes,
            self.tokenwise and self.probed,
            self.rerun,
            chunk_share=self.chunk_tokens / self.tokens if chunks else None,
            kv_bytes=self.kv_bytes,
            node_bytes=self.node_bytes,
            chunks_only=self.chunks_only,
        )


def input_bytes(run: ScopeRun, values: list[Any]) -> int:
    """Bytes of the block's tensor inputs (the call's flattened ``values``) actoff would store:
    on its device, not parameters, not under ``min_bytes`` (taken before the forward lets them go)."""
    seen: dict[int, int] = {}
    for value in values:
        if not isinstance(value, torch.Tensor) or value.device != run.device or value.layout != torch.strided:
            continue
        nbytes = value.numel() * value.element_size()
        storage = value.untyped_storage().data_ptr() if value.numel() else 0
        if nbytes and nbytes >= run.min_bytes and not param_like(value, storage, run.param_storages):
            seen[id(value)] = nbytes
    return sum(seen.values())


def observe(entry: Measured, state: AutoRun, others: Iterable[Measured] = ()) -> None:
    """Take a run's measurements into its block's: bytes by class while it measures (the
    token-wise placement sorts them), the probe's verdict, times from warm steps; ``others``: the
    block's entries under other conditions (a chunked run's refusal reaches those of its other
    lengths)."""
    if state.placement is None and state.classes is not None:
        entry.input_bytes, entry.attention_bytes, entry.local_bytes, _ = state.classes
    _observe_chunks(entry, state, others)
    if state.placement is PROBE:
        entry.probed, entry.probe_next = True, False
        entry.tokenwise = state.run.placement.probe_passed
        return  # a step of its own: its times include the probe
    if state.run.placement.rerun_unsafe:
        entry.rerun = False  # a collective called again on one rank, or a changed input
    if entry.steps < 2:
        return  # cold: the probe's re-run, the allocators and kernels warming up
    if entry.scaled:  # its own time replaces the one scaled from another length
        entry.scaled, entry.forward_s, entry.compute_s = False, None, None
    # The least forward time seen, and attention's share in the step that gave it: figures
    # that only settle, so replans from them settle too (no plan flapping with the noise).
    forward_s = forward_ms(state) / 1e3
    if forward_s > 0 and timed_apart_from_waits(state):
        entry.compute_s = forward_s if entry.compute_s is None else min(entry.compute_s, forward_s)
    if forward_s > 0 and (entry.forward_s is None or forward_s < entry.forward_s):
        entry.forward_s = forward_s
        mixers = attention_ms(state)
        if mixers is not None:
            entry.attention_share = min(mixers / 1e3 / forward_s, 1.0)


def _observe_chunks(entry: Measured, state: AutoRun, others: Iterable[Measured]) -> None:
    """What the run told of the chunked placement (Note [the chunked placement in the plan] in
    actoff.budget): a measuring run's survey, or a chunked run's refusal (Note [a chunked block
    the plan misjudged] in actoff.runtime.placements.chunked). A refusal is kept: later runs that
    see none do not reopen the placement. A failed probe (the block mixes tokens) holds at every
    length: the block's entries of its other lengths (``others`` of the same ``any_length``) take
    it too; a forward's or a survey's refusal may be its length's own (a last chunk of one token,
    an input with two dimensions as long as the sequence) and stays with it."""
    placement = state.run.placement
    survey = getattr(placement, "chunk_survey", None)
    refused = getattr(placement, "refused", None)
    if survey is not None:
        entry.chunks_only = entry.chunks_only or getattr(placement, "measured", None) is not None
        if survey.refused or entry.chunk_refusal is None:
            entry.chunk_refusal = survey.refused or ""
        entry.kv_bytes, entry.node_bytes = survey.kv_bytes, survey.node_bytes
        entry.chunk_tokens = state.run.config.chunk_tokens
    if refused is not None:
        entry.chunk_refusal = refused
        if placement.refused_every_length:
            for other in others:
                if other.any_length == entry.any_length:
                    other.chunk_refusal = refused


def step_s(watch: Stopwatch, ran: tuple[Placement, ...]) -> float:
    """A step's time from its first block's forward to the end of backward, in seconds (Note [a
    plan tried against its runner-up]); ``ran``: the placements it ran. One of the places where
    the auto policy reads a measured time (with `forward_ms`, `attention_ms`): tests replace it."""
    watch.stop()
    watch.synchronize()
    return watch.elapsed_ms() / 1e3


def measured_s(state: AutoRun) -> float:
    """A run's time as a plan predicts it (its forward and what its placement added): its
    forward's compute, the waits for copies out it held up (unless `forward_ms` timed them in:
    Note [a forward timed through its waits]), recompute, and backward's waits for copies back.
    Without the waits out, a step at the floor (windows of none: every copy waited for) read
    about 630 ms against 1054 predicted, off by 40% every step, while its step ran 1045 ms over
    keep's. And the waits for its copies out when a later block was placed (Note [the waits at
    placing] in actoff.runtime.step), in no forward's time."""
    stats = state.run.stats
    out = stats.out_wait_ms if timed_apart_from_waits(state) else 0.0
    waits = out + stats.place_wait_ms + stats.recompute_ms + stats.wait_ms
    return forward_ms(state) / 1e3 + waits / 1e3


def figures(states: list[AutoRun], step_plan: StepPlan | None) -> None:
    """Each run's placement, measured time and, where a plan ran, its prediction (statistics)."""
    for index, state in enumerate(states):
        stats = state.run.stats
        placement = state.placement
        stats.placement = (
            "measuring" if placement is None else "probing" if placement is PROBE else str(placement)
        )
        stats.forward_ms = forward_ms(state)
        stats.measured_ms = measured_s(state) * 1e3
        if step_plan is not None:
            cost = step_plan.costs[index]
            placement = step_plan.plan.placements[index]
            following = followings(step_plan.costs, step_plan.plan.placements)[index]
            added = added_seconds(
                cost, placement, step_plan.link_bytes_per_s, step_plan.plan.windows, following
            )
            stats.predicted_ms = (cost.forward_s + added) * 1e3
