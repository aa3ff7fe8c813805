"""The long-context table: every policy over the sequence lengths, a process per policy and a
row per (policy, length), with what actoff placed where, device memory and the step's cost.
"""

from __future__ import annotations

import torch
from _common import format_table, progress

from .paired import PAIRS, print_ratios, summarize
from .worker import run_one

COLUMNS = [
    ("label", "policy"), ("seq", "seq"), ("status", "status"), ("step_ms", "step ms"),
    ("step_vs_none", "x none"), ("peak_vs_keep", "peak/keep"), ("step_cpu_ms", "CPU ms"),
    ("tokens_per_s", "tok/s"), ("mfu", "MFU"), ("peak_allocated_gib", "peak GiB"),
    ("peak_reserved_gib", "reserved GiB"), ("fragmentation_gib", "frag GiB"),
    ("activation_peak_gib", "act peak GiB"), ("act_keep_gib", "keep GiB"), ("act_cpu_gib", "cpu GiB"),
    ("act_nvme_gib", "nvme GiB"), ("act_recompute_gib", "recomp GiB"), ("copy_gbps", "copy GB/s"),
    ("hidden_share", "hidden"), ("wait_ms", "wait ms"), ("recompute_share", "recomp share"),
    ("rss_peak_gib", "RSS GiB"),
]  # fmt: skip
#: Byte fields shown in GiB (as ``*_gib``).
GIB_FIELDS = ("act_keep_bytes", "act_cpu_bytes", "act_nvme_bytes", "act_recompute_bytes", "peak_allocated_bytes",
              "peak_reserved_bytes", "fragmentation_bytes", "activation_peak_bytes", "rss_peak_bytes")  # fmt: skip


def gib(value: float | None) -> float | None:
    return None if value is None else value / 2**30


def run_policies(
    policies: list[str], base: dict, lengths: list[int], launch: dict | None, time_left, out, lead: bool
) -> tuple[list[dict], list[dict]]:
    """Each policy in its own worker over ``lengths``, then on a CPU the interleaved timing of
    `PAIRS`: the records and the interleaved ones. A policy that could not finish within the
    time left is not started (its records say so)."""
    interleaved: list[dict] = []
    shown = progress(policies, len(policies), lambda policy: policy) if lead else policies
    records = []
    for index, policy in enumerate(shown):
        spec = {**base, "policy": policy, "seqs": lengths}
        if launch is not None:  # every job its own key space in the launch's store, the same on every rank
            spec["ddp"] = {**launch, "job": f"job{index}"}
        if time_left() <= 0:
            late = {"status": "not run", "error": "--time-budget spent"}
            for seq in lengths:
                records.append({**base, "policy": policy, "seq": seq, **late})
                out.write(records[-1])
            continue
        records.extend(run_one(spec, time_left(), out.write))
    wanted = {name for pair in PAIRS for name in pair}
    paired = base.get("interleave", True)
    if (
        paired
        and not torch.cuda.is_available()
        and launch is None
        and wanted <= set(policies)
        and time_left() > 0
    ):
        # (Note [timing on a shared CPU]) The ratio lines' step times, interleaved.
        spec = {
            **base,
            "policy": "interleaved",
            "seqs": lengths,
            "sim_memory": None,
            "tunnel": None,
        }  # plain CPU
        interleaved = run_one(spec, time_left(), out.write)
    return records, interleaved


