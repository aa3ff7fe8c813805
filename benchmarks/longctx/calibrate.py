"""``--calibrate``: the wind tunnel against a GPU run. For each target the GPU measured, the
tunnel runs the same policies, and the table puts the step-time ratios to no offload side by
side with their error (and the activation peaks' ratios, for the memory side).
"""

from __future__ import annotations

import json
import os

from _common import format_table

#: The GPU run the tunnel is calibrated on (7B-shaped, 4 layers, bf16, batch 1).
MEASURED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "h100-2026-11-23", "long.jsonl"
)
#: Targets of that run, and the policies compared (its names for PyTorch's baselines mapped).
TARGETS = ("h100:7b@8k", "h100:7b@32k")
POLICIES = ("none", "keep", "torch_checkpoint", "torch_save_on_cpu", "cpu")
_RENAMED = {"checkpoint": "torch_checkpoint", "save_on_cpu": "torch_save_on_cpu"}
LAYERS = 4
#: A tunnel ratio within this share of the measured one passes.
ERROR_LIMIT = 0.25


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


def _ratios(records: dict[str, dict]) -> dict[str, tuple[float | None, float | None]]:
    """``policy -> (step time / none's, activation peak / none's)``."""
    none = records.get("none")
    out = {}
    for policy, record in records.items():
        step = record["step_ms"] / none["step_ms"] if none else None
        peak, base = record.get("activation_peak_bytes"), (none or {}).get("activation_peak_bytes")
        out[policy] = (step, peak / base if peak and base else None)
    return out


def calibration_rows(
    measured: dict[tuple[str, int], dict], tunnel_runs: dict[str, tuple[int, list[dict]]]
) -> list[dict]:
    """One row per (target, policy) the GPU measured: its ratios, the tunnel's, the error.

    ``tunnel_runs``: ``target text -> (the target's length, the tunnel's records)``.

    >>> measured = {("none", 8192): {"step_ms": 100.0}, ("cpu", 8192): {"step_ms": 200.0}}
    >>> tunnel = {"h100:7b@8k": (8192, [{"policy": "none", "status": "ok", "step_ms": 10.0},
    ...                                  {"policy": "cpu", "status": "ok", "step_ms": 24.0}])}
    >>> [(r["policy"], r["measured"], r["tunnel"], round(r["error"], 2)) for r in calibration_rows(measured, tunnel)]
    [('none', 1.0, 1.0, 0.0), ('cpu', 2.0, 2.4, 0.2)]
    """
    rows = []
    for target, (seq, records) in tunnel_runs.items():
        gpu = _ratios({policy: r for (policy, length), r in measured.items() if length == seq})
        cpu = _ratios({r["policy"]: r for r in records if r.get("status") == "ok"})
        for policy in POLICIES:
            if policy not in gpu:
                continue
            (step_gpu, peak_gpu), (step_cpu, peak_cpu) = gpu[policy], cpu.get(policy, (None, None))
            error = step_cpu / step_gpu - 1 if step_cpu and step_gpu else None
            rows.append(
                {
                    "target": target,
                    "policy": policy,
                    "measured": step_gpu,
                    "tunnel": step_cpu,
                    "error": error,
                    "within": None if error is None else abs(error) <= ERROR_LIMIT,
                    "peak_measured": peak_gpu,
                    "peak_tunnel": peak_cpu,
                }
            )
    return rows


def print_calibration(rows: list[dict]) -> None:
    shown = [
        {
            **row,
            "error_pct": None if row["error"] is None else f"{row['error'] * 100:+.0f}%",
            "within": {True: "yes", False: "NO", None: "-"}[row["within"]],
        }
        for row in rows
    ]
    print(
        format_table(
            shown,
            [
                ("target", "target"),
                ("policy", "policy"),
                ("measured", "GPU x none"),
                ("tunnel", "tunnel x none"),
                ("error_pct", "error"),
                ("within", "within 25%"),
                ("peak_measured", "GPU act peak / none"),
                ("peak_tunnel", "tunnel act peak / none"),
            ],
        )
    )
    print(
        f"\nGPU figures: {os.path.relpath(MEASURED)}; the tunnel's from the simulated device's link scaled "
        "to the target (Note [scaling the tunnel]), the CPU model at the length with the target's share of "
        "attention."
    )
