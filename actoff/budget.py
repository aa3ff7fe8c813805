"""Fitting a device budget at the least step time: the model of a step's device peak and added
time under a placement per block and two windows (actoff.fitting finds the plan).

Pure functions on what the measuring steps measured: no tensors, no devices, tested on numbers
against brute force.

Note [the budget model]: a block saves three classes of bytes in forward: its input, what
attention saves (q, k, v, its output, the log-sum-exp) and the token-local rest. A placement
says which stay on the device until the block's backward:

- ``keep``: all of them; it adds no time.
- ``stream``: all of them go to the host one saved tensor at a time as they are saved, and come
  back one at a time in backward (Note [copy out at pack], Note [fetch per saved tensor]): on the
  device only what the windows allow, besides the node at work.
- ``tokenwise`` with a stored fraction ``a``: the input, attention's saves and a share ``a``
  of the rest go to the host at the block's end; the rest is recomputed in backward (``(1 - a)``
  of the block's forward time outside attention).
- ``checkpoint``: the input goes to the host; the whole block is run again (its forward time).
- ``chunked``: the input goes to the host; backward runs the block again in token chunks (Note
  [the chunked placement in the plan]).

The windows are the step's: ``copy`` bytes of saved tensors may be copying out at once in
forward (a ``stream`` block's), ``fetch`` bytes may be fetched and not yet let go in backward
(any offloaded block's records). What a plan adds to the step's time is actoff.step_time's (Note
[one link]): copies the compute does not hide, and recompute.

The device peak is the largest of three moments, each with what the step holds outside the
blocks then (`Outside`: weights, gradients, optimizer state, one autograd node's working
memory, and the moment's own, the logits and their gradient at the head):

- the forward of each block: every kept block before it, its own bytes as it saves them (none
  for a ``stream`` block, whose saves go as their copies land, nor for a ``checkpoint`` one, which
  saves its inputs only, streamed), and what the offloaded block before it (kept blocks wait for
  no copy; the next offloaded one's placement waits for a token-wise block's) still copies out: a
  token-wise block's stored bytes, a streamed one's window (or its own, at most the window);
- the head, between forward and backward: every kept block, and the last offloaded block's bytes
  on their way out (its window's, if it streams);
- the backward of each block, from the last: the kept blocks before it (their backward comes
  later), its own working bytes (kept, rebuilt or run again; none for a ``stream`` block) and the
  fetch window; for the last block, at least the copies still under way at the head, served from
  the device (Note [forward what is still on the device] in actoff.runtime.fetch). A token-wise
  block that stores and recomputes rows holds its stored rows twice while it is rebuilt: fetched
  packed, and scattered into the rebuilt tensors (the packed copy goes when the last is rebuilt).

So kept blocks are best the last ones: their backward comes first and lets them go before any
offloaded block comes back.

Note [the chunked placement in the plan]: the memory outside the blocks, measured under other
placements, holds attention's backward node at full length: its saves and gradients (q, k, v,
its output and theirs: `BlockCost.node_bytes`, from attention's call). A chunked block runs that
node a chunk at a time; at full length it holds its input, the keys and values with their
gradients (twice `BlockCost.kv_bytes`) and a chunk's share (`BlockCost.chunk_share`) of its saves
and of the node. Its working bytes are that less the node (negative where below ``stream``'s).
Its added time: the input's copies, and the block run twice less attention once (an upper bound).
Open only where the placement takes the block, and slower than a checkpoint: a plan picks it
where nothing else fits. Conservative: the other nodes chunks shrink, and a chunked forward's
transients, are not credited (a step bound in its forward, or in a norm's node, stays streamed).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CALIBRATED_HEADROOM",
    "CUDA_MARGIN_BYTES",
    "CUDA_MARGIN_SHARE",
    "PLACEMENTS",
    "PLAN_HEADROOM",
    "REPLAN_TOLERANCE",
    "BlockCost",
    "BudgetWarning",
    "Outside",
    "Placement",
    "Plan",
    "Windows",
    "allowed",
    "cuda_budget",
    "least",
    "moments",
    "off_by",
    "outside_from",
    "unsure",
]

# Note [the CUDA margin]: the default budget of a CUDA device is its total memory less the
# larger of these: what lives outside torch's allocated bytes (the CUDA context, cuBLAS and
# cuDNN workspaces, NCCL buffers) and the caching allocator's fragmentation, which the
# allocator's figures of allocated bytes do not show.
CUDA_MARGIN_BYTES = 2 * 2**30
CUDA_MARGIN_SHARE = 0.05

#: A step whose measured peak or time is off its prediction by more than this share is
#: replanned from the new measurements.
REPLAN_TOLERANCE = 0.10

#: Plans leave a share of the budget free for what the model does not see (the device arena's buffers
#: as placements change, a block's transients in backward, the allocator's rounding): a first plan, from
#: the measuring steps' peaks, missed its step's by up to 12% on the simulated device; one from its own, 1-4%.
PLAN_HEADROOM = 0.15
CALIBRATED_HEADROOM = 0.03


class BudgetWarning(RuntimeWarning):
    """A step of the auto policy peaked over its device budget, or no plan fits it
    (Note [every step over the budget is said] in actoff.runtime.over_budget). Silence it with
    ``warnings.filterwarnings("ignore", category=actoff.BudgetWarning)``.

    >>> issubclass(BudgetWarning, RuntimeWarning)
    True
    """


@dataclass(frozen=True)
class BlockCost:
    """One block as its measuring steps measured it: forward time, attention's share of it, and
    the bytes it saves by class."""

    forward_s: float
    attention_s: float
    input_bytes: int
    attention_bytes: int
    local_bytes: int
    #: The block can be recomputed token-wise (its probe passed): else no ``tokenwise``.
    tokenwise: bool = True
    #: The block may be run again in backward (no collective outside a token mixer, no input
    #: written in place): else no ``checkpoint``.
    rerun: bool = True
    #: The block's share of the host budget in bytes (None: no cap). Where its saves do not fit
    #: it, ``stream`` is closed and ``tokenwise`` storing every row opens: its rows split
    #: between host memory and NVMe, or recomputed past the host's share without an NVMe
    #: directory (actoff.policy.host_split).
    host_room: float | None = None
    #: Note [the chunked placement in the plan]: a chunk's share of its tokens (None: the
    #: placement does not take it), attention's keys and values, its node's bytes.
    chunk_share: float | None = None
    kv_bytes: int = 0
    node_bytes: int = 0
    #: Only chunks fit (Note [measuring where only chunks fit] in actoff.runtime.placements.measuring):
    #: the one placement open while it takes the block (its steps' peaks tell of no other's).
    chunks_only: bool = False

    @property
    def saved_bytes(self) -> int:
        return self.input_bytes + self.attention_bytes + self.local_bytes


@dataclass(frozen=True)
class Placement:
    """``keep``, ``stream``, ``tokenwise`` with the token fraction ``stored`` of the token-local
    bytes kept on the host (the rest recomputed), ``checkpoint`` or ``chunked``."""

    kind: str
    stored: float = 1.0

    def __str__(self) -> str:
        return f"tokenwise:{self.stored:g}" if self.kind == "tokenwise" else self.kind


#: From most to least device memory held through the step (Note [the budget model]).
PLACEMENTS = (
    Placement("keep"),
    Placement("stream"),
    *(Placement("tokenwise", stored) for stored in (1.0, 0.75, 0.5, 0.25, 0.0)),
    Placement("checkpoint"),
    Placement("chunked"),
)


@dataclass(frozen=True)
class Windows:
    """The step's windows in bytes (Note [the budget model]): ``fetch`` in backward, ``copy`` in forward."""

    fetch: float = 0.0
    copy: float = 0.0

    def __str__(self) -> str:
        return f"fetch window {_mib(self.fetch)}, copy window {_mib(self.copy)}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def allowed(block: BlockCost) -> tuple[Placement, ...]:
    """The placements open to ``block`` (`BlockCost.tokenwise`, `BlockCost.rerun`,
    `BlockCost.host_room`): ``tokenwise`` storing every row only where ``stream``, which holds
    less, is closed by the host budget.

    >>> [str(p) for p in allowed(BlockCost(0.01, 0.0, 1, 1, 1, tokenwise=False, rerun=False))]
    ['keep', 'stream']
    >>> [str(p) for p in allowed(BlockCost(0.01, 0.0, 1, 1, 1, rerun=False, host_room=2))]
    ['keep', 'tokenwise:1', 'tokenwise:0.75', 'tokenwise:0.5', 'tokenwise:0.25', 'tokenwise:0']
    >>> allowed(BlockCost(0.01, 0.0, 1, 1, 1, chunk_share=0.25))[-2:]
    (Placement(kind='checkpoint', stored=1.0), Placement(kind='chunked', stored=1.0))
    """
    if block.chunks_only and block.rerun and block.chunk_share is not None:
        return (Placement("chunked"),)
    streams = block.host_room is None or block.saved_bytes <= block.host_room

    def open_to(placement: Placement) -> bool:
        if placement.kind == "stream":
            return streams
        if placement.kind == "tokenwise":
            return block.tokenwise and (placement.stored < 1.0 or not streams)
        if placement.kind == "chunked":
            return block.rerun and block.chunk_share is not None
        return placement.kind != "checkpoint" or block.rerun

    return tuple(p for p in PLACEMENTS if open_to(p))


