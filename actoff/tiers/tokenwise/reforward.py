"""The re-forward of a token-wise run on a token slice: the probe in a block's first backward, and
the recompute of dropped rows in every backward.

Note [token-wise re-forward]: the dropped rows of every saved tensor are rebuilt by re-running
the block's forward on the sliced inputs (RNG state restored) while `ReforwardMode` serves the
token mixer's (attention's) output rows from its stored output. This is exact because a slice
of a block's input gives the same slice of every token-local activation; only the mixer needs
all tokens. Saved tensors arrive in the same order as in the forward pass (parameters,
recognised by storage, and the mixer's own saves are left out of the order on both passes), so
the i-th repacked tensor gives record i its rows. Any difference in count or shape is a
mismatch.

The re-forward leaves nothing behind: Note [re-forwards leave no trace]
(actoff.tiers.tokenwise.isolation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.utils._pytree as pytree

from actoff.tiers.record import Record, param_like, serve

from .isolation import forward_hooks_off, left_as_found, without_caches
from .mixers import ReforwardMismatch, ReforwardMode, rows_like, slice_inputs, with_status
from .tokens import Canon, detect_canon

if TYPE_CHECKING:
    from .run import TokenwiseRun

__all__ = [
    "Resave",
    "autocast_state",
    "forward_state",
    "low_precision",
    "probe",
    "recompute",
    "rows_differ",
    "rows_match",
]


def rows_match(original: torch.Tensor, recomputed: torch.Tensor, half: bool = False) -> bool:
    """Recomputed rows against the real ones: equal for integers; for floats within float32
    reassociation (1e-5) or half-precision rounding (2e-2: half-precision tensors, or any when
    ``half``, as under bf16 autocast), of each value plus the mean magnitude of the rows (a
    largest value does not hide a difference in the others)."""
    return not rows_differ([(original, recomputed)], half)


def rows_differ(pairs: list[tuple[torch.Tensor, torch.Tensor]], half: bool = False) -> bool:
    """Whether any ``(original, recomputed)`` pair fails `rows_match`, with one wait for the device
    for them all (Note [sentinel rows], actoff.tiers.tokenwise.sentinels).

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
    tokenwise: TokenwiseRun, candidates: list[Record], originals: dict[int, torch.Tensor]
) -> tuple[dict[int, Canon] | None, str]:
    """Re-run the block on its last tokens, in the backward of its first step, with the
    forward's saves at hand (``originals``: each candidate's tensor, by record index): find each
    record's token dimension (the one that shrank) and check the rows against the real ones.

    Returns ``{record index: Canon}`` for the records it can split, or ``None`` and the
    reason it fails.
    """
    seq_len = tokenwise.seq_len
    ranges = tokenwise.ranges  # None on auto's first step: its fractions are not decided yet
    recompute_len = ranges.recompute_len if ranges is not None else 0
    length = recompute_len if 0 < recompute_len < seq_len else seq_len // 2
    if length < 1:
        return None, f"a sequence of {seq_len} token(s) cannot be sliced"
    while True:
        start, short_of_memory = seq_len - length, False
        try:
            saved = recompute(tokenwise, start, seq_len, detect=candidates)
            break
        except ReforwardMismatch as error:
            return None, str(error)
        except torch.OutOfMemoryError as error:
            # A shorter slice asks less (Note [a probe short of memory]); retried outside the
            # handler, whose traceback holds the failed re-forward's tensors.
            short_of_memory = length // PROBE_SHRINK >= PROBE_MIN_TOKENS
            if not short_of_memory:
                return None, _raised(start, seq_len, error)
        except Exception as error:  # the block cannot run on a token slice at all
            return None, _raised(start, seq_len, error)
        if short_of_memory:
            length //= PROBE_SHRINK
    canons: dict[int, Canon] = {}
    half = low_precision(tokenwise)  # a float32 value of a bf16 product: a rounding
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
                f"recompute on tokens [{start}, {seq_len}) ({_likely_cause(tokenwise.module)})"
            )
        canons[record.index] = canon
    if not canons:
        return None, "no saved tensor has a token dimension"
    return canons, ""


