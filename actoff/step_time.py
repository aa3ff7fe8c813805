"""The time a plan adds to a step over keeping every block: copies the compute does not hide,
and recompute; with actoff.budget's peaks, what `predict` says of a plan.

Pure functions on numbers, like actoff.budget.

Note [one link]: a step's copies go over one link, in order. A block's copies hide behind its
own compute as far as its window lets that compute run ahead of them (out in forward: its
forward time; back in backward: its backward, twice its forward; each scaled by the window's
share of the block's bytes, up to one), and, where the window is wider than the block, behind
its neighbour's compute (out: the next block's forward; back: the next block's backward, which
runs just before it), but only the part of it the neighbour's own copies leave free on the
link. A token-wise block copies at its end, behind the next forward as far as it is free.
The last block's neighbour is the head and the loss, taken as long as its own forward with no
copies of its own. So a block's added time depends on it and the next block only: the plan
search (actoff.fitting) stays exact by dynamic programming over the blocks in order.

Before this, each block's copies hid behind up to two forwards of its own, as if every block had
the link to itself: at 87 MiB the main run's plan of every block streamed was priced at +43 ms
and measured at +160 to +350 ms (copies of 105 ms a block behind forwards of about 45).
"""

from __future__ import annotations

from collections.abc import Sequence

from .budget import BlockCost, Outside, Placement, Windows, _host_bytes, moments

__all__ = ["added_seconds", "followings", "predict"]

#: Windows of none: each copy waits for its own, as ``save_on_cpu``'s.
_NO_WINDOWS = Windows()

#: Where a block comes in forward order: the next block and its placement, or None for the last.
Following = tuple[BlockCost, Placement] | None


def followings(blocks: Sequence[BlockCost], placements: Sequence[Placement]) -> list[Following]:
    """Each block's `Following`: the next block and its placement, None for the last.

    >>> [f if f is None else str(f[1]) for f in followings([None, None], [Placement("stream"), Placement("keep")])]
    ['keep', None]
    """
    pairs = list(zip(blocks, placements, strict=True))
    return [*pairs[1:], None]


def _recompute_s(block: BlockCost, placement: Placement) -> float:
    if placement.kind == "checkpoint":
        return block.forward_s
    if placement.kind == "chunked":
        return 2 * block.forward_s - block.attention_s
    if placement.kind == "tokenwise":
        return (1.0 - placement.stored) * (block.forward_s - block.attention_s)
    return 0.0


def _link_free(block: BlockCost, placement: Placement, link_bytes_per_s: float) -> tuple[float, float]:
    """Of a block's forward and backward, the time its own copies leave the link free."""
    copy_s = _host_bytes(block, placement) / link_bytes_per_s
    out = 0.0 if placement.kind == "tokenwise" else copy_s  # a token-wise block copies at its end
    return max(0.0, block.forward_s - out), max(
        0.0, 2 * block.forward_s + _recompute_s(block, placement) - copy_s
    )


def added_seconds(
    block: BlockCost,
    placement: Placement,
    link_bytes_per_s: float,
    windows: Windows,
    following: Following = None,
) -> float:
    """Time a placement adds to a step over ``keep``: copies not hidden (Note [one link]), and
    recompute. ``following``: the next block and its placement (None: the last block).

    >>> block = BlockCost(0.01, 0.002, 10_000_000, 10_000_000, 30_000_000)
    >>> # re-run 10 ms; windows of none: its input's copies (10 ms each way) hide behind nothing
    >>> round(added_seconds(block, Placement("checkpoint"), 1e9, Windows()), 4)
    0.03
    >>> two = Windows(fetch=100e6, copy=100e6)  # two blocks' worth: 50 ms of copy each way
    >>> round(added_seconds(block, Placement("stream"), 1e9, two), 4)  # 20 ms hidden out, 40 back
    0.04
    >>> # followed by a streamed block, whose own copies fill its compute: 10 ms hidden out, 20 back
    >>> round(added_seconds(block, Placement("stream"), 1e9, two, (block, Placement("stream"))), 4)
    0.07
    """
    host = _host_bytes(block, placement)
    if host == 0.0:
        return _recompute_s(block, placement)
    copy_s = host / link_bytes_per_s
    if following is None:
        free_out, free_in = block.forward_s, 2 * block.forward_s
    else:
        free_out, free_in = _link_free(*following, link_bytes_per_s)
    if placement.kind == "tokenwise":
        out_hidden = free_out
    else:
        out_hidden = block.forward_s * min(windows.copy / host, 1.0) + free_out * _beyond(windows.copy, host)
    in_hidden = 2 * block.forward_s * min(windows.fetch / host, 1.0) + free_in * _beyond(windows.fetch, host)
    return max(0.0, copy_s - out_hidden) + max(0.0, copy_s - in_hidden) + _recompute_s(block, placement)


def _beyond(window: float, host: float) -> float:
    """The share of the neighbour's compute a window wider than the block reaches: up to one."""
    return min(max(window / host - 1.0, 0.0), 1.0)


def predict(
    blocks: Sequence[BlockCost],
    placements: Sequence[Placement],
    link_bytes_per_s: float,
    *,
    outside_bytes: Outside | float = 0,
    windows: Windows = _NO_WINDOWS,
) -> tuple[float, float]:
    """The step's device peak and the time the placements add (Note [the budget model] in
    actoff.budget, Note [one link]).

    >>> blocks = [BlockCost(0.01, 0.002, 10, 10, 30)] * 2
    >>> predict(blocks, [Placement("keep")] * 2, 1e9, outside_bytes=100)
    (200.0, 0.0)
    >>> peak, _ = predict(blocks, [Placement("checkpoint"), Placement("keep")], 1e9, outside_bytes=100)
    >>> peak  # the kept block at the head; it is let go before the checkpointed one comes back whole
    150.0
    >>> predict(blocks, [Placement("stream")] * 2, 1e9, outside_bytes=100)[0]  # windows of 0: nothing
    100.0
    """
    seconds = sum(
        added_seconds(block, placement, link_bytes_per_s, windows, following)
        for block, placement, following in zip(
            blocks, placements, followings(blocks, placements), strict=True
        )
    )
    return float(max(moments(blocks, placements, outside_bytes, windows))), seconds