def least(block: BlockCost) -> Placement:
    """The placement open to ``block`` that holds the least device memory (the floor): ``chunked``
    where it holds less than the first of these open to it (Note [the chunked placement in the
    plan]): ``stream``, else ``checkpoint``, else ``tokenwise`` recomputing every row, else ``stream``
    all the same (what the host budget cannot take stays on the device, said: actoff.tiers.cpu).

    >>> str(least(BlockCost(0.01, 0.0, 1, 1, 1, host_room=0)))
    'checkpoint'
    >>> long = BlockCost(0.01, 0.0, 100, 400, 1000, chunk_share=0.05, kv_bytes=100, node_bytes=800)
    >>> str(least(long)), _working_bytes(long, Placement("chunked"))  # 100 + 200 + 0.05 * 2300 - 800
    ('chunked', -385.0)
    """
    open_, chunked = allowed(block), Placement("chunked")
    others = (Placement("stream"), Placement("checkpoint"), Placement("tokenwise", 0.0))
    other = next((placement for placement in others if placement in open_), Placement("stream"))
    less = block.chunks_only or _working_bytes(block, chunked) < _working_bytes(block, other)
    if chunked in open_ and less:
        return chunked
    return other


def _host_bytes(block: BlockCost, placement: Placement) -> float:
    """Bytes copied to the host and back."""
    if placement.kind == "keep":
        return 0.0
    if placement.kind in ("checkpoint", "chunked"):
        return block.input_bytes
    if placement.kind == "stream":
        return block.saved_bytes
    return block.input_bytes + block.attention_bytes + placement.stored * block.local_bytes


