"""Static memory layout planner: offsets for buffers with known sizes and lifetimes.

A buffer is live on ``[start, end)``; buffers live at the same time must not overlap in the
address space. `solve` minimises the peak (the highest end offset): greedy best-fit over a
few orders as the floor, then, if greedy misses the lower bound (the most bytes live at once),
a mixed-integer program (PuLP; HiGHS through highspy when installed, else CBC) warm-started
from greedy, with big-M tightened to the greedy peak and a live-bytes cut per time step. It
never returns an invalid layout or one worse than greedy. `solve_bilevel` is MEMO's
decomposition: one solve per distinct block, then one for the step with each block a
rectangle.

Example:
    >>> from actoff.planner import Buffer, solve
    >>> layout = solve([Buffer(4, 0, 2), Buffer(4, 1, 3), Buffer(4, 2, 4)])
    >>> layout.peak, layout.lower_bound, layout.optimal
    (8, 8, True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ._version import __version__

__all__ = ["Buffer", "Layout", "PlanCache", "lower_bound", "solve", "solve_bilevel", "validate"]


@dataclass(frozen=True)
class Buffer:
    """``size`` bytes live on the half-open interval ``[start, end)`` of a logical clock."""

    size: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.size < 0 or self.end <= self.start:
            raise ValueError(
                f"Buffer(size={self.size}, start={self.start}, end={self.end}): need size >= 0 and end > start"
            )

    def overlaps(self, other: Buffer) -> bool:
        """Live at the same time as ``other``."""
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class Layout:
    """Offsets (input order), the peak they reach, and how good that is."""

    offsets: tuple[int, ...]
    peak: int
    lower_bound: int
    method: str  # "greedy:<order>", "mip", "bilevel", or "cache"
    optimal: bool  # peak proven minimal (equals the lower bound, or the MIP proved it)
    solve_s: float = 0.0

    @property
    def gap(self) -> float:
        """How far above the lower bound: ``peak / lower_bound - 1``."""
        return self.peak / self.lower_bound - 1.0 if self.lower_bound else 0.0


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def lower_bound(buffers: Sequence[Buffer], alignment: int = 1) -> int:
    """The most (aligned) bytes live at any one time: no layout can do better.

    >>> lower_bound([Buffer(3, 0, 2), Buffer(5, 1, 3), Buffer(7, 2, 3)])
    12
    """
    events = sorted(
        [(b.start, _align(b.size, alignment)) for b in buffers]
        + [(b.end, -_align(b.size, alignment)) for b in buffers]
    )
    live = best = 0
    for _, delta in events:  # at equal times frees (negative) sort first: [start, end) intervals
        live += delta
        best = max(best, live)
    return best


def validate(buffers: Sequence[Buffer], offsets: Sequence[int], alignment: int = 1) -> int:
    """Check a layout and return its peak; raise ``ValueError`` naming the first conflict.

    With ``alignment`` > 1 a buffer occupies its size rounded up to it (as allocators hand
    it out), for the overlap check and the peak alike, consistent with `lower_bound`."""
    if len(offsets) != len(buffers):
        raise ValueError(f"layout has {len(offsets)} offsets for {len(buffers)} buffers")
    for i, offset in enumerate(offsets):
        if offset < 0 or offset % alignment:
            raise ValueError(f"buffer {i}: offset {offset} is negative or not a multiple of {alignment}")
    sizes = [_align(b.size, alignment) for b in buffers]
    order = sorted(range(len(buffers)), key=lambda i: buffers[i].start)
    active: list[int] = []
    for i in order:
        b = buffers[i]
        active = [j for j in active if buffers[j].end > b.start]
        for j in active:
            if offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]:
                raise ValueError(
                    f"buffers {j} and {i} are live together and overlap: [{offsets[j]}, "
                    f"{offsets[j] + sizes[j]}) and [{offsets[i]}, {offsets[i] + sizes[i]})"
                )
        active.append(i)
    return max((offsets[i] + sizes[i] for i in range(len(buffers))), default=0)


# Greedy's orders, tried in turn; on a tie the first wins (for every arena: any of them is as good
# there). Start order first: when every buffer is live at once (a block's records fetched
# together) it stacks them as they were requested, so the first requested lie lowest and a step
# that skips the last ones needs only the low part of the range (the device arena takes a
# shorter buffer then: Note [skipped requests], actoff.memory.device_arena).
_ORDERS = {
    "start": lambda b: (b.start, -b.size),
    "size": lambda b: (-b.size, b.start),
    "size_x_lifetime": lambda b: (-b.size * (b.end - b.start), b.start),
}


def _greedy(buffers: Sequence[Buffer], order: str, alignment: int) -> list[int]:
    """Best fit: each buffer, in ``order``, goes into the smallest free gap among the buffers
    already placed that it meets in time, else on top of them."""
    offsets = [0] * len(buffers)
    placed: list[int] = []
    for i in sorted(range(len(buffers)), key=lambda i: _ORDERS[order](buffers[i])):
        b = buffers[i]
        size = _align(b.size, alignment)
        busy = sorted(
            (offsets[j], offsets[j] + _align(buffers[j].size, alignment))
            for j in placed
            if buffers[j].overlaps(b)
        )
        best: tuple[int, int] | None = None  # (gap size, offset)
        cursor = 0
        for low, high in busy:
            if low - cursor >= size and (best is None or low - cursor < best[0]):
                best = (low - cursor, cursor)
            cursor = max(cursor, _align(high, alignment))
        offsets[i] = best[1] if best is not None else cursor
        placed.append(i)
    return offsets


def _best_greedy(buffers: Sequence[Buffer], alignment: int) -> tuple[list[int], int, str]:
    best = None
    for order in _ORDERS:
        offsets = _greedy(buffers, order, alignment)
        peak = validate(buffers, offsets, alignment)
        if best is None or peak < best[1]:
            best = (offsets, peak, order)
    return best  # type: ignore[return-value]


def _mip(
    buffers: Sequence[Buffer], start: list[int], big_m: int, alignment: int, time_limit_s: float
) -> tuple[list[int] | None, bool]:
    """The big-M MIP warm-started from ``start``; returns (offsets or None, proven optimal)."""
    import pulp

    unit = alignment
    sizes = [_align(b.size, alignment) // unit for b in buffers]
    # Big-M: the greedy peak in units of the alignment (sizes rounded up to it), which the
    # warm start reaches by construction.
    m = max(_align(big_m, alignment) // unit, max(start[i] // unit + sizes[i] for i in range(len(buffers))))
    prob = pulp.LpProblem("actoff_layout", pulp.LpMinimize)
    peak = pulp.LpVariable("peak", lowBound=0, upBound=m)
    xs = [
        pulp.LpVariable(f"x{i}", lowBound=0, upBound=max(m - s, 0), cat="Integer")
        for i, s in enumerate(sizes)
    ]
    prob += peak
    for i, x in enumerate(xs):
        prob += x + sizes[i] <= peak
    zs = {}
    for i in range(len(buffers)):
        for j in range(i + 1, len(buffers)):
            if buffers[i].overlaps(buffers[j]):
                z = pulp.LpVariable(f"z{i}_{j}", cat="Binary")
                zs[i, j] = z
                prob += xs[i] + sizes[i] <= xs[j] + m * (1 - z)  # z = 1: i below j
                prob += xs[j] + sizes[j] <= xs[i] + m * z
    for t in sorted({b.start for b in buffers}):  # live-bytes cuts: the LP bound is tight
        prob += peak >= sum(sizes[i] for i, b in enumerate(buffers) if b.start <= t < b.end)
    # Warm start from greedy.
    for i, x in enumerate(xs):
        x.setInitialValue(start[i] // unit)
    for (i, j), z in zs.items():
        z.setInitialValue(1 if start[i] < start[j] else 0)
    peak.setInitialValue(max((start[i] // unit + sizes[i] for i in range(len(buffers))), default=0))
    solver = _solver(time_limit_s)
    prob.solve(solver)
    # PuLP says "Optimal" on a time limit with a solution: read the solution status.
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, False
    offsets = [round(x.varValue) * unit for x in xs]
    return offsets, prob.sol_status == pulp.LpSolutionOptimal


def _solver(time_limit_s: float):
    import pulp

    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        import highspy

        class WarmHiGHS(pulp.HiGHS):
            """PuLP's HiGHS, handed the variables' initial values as a starting solution."""

            def callSolver(self, lp):
                solution = highspy.HighsSolution()
                solution.col_value = [v.varValue if v.varValue is not None else 0.0 for v in lp.variables()]
                solution.value_valid = True
                lp.solverModel.setSolution(solution)
                super().callSolver(lp)

        return WarmHiGHS(msg=False, timeLimit=time_limit_s)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=True)


def solve(
    buffers: Sequence[Buffer], *, method: str = "auto", time_limit_s: float = 10.0, alignment: int = 1
) -> Layout:
    """A layout for ``buffers`` (see the module docstring).

    ``method``: ``"greedy"`` (best of three orders), ``"mip"`` (always run the MIP), or
    ``"auto"`` (the MIP only when greedy misses the lower bound). The MIP stops after
    ``time_limit_s``; offsets are multiples of ``alignment``.
    """
    if method not in ("auto", "greedy", "mip"):
        raise ValueError(f"solve(method={method!r}): expected 'auto', 'greedy' or 'mip'")
    if alignment < 1:
        raise ValueError(f"solve(alignment={alignment}): expected an integer >= 1")
    started = time.perf_counter()
    bound = lower_bound(buffers, alignment)
    if not buffers:
        return Layout((), 0, 0, "greedy:start", True)
    offsets, peak, order = _best_greedy(buffers, alignment)
    layout = Layout(
        tuple(offsets), peak, bound, f"greedy:{order}", peak == bound, time.perf_counter() - started
    )
    if method == "greedy" or (method == "auto" and peak == bound):
        return layout
    mip_offsets, proven = _mip(buffers, offsets, peak, alignment, time_limit_s)
    if mip_offsets is not None:
        try:
            mip_peak = validate(buffers, mip_offsets, alignment)
        except ValueError:  # a solver answer that breaks a constraint is never trusted
            mip_peak = None
        if mip_peak is not None and mip_peak <= peak:
            layout = Layout(tuple(mip_offsets), mip_peak, bound, "mip", proven or mip_peak == bound)
        elif proven:  # the MIP proved greedy optimal
            layout = dataclasses.replace(layout, optimal=True)
    return dataclasses.replace(layout, solve_s=time.perf_counter() - started)


def solve_bilevel(
    buffers: Sequence[Buffer],
    blocks: Sequence[Hashable],
    *,
    method: str = "auto",
    time_limit_s: float = 10.0,
    alignment: int = 1,
    blocks_apart: bool = False,
) -> Layout:
    """MEMO's bi-level plan: ``blocks[i]`` names the block buffer ``i`` belongs to.

    Each block's buffers are solved once per distinct shape (same sizes and relative
    lifetimes: all layers of a model share one solve), then the step is solved with each
    block as one rectangle. The answer is never worse than flat greedy, unless
    ``blocks_apart``: then each block's buffers stay within one range of their own (the
    device arena allocates each block's range apart: Note [a buffer per wave]).

    >>> buffers = [Buffer(4, 0, 2), Buffer(4, 1, 3), Buffer(4, 4, 6)]
    >>> layout = solve_bilevel(buffers, ["a", "a", "b"], blocks_apart=True)
    >>> layout.offsets, layout.peak, layout.method
    ((0, 4, 0), 8, 'bilevel')
    """
    if len(blocks) != len(buffers):
        raise ValueError(f"solve_bilevel: {len(blocks)} block ids for {len(buffers)} buffers")
    started = time.perf_counter()
    members: dict[Hashable, list[int]] = {}
    for i, block in enumerate(blocks):
        members.setdefault(block, []).append(i)
    inner_cache: dict[tuple, Layout] = {}
    rectangles, inner_offsets = [], {}
    for block, indices in members.items():
        begin = min(buffers[i].start for i in indices)
        shape = tuple((buffers[i].size, buffers[i].start - begin, buffers[i].end - begin) for i in indices)
        inner = inner_cache.get(shape)
        if inner is None:
            inner = inner_cache[shape] = solve(
                [Buffer(*s) for s in shape], method=method, time_limit_s=time_limit_s, alignment=alignment
            )
        inner_offsets[block] = inner.offsets
        rectangles.append(Buffer(_align(inner.peak, alignment), begin, max(buffers[i].end for i in indices)))
    outer = solve(rectangles, method=method, time_limit_s=time_limit_s, alignment=alignment)
    offsets = [0] * len(buffers)
    for (block, indices), base in zip(members.items(), outer.offsets, strict=True):
        for i, inner in zip(indices, inner_offsets[block], strict=True):
            offsets[i] = base + inner
    peak = validate(buffers, offsets, alignment)
    bound = lower_bound(buffers, alignment)
    flat = solve(buffers, method="greedy", alignment=alignment)
    if flat.peak < peak and not blocks_apart:
        return dataclasses.replace(flat, solve_s=time.perf_counter() - started)
    return Layout(tuple(offsets), peak, bound, "bilevel", peak == bound, time.perf_counter() - started)


class PlanCache:
    """Plans on disk as JSON, keyed by what they depend on. A stale or corrupt entry is
    ignored with a warning (and re-solved), never trusted.

    >>> import tempfile
    >>> cache = PlanCache(tempfile.mkdtemp())
    >>> buffers = [Buffer(4, 0, 2), Buffer(4, 1, 3)]
    >>> key = {"model": "tiny", "seq": 128, "dtype": "float32", "policy": "cpu"}
    >>> cache.get(key, buffers) is None
    True
    >>> cache.put(key, buffers, solve(buffers)); cache.get(key, buffers).method
    'cache'
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: dict) -> str:
        digest = hashlib.sha256(
            json.dumps({**key, "actoff": __version__}, sort_keys=True).encode()
        ).hexdigest()
        return os.path.join(self.directory, f"plan-{digest[:24]}.json")

    def get(self, key: dict, buffers: Sequence[Buffer], alignment: int = 1) -> Layout | None:
        path = self._path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path) as handle:
                data = json.load(handle)
            if data.get("actoff") != __version__ or data.get("buffers") != [
                list(dataclasses.astuple(b)) for b in buffers
            ]:
                raise ValueError("it was made for other buffers or another actoff version")
            offsets = tuple(int(o) for o in data["offsets"])
            peak = validate(buffers, offsets, alignment)
        except (OSError, ValueError, KeyError, TypeError) as error:
            warnings.warn(
                f"actoff: ignoring the cached plan {path}: {error}; solving again",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        return Layout(offsets, peak, lower_bound(buffers, alignment), "cache", bool(data.get("optimal")))

    def put(self, key: dict, buffers: Sequence[Buffer], layout: Layout) -> None:
        path = self._path(key)
        payload = {
            "actoff": __version__,
            "key": key,
            "buffers": [dataclasses.astuple(b) for b in buffers],
            "offsets": list(layout.offsets),
            "peak": layout.peak,
            "optimal": layout.optimal,
            "method": layout.method,
        }
        # Created exclusively, never through a symlink someone planted in a shared directory.
        temporary = path + f".tmp{os.getpid()}-{os.urandom(4).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with os.fdopen(os.open(temporary, flags, 0o600), "w") as handle:
                json.dump(payload, handle)
            os.replace(temporary, path)  # readers never see half a file; a link at path is replaced
        except OSError as error:  # the plan is still used, just not kept
            warnings.warn(
                f"actoff: could not cache the plan at {path}: {error}", RuntimeWarning, stacklevel=2
            )
