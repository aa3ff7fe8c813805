"""``--calibrate``: the wind tunnel against a GPU run, judged on overheads. For each target the GPU
measured, the tunnel steps the same policies in interleaved rounds (`rounds`), and the table puts
each policy's overhead (its step time over ``none``'s, minus 1) side by side with the GPU's: the
tunnel's median over the rounds, its spread, the error on the overhead, and which rows the
constants were fitted on.

Note [fitting the tunnel]: the tunnel has two free constants, both of the target
(`tunnel.Gpu`): the block utilisation ``mfu`` (a block's forward time, hence the link's scale)
and ``save_on_cpu_share`` (the share of the link PyTorch's save_on_cpu reached). Both are fitted
on one length of the GPU run, `FIT_TARGET`: ``mfu`` to ``none``'s step time there (a time, not a
ratio: ``none``'s overhead is 0 by definition, and no row tests it), the share to `FIT_POLICY`'s
overhead there. The link (55 GB/s) is measured, not fitted. Every other row is out of sample.
The share is fitted on the tunnel itself: that target runs first with the share at 1, where a
torch_save_on_cpu step is its compute and its synchronous copies, which add their link time
(``link_ms``) and nothing else; so the share that gives the GPU's overhead is solved for per
round, and the fitted row's step times are those copies' time rescaled to it.

Note [what the tunnel cannot carry]: compute runs at the CPU's own speed and mix. Recompute
(``torch_checkpoint``) costs a block's forward, whose share of a step differs between the CPU
and the GPU (on the H100 a 7B block's backward is slower against its forward than the CPU's
is); the tunnel scales the link, not that share, so it cannot get recompute's overhead right
without a constant fitted on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

from _common import format_table

_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
#: The GPU run the tunnel is calibrated on (7B-shaped, 4 layers, bf16, batch 1).
MEASURED = os.path.join(_RESULTS, "h100-2026-11-23", "long.jsonl")
#: Note [a second side]: every GPU run the tunnel's rows are judged against, by GPU. The H200 run
#: (same model, lengths and policies, five days' newer code: per-tensor streaming, the seam) is
#: out of sample whole: the tunnel's constants are the H100's, and the H200's rows compare the
#: same tunnel rounds (the two GPUs differ in memory, which no step here fills) with its step
#: times, so a model that only fits the H100 run shows it there.
SIDES = {"h100": MEASURED, "h200": os.path.join(_RESULTS, "h200-2026-11-28", "calib.jsonl")}
#: Targets of that run, and the policies compared (its names for PyTorch's baselines mapped).
TARGETS = ("h100:7b@8k", "h100:7b@32k")
POLICIES = ("none", "keep", "torch_checkpoint", "torch_save_on_cpu", "cpu")
_RENAMED = {"checkpoint": "torch_checkpoint", "save_on_cpu": "torch_save_on_cpu"}
LAYERS = 4
#: Where the free constants are fitted (Note [fitting the tunnel]).
FIT_TARGET, FIT_POLICY = "h100:7b@8k", "torch_save_on_cpu"
#: An out-of-sample overhead within this share of the GPU's passes ...
ERROR_LIMIT = 0.25
#: ... or within this many points of it: the H100 run's own repeatability (its baselines measured
#: in two calls differ by up to 4%: benchmarks/results/h100-2026-11-23/README.md), below which an
#: overhead (keep's -2.3% and -0.7%) is noise and a share of it means nothing.
GPU_NOISE = 0.04


def measured_records(path: str = MEASURED) -> dict[tuple[str, int], dict]:
    """``(policy, seq) -> record`` of the GPU run's ``ok`` records, policies by today's names."""
    found = {}
    with open(path) as handle:
        for line in handle:
            record = json.loads(line)
            if record.get("status") == "ok":
                policy = _RENAMED.get(record["policy"], record["policy"])
                found[(policy, record["seq"])] = record
    return found


def sides_rows(
    sides: dict[str, dict[tuple[str, int], dict]], runs: dict[str, tuple[int, dict]]
) -> list[dict]:
    """`calibration_rows` for each GPU run in ``sides`` (``gpu name -> its records``, Note [a
    second side]), the tunnel's ``runs`` (keyed by the H100 targets) relabelled with that GPU.

    >>> measured = {("none", 8192): {"step_ms": 100.0}, ("cpu", 8192): {"step_ms": 200.0}}
    >>> rounds = {"status": "ok", "step_ms": {"none": [10.0] * 3, "cpu": [21.0] * 3}, "activation_peak_bytes": {}}
    >>> [(r["target"], round(r["error"], 2)) for r in sides_rows({"h100": measured, "h200": measured},
    ...                                                          {"h100:7b@8k": (8192, rounds)})]
    [('h100:7b@8k', 0.1), ('h200:7b@8k', 0.1)]
    """
    rows = []
    for gpu, measured in sides.items():
        relabelled = {f"{gpu}:{target.split(':', 1)[1]}": run for target, run in runs.items()}
        rows += calibration_rows(measured, relabelled)
    return rows


def fit_mfu(like, layers: int, none_step_ms: float) -> float:
    """The block utilisation that gives ``none``'s measured step: forward and backward (3x the
    forward's FLOPs) of ``layers`` blocks and the head, at ``like``'s GPU's peak.

    >>> from longctx.tunnel import parse_like
    >>> round(fit_mfu(parse_like("h100:7b@8k"), 4, 117.0), 3)
    0.572
    """
    from actoff.reference import ModelConfig

    from .tunnel import block_flops

    config = ModelConfig.preset(like.model)
    forward = layers * block_flops(config, like.seq) + 2 * config.hidden_size * config.vocab_size * like.seq
    return 3 * forward / (none_step_ms / 1e3) / like.gpu.flops


def fit_share(record: dict, gpu_overhead: float, policy: str = FIT_POLICY) -> float:
    """The save_on_cpu share that gives ``gpu_overhead`` to ``policy`` in a rounds ``record`` run
    with the share at 1 (Note [fitting the tunnel]): solved per round, the median.

    >>> record = {"step_ms": {"none": [100.0, 100.0], "s": [300.0, 300.0]}, "link_ms": {"s": [150.0, 150.0]}}
    >>> round(fit_share(record, 2.5, "s"), 3)  # 350 ms = 150 + 150 / share
    0.75
    """
    shares = []
    for none, step, link in zip(
        record["step_ms"]["none"], record["step_ms"][policy], record["link_ms"][policy], strict=True
    ):
        compute = step - link
        shares.append(link / ((1 + gpu_overhead) * none - compute))
    return statistics.median(shares)


def with_share(record: dict, share: float, policy: str = FIT_POLICY) -> dict:
    """``record`` with ``policy``'s step times as at ``share`` (its copies' link time over it)."""
    steps = [
        s - link + link / share
        for s, link in zip(record["step_ms"][policy], record["link_ms"][policy], strict=True)
    ]
    return {**record, "step_ms": {**record["step_ms"], policy: steps}}


def tunnel_overheads(record: dict) -> dict[str, list[float]]:
    """``policy -> [overhead per round]``: its step time over ``none``'s in the same round, minus 1."""
    none = record["step_ms"]["none"]
    return {
        policy: [step / base - 1 for step, base in zip(times, none, strict=True)]
        for policy, times in record["step_ms"].items()
    }


