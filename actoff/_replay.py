"""The re-forward of a token-wise run on a token slice: the probe of a block's first step, and
the recompute of dropped rows in backward.

Note [token-wise replay]: a slice of a block's input gives the same slice of every token-local
activation; only the token mixer (attention) needs all tokens. So the dropped rows of every
saved tensor are rebuilt by re-running the block's forward on the sliced inputs (RNG state
restored) while `ReplayMode` serves the mixer's output rows from its stored output. Saved
tensors arrive in the same order as in the forward pass (parameters, recognised by storage,
and the mixer's own saves are left out of the order on both passes), so the i-th repacked
tensor gives record i its rows. Any difference in count or shape is a mismatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ._mixers import ReplayMismatch, ReplayMode, rows_like, slice_inputs
from ._record import Record
from ._step import param_like
from ._tokens import detect_canon

__all__ = ["probe", "replay", "rows_match"]


def rows_match(original: torch.Tensor, replayed: torch.Tensor) -> bool:
    """Recomputed rows against the real ones: equal for integers; for floats within float32
    reassociation (1e-5) or half-precision rounding (2e-2), relative to the largest value."""
    if original.shape != replayed.shape:
        return False
    if not original.is_floating_point():
        return torch.equal(original, replayed)
    tolerance = 1e-5 if original.dtype in (torch.float32, torch.float64) else 2e-2
    scale = max(float(original.abs().max()), 1.0) if original.numel() else 1.0
    return torch.allclose(replayed, original, rtol=tolerance, atol=tolerance * scale)


def probe(tokenwise: Any, candidates: list[Record]) -> tuple[dict[int, tuple] | None, str]:
    """Re-run the block on its last tokens while everything is live: find each record's
    token dimension (the one that shrank) and check the rows against the real ones.

    Returns ``{record index: (size, stride, Canon)}``, or ``None`` and the reason it fails.
    """
    seq_len = tokenwise.seq_len
    recompute = tokenwise.ranges.recompute_len
    length = recompute if 0 < recompute < seq_len else seq_len // 2
    if length < 1:
        return None, f"a sequence of {seq_len} token(s) cannot be sliced"
    start = seq_len - length
    try:
        saved = replay(tokenwise, start, seq_len, detect=candidates)
    except ReplayMismatch as error:
        return None, str(error)
    except Exception as error:  # the block cannot run on a token slice at all
        return (
            None,
            f"the re-forward on tokens [{start}, {seq_len}) raised {type(error).__name__}: {error}",
        )
    plan: dict[int, tuple] = {}
    for record in candidates:
        replayed = saved.get(record.index)
        if replayed is None:
            continue
        view = (record.layout.size, record.layout.stride)
        canon = detect_canon(view, record.base_info, replayed, seq_len, length)
        if canon is None:
            continue  # no token dimension we can trust: stored whole
        original = canon.view(record.layout.flat(record.device_tensor.detach())).narrow(
            canon.dim, start, length
        )
        if not rows_match(original, canon.source(replayed).detach()):
            return None, (
                f"saved tensor {record.index} (shape {list(record.layout.size)}) differs after "
                f"recompute on tokens [{start}, {seq_len}) (attention written out without a "
                "registered token mixer, positions computed inside the block, or dropout?)"
            )
        plan[record.index] = (record.layout.size, record.layout.stride, canon)
    if not plan:
        return None, "no saved tensor has a token dimension"
    return plan, ""


def replay(
    tokenwise: Any, start: int, stop: int, *, detect: list[Record] | None = None
) -> dict[int, torch.Tensor]:
    """Note [token-wise replay]: the block's forward on token rows ``[start, stop)``.

    Returns, per record, its re-forward save: for ``detect``'s records the saved tensor as
    it is (to find the token dimension), else the rows in the record's canonical shape.
    """
    run = tokenwise.run
    runtime = run.runtime
    length = stop - start
    values = [runtime.materialize(v) if isinstance(v, Record) else v for v in tokenwise.inputs]
    with torch.enable_grad():  # backward runs with grad off; the sliced inputs need it on
        sliced = slice_inputs(
            values, tokenwise.input_status, tokenwise.seq_len, run.config.token_dim, start, stop
        )
    args, kwargs = pytree.tree_unflatten(sliced, tokenwise.input_spec)
    mixer_rows = []
    for value, dim in tokenwise.mixer_outputs:
        if dim is None:
            raise ReplayMismatch("a token mixer's output has no token dimension actoff can find")
        whole = runtime.materialize(value) if isinstance(value, Record) else value
        mixer_rows.append(rows_like(whole, dim, start, stop))
    wanted = {r.index: r for r in (detect if detect is not None else tokenwise.split_records)}
    events, rows, count = tokenwise.events, {}, [0]

    def pack(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        if isinstance(tensor, torch.nn.Parameter) or param_like(tensor, storage, run.param_storages):
            return None
        k = count[0]
        count[0] += 1
        if k >= len(events):
            raise ReplayMismatch(f"the re-forward saved more tensors than the forward ({len(events)})")
        record = wanted.get(events[k])
        if record is None or record.index in rows:
            return None
        if detect is not None:
            rows[record.index] = tensor
            return None
        expected = list(record.canon.shape)
        expected[record.canon.dim] = length
        candidate = record.canon.source(tensor)
        if candidate is None or list(candidate.shape) != expected:
            raise ReplayMismatch(
                f"saved tensor {k} has shape {list(tensor.shape)}; the forward's record "
                f"{record.index} needs {expected} on {length} tokens"
            )
        rows[record.index] = candidate.detach()
        return None

    mode = ReplayMode(mixer_rows)
    devices = [run.device] if run.device.type == "cuda" else []
    runtime.thread.stack.append(run)  # nested scopes inside the block pass through
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(tokenwise.rng[0])
            if tokenwise.rng[1] is not None:
                torch.cuda.set_rng_state(tokenwise.rng[1], run.device)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed), mode:
                tokenwise.fn(*args, **kwargs)
    finally:
        runtime.thread.stack.pop()
    if count[0] != len(events):
        raise ReplayMismatch(f"the re-forward saved {count[0]} tensors, the forward {len(events)}")
    if mode.calls != len(mixer_rows):
        raise ReplayMismatch(
            f"the re-forward called the token mixer {mode.calls} times, the forward {len(mixer_rows)}"
        )
    if detect is None:
        missing = [i for i in wanted if i not in rows]
        if missing:
            raise ReplayMismatch(f"the re-forward did not produce records {missing}")
    return rows
