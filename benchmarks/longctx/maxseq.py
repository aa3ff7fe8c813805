"""``--find-max-seq``: the longest sequence each policy trains, by doubling then bisection, a
fresh process per probe; the ratios of the best actoff configuration to keep's and
torch_checkpoint's longest, against their targets; and where the device memory goes at the limit.
"""

from __future__ import annotations

import sys
import time
from typing import NamedTuple

import torch
from _common import JsonLines, format_table, write_json

import actoff

from .budgets import AUTO_WARMUP
from .plots import plot_max_seq
from .policies import is_actoff_policy, split_variants
from .worker import run_one

#: Targets of the longest-sequence search (issue 16), as ratios within one run, same model and
#: memory: the best actoff configuration trains at least this many times keep's longest length,
#: and torch_checkpoint's.
MAXSEQ_VS_KEEP_TARGET = 4.0
MAXSEQ_VS_CHECKPOINT_TARGET = 1.5


# Note [probe time limits]: a fixed time limit per probe measures the limit, not the device:
# a probe at twice the length takes two to four times as long (attention grows as S^2), and
# one cut off says nothing about the length. So each probe's limit is sized from the last
# probe that trained: its wall time (start-up included) times (S / S_last)^2, never less than
# it, taken PROBE_MARGIN times plus PROBE_SLACK_S, within the time left. A probe predicted to
# need more than the time left is not started: the search ends there with a lower bound.
PROBE_MARGIN = 2.0
PROBE_SLACK_S = 30.0


class ProbeClock:
    """The wall time of the last probe that trained, to size the next ones' limits (Note
    [probe time limits]).

    >>> clock = ProbeClock()
    >>> clock.predict(4096) is None
    True
    >>> clock.note(4096, 10.0)
    >>> clock.predict(8192), clock.predict(2048)
    (40.0, 10.0)
    """

    def __init__(self) -> None:
        self.seq: int | None = None
        self.seconds = 0.0

    def note(self, seq: int, seconds: float) -> None:
        self.seq, self.seconds = seq, seconds

    def predict(self, seq: int) -> float | None:
        if self.seq is None:
            return None
        return self.seconds * max(1.0, seq / self.seq) ** 2


def _probe(policy: str, base: dict, seq: int, timeout_s, on_record, clock: ProbeClock | None = None) -> bool:
    """One training step of ``policy`` at ``seq`` in a fresh process; whether it trained."""
    left = timeout_s() if callable(timeout_s) else timeout_s  # the time left, asked at each probe
    if left <= 0:
        raise TimeoutError("time budget spent")
    predicted = clock.predict(seq) if clock is not None else None
    if predicted is not None and predicted > left:
        raise TimeoutError(f"the probe at {seq} would need about {predicted:.0f} s; {left:.0f} s left")
    limit = left if predicted is None else min(left, PROBE_MARGIN * predicted + PROBE_SLACK_S)
    spec = {"steps": 1, "warmup": 1, **base, "policy": policy, "seq": seq}
    if policy.startswith("auto"):
        # Its measuring steps, its first plan, then the plan calibrated on that one's step: the
        # probe's measured step (Note [calibrated plans] in actoff.runtime.auto).
        spec["warmup"] = max(spec["warmup"], AUTO_WARMUP + 1)
    started = time.monotonic()
    status = run_one(spec, limit, on_record)[0]["status"]
    if status == "timeout":  # cut off, not failed: it says nothing about the length
        raise TimeoutError(f"the probe at {seq} ran out of time ({limit:.0f} s)")
    if status == "ok" and clock is not None:
        clock.note(seq, time.monotonic() - started)
    return status == "ok"


class MaxSeq(NamedTuple):
    """What `find_max_seq` found: the longest length that trained, the shortest that failed
    (None: none did), the probes run, and whether the search finished (False: the time ran
    out, and ``longest`` is a lower bound; so it is when nothing failed up to the limit)."""

    longest: int
    failed: int | None
    probes: int
    finished: bool