def judge(gpu: float, median: float, low: float, high: float, fitted: bool) -> tuple[float, str]:
    """The error on the overhead (relative to the GPU's) and the verdict: ``fitted``; ``yes``
    where the median is within the bar (`ERROR_LIMIT` of the GPU's overhead, or `GPU_NOISE`
    points where that is wider); ``within spread`` where only part of the rounds' spread is;
    ``NO`` where all of it is outside.

    >>> judge(1.0, 1.1, 1.0, 1.2, False), judge(0.2, 0.34, 0.32, 0.36, False)[1]
    ((0.10000000000000009, 'yes'), 'NO')
    >>> judge(0.2, 0.27, 0.24, 0.3, False)[1], judge(-0.02, 0.01, 0.0, 0.02, False)[1]
    ('within spread', 'yes')
    """
    error = (median - gpu) / abs(gpu) if gpu else float("inf")
    if fitted:
        return error, "fitted"
    bar = max(ERROR_LIMIT * abs(gpu), GPU_NOISE)
    if abs(median - gpu) <= bar:
        return error, "yes"
    if low <= gpu + bar and high >= gpu - bar:
        return error, "within spread"
    return error, "NO"


def _peak_ratios(records: dict[str, dict]) -> dict[str, float | None]:
    base = (records.get("none") or {}).get("activation_peak_bytes")
    return {
        policy: record["activation_peak_bytes"] / base
        if base and record.get("activation_peak_bytes")
        else None
        for policy, record in records.items()
    }