# Note [a probe short of memory]: the probe runs in backward with the block's saves served whole,
# so its re-forward's saves come on top of them. Out of memory there says nothing about whether
# the block can be recomputed: the probe tries a slice PROBE_SHRINK times shorter (the token
# dimension is still the one that shrank), down to PROBE_MIN_TOKENS, and only then gives up.
# Its check of the rows then compares COMPARE_ELEMENTS at a time, so its temporaries do not ask
# for more than the re-forward did.
PROBE_SHRINK = 4
PROBE_MIN_TOKENS = 8


def _raised(start: int, seq_len: int, error: BaseException) -> str:
    return f"the re-forward on tokens [{start}, {seq_len}) raised {type(error).__name__}: {error}"


def _likely_cause(module: torch.nn.Module | None) -> str:
    """Why recomputed rows differ: the block's dropout modules in training mode by name (they
    draw other masks on a token slice), else the usual suspects."""
    dropouts = [
        f"{name!r} (p={sub.p})"
        for name, sub in (module.named_modules() if module is not None else ())
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0
    ]
    if dropouts:  # Note [dropout in a re-forward] (actoff.tiers.tokenwise.dropout)
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
    """What the probe keeps of a re-forward save: shapes and detached rows, never the tensor.

    Note [probe keeps no graph]: the probe keeps re-forward saves detached, never as they are.
    A re-forward save is an intermediate whose ``grad_fn`` holds the saved-tensor hooks of the
    re-forward, whose pack closure holds the dictionary of saves, the token-wise run and its
    step: a cycle through C++ autograd that Python's collector cannot see, so every probe (one
    per block and new sequence length) would leak its step. Detached tensors hold only memory.
    """

    shape: tuple[int, ...]
    base_shape: tuple[int, ...] | None  # of its ``_base``, when it is a view
    view: torch.Tensor  # detached
    base: torch.Tensor | None  # detached ``_base``


def autocast_state(device: torch.device) -> tuple[tuple[str, bool, torch.dtype, bool], ...]:
    """Autocast as it is now, for the CPU and ``device``'s type: ``(device type, enabled,
    dtype, weight cache enabled)`` each. Part of what decides what autograd saves.

    >>> autocast_state(torch.device("cpu"))
    (('cpu', False, torch.bfloat16, True),)
    """
    device_types = ("cpu",) if device.type == "cpu" else ("cpu", device.type)
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), cache)
        for kind in device_types
    )


_HALF = (torch.bfloat16, torch.float16)


def low_precision(tokenwise: TokenwiseRun) -> bool:
    """Whether a token-wise run's block computes in half precision: under half-precision autocast
    (`autocast_state`), with a half-precision parameter or input. A float32 value computed from
    a bf16 product (a norm's statistics) may be a bf16 rounding off on fewer rows."""
    if any(enabled and dtype in _HALF for _, enabled, dtype, _ in tokenwise.autocast):
        return True
    module = tokenwise.module
    if module is not None and any(p.dtype in _HALF for p in module.parameters()):
        return True
    dtypes = (
        v.geometry.dtype if isinstance(v, Record) else getattr(v, "dtype", None) for v in tokenwise.inputs
    )
    return any(dtype in _HALF for dtype in dtypes)