def _forward_bytes(block: BlockCost, placement: Placement) -> float:
    """What a block holds through its own forward: all it saves, but if it streams (its inputs, at least)."""
    return 0.0 if placement.kind in ("stream", "checkpoint", "chunked") else block.saved_bytes


def _leaving(block: BlockCost, placement: Placement) -> float:
    """A token-wise block's copies out, issued at its end, in flight through the next forward."""
    return _host_bytes(block, placement) if placement.kind == "tokenwise" else 0.0


def _streaming(block: BlockCost, placement: Placement, windows: Windows) -> float:
    """A block's copies out started at pack and still in flight: at most the copy window."""
    if placement.kind in ("stream", "checkpoint", "chunked"):
        return min(windows.copy, _host_bytes(block, placement))
    return 0.0


def _working_bytes(block: BlockCost, placement: Placement) -> float:
    """Bytes an offloaded block has back on the device at its backward (Note [the budget model])."""
    if placement.kind == "stream":
        return 0.0
    if placement.kind == "chunked":  # Note [the chunked placement in the plan]
        share = 1.0 if block.chunk_share is None else block.chunk_share
        full = block.input_bytes + 2 * block.kv_bytes
        return full + share * (block.saved_bytes + block.node_bytes) - block.node_bytes
    if placement.kind == "tokenwise" and 0.0 < placement.stored < 1.0:
        return block.saved_bytes + placement.stored * block.local_bytes
    return block.saved_bytes


@dataclass(frozen=True)
class Outside:
    """The step's device memory outside the blocks at each moment of Note [the budget model]
    (Note [memory outside the blocks]): ``forward``, ``head`` and ``backward``.

    >>> Outside.flat(100)
    Outside(forward=100.0, head=100.0, backward=100.0)
    """

    forward: float = 0.0
    head: float = 0.0
    backward: float = 0.0

    @classmethod
    def flat(cls, nbytes: float) -> Outside:
        """The same at every moment."""
        return cls(float(nbytes), float(nbytes), float(nbytes))

    @property
    def peak(self) -> float:
        return max(self.forward, self.head, self.backward)


@dataclass(frozen=True)
class Plan:
    """Placements per block (in forward order), the step's windows, and what they predict."""

    placements: tuple[Placement, ...]
    windows: Windows
    peak_bytes: float
    seconds: float

    def describe(self) -> str:
        counts = collections.Counter(str(placement) for placement in self.placements)
        return ", ".join(f"{n} {name}" for name, n in counts.items()) + f"; {self.windows}"