def calibration_rows(measured: dict[tuple[str, int], dict], runs: dict[str, tuple[int, dict]]) -> list[dict]:
    """One row per (target, policy) the GPU measured besides ``none``: its overhead, the tunnel's
    median and spread over the rounds, the error and verdict (`judge`), and the activation
    peaks over ``none``'s.

    ``runs``: ``target text -> (the target's length, the tunnel's rounds record)``, the fitted
    target's with its fitted share applied (`with_share`).

    >>> measured = {("none", 8192): {"step_ms": 100.0}, ("cpu", 8192): {"step_ms": 200.0}}
    >>> rounds = {"status": "ok", "step_ms": {"none": [10.0, 10.0, 10.0], "cpu": [21.0, 22.0, 23.0]},
    ...           "activation_peak_bytes": {}}
    >>> [(r["policy"], r["gpu"], round(r["tunnel"], 2), round(r["error"], 2), r["verdict"])
    ...  for r in calibration_rows(measured, {"h100:7b@8k": (8192, rounds)})]
    [('cpu', 1.0, 1.2, 0.2, 'yes')]
    """
    rows = []
    for target, (seq, record) in runs.items():
        gpu = {policy: r for (policy, length), r in measured.items() if length == seq}
        if record.get("status") != "ok" or "none" not in gpu:
            continue
        tunnel = tunnel_overheads(record)
        gpu_peaks = _peak_ratios(gpu)
        peaks = record.get("activation_peak_bytes", {})
        base_peak = peaks.get("none")
        for policy in POLICIES:
            if policy == "none" or policy not in gpu or policy not in tunnel:
                continue
            overhead = gpu[policy]["step_ms"] / gpu["none"]["step_ms"] - 1
            rounds = sorted(tunnel[policy])
            median = statistics.median(rounds)
            fitted = target == FIT_TARGET and policy == FIT_POLICY
            error, verdict = judge(overhead, median, rounds[0], rounds[-1], fitted)
            rows.append(
                {
                    "target": target,
                    "policy": policy,
                    "gpu": overhead,
                    "tunnel": median,
                    "low": rounds[0],
                    "high": rounds[-1],
                    "error": error,
                    "verdict": verdict,
                    "peak_gpu": gpu_peaks.get(policy),
                    "peak_tunnel": peaks[policy] / base_peak if base_peak and peaks.get(policy) else None,
                }
            )
    return rows


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value * 100:+.1f}%"


def print_calibration(rows: list[dict], fit: dict) -> None:
    """The table, then the constants and what was fitted on what."""
    shown = [
        {
            **row,
            "gpu_pct": _pct(row["gpu"]),
            "tunnel_pct": _pct(row["tunnel"]),
            "spread": f"{row['low'] * 100:+.1f} .. {row['high'] * 100:+.1f}%",
            "error_pct": f"{row['error'] * 100:+.0f}%",
            "points": f"{(row['tunnel'] - row['gpu']) * 100:+.1f}",
        }
        for row in rows
    ]
    print(
        format_table(
            shown,
            [
                ("target", "target"),
                ("policy", "policy"),
                ("gpu_pct", "GPU overhead"),
                ("tunnel_pct", "tunnel overhead (median)"),
                ("spread", "tunnel spread (rounds)"),
                ("error_pct", "error on overhead"),
                ("points", "points"),
                ("verdict", "within 25%"),
                ("peak_gpu", "GPU act peak / none"),
                ("peak_tunnel", "tunnel act peak / none"),
            ],
        )
    )
    print(
        f"\noverhead: step time / none's - 1; the tunnel's per round of {fit['rounds']} (ABAB..., one process), "
        f"median and least .. most; error: relative to the GPU's overhead, points: the difference. Bar: {ERROR_LIMIT:.0%} of the GPU's overhead, or {GPU_NOISE * 100:.0f} points "
        "where wider (the H100 run's repeatability); 'within spread': only part of the spread is within it.\n"
        f"fitted on {FIT_TARGET} (Note [fitting the tunnel]): mfu {fit['mfu']:.3f} from none's "
        f"{fit['none_ms']:.0f} ms; save_on_cpu_share {fit['share']:.3f} from {FIT_POLICY}'s overhead "
        f"(row marked 'fitted'); link {fit['link'] / 1e9:.0f} GB/s measured. Every other row is out of sample.\n"
        f"GPU figures: {', '.join(os.path.relpath(path) for path in SIDES.values())} (Note [a second side]: "
        "the H200's rows are the same tunnel rounds against its run, every one out of sample); the tunnel's from the simulated device's link scaled to the "
        "target (Note [scaling the tunnel]), the CPU model at the length with the target's share of attention, "
        f"timed on the clock that leaves out other processes' time (stolen from the training thread: "
        f"{fit['stolen_pct']:.0f}% of wall time in the rounds)."
    )


def fitted_gpu(gpu, **constants):
    """``gpu`` (`tunnel.Gpu`) with the fitted constants."""
    return dataclasses.replace(gpu, **constants)