@contextlib.contextmanager
def forward_state(tokenwise: TokenwiseRun) -> Iterator[None]:
    """Note [re-forward state]: run under the grad mode and autocast state of the forward pass.

    Whether an operation saves an operand, and in which dtype, depends on grad mode and on
    autocast (under autocast a linear layer saves the bf16 cast of its weight). Backward runs
    with grad off and usually outside the training loop's autocast region, and the probe
    could run under another state than the step it recomputes for: so both set the captured state.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(tokenwise.grad_enabled))
        for device_type, enabled, dtype, cache in tokenwise.autocast:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield


def recompute(
    tokenwise: TokenwiseRun, start: int, stop: int, *, detect: list[Record] | None = None, keep_from: int = 0
) -> dict[int, Resave | torch.Tensor]:
    """The block's forward on token rows ``[start, stop)`` (Note [token-wise re-forward]); of each
    record, the rows from token ``keep_from`` on are kept (a copy, when it is not ``start``).

    Returns, per record, its re-forward save: for ``detect``'s records a `Resave` (to find
    the token dimension), else the rows in the record's canonical shape (detached).
    """
    run = tokenwise.run
    runtime = run.runtime
    length = stop - start
    values = [serve(v) if isinstance(v, Record) else v for v in tokenwise.inputs]
    with forward_state(tokenwise):  # backward runs with grad off; the sliced inputs need it on
        sliced = slice_inputs(
            values, tokenwise.input_status, tokenwise.seq_len, run.config.token_dim, start, stop
        )
    # Note [re-forwards leave no trace] (actoff.tiers.tokenwise.isolation): no cache is written.
    sliced = without_caches(sliced)
    args, kwargs = pytree.tree_unflatten(sliced, tokenwise.input_spec)
    mixer_rows = []
    for value, dim, status in tokenwise.mixer_outputs:
        if dim is None:
            raise ReforwardMismatch("a token mixer's output has no token dimension actoff can find")
        whole = serve(value) if isinstance(value, Record) else value
        with forward_state(tokenwise):  # rows that require grad, as the mixer's output did
            mixer_rows.append(with_status(status, rows_like(whole, dim, start, stop)))
    wanted = {r.index: r for r in (detect if detect is not None else tokenwise.split_records)}
    events, rows, count = tokenwise.events, {}, [0]

    def pack(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        if isinstance(tensor, torch.nn.Parameter) or param_like(tensor, storage, run.param_storages):
            return None
        k = count[0]
        count[0] += 1
        if k >= len(events):
            raise ReforwardMismatch(f"the re-forward saved more tensors than the forward ({len(events)})")
        record = wanted.get(events[k])
        if record is None or record.index in rows:
            return None
        if detect is not None:  # Note [probe keeps no graph]
            base = tensor._base
            rows[record.index] = Resave(
                tuple(tensor.shape),
                None if base is None else tuple(base.shape),
                tensor.detach(),
                None if base is None else base.detach(),
            )
            return None
        expected = list(record.canon.shape)
        expected[record.canon.dim] = length
        candidate = record.canon.source(tensor)
        if candidate is None or list(candidate.shape) != expected:
            raise ReforwardMismatch(
                f"saved tensor {k} has shape {list(tensor.shape)}; the forward's record "
                f"{record.index} needs {expected} on {length} tokens"
            )
        if keep_from > start:  # a copy: the rows before it go with the re-forward
            candidate = candidate.narrow(record.canon.dim, keep_from - start, stop - keep_from).clone()
        rows[record.index] = candidate.detach()
        return None

    mode = ReforwardMode(mixer_rows, tokenwise.dropouts, tokenwise.seq_len, start, stop)
    devices = [run.device] if run.device.type == "cuda" else []
    runtime.thread.stack.append(run)  # nested scopes inside the block pass through
    try:
        with torch.random.fork_rng(devices=devices), forward_state(tokenwise):
            torch.set_rng_state(tokenwise.rng[0])
            if tokenwise.rng[1] is not None:
                torch.cuda.set_rng_state(tokenwise.rng[1], run.device)
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed)
            found = left_as_found(tokenwise.module, sliced, tokenwise.touched)
            with hooks, mode, found, forward_hooks_off(tokenwise.module, tokenwise.touched):
                tokenwise.fn(*args, **kwargs)
    finally:
        runtime.thread.stack.pop()
    if count[0] != len(events):
        raise ReforwardMismatch(
            f"the re-forward saved {count[0]} tensors, the forward {len(events)} (a loop over the "
            "tokens, as a scan's, or control flow that depends on the length?)"
        )
    if mode.calls != len(mixer_rows):
        raise ReforwardMismatch(
            f"the re-forward called the token mixer {mode.calls} times, the forward {len(mixer_rows)}"
        )
    if detect is None:
        missing = [i for i in wanted if i not in rows]
        if missing:
            raise ReforwardMismatch(f"the re-forward did not produce records {missing}")
    return rows
