"""``--budgets N``: every policy under device budgets from keep's peak down to the floor, and
``auto``'s step time against the fastest policy that fits each.

Note [a budget sweep]: a first pass runs every policy without a cap (on a CPU, on a simulated
device too large to fill, so that it counts as the capped ones do), for its device peak;
``keep``'s is the top budget and the least peak of any policy the floor, and ``N`` budgets
are spaced evenly between them. Each budget then runs every policy again: on a CPU on the
simulated device with that capacity (the wind tunnel's link with it), on CUDA under
``ACTOFF_GPU_BUDGET`` with the process held to that much of the GPU
(``torch.cuda.set_per_process_memory_fraction``). A policy that does not fit is recorded ``oom``,
never dropped; every record carries ``budget_bytes``. Every policy warms up `AUTO_WARMUP`
steps. The targets: ``auto``'s step time is at
most the fastest of the `RIVALS` that fit under each budget, and at most `KEEP_FITS_TARGET`
times ``none``'s where ``keep`` fits.
"""

from __future__ import annotations

import torch
from _common import format_table

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
#: Warm-up steps of every policy in a sweep: ``auto`` measures this many before its plan runs
#: (Note [measuring at the floor] in actoff.runtime.auto), so its timed steps run the plan.
AUTO_WARMUP = 2


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
    policies: list[str], base: dict, seq: int, count: int, time_left, out
) -> tuple[list[dict], list[dict], list[int]]:
    """The uncapped pass, then every policy under each budget (Note [a budget sweep]). Returns
    the uncapped records, the capped ones and the budgets."""
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
    floor = min(peak for peak in peaks.values() if peak)
    budgets = budgets_between(peaks["keep"], floor, count)
    capped = []
    for budget in budgets:
        for policy in policies:
            spec = {**base, "policy": policy, "seq": seq, "budget_bytes": budget}
            if not torch.cuda.is_available():
                spec["sim_memory"] = budget  # Note [a capped device on a CPU]
            if time_left() <= 0:
                record = {**spec, "status": "not run", "error": "--time-budget spent"}
                out.write(record)
                capped.append(record)
                continue
            capped.extend(run_one(spec, time_left(), out.write))
    return uncapped, capped, budgets


def verdicts(records: list[dict], budgets: list[int]) -> list[dict]:
    """Per budget: the rivals that fit, the fastest of them, ``auto``'s step time against it and,
    where ``keep`` fits, against ``none``'s; each against its target.

    >>> records = [{"policy": "none", "budget_bytes": 10, "status": "ok", "step_ms": 100.0},
    ...            {"policy": "keep", "budget_bytes": 10, "status": "ok", "step_ms": 101.0},
    ...            {"policy": "checkpoint", "budget_bytes": 10, "status": "ok", "step_ms": 130.0},
    ...            {"policy": "auto", "budget_bytes": 10, "status": "ok", "step_ms": 102.0}]
    >>> [line["text"] for line in verdicts(records, [10])]  # doctest: +NORMALIZE_WHITESPACE
    ['budget 10 B: auto 102.0 ms vs the fastest that fits, none 100.0 ms: 1.02x (target <= 1x: NOT met)',
     'budget 10 B: keep fits: auto 102.0 ms vs none 100.0 ms: 1.02x (target <= 1.03x: met)']
    """
    import actoff

    lines = []
    for budget in budgets:
        at = {r["policy"]: r for r in records if r.get("budget_bytes") == budget}
        fits = [at[name] for name in RIVALS if at.get(name, {}).get("status") == "ok"]
        auto = at.get("auto", {})
        where = f"budget {actoff.format_bytes(budget)}"
        if auto.get("status") != "ok":
            lines.append(
                {
                    "budget_bytes": budget,
                    "met": False,
                    "target": None,
                    "text": f"{where}: auto {auto.get('status', 'not run')} (target: fits: NOT met)",
                }
            )
            continue
        if fits:
            best = min(fits, key=lambda r: r["step_ms"])
            ratio = auto["step_ms"] / best["step_ms"]
            lines.append(
                {
                    "budget_bytes": budget,
                    "vs": best["policy"],
                    "ratio": ratio,
                    "target": 1.0,
                    "met": ratio <= 1.0,
                    "text": f"{where}: auto {auto['step_ms']:.1f} ms vs the fastest that fits, {best['policy']} "
                    f"{best['step_ms']:.1f} ms: {ratio:.2f}x (target <= 1x: {'met' if ratio <= 1.0 else 'NOT met'})",
                }
            )
        else:
            lines.append(
                {
                    "budget_bytes": budget,
                    "met": True,
                    "target": None,
                    "text": f"{where}: auto {auto['step_ms']:.1f} ms; none of the others fits",
                }
            )
        none = at.get("none", {})
        if at.get("keep", {}).get("status") == "ok" and none.get("status") == "ok":
            ratio = auto["step_ms"] / none["step_ms"]
            met = ratio <= KEEP_FITS_TARGET
            lines.append(
                {
                    "budget_bytes": budget,
                    "vs": "none",
                    "ratio": ratio,
                    "target": KEEP_FITS_TARGET,
                    "met": met,
                    "text": f"{where}: keep fits: auto {auto['step_ms']:.1f} ms vs none {none['step_ms']:.1f} ms: "
                    f"{ratio:.2f}x (target <= {KEEP_FITS_TARGET:g}x: {'met' if met else 'NOT met'})",
                }
            )
    return lines


def print_sweep(records: list[dict], budgets: list[int], policies: list[str]) -> list[dict]:
    """A row per budget, a column per policy (step ms, or why not), then the verdict lines."""
    import actoff

    rows = []
    for budget in budgets:
        row = {"budget": actoff.format_bytes(budget)}
        for policy in policies:
            record = next(
                (r for r in records if r["policy"] == policy and r.get("budget_bytes") == budget), {}
            )
            status = record.get("status", "not run")
            row[policy] = f"{record['step_ms']:.1f}" if status == "ok" else status
            if policy == "auto" and status == "ok":
                row["auto plan"] = record.get("auto_plan") or "-"
        rows.append(row)
    print(format_table(rows, [("budget", "budget"), *((p, p) for p in policies), ("auto plan", "auto plan")]))
    print(
        "\nstep ms under each device budget (the simulated device's capacity on a CPU; ACTOFF_GPU_BUDGET "
        "and a cap on CUDA); oom: the policy does not fit. auto plan: the placements auto chose.\n"
    )
    lines = verdicts(records, budgets)
    for line in lines:
        print(f"   {line['text']}")
    return lines
