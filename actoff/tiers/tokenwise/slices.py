"""A block re-run on a token slice: the probe in a block's first backward, and the recompute of
dropped rows in every backward.

Note [token-wise re-run]: the dropped rows of every saved tensor are rebuilt by re-running
the block's forward on the sliced inputs (RNG state restored) while `RerunMode` serves the
token mixer's (attention's) output rows from its stored output. This is exact because a slice
of a block's input gives the same slice of every token-local activation; only the mixer needs
all tokens. Saved tensors arrive in the same order as in the forward pass (parameters,
recognised by storage, and the mixer's own saves are left out of the order on both passes), so
the i-th repacked tensor gives record i its rows. Any difference in count or shape is a
mismatch.

The re-run leaves nothing behind: Note [re-runs leave no trace] (actoff.rerun.isolation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.utils._pytree as pytree

from actoff.params import param_like
from actoff.rerun.again import run_again
from actoff.rerun.isolation import without_caches
from actoff.rerun.state import with_status
from actoff.tiers.record import Record, serve

from .mixers import RerunMismatch, RerunMode, rows_like, slice_inputs
from .tokens import Canon, detect_canon

if TYPE_CHECKING:
    from .split import Split

__all__ = ["Resave", "probe", "recompute", "rows_differ", "rows_match"]


def rows_match(original: torch.Tensor, recomputed: torch.Tensor, half: bool = False) -> bool:
    """Recomputed rows against the real ones: equal for integers; for floats within float32
    reassociation (1e-5) or half-precision rounding (2e-2: half-precision tensors, or any when
    ``half``, as under bf16 autocast), of each value plus the mean magnitude of the rows (a
    largest value does not hide a difference in the others)."""
    return not rows_differ([(original, recomputed)], half)


def rows_differ(pairs: list[tuple[torch.Tensor, torch.Tensor]], half: bool = False) -> bool:
    """Whether any ``(original, recomputed)`` pair fails `rows_match`, with one wait for the device
    for them all (Note [sentinel rows], actoff.tiers.split.sentinels).

    >>> rows = torch.ones(2, 4)
    >>> rows_differ([(rows, rows + 1e-7)]), rows_differ([(rows, rows + 1e-3)])
    (False, True)
    >>> rows_differ([(rows, rows + 1e-3)], half=True)  # under bf16 autocast
    False
    """
    flags = []
    for original, recomputed in pairs:
        if original.shape != recomputed.shape:
            return True
        if not original.numel():
            continue
        pieces = _pieces(original, recomputed)
        if not original.is_floating_point():
            flags += [(piece != again).any() for piece, again in pieces]
            continue
        full = original.dtype in (torch.float32, torch.float64) and not half
        tolerance = 1e-5 if full else 2e-2
        dtype = torch.promote_types(original.dtype, torch.float32)
        magnitude = sum(_size(piece, dtype).sum() for piece, _ in pieces) / original.numel()
        for piece, again in pieces:
            size = _size(piece, dtype)  # an infinity matches itself only
            piece, again = piece.to(dtype), again.to(dtype)
            near = ((again - piece).abs() <= tolerance * (magnitude + size)) | (again == piece)
            flags.append(~(near | (piece.isnan() & again.isnan())).all())
    return bool(torch.stack([flag.to(pairs[0][0].device) for flag in flags]).any()) if flags else False


def _size(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to(dtype).abs().nan_to_num(0.0, 0.0, 0.0)


#: Elements compared at a time: the comparison's temporaries (a few float32 copies of what it
#: compares) stay small next to the block's saves (Note [a probe short of memory]).
COMPARE_ELEMENTS = 1 << 18


def _pieces(original: torch.Tensor, recomputed: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Both tensors cut alike along their longest dimension into pieces of at most about
    `COMPARE_ELEMENTS` elements (views: nothing is copied)."""
    if original.numel() <= COMPARE_ELEMENTS or original.dim() == 0:
        return [(original, recomputed)]
    dim = max(range(original.dim()), key=original.size)
    rows = max(1, COMPARE_ELEMENTS * original.size(dim) // original.numel())
    return list(zip(original.split(rows, dim), recomputed.split(rows, dim), strict=True))


def probe(
    split: Split, candidates: list[Record], originals: dict[int, torch.Tensor]
) -> tuple[dict[int, Canon] | None, str]:
    """Re-run the block on its last tokens, in the backward of its first step, with the
    forward's saves at hand (``originals``: each candidate's tensor, by record index): find each
    record's token dimension (the one that shrank) and check the rows against the real ones.

    Returns ``{record index: Canon}`` for the records it can split, or ``None`` and the
    reason it fails.
    """
    seq_len = split.seq_len
    ranges = split.ranges  # None on auto's first step: its fractions are not decided yet
    recompute_len = ranges.recompute_len if ranges is not None else 0
    length = recompute_len if 0 < recompute_len < seq_len else seq_len // 2
    if length < 1:
        return None, f"a sequence of {seq_len} token(s) cannot be sliced"
    while True:
        start, short_of_memory = seq_len - length, False
        try:
            saved = recompute(split, start, seq_len, detect=candidates)
            break
        except RerunMismatch as error:
            return None, str(error)
        except torch.OutOfMemoryError as error:
            # A shorter slice asks less (Note [a probe short of memory]); retried outside the
            # handler, whose traceback holds the failed re-run's tensors.
            short_of_memory = length // PROBE_SHRINK >= PROBE_MIN_TOKENS
            if not short_of_memory:
                return None, _raised(start, seq_len, error)
        except Exception as error:  # the block cannot run on a token slice at all
            return None, _raised(start, seq_len, error)
        if short_of_memory:
            length //= PROBE_SHRINK
    canons: dict[int, Canon] = {}
    half = split.half_precision  # a float32 value of a bf16 product: a rounding
    for record in candidates:
        recomputed = saved.get(record.index)
        if recomputed is None:
            continue
        view = (record.geometry.size, record.geometry.stride)
        canon = detect_canon(view, record.base_info, recomputed.shape, recomputed.base_shape, seq_len, length)
        if canon is None:
            continue  # no token dimension we can trust: stored whole
        original = canon.view(record.geometry.flat(originals[record.index].detach())).narrow(
            canon.dim, start, length
        )
        if not rows_match(original, recomputed.base if canon.on_base else recomputed.view, half):
            return None, (
                f"saved tensor {record.index} (shape {list(record.geometry.size)}) differs after "
                f"recompute on tokens [{start}, {seq_len}) ({_likely_cause(split.module)})"
            )
        canons[record.index] = canon
    if not canons:
        return None, "no saved tensor has a token dimension"
    return canons, ""


# Note [a probe short of memory]: the probe runs in backward with the block's saves served whole,
# so its re-run's saves come on top of them. Out of memory there says nothing about whether
# the block can be recomputed: the probe tries a slice PROBE_SHRINK times shorter (the token
# dimension is still the one that shrank), down to PROBE_MIN_TOKENS, and only then gives up.
# Its check of the rows then compares COMPARE_ELEMENTS at a time, so its temporaries do not ask
# for more than the re-run did.
PROBE_SHRINK = 4
PROBE_MIN_TOKENS = 8


def _raised(start: int, seq_len: int, error: BaseException) -> str:
    return f"the re-run on tokens [{start}, {seq_len}) raised {type(error).__name__}: {error}"


def _likely_cause(module: torch.nn.Module | None) -> str:
    """Why recomputed rows differ: the block's dropout modules in training mode by name (they
    draw other masks on a token slice), else the usual suspects."""
    dropouts = [
        f"{name!r} (p={sub.p})"
        for name, sub in (module.named_modules() if module is not None else ())
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0
    ]
    if dropouts:  # Note [dropout in a re-run] (actoff.tiers.split.dropout)
        return (
            f"its dropout module{'s' if len(dropouts) > 1 else ''} {', '.join(dropouts)} in training mode "
            "could not draw the forward's masks again: random numbers drawn inside its token mixer "
            "(attention dropout) or elsewhere outside F.dropout shift them; without those the block is "
            "recomputed"
        )
    return (
        "tokens mixed outside a registered token mixer: attention written out with matmul and softmax, "
        "a scan or a convolution over tokens; positions computed inside the block; or dropout"
    )


class Resave(NamedTuple):
    """What the probe keeps of a re-run save: shapes and detached rows, never the tensor.

    Note [probe keeps no graph]: the probe keeps re-run saves detached, never as they are.
    A re-run save is an intermediate whose ``grad_fn`` holds the saved-tensor hooks of the
    re-run, whose pack closure holds the dictionary of saves, the token-wise run and its
    step: a cycle through C++ autograd that Python's collector cannot see, so every probe (one
    per block and new sequence length) would leak its step. Detached tensors hold only memory.
    """

    shape: tuple[int, ...]
    base_shape: tuple[int, ...] | None  # of its ``_base``, when it is a view
    view: torch.Tensor  # detached
    base: torch.Tensor | None  # detached ``_base``


def recompute(
    split: Split, start: int, stop: int, *, detect: list[Record] | None = None, keep_from: int = 0
) -> dict[int, Resave | torch.Tensor]:
    """The block's forward on token rows ``[start, stop)`` (Note [token-wise re-run]); of each
    record, the rows from token ``keep_from`` on are kept (a copy, when it is not ``start``).

    Returns, per record, its re-run save: for ``detect``'s records a `Resave` (to find
    the token dimension), else the rows in the record's canonical shape (detached).
    """
    run = split.run
    values = [serve(v) if isinstance(v, Record) else v for v in split.inputs]
    with split.forward.restored():  # backward runs with grad off; the sliced inputs need it on
        sliced = slice_inputs(values, split.input_status, split.seq_len, run.config.token_dim, start, stop)
    # Note [re-runs leave no trace] (actoff.rerun.isolation): no cache is written.
    sliced = without_caches(sliced)
    args, kwargs = pytree.tree_unflatten(sliced, split.input_spec)
    mixer_rows = []
    for value, dim, status in split.mixer_outputs:
        if dim is None:
            raise RerunMismatch("a token mixer's output has no token dimension actoff can find")
        whole = serve(value) if isinstance(value, Record) else value
        with split.forward.restored():  # rows that require grad, as the mixer's output did
            mixer_rows.append(with_status(status, rows_like(whole, dim, start, stop)))
    wanted = {r.index: r for r in (detect if detect is not None else split.records)}
    resaves = _Resaves(split, wanted, stop - start, detect is not None, keep_from - start)
    mode = RerunMode(mixer_rows, split.dropouts, split.seq_len, start, stop)
    devices = [run.device] if run.device.type == "cuda" else []
    # Scopes inside the block pass through (run.nested).
    with run.nested(), torch.random.fork_rng(devices=devices), split.forward.restored():
        torch.set_rng_state(split.rng[0])
        if split.rng[1] is not None:
            torch.cuda.set_rng_state(split.rng[1], run.device)
        hooks = torch.autograd.graph.saved_tensors_hooks(resaves.pack, lambda packed: packed)
        with hooks, mode, run_again(split.module, sliced, split.began, run.name):
            split.fn(*args, **kwargs)
    events, rows = split.events, resaves.rows
    if resaves.count != len(events):
        raise RerunMismatch(
            f"the re-run saved {resaves.count} tensors, the forward {len(events)} (a loop over the "
            "tokens, as a scan's, or control flow that depends on the length?)"
        )
    if mode.calls != len(mixer_rows):
        raise RerunMismatch(
            f"the re-run called the token mixer {mode.calls} times, the forward {len(mixer_rows)}"
        )
    if detect is None:
        missing = [i for i in wanted if i not in rows]
        if missing:
            raise RerunMismatch(f"the re-run did not produce records {missing}")
    return rows


class _Resaves:
    """The pack hook of a re-run: the i-th save (parameters left out, as in the forward) gives
    the forward's i-th record its rows (Note [token-wise re-run]); ``detect``: keep `Resave`s,
    to find each record's token dimension; ``keep``: the rows kept start that far into the slice."""

    def __init__(self, split: Split, wanted: dict[int, Record], length: int, detect: bool, keep: int) -> None:
        self.split, self.wanted, self.length, self.detect, self.keep = split, wanted, length, detect, keep
        self.rows: dict[int, Resave | torch.Tensor] = {}
        self.count = 0

    def pack(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        if isinstance(tensor, torch.nn.Parameter) or param_like(
            tensor, storage, self.split.run.param_storages
        ):
            return None
        k, events = self.count, self.split.events
        self.count += 1
        if k >= len(events):
            raise RerunMismatch(f"the re-run saved more tensors than the forward ({len(events)})")
        record = self.wanted.get(events[k])
        if record is None or record.index in self.rows:
            return None
        if self.detect:  # Note [probe keeps no graph]
            base = tensor._base
            self.rows[record.index] = Resave(
                tuple(tensor.shape),
                None if base is None else tuple(base.shape),
                tensor.detach(),
                None if base is None else base.detach(),
            )
            return None
        expected = list(record.canon.shape)
        expected[record.canon.dim] = self.length
        candidate = record.canon.source(tensor)
        if candidate is None or list(candidate.shape) != expected:
            raise RerunMismatch(
                f"saved tensor {k} has shape {list(tensor.shape)}; the forward's record "
                f"{record.index} needs {expected} on {self.length} tokens"
            )
        if self.keep > 0:  # a copy: the rows before it go with the re-run
            candidate = candidate.narrow(record.canon.dim, self.keep, self.length - self.keep).clone()
        self.rows[record.index] = candidate.detach()
        return None