def add_derived(records: list[dict]) -> None:
    """Share of transfer time hidden under compute, against ``none`` (no actoff) at the same length."""
    plain = {
        (r["seq"], r.get("rank")): r for r in records if r["policy"] == "none" and r.get("status") == "ok"
    }
    kept = {
        (r["seq"], r.get("rank")): r for r in records if r["policy"] == "keep" and r.get("status") == "ok"
    }
    for record in records:
        if record.get("status") != "ok":
            continue
        base = plain.get((record["seq"], record.get("rank")))
        # The plane a user judges by: step time over no offload's, device peak over keep's.
        if base is not None:
            record["step_vs_none"] = record["step_ms"] / base["step_ms"]
        reference = kept.get((record["seq"], record.get("rank"))) or base
        peak, reference_peak = (
            record.get("peak_allocated_bytes"),
            (reference or {}).get("peak_allocated_bytes"),
        )
        if peak and reference_peak:
            record["peak_vs_keep"] = peak / reference_peak
        transfer_s = (record.get("copy_ms") or 0) / 1e3 + (record.get("fetch_ms") or 0) / 1e3
        if base is None or transfer_s <= 0:
            record["hidden_share"] = None
            continue
        overhead_s = max(0.0, (record["step_ms"] - base["step_ms"]) / 1e3)
        record["hidden_share"] = max(0.0, 1.0 - overhead_s / transfer_s)
    plain = {(r["policy"], r["seq"], r.get("rank")): r for r in records if r.get("status") == "ok"}
    for record in records:
        base = plain.get((record["policy"].removesuffix("+verify"), record["seq"], record.get("rank")))
        if record["policy"].endswith("+verify") and base is not None and record.get("status") == "ok":
            record["verify_cost"] = record["step_ms"] / base["step_ms"] - 1.0


def report(records: list[dict], interleaved: list[dict], policies: list[str], layers: int) -> list[dict]:
    """Sort the records (by rank, length, then policy as given), add the derived fields, print
    the table, what failed and the ratio lines with their notes; the ratio lines."""
    order = {policy: i for i, policy in enumerate(policies)}
    records.sort(key=lambda r: (str(r.get("rank", "")), r["seq"], order.get(r["policy"], len(order))))
    add_derived(records)
    for record in records:
        record.setdefault("label", record["policy"])  # auto under a budget: Note [auto in the main run]
        for key in GIB_FIELDS:
            record[key.replace("_bytes", "_gib")] = gib(record.get(key))
    columns = [*([("rank", "rank")] if any("rank" in r for r in records) else []), *COLUMNS]
    print(format_table(records, columns))
    for record in records:
        if record.get("verify_cost") is not None:
            print(
                f"   ACTOFF_VERIFY cost for {record['policy'].removesuffix('+verify')} at seq {record['seq']}: "
                f"{record['verify_cost'] * 100:+.1f}% step time"
            )
    for record in records:
        if record.get("status") != "ok":
            name = record.get("label") or record["policy"]  # auto<=NMiB: which budget it was
            print(f"   {name} seq {record['seq']}: {record['status']}: {record.get('error', '')}")
    summary = summarize(records + interleaved, layers, cuda=torch.cuda.is_available())
    print_ratios(summary, interleaved)
    where = (
        "the simulated device (one extra step)"
        if any(r.get("memory_source") == "simulated device" for r in records)
        else "the GPU"
    )
    print(
        "\nnone: no actoff; keep: actoff's hooks, nothing moved. keep/cpu/nvme/recomp GiB: activation bytes "
        "actoff placed per tier; hidden: share of copy time not added to the step compared with none; wait ms: "
        "backward waiting for copies back; recomp share: token-wise re-run time / step time; peak and act "
        f"peak GiB: device memory, measured on {where}; step times on the device itself."
    )
    return summary


def failed(records: list[dict]) -> list[dict]:
    """The records that make the run fail: every one not ok, except ``auto`` under a budget out of
    memory, which is a finding (the budget is under auto's floor: Note [auto in the main run]),
    not a broken run.

    >>> failed([{"status": "ok"}, {"status": "oom", "label": "auto<=46MiB", "budget_bytes": 1}])
    []
    >>> [r["policy"] for r in failed([{"policy": "cpu", "status": "oom"}, {"policy": "x", "status": "error", "label": "a"}])]
    ['cpu', 'x']
    """
    return [
        r
        for r in records
        if r.get("status") != "ok" and not (r.get("status") == "oom" and "label" in r and "budget_bytes" in r)
    ]