def moments(
    blocks: Sequence[BlockCost], placements: Sequence[Placement], outside: Outside | float, windows: Windows
) -> tuple[float, float, float]:
    """Bytes on the device at the worst forward moment, the head and the worst backward one."""
    outside = outside if isinstance(outside, Outside) else Outside.flat(outside)
    pairs = list(zip(blocks, placements, strict=True))
    kept = [b.saved_bytes if p.kind == "keep" else 0 for b, p in pairs]
    leaving = [_leaving(b, p) for b, p in pairs]
    streaming = [_streaming(b, p, windows) for b, p in pairs]
    # Copies from the nearest offloaded block before each may be under way: kept blocks wait for none.
    under_way, last, left, held = [], 0.0, [], 0.0
    for nbytes, out, placement in zip(streaming, leaving, placements, strict=True):
        under_way.append(last)
        left.append(held)
        if placement.kind != "keep":
            last, held = nbytes, out
    forward = outside.forward + max(
        sum(kept[:index])
        + left[index]
        + _forward_bytes(block, placement)
        + max(streaming[index], under_way[index])
        for index, (block, placement) in enumerate(pairs)
    )
    head = outside.head + sum(kept) + held + last
    fetch = windows.fetch if any(p.kind != "keep" for p in placements) else 0.0
    # A chunked block's working bytes may be negative (Note [the chunked placement in the plan]).
    backward = -float("inf")
    for index, (block, placement) in enumerate(pairs):
        own = kept[index] if placement.kind == "keep" else _working_bytes(block, placement)
        ahead = fetch if index and any(p.kind != "keep" for p in placements[:index]) else 0.0
        if index == len(pairs) - 1:  # copies still under way at the head are served from the device
            ahead = max(ahead, last + (held if placement.kind == "keep" else 0.0))
        backward = max(backward, sum(kept[:index]) + own + ahead)
    return forward, head, outside.backward + backward


def outside_from(
    measured: tuple[float, float, float],
    blocks: Sequence[BlockCost],
    placements: Sequence[Placement],
    windows: Windows,
) -> Outside:
    """The step's memory outside the blocks at each moment, from a step's measured peak at each
    (forward, the head, backward) under ``placements`` and ``windows``.

    Note [memory outside the blocks]: what the step holds besides the blocks' saved bytes
    (weights, gradients, optimizer state, the loss and its logits, the tokens, the embedding's
    output, kernels' scratch, the node at work in backward, copies still on their way) is counted
    by nobody: at each moment it is the measured peak of that moment less what the model says
    the blocks held then under the placements that ran. Taken as the same under every placement;
    a plan it misleads is caught by the next step's comparison (`off_by`) and replanned from that
    step's peaks.

    >>> blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 2
    >>> outside_from((500, 400, 300), blocks, [Placement("keep")] * 2, Windows())  # 50 + 50 held at the head
    Outside(forward=400.0, head=300.0, backward=200.0)
    """
    model = moments(blocks, placements, Outside(), windows)
    return Outside(*(max(0.0, seen - modelled) for seen, modelled in zip(measured, model, strict=True)))


def unsure(outside: Outside, seen: Windows | None, windows: Windows) -> Outside:
    """The memory outside the blocks to plan ``windows`` with, where ``outside`` was measured
    on a step that ran under ``seen`` (None: not known).

    Note [windows the step did not run]: `outside_from` takes the step's windows as full at its
    peak, and they need not have been: a step whose copies land quickly peaks with nothing in
    flight, and the bytes the model credits to its windows then belong to the memory outside,
    which is so underestimated by up to those windows. The same windows fill the same way
    again, so a plan that keeps them is predicted as its step measured; one with other windows
    is predicted with the measured windows' bytes added at each moment they count in. On the
    main run's floor (auto under 59.6 MiB, 1024 tokens) a calibrated plan moved from a copy
    window of 5.26 MiB to 42.1 MiB: predicted 54.4 MiB with 3% headroom, its forward peaked at
    59 to 61 MiB (in flight then: a whole block behind the link), and the capped device ran
    out of memory.

    >>> unsure(Outside.flat(100), Windows(10, 20), Windows(10, 40))
    Outside(forward=120.0, head=120.0, backward=110.0)
    >>> unsure(Outside.flat(100), Windows(10, 20), Windows(10, 20)) == Outside.flat(100)
    True
    """
    if seen is None or (int(windows.fetch), int(windows.copy)) == (int(seen.fetch), int(seen.copy)):
        return outside  # a step's windows are whole bytes, a plan's shares of a block
    return Outside(outside.forward + seen.copy, outside.head + seen.copy, outside.backward + seen.fetch)


def off_by(measured: float, predicted: float, tolerance: float = REPLAN_TOLERANCE) -> bool:
    """Whether ``measured`` is off ``predicted`` by more than ``tolerance`` of it.

    >>> off_by(109, 100), off_by(111, 100), off_by(89, 100)
    (False, True, True)
    """
    return abs(measured - predicted) > tolerance * max(predicted, 1e-12)


def cuda_budget(total_bytes: int) -> int:
    """The default budget of a CUDA device of ``total_bytes`` (Note [the CUDA margin]).

    >>> cuda_budget(80 * 2**30) / 2**30  # an H100: 4 GiB (5%) kept free
    76.0
    """
    return int(total_bytes - max(CUDA_MARGIN_BYTES, CUDA_MARGIN_SHARE * total_bytes))
