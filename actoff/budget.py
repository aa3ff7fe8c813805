"""Fitting a device budget at the least step time: per block a placement, the step's predicted
device peak and added time, and the plan with the least time whose peak fits.

Pure functions on what a first step measured: no tensors, no devices, tested on numbers
against brute force.

Note [the budget model]: a block saves three classes of bytes in forward: its input, what
attention saves (q, k, v, its output, the log-sum-exp) and the token-local rest. A placement
says which stay on the device until the block's backward:

- ``keep``: all of them; it adds no time.
- ``tokenwise`` with a stored fraction ``a``: the input, attention's saves and a share ``a``
  of the rest go to the host; the rest is recomputed in backward (``(1 - a)`` of the block's
  forward time outside attention).
- ``checkpoint``: the input goes to the host; the whole block is run again (its forward time).

Copies out overlap the next block's forward and copies back the previous block's backward
(twice a forward, times the prefetch depth): only the part a copy takes beyond that is added.

The device peak is the largest of three moments, each with what the step holds outside the
blocks then (`Outside`: weights, gradients, optimizer state, and the moment's own, the logits
and their gradient at the head):

- the forward of each block: every kept block before it, the stored bytes of the block
  before it on their way out (if offloaded: the next block's placement waits for them), and
  its own bytes as it saves them;
- the head, between forward and backward: every kept block, and the last block's stored bytes
  on their way out if it is offloaded;
- the backward of each block, from the last: the kept blocks before it (their backward comes
  later), its own bytes back on the device (kept, fetched or rebuilt) and the prefetch of the
  ``depth`` blocks before it. A token-wise block that both stores and recomputes rows holds its
  stored rows twice while it is rebuilt: fetched packed, and scattered into the rebuilt tensors
  (the packed copy goes when the last is rebuilt).

So kept blocks are best the last ones: their backward comes first and lets them go before any
offloaded block comes back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "CALIBRATED_HEADROOM",
    "CUDA_MARGIN_BYTES",
    "CUDA_MARGIN_SHARE",
    "PLACEMENTS",
    "PLAN_HEADROOM",
    "REPLAN_TOLERANCE",
    "BlockCost",
    "Outside",
    "Placement",
    "Plan",
    "allowed",
    "cuda_budget",
    "floor_plan",
    "off_by",
    "outside_from",
    "plan",
    "predict",
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

#: Plans leave a share of the budget free for what the model does not see (the device arena's
#: buffers as placements change, a block's transients in backward, the allocator's rounding):
#: a first plan, from the measuring steps' peaks, missed its step's by up to 12% on the
#: simulated device; a plan made from the peaks of its own placements' step, by 1 to 4%.
PLAN_HEADROOM = 0.15
CALIBRATED_HEADROOM = 0.03


@dataclass(frozen=True)
class BlockCost:
    """One block as its first step measured it: forward time, attention's share of it, and
    the bytes it saves by class."""

    forward_s: float
    attention_s: float
    input_bytes: int
    attention_bytes: int
    local_bytes: int
    #: The block can be recomputed token-wise (its probe passed): else of the token-wise
    #: placements only ``tokenwise:1`` (everything stored) is open to it.
    tokenwise: bool = True
    #: The block may be run again in backward (its forward calls no collective outside a
    #: token mixer, which a re-run on one rank would call again): else no ``checkpoint``.
    rerun: bool = True

    @property
    def saved_bytes(self) -> int:
        return self.input_bytes + self.attention_bytes + self.local_bytes


@dataclass(frozen=True)
class Placement:
    """``keep``, ``tokenwise`` with the token fraction ``stored`` of the token-local bytes kept
    on the host (the rest recomputed), or ``checkpoint``."""

    kind: str
    stored: float = 1.0

    def __str__(self) -> str:
        return f"tokenwise:{self.stored:g}" if self.kind == "tokenwise" else self.kind


#: From most to least device memory held through the step (Note [the budget model]).
PLACEMENTS = (
    Placement("keep"),
    *(Placement("tokenwise", stored) for stored in (1.0, 0.75, 0.5, 0.25, 0.0)),
    Placement("checkpoint"),
)


def allowed(block: BlockCost) -> tuple[Placement, ...]:
    """The placements open to ``block`` (`BlockCost.tokenwise`, `BlockCost.rerun`).

    >>> [str(p) for p in allowed(BlockCost(0.01, 0.0, 1, 1, 1, tokenwise=False, rerun=False))]
    ['keep', 'tokenwise:1']
    """
    return tuple(
        p
        for p in PLACEMENTS
        if (p.kind != "tokenwise" or block.tokenwise or p.stored == 1.0)
        and (p.kind != "checkpoint" or block.rerun)
    )


def _host_bytes(block: BlockCost, placement: Placement) -> float:
    """Bytes copied to the host and back."""
    if placement.kind == "keep":
        return 0.0
    if placement.kind == "checkpoint":
        return block.input_bytes
    return block.input_bytes + block.attention_bytes + placement.stored * block.local_bytes


def _working_bytes(block: BlockCost, placement: Placement) -> float:
    """Bytes an offloaded block has back on the device at its backward (Note [the budget model])."""
    if placement.kind == "tokenwise" and 0.0 < placement.stored < 1.0:
        return block.saved_bytes + placement.stored * block.local_bytes
    return block.saved_bytes


def _recompute_s(block: BlockCost, placement: Placement) -> float:
    if placement.kind == "checkpoint":
        return block.forward_s
    if placement.kind == "tokenwise":
        return (1.0 - placement.stored) * (block.forward_s - block.attention_s)
    return 0.0


def added_seconds(block: BlockCost, placement: Placement, link_bytes_per_s: float, depth: int = 1) -> float:
    """Time a placement adds to a step over ``keep``: copies not hidden, and recompute.

    >>> block = BlockCost(0.01, 0.002, 10_000_000, 10_000_000, 30_000_000)
    >>> round(added_seconds(block, Placement("checkpoint"), 1e9), 4)  # re-run the forward
    0.01
    >>> round(added_seconds(block, Placement("tokenwise", 1.0), 1e9), 4)  # 50 ms each way: 40 + 30 over
    0.07
    """
    copy_s = _host_bytes(block, placement) / link_bytes_per_s
    out_stall = max(0.0, copy_s - block.forward_s)
    in_stall = max(0.0, copy_s - 2 * block.forward_s * depth)
    return out_stall + in_stall + _recompute_s(block, placement)


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


def _outside(outside: Outside | float) -> Outside:
    return outside if isinstance(outside, Outside) else Outside.flat(outside)


@dataclass(frozen=True)
class Plan:
    """Placements per block (in forward order), the prefetch depth, and what they predict."""

    placements: tuple[Placement, ...]
    depth: int
    peak_bytes: float
    seconds: float

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for placement in self.placements:
            counts[str(placement)] = counts.get(str(placement), 0) + 1
        return ", ".join(f"{n} {name}" for name, n in counts.items()) + f"; prefetch depth {self.depth}"


def predict(
    blocks: Sequence[BlockCost],
    placements: Sequence[Placement],
    link_bytes_per_s: float,
    *,
    outside_bytes: Outside | float = 0,
    depth: int = 1,
) -> tuple[float, float]:
    """The step's device peak and the time the placements add (Note [the budget model]).

    >>> blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 2
    >>> predict(blocks, [Placement("keep")] * 2, 1e9, outside_bytes=100)
    (200.0, 0.0)
    >>> peak, _ = predict(blocks, [Placement("checkpoint"), Placement("keep")], 1e9, outside_bytes=100)
    >>> peak  # the kept block, let go before the checkpointed one comes back whole
    160.0
    """
    return float(max(_moments(blocks, placements, outside_bytes, depth))), sum(
        added_seconds(b, p, link_bytes_per_s, depth) for b, p in zip(blocks, placements, strict=True)
    )


def _moments(
    blocks: Sequence[BlockCost], placements: Sequence[Placement], outside: Outside | float, depth: int
) -> tuple[float, float, float]:
    """Bytes on the device at the worst forward moment, the head and the worst backward one."""
    outside = _outside(outside)
    kept = [b.saved_bytes if p.kind == "keep" else 0 for b, p in zip(blocks, placements, strict=True)]
    stored = [0.0 if p.kind == "keep" else _host_bytes(b, p) for b, p in zip(blocks, placements, strict=True)]
    forward = outside.forward + max(
        sum(kept[:index]) + (stored[index - 1] if index else 0.0) + block.saved_bytes
        for index, block in enumerate(blocks)
    )
    head = outside.head + sum(kept) + stored[-1]
    backward = 0.0
    for index, (block, placement) in enumerate(zip(blocks, placements, strict=True)):
        own = kept[index] if placement.kind == "keep" else _working_bytes(block, placement)
        ahead = sum(stored[max(0, index - depth) : index])
        backward = max(backward, sum(kept[:index]) + own + ahead)
    return forward, head, outside.backward + backward


def outside_from(
    moments: tuple[float, float, float],
    blocks: Sequence[BlockCost],
    placements: Sequence[Placement],
    *,
    depth: int = 1,
) -> Outside:
    """The step's memory outside the blocks at each moment, from a step's measured peak at each
    (forward, the head, backward) under ``placements``.

    Note [memory outside the blocks]: what the step holds besides the blocks' saved bytes
    (weights, gradients, optimizer state, the loss and its logits, the tokens, the embedding's
    output, kernels' scratch, copies still on their way) is counted by nobody: at each moment
    it is the measured peak of that moment less what the model says the blocks held then under
    the placements that ran. Taken as the same under every placement; a plan it misleads is
    caught by the next step's comparison (`off_by`) and replanned from that step's peaks.

    >>> blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 2
    >>> outside_from((500, 400, 300), blocks, [Placement("keep")] * 2)  # 50 + 50 held at the head
    Outside(forward=400.0, head=300.0, backward=200.0)
    """
    model = _moments(blocks, placements, Outside(), depth)
    return Outside(
        *(max(0.0, measured - modelled) for measured, modelled in zip(moments, model, strict=True))
    )


def plan(
    blocks: Sequence[BlockCost],
    link_bytes_per_s: float,
    budget_bytes: float,
    *,
    outside_bytes: Outside | float = 0,
    depths: Sequence[int] = (1, 2),
) -> Plan | None:
    """The least added time whose predicted peak fits ``budget_bytes``, or None if nothing does.

    Keeping is free in time, so each count of kept blocks is tried (the last ones: their
    backward comes first and lets them go before an offloaded block comes back); the offloaded
    ones get placements by dynamic programming over the blocks in order, the state being the
    last ``depth`` placements (what is fetched ahead of a block's backward). Exact when the
    blocks are alike (a transformer's are); for blocks that differ, among plans that keep the
    last blocks.

    >>> blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 4  # 50 bytes each: copies take no time
    >>> plan(blocks, 1e9, 200).describe()  # keep fits: keep
    '4 keep; prefetch depth 1'
    >>> plan(blocks, 1e9, 150).describe()  # three held at the head; the first back once they are gone
    '1 tokenwise:1, 3 keep; prefetch depth 1'
    >>> plan(blocks, 1e9, 60).describe(), plan(blocks, 1e9, 59)  # the floor: one block back whole
    ('3 checkpoint, 1 keep; prefetch depth 1', None)
    >>> # (the last block's backward comes first, with one input fetched ahead: it may stay)
    """
    outside = _outside(outside_bytes)
    best: Plan | None = None
    count = len(blocks)
    for kept in range(count, -1, -1):
        held = sum(b.saved_bytes for b in blocks[count - kept :])
        if outside.head + held > budget_bytes:
            continue
        # Offloaded blocks come back after every kept one has gone.
        cap = budget_bytes - outside.backward
        for depth in depths if kept < count else depths[:1]:

            def fits(offloaded: tuple[Placement, ...], depth: int = depth, kept: int = kept) -> bool:
                # The head and the kept blocks' backward depend on the last offloaded ones only.
                placements = (*offloaded, *(PLACEMENTS[0],) * kept)
                return max(_moments(blocks, placements, outside, depth)) <= budget_bytes

            offloaded = _cheapest(blocks[: count - kept], link_bytes_per_s, cap, depth, fits)
            if offloaded is None:
                continue
            placements = (*offloaded, *(PLACEMENTS[0],) * kept)
            peak, seconds = predict(blocks, placements, link_bytes_per_s, outside_bytes=outside, depth=depth)
            if best is None or seconds < best.seconds - 1e-12:
                best = Plan(placements, depth, peak, seconds)
        if best is not None and best.seconds == 0.0:
            break  # nothing is faster than adding no time: keeping more only holds more
    return best


def _cheapest(
    blocks: Sequence[BlockCost],
    link_bytes_per_s: float,
    cap: float,
    depth: int,
    fits: Callable[[tuple[Placement, ...]], bool],
) -> tuple[Placement, ...] | None:
    """Offloaded placements for ``blocks`` (in forward order) with the least added time such
    that each block's bytes back plus the ``depth`` stored ones before it stay within ``cap``,
    and the whole plan ``fits`` (which depends on the last ``depth`` placements alone)."""
    # state: the last ``depth`` placements (fewer at the start) -> (seconds, placements so far)
    states: dict[tuple[Placement, ...], tuple[float, tuple[Placement, ...]]] = {(): (0.0, ())}
    for block in blocks:
        following: dict[tuple[Placement, ...], tuple[float, tuple[Placement, ...]]] = {}
        for window, (seconds, chosen) in states.items():
            before = chosen[-depth:] if depth else ()
            ahead = sum(
                _host_bytes(b, p) for b, p in zip(blocks[len(chosen) - len(before) :], before, strict=False)
            )
            for placement in allowed(block)[1:]:
                if _working_bytes(block, placement) + ahead > cap:
                    continue
                total = seconds + added_seconds(block, placement, link_bytes_per_s, depth)
                key = (*window, placement)[-depth:]
                if key not in following or total < following[key][0] - 1e-15:
                    following[key] = (total, (*chosen, placement))
        states = following
        if not states:
            return None
    valid = [state for state in states.values() if fits(state[1])]
    return min(valid, key=lambda state: state[0])[1] if valid else None


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


def floor_plan(
    blocks: Sequence[BlockCost], link_bytes_per_s: float, *, outside_bytes: Outside | float = 0
) -> Plan:
    """Every block at the least device memory open to it, prefetch depth 1: what runs when no
    plan fits the budget (it may still fit: the model errs both ways).

    >>> floor_plan([BlockCost(0.01, 0.002, 10, 10, 30)] * 2, 1e9).describe()
    '2 checkpoint; prefetch depth 1'
    """
    placements = tuple(allowed(block)[-1] for block in blocks)
    peak, seconds = predict(blocks, placements, link_bytes_per_s, outside_bytes=outside_bytes)
    return Plan(placements, 1, peak, seconds)
