"""``--budgets N``: every policy under device budgets from keep's peak down to the floor, and
``auto``'s step time against the fastest policy that fits each.

Note [a budget sweep]: a first pass runs every policy without a cap (on a CPU, on a simulated
device too large to fill, so that it counts as the capped ones do), for its device peak;
``keep``'s is the top budget and the least peak of any policy the floor, and ``N`` budgets
are spaced evenly between them. Each budget then runs every policy again: on a CPU on the
simulated device with that capacity (the wind tunnel's link with it), on CUDA under
``ACTOFF_GPU_BUDGET`` with the process held to that much of the GPU
(``torch.cuda.set_per_process_memory_fraction``). A policy that does not fit is recorded ``oom``,
never dropped; every record carries ``budget_bytes`` and its ``round``. Every policy warms up
`AUTO_WARMUP` steps. The capped runs go in `SWEEP_ROUNDS` rounds (each a process per budget and
policy, in an order rotated each round), so each cell has a median and a spread (least .. most).
The targets: ``auto``'s step time is at most the fastest of the `RIVALS` that fit under each
budget, and at most `KEEP_FITS_TARGET` times ``none``'s where ``keep`` fits; a verdict is given
only where the difference is larger than the spreads (their ranges do not overlap), else it is
``within noise``. Under each budget the sweep also prints what ``auto`` planned against what
it measured (`actoff.stats()`): the budget it was asked, the device peak it measured, and the
blocks' time it predicted and measured; a peak over the budget is said.

Note [auto in the main run]: the main command (no question asked) runs every policy at every
length, but ``auto`` with no budget keeps everything where the device has room, which shows
nothing. So ``auto`` runs instead under `MAIN_AUTO_BUDGETS` budgets at the longest length where
``keep`` ran: the top is ``keep``'s peak over one less ``CALIBRATED_HEADROOM`` (auto keeps that
share of its budget free, so at ``keep``'s peak exactly it would not keep), the floor the least
peak of every policy that ran (to 64 KiB: Note [the floor budget]), the rest evenly between. Each run is on a device of that size, as
a sweep's capped runs are; its records carry ``budget_bytes`` and a ``label`` (`auto_label`)
that the table and the plot show. A budget under ``auto``'s floor is recorded ``oom``, a finding
that does not fail the run (`table.failed`): that is the figure a user at the edge of memory needs.
"""

from __future__ import annotations

import math
import statistics

import torch
from _common import format_table

from actoff.budget import CALIBRATED_HEADROOM

from .worker import run_one

#: The policies ``auto`` is held against under each budget (actoff's explicit ``cpu`` and
#: ``checkpoint`` with PyTorch's tools and no offload).
RIVALS = ("none", "torch_checkpoint", "torch_checkpoint_cpu", "torch_save_on_cpu", "cpu", "checkpoint")
#: The policies a sweep runs by default: the rivals, ``keep`` (which sets the top budget) and ``auto``.
SWEEP_POLICIES = ("none", "keep", *RIVALS[1:], "auto")
#: Where ``keep`` fits, ``auto`` keeps: it costs its hooks, at most this much over ``none``.
KEEP_FITS_TARGET = 1.03
#: The simulated device of the first pass: counted as the capped ones are, never full.
UNCAPPED_BYTES = 2**40
#: Warm-up steps of every policy in a sweep: ``auto`` measures two steps, probes in a third,
#: plans and calibrates its plan in the next two (Note [measuring at the floor], Note
#: [calibrated plans] in actoff.runtime.auto), so its timed steps run the calibrated plan.
AUTO_WARMUP = 5
#: Budgets ``auto`` runs under in the main run (Note [auto in the main run]).
MAIN_AUTO_BUDGETS = 3
#: Rounds of the capped runs: a median and a spread per policy and budget.
SWEEP_ROUNDS = 3


# Note [the floor budget]: the lowest budget asked is the least peak of the policies that ran,
# rounded up to `FLOOR_GRAIN` bytes. A policy's peak is its timed steps', and its warm-up steps
# peak a little over them (the main run's 1024 tokens: torch_save_on_cpu's second step needs 504
# bytes more than its timed steps, out of memory at its own peak as a cap; auto's measuring step
# then holds the same bytes as it, to the byte). Any run under a cap lives through its warm-up,
# so the floor leaves that grain.
FLOOR_GRAIN = 64 * 2**10


