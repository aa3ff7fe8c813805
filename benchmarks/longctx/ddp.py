"""The torchrun mode: every policy under DDP, a record per rank and a ``total`` row.

Each rank runs the benchmark as it would alone; its workers join one process group per job,
through the key-value store of the launch (no second port), and rank 0 gathers the records.
"""

from __future__ import annotations

import json
import os


def torchrun_launch() -> dict | None:
    """Rank facts when torchrun launched this process with more than one rank, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return {
        "rank": int(os.environ["RANK"]),
        "world": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        "address": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "port": int(os.environ.get("MASTER_PORT", "29500")),
    }


def host_store(launch: dict):
    """The key-value store every job of this launch meets in, or None when torchrun's agent hosts it.

    torchrun's agent already serves a store on MASTER_ADDR:MASTER_PORT for the whole launch
    (``TORCHELASTIC_USE_AGENT_STORE``); under another launcher rank 0 hosts one there itself, for
    as long as this process runs. Either way no second port is needed.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or launch["rank"] != 0:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        launch["address"],
        launch["port"],
        launch["world"],
        is_master=True,
        timeout=timedelta(minutes=10),
        wait_for_workers=False,
    )


def rendezvous(launch: dict, name: str):
    """A client of the launch's store with keys under ``name``: one process group per job, no new port."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        launch["address"], launch["port"], launch["world"], is_master=False, timeout=timedelta(minutes=10)
    )
    return dist.PrefixStore(f"actoff-bench/{name}/", store)


def join_process_group(ddp: dict, cuda: bool) -> None:
    """A worker's process group for its job (``ddp``: the launch's facts and the job's name)."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(ddp["rank"]), WORLD_SIZE=str(ddp["world"]), LOCAL_WORLD_SIZE=str(ddp["local_world"])
    )
    if cuda:
        torch.cuda.set_device(ddp["local_rank"])
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=rendezvous(ddp, ddp["job"]),
        rank=ddp["rank"],
        world_size=ddp["world"],
    )


def gather_to_rank0(records: list[dict], launch: dict) -> list[dict] | None:
    """All ranks' records on rank 0, plus a ``total`` row per (policy, length); None elsewhere.

    Through the launch's store (a key per rank), not a process group: no collective, so
    nothing of gloo's is left to tear down at exit.
    """
    store = rendezvous(launch, "gather")
    store.set(f"rank{launch['rank']}", json.dumps(records))
    if launch["rank"] != 0:
        return None
    gathered = [json.loads(store.get(f"rank{rank}")) for rank in range(launch["world"])]
    rows = [record for part in gathered for record in part]
    totals = []
    for policy, seq in dict.fromkeys((r["policy"], r["seq"]) for r in rows):
        group = [r for r in rows if r["policy"] == policy and r["seq"] == seq]
        total = {"policy": policy, "seq": seq, "rank": "total", "status": "ok"}
        if all(r.get("status") == "ok" for r in group):
            total["step_ms"] = max(r["step_ms"] for r in group)  # the step ends with the slowest rank
            total["tokens_per_s"] = sum(r["tokens_per_s"] for r in group)
        else:
            total["status"] = "failed on a rank"
        totals.append(total)
    return rows + totals