def find_max_seq(
    policy: str, base: dict, start: int, limit: int, timeout_s, on_record=None, *, precision: float = 0.0
) -> MaxSeq:
    """Doubling then bisection to the longest length that trains.

    ``timeout_s`` is seconds per probe, or a function giving them (the time left); each probe's
    own limit is sized from the last that trained (Note [probe time limits]). Bisection
    stops when the bracket is at most ``max(256, start // 8)`` tokens wide, or ``precision``
    times the longest length found (a relative width, for lengths short next to 256). A
    probe that times out ends the search: what was found is a lower bound.
    """
    probes, good, bad, seq = 0, 0, None, start
    step = max(256, start // 8) if not precision else max(1, int(start * precision))
    clock = ProbeClock()
    try:
        while seq <= limit:
            probes += 1
            ok = _probe(policy, base, seq, timeout_s, on_record, clock)
            print(f"   {policy:<12} seq {seq:>8}: {'ok' if ok else 'fails'}", file=sys.stderr, flush=True)
            if not ok:
                bad = seq
                break
            if seq >= limit:
                good = seq
                break
            good, seq = seq, min(seq * 2, limit)  # the limit itself, where doubling passes it
        if bad is None:
            return MaxSeq(good, None, probes, True)
        while bad - good > max(step, int(good * precision)):
            middle = (good + bad) // 2 // step * step or step
            if middle in (good, bad):
                break
            probes += 1
            ok = _probe(policy, base, middle, timeout_s, on_record, clock)
            print(f"   {policy:<12} seq {middle:>8}: {'ok' if ok else 'fails'}", file=sys.stderr, flush=True)
            good, bad = (middle, bad) if ok else (good, middle)
    except TimeoutError as why:  # the time ran out before or during a probe: ``good`` is a lower bound
        print(f"   {policy:<12} search ends: {why}", file=sys.stderr, flush=True)
        return MaxSeq(good, bad, probes - 1, False)
    return MaxSeq(good, bad, probes, True)


def find_max(
    policies: list[str], base: dict, start: int, limit: int, time_left, header: dict, args, out: JsonLines
) -> int:
    """``--find-max-seq``: search every policy, print the table, the ratio lines and where the
    memory goes at the limit; then the plot and the records as asked."""
    cuda = torch.cuda.is_available()
    if not cuda and not base.get("sim_memory"):
        raise SystemExit(
            "--find-max-seq on a CPU runs on the simulated device with a capacity: give --sim-memory"
        )
    # On a CPU the lengths are short next to the GPU's 256-token grain: stop at 1/16 instead.
    rows, found = search(policies, base, start, limit, time_left, out, precision=0.0 if cuda else 1 / 16)
    where = f"{actoff.format_bytes(base['sim_memory'])} simulated device" if not cuda else "the GPU"
    summary = print_max_seq(rows, where)
    if args.plot:
        plot_max_seq(rows, args.plot, where)
        print(f"plot written to {args.plot}")
    records = [{key: value for key, value in row.items() if key != "record"} for row in rows]
    if args.jsonl:
        out.write({"summary": summary})
    if args.json:
        write_json(args.json, header, records, summary=summary, probes=found)
    return 0


def search(
    policies: list[str], base: dict, start: int, limit: int, time_left, out: JsonLines, *, precision: float
) -> tuple[list[dict], list[dict]]:
    """`find_max_seq` for each policy in turn: a row per policy, with its ratios and the record
    of its probe at the longest length, and every probe's record."""
    found: list[dict] = []  # every probe's record: the breakdown at the limit reads them

    def on_record(record: dict) -> None:
        found.append(record)
        out.write(record)

    rows = []
    for done, policy in enumerate(policies):
        # An equal share of the time left for each policy still to search: the first one cannot
        # spend it all (a long search probes many lengths, each a fresh process).
        deadline = time.monotonic() + time_left() / (len(policies) - done)

        def share_left(deadline=deadline) -> float:
            return min(time_left(), deadline - time.monotonic())

        result = find_max_seq(policy, base, start, limit, share_left, on_record, precision=precision)
        rows.append(
            {
                "policy": policy,
                "max_seq": result.longest,
                "fails_at": result.failed,
                "probes": result.probes,
                "search": _search_state(result, limit),
            }
        )
        out.write({"result": rows[-1]})
    add_max_seq_ratios(rows)
    for row in rows:
        record = next(
            (
                r
                for r in found
                if r["policy"] == row["policy"] and r["seq"] == row["max_seq"] and r.get("status") == "ok"
            ),
            None,
        )
        peak = record.get("peak_allocated_bytes") if record else None
        row["peak_mib"] = f"{peak / 2**20:.1f}" if peak else None
        row["record"] = record
    return rows, found


def print_max_seq(rows: list[dict], where: str) -> list[dict]:
    """The table of longest lengths, its notes, the ratio lines and, for the best actoff
    configuration (and the best with the default planner), where its memory goes; the ratio lines."""
    print()
    print(
        format_table(
            rows,
            [
                ("policy", "policy"),
                ("max_seq", "longest seq"),
                ("fails_at", "fails at"),
                ("x_keep", "x keep"),
                ("x_torch_checkpoint", "x torch_checkpoint"),
                ("peak_mib", "peak MiB"),
                ("probes", "probes"),
                ("search", "search"),
            ],
        )
    )
    print(
        f"\nlongest seq: the longest length that trained (forward, loss, backward, two steps) on {where}; "
        "fails at: the shortest that ran out of memory; x keep / x torch_checkpoint: longest seq over theirs "
        "(>=: a lower bound, <=: an upper bound, ?: both sides bounds); peak MiB: the device peak at the "
        "longest length. actoff configurations: keep, cpu, nvme, tokenwise, recompute, auto (+tile: "
        "actoff.tile_ on the MLPs and the final norm, +loss: actoff.chunked_cross_entropy).\n"
    )
    summary = max_seq_summary(rows)
    for line in summary:
        print(f"   {line['text']}")
    best, default = best_actoff(rows), best_actoff(rows, default_planner=True)
    for row in [best] + ([default] if default is not best else []):
        if row is not None and row["record"] is not None:
            print()
            for line in where_memory_goes(row["record"]):
                print(line)
    return summary


def _search_state(result: MaxSeq, limit: int) -> str:
    if not result.finished:
        return "cut short by --time-budget (a lower bound)"
    if result.failed is None:
        return f"reached --max-seq {limit} (a lower bound)"
    return "done"


def add_max_seq_ratios(rows: list[dict]) -> None:
    """Add ``x_keep`` and ``x_torch_checkpoint`` (text: ``"4.50"``, ``">=4.50"``, ``"<=0.80"``, ``"?"``)
    and their values to rows of `search`, against the plain ``keep`` and ``torch_checkpoint`` rows.

    >>> rows = [{"policy": "keep", "max_seq": 1000, "search": "done"},
    ...         {"policy": "cpu", "max_seq": 4500, "search": "cut short by --time-budget (a lower bound)"}]
    >>> add_max_seq_ratios(rows)
    >>> rows[1]["x_keep"], rows[1]["x_keep_value"], rows[1]["x_torch_checkpoint"]
    ('>=4.50', 4.5, None)
    """
    by_policy = {row["policy"]: row for row in rows}
    for name in ("keep", "torch_checkpoint"):
        bottom = by_policy.get(name)
        for row in rows:
            ratio = max_seq_ratio(row, bottom) if bottom is not None else None
            row[f"x_{name}"] = (
                None if ratio is None else ratio[1] + f"{ratio[0]:.2f}" if ratio[1] != "?" else "?"
            )
            row[f"x_{name}_value"] = None if ratio is None else ratio[0]
            row[f"x_{name}_bound"] = None if ratio is None else ratio[1]


def max_seq_ratio(top: dict, bottom: dict) -> tuple[float, str] | None:
    """``top``'s longest length over ``bottom``'s, and what it is: ``""`` (measured), ``">="``
    (``top`` is a lower bound), ``"<="`` (``bottom`` is), ``"?"`` (both are).

    >>> max_seq_ratio({"max_seq": 3000, "search": "done"}, {"max_seq": 1000, "search": "done"})
    (3.0, '')
    """
    if not top.get("max_seq") or not bottom.get("max_seq"):
        return None
    top_bound, bottom_bound = "lower bound" in top["search"], "lower bound" in bottom["search"]
    kind = "?" if top_bound and bottom_bound else ">=" if top_bound else "<=" if bottom_bound else ""
    return top["max_seq"] / bottom["max_seq"], kind


def _verdict(value: float, kind: str, target: float) -> str:
    """met / NOT met / undecided, for a ratio that may be a bound."""
    if kind == "?" or (kind == ">=" and value < target) or (kind == "<=" and value >= target):
        return "undecided: a bound on the wrong side of the target"
    return "met" if value >= target else "NOT met"


def best_actoff(rows: list[dict], *, default_planner: bool = False) -> dict | None:
    """The actoff row with the longest length (``default_planner``: leaving out ``+noplan``)."""
    candidates = [
        r
        for r in rows
        if is_actoff_policy(r["policy"])
        and r["max_seq"]
        and not (default_planner and "noplan" in split_variants(r["policy"])[1])
    ]
    return max(candidates, key=lambda r: r["max_seq"]) if candidates else None


def max_seq_summary(rows: list[dict]) -> list[dict]:
    """The ratio lines: the best actoff configuration (the longest length among actoff's
    policies, with any variants) against keep and torch_checkpoint with their targets; the same for
    the best with actoff's default planner when the best turned it off (``+noplan``); then the
    best against the longest configuration without actoff's placement, for scale.

    >>> rows = [{"policy": "keep", "max_seq": 1000, "search": "done"},
    ...         {"policy": "torch_checkpoint", "max_seq": 3000, "search": "done"},
    ...         {"policy": "recompute+tile+loss", "max_seq": 4800, "search": "done"}]
    >>> [line["text"] for line in max_seq_summary(rows)]  # doctest: +NORMALIZE_WHITESPACE
    ['best actoff configuration: recompute+tile+loss, longest 4800 vs keep 1000: 4.80x (target >= 4x: met)',
     'best actoff configuration: recompute+tile+loss, longest 4800 vs torch_checkpoint 3000: 1.60x (target >= 1.5x: met)']
    """
    best = best_actoff(rows)
    if best is None:
        return []
    default = best_actoff(rows, default_planner=True)
    contenders = [("best actoff configuration", best)]
    if default is not None and default is not best:
        contenders.append(("best with actoff's default planner", default))
    lines = [line for what, top in contenders for line in _target_lines(what, top, rows)]
    others = [
        r
        for r in rows
        if not is_actoff_policy(r["policy"])
        and r["max_seq"]
        and r["policy"] not in ("keep", "torch_checkpoint")
    ]
    if others and lines:
        rival = max(others, key=lambda r: r["max_seq"])
        ratio = max_seq_ratio(best, rival)
        if ratio is not None:
            lines.append(
                {
                    "policy": best["policy"],
                    "vs": rival["policy"],
                    "ratio": ratio[0],
                    "bound": ratio[1],
                    "target": None,
                    "met": None,
                    "verdict": "for scale",
                    "text": f"for scale, the longest without actoff's placement: {rival['policy']} "
                    f"{rival['max_seq']}; {best['policy']} reaches {ratio[1]}{ratio[0]:.2f}x "
                    "of it",
                }
            )
    return lines


def _target_lines(what: str, top: dict, rows: list[dict]) -> list[dict]:
    """``top``'s longest length against keep's and torch_checkpoint's, each with its target and verdict."""
    by_policy = {row["policy"]: row for row in rows}
    lines = []
    for name, target in (("keep", MAXSEQ_VS_KEEP_TARGET), ("torch_checkpoint", MAXSEQ_VS_CHECKPOINT_TARGET)):
        bottom = by_policy.get(name)
        ratio = max_seq_ratio(top, bottom) if bottom is not None else None
        if ratio is None:
            continue
        value, kind = ratio
        verdict = _verdict(value, kind, target)
        lines.append(
            {
                "policy": top["policy"],
                "vs": name,
                "ratio": value,
                "bound": kind,
                "target": target,
                "met": verdict == "met",
                "verdict": verdict,
                "text": f"{what}: {top['policy']}, longest {top['max_seq']} vs {name} "
                f"{bottom['max_seq']}: {kind}{value:.2f}x (target >= {target:g}x: {verdict})",
            }
        )
    return lines


def where_memory_goes(record: dict) -> list[str]:
    """Where the device memory of one capped probe (Note [a capped device on a CPU]) goes, as
    lines: the cap, what stays across steps (weights and gradients, the tokens), what autograd
    saved and where actoff put it, and per phase of the step the bytes live at its end and the
    peak within it over the step's start (working memory), naming the phase of the peak.

    >>> record = {"policy": "cpu", "seq": 2048, "sim_capacity_bytes": 2**27, "static_bytes": 2**24,
    ...           "weights_grads_bytes": 2**24, "tokens_bytes": 0, "device_arena_bytes": 2**20,
    ...           "act_keep_bytes": 0, "act_cpu_bytes": 2**25, "act_nvme_bytes": 0, "act_recompute_bytes": 0,
    ...           "peak_allocated_bytes": 2**25, "phases": [["forward", 2**24 + 2**22, 2**25]]}
    >>> print(where_memory_goes(record)[-1])
       forward                 live at its end  +4.00 MiB  peak  +16.00 MiB  <- the step's peak
    """
    if not record.get("phases"):
        return []
    mib = lambda value: f"{value / 2**20:.2f} MiB"  # noqa: E731
    static = record["static_bytes"]
    ballast = record.get("ballast_static_bytes", 0) + record.get("ballast_held_bytes", 0)
    other = static - record["weights_grads_bytes"] - record["tokens_bytes"] - ballast
    capacity = record.get("sim_capacity_bytes")
    lines = [
        f"where the device memory goes at the limit: {record['policy']} at seq {record['seq']}, peak "
        f"{mib(record['peak_allocated_bytes'])}" + (f" of {mib(capacity)}" if capacity else ""),
        f"   weights + gradients   {mib(record['weights_grads_bytes'])}",
        f"   tokens                {mib(record['tokens_bytes'])}",
        *(
            [
                f"   ballast for the {record['emulated_layers'] - record['layers']} blocks not built  {mib(ballast)} "
                f"(weights and gradients {mib(record['ballast_static_bytes'])}, held through the step "
                f"{mib(record['ballast_held_bytes'])}; Note [emulated layers])"
            ]
            if ballast
            else []
        ),
        f"   other kept across steps  {mib(other)}",
        "   saved for backward by actoff's scopes: on the device (keep) "
        f"{mib(record['act_keep_bytes'])}; off it: cpu {mib(record['act_cpu_bytes'])}, nvme "
        f"{mib(record['act_nvme_bytes'])}, recomputed in backward {mib(record['act_recompute_bytes'])}",
        f"   actoff's device arena (its backward buffers: fetched and rebuilt activations) "
        f"{mib(record['device_arena_bytes'])} at most at once (a buffer per wave of a block's tensors, alive while they are)",
        "   per phase, over the step's start (weights, gradients, tokens):",
    ]
    peak = max(phase_peak for _, _, phase_peak in record["phases"])
    for phase, live, phase_peak in record["phases"]:
        lines.append(
            f"   {phase:<22}  live at its end {'+' + mib(live - static):>10}  peak {'+' + mib(phase_peak - static):>11}"
            + ("  <- the step's peak" if phase_peak == peak else "")
        )
    return lines