def floor_budget(least_peak: int) -> int:
    """The lowest budget of a sweep or the main run (Note [the floor budget]).

    >>> floor_budget(47803400), floor_budget(65536)
    (47841280, 65536)
    """
    return -(-least_peak // FLOOR_GRAIN) * FLOOR_GRAIN


def budgets_between(top: int, floor: int, count: int) -> list[int]:
    """``count`` budgets from ``top`` down to ``floor``, evenly spaced (bytes).

    >>> budgets_between(100, 40, 4)
    [100, 80, 60, 40]
    >>> budgets_between(100, 40, 1)
    [100]
    """
    if count == 1:
        return [top]
    return [round(top - (top - floor) * index / (count - 1)) for index in range(count)]


def sweep(
    policies: list[str], base: dict, seq: int, count: int, time_left, out, rounds: int = SWEEP_ROUNDS
) -> tuple[list[dict], list[dict], list[int]]:
    """The uncapped pass, then every policy under each budget in ``rounds`` rounds (Note [a
    budget sweep]). Returns the uncapped records, the capped ones and the budgets."""
    uncapped = []
    for policy in policies:
        if policy.startswith("auto"):
            continue  # no budget there: it would keep
        spec = {**base, "policy": policy, "seq": seq, "budget_bytes": None}
        if not torch.cuda.is_available():  # counted as under a cap, by a device too large to fill
            spec["sim_memory"] = UNCAPPED_BYTES
        uncapped.extend(run_one(spec, time_left(), out.write))
    peaks = {r["policy"]: r.get("peak_allocated_bytes") for r in uncapped if r.get("status") == "ok"}
    if not peaks.get("keep"):
        raise SystemExit("--budgets needs keep's device peak: keep did not run (put it in --policies)")
    floor = floor_budget(min(peak for peak in peaks.values() if peak))
    budgets = budgets_between(peaks["keep"], floor, count)
    capped = []
    for round_index in range(rounds):
        shift = round_index % len(policies)
        for budget in budgets:
            for policy in policies[shift:] + policies[:shift]:
                spec = {**base, "policy": policy, "seq": seq, "budget_bytes": budget}
                if not torch.cuda.is_available():
                    spec["sim_memory"] = budget  # Note [a capped device on a CPU]
                if time_left() <= 0:
                    made = [{**spec, "status": "not run", "error": "--time-budget spent"}]
                    out.write(made[0])
                else:
                    made = run_one(spec, time_left(), out.write)
                capped.extend({**record, "round": round_index} for record in made)
    return uncapped, capped, budgets


def cells(records: list[dict], budgets: list[int], policies: list[str]) -> dict[tuple[int, str], dict]:
    """``(budget, policy) -> its rounds``: ``status`` (``ok`` where every round ran, else the
    first other status and how many rounds had it), and over the ok rounds the step time's
    ``median``, ``low`` and ``high``.

    >>> records = [{"policy": "cpu", "budget_bytes": 8, "status": "ok", "step_ms": ms} for ms in (12.0, 10.0, 11.0)]
    >>> cells(records + [{"policy": "auto", "budget_bytes": 8, "status": "oom"}], [8], ["cpu", "auto"])
    ... # doctest: +NORMALIZE_WHITESPACE
    {(8, 'cpu'): {'status': 'ok', 'rounds': 3, 'median': 11.0, 'low': 10.0, 'high': 12.0},
     (8, 'auto'): {'status': 'oom 1/1', 'rounds': 1, 'median': None, 'low': None, 'high': None}}
    """
    out = {}
    for budget in budgets:
        for policy in policies:
            mine = [r for r in records if r["policy"] == policy and r.get("budget_bytes") == budget]
            times = sorted(r["step_ms"] for r in mine if r.get("status") == "ok")
            failed = [r.get("status", "not run") for r in mine if r.get("status") != "ok"]
            status = "not run" if not mine else f"{failed[0]} {len(failed)}/{len(mine)}" if failed else "ok"
            out[(budget, policy)] = {
                "status": status,
                "rounds": len(mine),
                "median": statistics.median(times) if times else None,
                "low": times[0] if times else None,
                "high": times[-1] if times else None,
            }
    return out


def compare(mine: dict, other: dict, target: float = 1.0) -> str:
    """``mine`` against ``other`` times ``target`` (cells): ``faster`` or ``slower`` only where
    their spreads do not overlap, else ``within noise``.

    >>> compare({"low": 9.0, "high": 9.5}, {"low": 10.0, "high": 11.0})
    'faster'
    >>> compare({"low": 9.0, "high": 10.5}, {"low": 10.0, "high": 11.0}), compare({"low": 12.0, "high": 13.0}, {"low": 10.0, "high": 11.0})
    ('within noise', 'slower')
    """
    if mine["high"] < other["low"] * target:
        return "faster"
    if mine["low"] > other["high"] * target:
        return "slower"
    return "within noise"


def _spread(cell: dict, unit: str = " ms") -> str:
    return f"{cell['median']:.1f}{unit} ({cell['low']:.1f} .. {cell['high']:.1f})"


def verdicts(records: list[dict], budgets: list[int]) -> list[dict]:
    """Per budget: the rivals that fit in every round, the fastest of them by median, ``auto``'s
    step time against it and, where ``keep`` fits, against ``none``'s times `KEEP_FITS_TARGET`;
    ``met`` is False only where ``auto`` is slower beyond the spreads (`compare`).

    >>> records = [{"policy": p, "budget_bytes": 10, "status": "ok", "step_ms": ms}
    ...            for p, times in {"none": (100.0, 99.0, 103.0), "keep": (101.0, 100.0, 102.0),
    ...                             "checkpoint": (130.0, 128.0, 133.0), "auto": (102.0, 101.0, 104.0)}.items()
    ...            for ms in times]
    >>> [line["text"] for line in verdicts(records, [10])]  # doctest: +NORMALIZE_WHITESPACE
    ['budget 10 B: auto 102.0 ms (101.0 .. 104.0) vs the fastest that fits, none 100.0 ms (99.0 .. 103.0): 1.02x,
      within noise (target <= 1x: met within the spread)',
     'budget 10 B: keep fits: auto 102.0 ms (101.0 .. 104.0) vs none 100.0 ms (99.0 .. 103.0): 1.02x,
      within noise (target <= 1.03x: met within the spread)']
    """
    import actoff

    table = cells(records, budgets, sorted({r["policy"] for r in records}))
    lines = []
    for budget in budgets:
        where = f"budget {actoff.format_bytes(budget)}"
        auto = table.get((budget, "auto"), {"status": "not run"})
        if auto["status"] != "ok":
            text = f"{where}: auto {auto['status']} (target: fits in every round: NOT met)"
            lines.append(
                {
                    "budget_bytes": budget,
                    "met": False,
                    "target": None,
                    "verdict": "does not fit",
                    "text": text,
                }
            )
            continue
        fits = [
            (name, table[(budget, name)])
            for name in RIVALS
            if table.get((budget, name), {}).get("status") == "ok"
        ]
        if not fits:
            text = f"{where}: auto {_spread(auto)}; none of the others fits"
            lines.append(
                {
                    "budget_bytes": budget,
                    "met": True,
                    "target": None,
                    "verdict": "only auto fits",
                    "text": text,
                }
            )
        else:
            name, best = min(fits, key=lambda item: item[1]["median"])
            lines.append(_line(where, budget, auto, name, best, 1.0))
        if (
            table.get((budget, "keep"), {}).get("status") == "ok"
            and table.get((budget, "none"), {}).get("status") == "ok"
        ):
            lines.append(
                _line(f"{where}: keep fits", budget, auto, "none", table[(budget, "none")], KEEP_FITS_TARGET)
            )
    return lines


def _line(where: str, budget: int, auto: dict, name: str, other: dict, target: float) -> dict:
    """One verdict line: ``auto`` against ``other`` (``name``) times ``target`` (1: the fastest
    rival that fits)."""
    ratio = auto["median"] / other["median"]
    verdict = compare(auto, other, target)
    said = {"faster": "auto fastest", "slower": "auto slower", "within noise": "within noise"}[verdict]
    if target != 1.0:
        said = {
            "faster": f"faster than {name} x {target:g}",
            "slower": f"slower than {name} x {target:g}",
        }.get(verdict, verdict)
    met = verdict != "slower"
    how = "met within the spread" if verdict == "within noise" else "met" if met else "NOT met"
    return {
        "budget_bytes": budget,
        "vs": name,
        "ratio": ratio,
        "target": target,
        "verdict": verdict,
        "met": met,
        "text": f"{where}: auto {_spread(auto)} vs {'' if target != 1.0 else 'the fastest that fits, '}{name} "
        f"{_spread(other)}: {ratio:.2f}x, {said} "
        f"(target <= {target:g}x: {how})",
    }


#: The fields of a row of `auto_figures`, in order.
FIGURES = (
    "budget",
    "asked",
    "measured_peak",
    "predicted_peak",
    "peak_off",
    "counted_peak",
    "predicted_ms",
    "measured_ms",
    "over",
)


def auto_figures(records: list[dict], budgets: list[int]) -> list[dict]:
    """Per budget, what ``auto`` planned against what it measured, over its ok rounds (from
    `actoff.stats()`, in the records' ``auto_*`` fields): the budget it was asked, the most
    device peak it measured and the median it predicted for that plan (``peak_off``: measured
    over predicted, less 1), the most peak the benchmark counted over the whole step, and the
    medians of the blocks' time it predicted and measured; ``over`` where a measured or counted
    peak is over the budget asked.

    >>> records = [{"policy": "auto", "budget_bytes": 100, "status": "ok", "auto_budget_bytes": 100,
    ...             "auto_measured_peak_bytes": peak, "auto_predicted_peak_bytes": 96, "peak_allocated_bytes": 99,
    ...             "auto_predicted_step_ms": 5.0, "auto_measured_step_ms": ms}
    ...            for peak, ms in ((90, 6.0), (104, 7.0), (95, 6.5))]
    >>> auto_figures(records, [100])  # doctest: +NORMALIZE_WHITESPACE
    [{'budget': '100 B', 'asked': 100, 'measured_peak': 104, 'predicted_peak': 96, 'peak_off': 0.0833...,
      'counted_peak': 99, 'predicted_ms': 5.0, 'measured_ms': 6.5, 'over': 'auto measured 4 B over the budget asked'}]
    """
    import actoff

    def most(values: list) -> int | None:
        return max(values) if values else None

    rows = []
    for budget in budgets:
        mine = [
            r
            for r in records
            if r["policy"] == "auto" and r.get("budget_bytes") == budget and r.get("status") == "ok"
        ]
        if not mine:
            failed = {
                r.get("status") for r in records if r["policy"] == "auto" and r.get("budget_bytes") == budget
            }
            if failed:  # every round out of memory or stopped: said, not left out
                row = dict.fromkeys(FIGURES)
                row.update(
                    budget=actoff.format_bytes(budget), over=f"no round ran: {', '.join(sorted(failed))}"
                )
                rows.append(row)
            continue
        asked = max(r.get("auto_budget_bytes") or 0 for r in mine) or None
        peak = most(
            [r["auto_measured_peak_bytes"] for r in mine if r.get("auto_measured_peak_bytes") is not None]
        )
        predicted_peaks = [r["auto_predicted_peak_bytes"] for r in mine if r.get("auto_predicted_peak_bytes")]
        predicted_peak = int(statistics.median(predicted_peaks)) if predicted_peaks else None
        counted = most([r["peak_allocated_bytes"] for r in mine if r.get("peak_allocated_bytes") is not None])
        predicted = [r["auto_predicted_step_ms"] for r in mine if r.get("auto_predicted_step_ms")]
        measured = [r["auto_measured_step_ms"] for r in mine if r.get("auto_measured_step_ms") is not None]
        over = [
            f"{who} {actoff.format_bytes(value - asked)} over the budget asked"
            for who, value in (("auto measured", peak), ("the step counted", counted))
            if value is not None and asked is not None and value > asked
        ]
        rows.append(
            {
                "budget": actoff.format_bytes(budget),
                "asked": asked,
                "measured_peak": peak,
                "predicted_peak": predicted_peak,
                "peak_off": peak / predicted_peak - 1 if peak and predicted_peak else None,
                "counted_peak": counted,
                "predicted_ms": statistics.median(predicted) if predicted else None,
                "measured_ms": statistics.median(measured) if measured else None,
                "over": "; ".join(over) or None,
            }
        )
    return rows


def print_auto_figures(records: list[dict], budgets: list[int]) -> list[dict]:
    """`auto_figures` as a table with its legend (nothing where auto ran under no budget)."""
    import actoff

    figures = auto_figures(records, budgets)
    if not figures:
        return figures
    sizes = ("asked", "measured_peak", "predicted_peak", "counted_peak")
    shown = [
        {
            **row,
            **{key: actoff.format_bytes(row[key]) if row[key] is not None else None for key in sizes},
            "peak_off": f"{row['peak_off'] * 100:+.1f}%" if row["peak_off"] is not None else None,
        }
        for row in figures
    ]
    columns = [("budget", "budget"), ("asked", "auto asked"), ("measured_peak", "auto measured peak"),
               ("predicted_peak", "predicted peak"), ("peak_off", "off"), ("counted_peak", "step peak counted"),
               ("predicted_ms", "predicted ms"), ("measured_ms", "measured ms"), ("over", "")]  # fmt: skip
    print(format_table(shown, columns))
    print(
        "\nauto's own figures (actoff.stats()): the budget it planned under, the most device peak it measured "
        "over the rounds against the peak it predicted for that plan, and the blocks' time it predicted and "
        "measured (medians); step peak counted: the benchmark's own count over the whole step.\n"
    )
    return figures


def print_sweep(records: list[dict], budgets: list[int], policies: list[str]) -> list[dict]:
    """A row per budget, a column per policy (median step ms and spread, or why not), what auto
    planned against what it measured, then the verdict lines."""
    import actoff

    table = cells(records, budgets, policies)
    rows = []
    for budget in budgets:
        row = {"budget": actoff.format_bytes(budget)}
        for policy in policies:
            cell = table[(budget, policy)]
            row[policy] = _spread(cell, unit="") if cell["status"] == "ok" else cell["status"]
        plans = {
            r.get("auto_plan") for r in records if r["policy"] == "auto" and r.get("budget_bytes") == budget
        }
        row["auto plan"] = " | ".join(sorted(p for p in plans if p)) or "-"
        rows.append(row)
    print(format_table(rows, [("budget", "budget"), *((p, p) for p in policies), ("auto plan", "auto plan")]))
    rounds = max((r.get("round", 0) + 1 for r in records), default=0)
    print(
        f"\nstep ms under each device budget, median (least .. most) of {rounds} round(s) (the simulated "
        "device's capacity on a CPU; ACTOFF_GPU_BUDGET and a cap on CUDA); oom N/M: the policy did not fit in "
        "N of M rounds. auto plan: the placements auto chose.\n"
    )
    print_auto_figures(records, budgets)
    lines = verdicts(records, budgets)
    for line in lines:
        print(f"   {line['text']}")
    return lines


def auto_label(budget: int) -> str:
    """How an ``auto`` run under ``budget`` is named in tables and plots.

    >>> auto_label(85 * 2**20)
    'auto<=85MiB'
    """
    return f"auto<={budget / 2**20:.0f}MiB"


def auto_under_budgets(records: list[dict], base: dict, count: int, time_left, out) -> list[dict]:
    """``auto`` under ``count`` budgets at the longest length where ``keep`` ran, each on a device
    of that size (Note [auto in the main run]); its records, each with ``budget_bytes`` and a
    ``label`` naming the budget."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("peak_allocated_bytes")]
    kept = [r["seq"] for r in ok if r["policy"] == "keep"]
    if not kept or count < 1:
        return []
    seq = max(kept)
    peaks = {r["policy"]: r["peak_allocated_bytes"] for r in ok if r["seq"] == seq}
    top = math.ceil(peaks["keep"] / (1 - CALIBRATED_HEADROOM))
    made = []
    for budget in budgets_between(top, floor_budget(min(peaks.values())), count):
        spec = {**base, "policy": "auto", "seq": seq, "budget_bytes": budget}
        spec["warmup"] = max(spec.get("warmup", 0), AUTO_WARMUP)
        spec.pop("seqs", None)
        if not torch.cuda.is_available():
            spec["sim_memory"] = budget  # Note [a capped device on a CPU]
        made.extend(
            {**record, "label": auto_label(budget)} for record in run_one(spec, time_left(), out.write)
        )
    return made
