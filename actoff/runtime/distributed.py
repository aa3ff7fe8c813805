"""Distributed: rank facts, and the one agreement of every rank with rank 0's decisions.

Note [one agreement]
~~~~~~~~~~~~~~~~~~~~
Under torch.distributed, the decisions ranks could make apart and then disagree on are rank
0's, each broadcast once, unconditionally, at the end of a backward counted from the start,
with whatever rank 0 has by then: the host arena's plan at the end of the first backward, the
auto policy's placements at the end of the backward that ends its measuring steps (the second:
its first plan is made there). A collective is safe only at a point every rank reaches whatever
its local state (lengths, budgets, timings, policy), or a rank waits forever; the end of the
n-th backward is one. A rank installs rank 0's host plan when its own first step traced the
same buffers (same signature) and plans alone otherwise, as on any later re-plan: plans are
offsets into a rank's own arena and never feed a collective. A rank takes rank 0's placements
by position in its step (modules and devices differ between processes) when its step has as
many blocks, and replans no more on its own measurements: ranks with the same blocks keep one
plan. A step of blocks or conditions a rank has not planned (a new length) is planned by that
rank alone, as a broadcast then could wait on ranks that never run it; placements change where
and how a block's activations are kept, never which collectives run (a block whose forward
calls one is never re-run), so ranks holding different plans cannot deadlock. Only the entry
into each broadcast must be unconditional.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "agree_on_auto",
    "agree_with_rank0",
    "broadcast_from_rank0",
    "distributed_rank",
    "local_world_size",
]


def local_world_size() -> int:
    """Processes sharing this host (torchrun's LOCAL_WORLD_SIZE; 1 when not distributed).

    >>> local_world_size() >= 1
    True
    """
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def distributed_rank() -> int | None:
    """This process's rank when torch.distributed runs with more than one rank, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.get_rank()


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank when torch.distributed runs (one decision, not one per
    rank: ranks deciding apart can disagree); ``value`` itself otherwise."""
    import torch.distributed as dist

    if distributed_rank() is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree_with_rank0(plans: dict, plan_now: Callable[[], None]) -> None:
    """Call at the end of the first backward, on every rank exactly once (Note [one agreement]).

    Rank 0 first makes its plans (``plan_now``: from the cache or a solve); ranks other than 0
    then take its host plans for traces they share.
    """
    rank = distributed_rank()
    if rank is None:
        return
    if rank == 0:
        plan_now()
    shared = broadcast_from_rank0(dict(plans) if rank == 0 else {})
    if rank != 0:
        for signature, layout in shared.items():
            plans.setdefault(signature, dataclasses.replace(layout, method=f"rank 0 ({layout.method})"))


def agree_on_auto(auto: Any) -> None:
    """Call at the end of the backward that ends the auto policy's measuring steps, on every
    rank exactly once, whatever its policy (Note [one agreement]): every rank takes rank 0's
    auto plan (``auto``: an `actoff.runtime.auto.AutoObserver`)."""
    if distributed_rank() is None:
        return
    auto.adopt(broadcast_from_rank0(auto.export()))
