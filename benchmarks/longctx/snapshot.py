"""``--memory-snapshot DIR`` (CUDA): what holds the device's memory at the start of the first
timed step, as ``torch.cuda.memory._snapshot()`` says, with the code that allocated it.

The worker records the allocator's history from its start (`start_history`), so every block
live at the snapshot carries the stack that made it; the snapshot is written to DIR as a
pickle (for PyTorch's memory viewer) and summarised in the record: the bytes live, and the
largest groups of live blocks by the first frame outside torch. Recording costs CPU time per
allocation: a run with a snapshot is not one to time.
"""

from __future__ import annotations

import os
import pickle
from collections import defaultdict

__all__ = ["start_history", "summarize_snapshot", "take_snapshot"]

#: Alloc and free events the trace keeps (a 7B-shaped step makes a few thousand). Live blocks
#: keep their stacks whatever this is; it bounds the pickle's size.
HISTORY_ENTRIES = 20_000
#: Groups the summary lists.
TOP = 12


def start_history() -> None:
    """Record every allocation's stack from now on (before the model is built)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)


def take_snapshot(directory: str, policy: str, seq: int) -> dict:
    """The snapshot now, written to ``directory``; its summary, with the file's path."""
    import torch

    os.makedirs(directory, exist_ok=True)
    snapshot = torch.cuda.memory._snapshot()
    path = os.path.join(directory, f"snapshot-{policy.replace(':', '_')}-{seq}.pickle")
    with open(path, "wb") as handle:
        pickle.dump(snapshot, handle)
    return {"path": path, **summarize_snapshot(snapshot)}


def _origin(frames: list[dict]) -> str:
    """``file:line function`` of the first Python frame outside torch and Python's own libraries;
    where a block has C++ frames only (CUDA's history records both, C++ first, and a backward's
    allocations have no Python frame: autograd's engine thread runs them), the operator that
    allocated it, and whether autograd's engine ran it.

    >>> _origin([{"filename": "??", "name": "torch::unwind::unwind()", "line": 0},
    ...          {"filename": "/w/actoff/reference.py", "name": "forward", "line": 7}])
    'reference.py:7 forward'
    >>> _origin([{"filename": "??", "name": "at::_ops::mm::call(at::Tensor const&)", "line": 0},
    ...          {"filename": "??", "name": "torch::autograd::Engine::thread_main()", "line": 0}])
    'C++ mm (backward)'
    """
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name and "/lib/python" not in name:
            return f"{os.path.basename(name)}:{frame.get('line')} {frame.get('name')}"
    names = [frame.get("name", "") for frame in frames]
    op = next((n.split("at::_ops::", 1)[1].split("::", 1)[0] for n in names if "at::_ops::" in n), None)
    if op is None:
        return "no Python frame (allocated in C++, or before the history started)"
    backward = any("autograd::Engine" in n for n in names)
    return f"C++ {op}" + (" (backward)" if backward else "")


def summarize_snapshot(snapshot: dict) -> dict:
    """Bytes reserved and live (allocated) in ``snapshot``, and the live blocks grouped by
    where they were allocated, largest first.

    >>> block = lambda size, line: {"size": size, "state": "active_allocated",
    ...                             "frames": [{"filename": "/x/torch/nn/f.py", "line": 1, "name": "linear"},
    ...                                        {"filename": "/w/actoff/reference.py", "line": line, "name": "forward"}]}
    >>> snapshot = {"segments": [{"total_size": 2**30, "blocks": [block(2**20, 7), block(2**20, 7),
    ...            block(2**10, 9), {"size": 4096, "state": "inactive", "frames": []}]}]}
    >>> summary = summarize_snapshot(snapshot)
    >>> summary["reserved_bytes"], summary["live_bytes"], summary["live_blocks"]
    (1073741824, 2098176, 3)
    >>> summary["top"][0]
    {'origin': 'reference.py:7 forward', 'bytes': 2097152, 'blocks': 2}
    """
    reserved = live = count = 0
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for segment in snapshot.get("segments", []):
        reserved += segment.get("total_size", 0)
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            size = block.get("size", 0)
            live, count = live + size, count + 1
            group = groups[_origin(block.get("frames") or [])]
            group[0] += size
            group[1] += 1
    top = sorted(groups.items(), key=lambda item: -item[1][0])[:TOP]
    return {
        "reserved_bytes": reserved,
        "live_bytes": live,
        "live_blocks": count,
        "top": [{"origin": origin, "bytes": size, "blocks": blocks} for origin, (size, blocks) in top],
    }
