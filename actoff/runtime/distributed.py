"""Distributed: rank facts, and the one agreement of every rank with rank 0's first-step decisions.

Note [one agreement]
~~~~~~~~~~~~~~~~~~~~
Under torch.distributed, the decisions ranks could make apart and then disagree on (the auto
policy's fractions, the host arena's plan) are rank 0's, broadcast once, unconditionally, at
the end of the first backward, with whatever rank 0 has by then. A collective is safe only at a
point every rank reaches whatever its local state (lengths, budgets, timings), or a rank waits
forever; that end is one. A rank installs rank 0's plan when its own first step traced the same
buffers (same signature) and plans alone otherwise, as on any later re-plan. Plans are offsets
into a rank's own arena and never feed a collective, so ranks holding different plans cannot
deadlock: only the entry into the broadcast must be unconditional.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

__all__ = ["agree_with_rank0", "broadcast_from_rank0", "distributed_rank", "local_world_size"]


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


def agree_with_rank0(auto_decisions: dict, plans: dict, plan_now: Callable[[], None]) -> None:
    """Call at the first backward's end, on every rank exactly once (Note [one agreement]).

    Rank 0 first makes its plans (``plan_now``: from the cache or a solve); every rank then
    takes rank 0's auto decisions, and ranks other than 0 its plans for traces they share.
    """
    rank = distributed_rank()
    if rank is None:
        return
    if rank == 0:
        plan_now()
    shared = broadcast_from_rank0({"auto": auto_decisions, "plans": dict(plans) if rank == 0 else {}})
    auto_decisions.update(shared["auto"])  # rank 0's where it has one (a pipeline stage may not)
    if rank != 0:
        for signature, layout in shared["plans"].items():
            plans.setdefault(signature, dataclasses.replace(layout, method=f"rank 0 ({layout.method})"))
