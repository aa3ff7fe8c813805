"""``--plot``: memory over one step and tokens/s and peak memory against sequence length (the
table), or the longest sequence per policy and the device memory at it (``--find-max-seq``).
"""

from __future__ import annotations

from .policies import is_actoff_policy
from .table import gib


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(records: list[dict], path: str) -> None:
    plt = _pyplot()
    ok = [r for r in records if r.get("status") == "ok"]
    policies = list(dict.fromkeys(r["policy"] for r in ok))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    sources = {r.get("memory_source") for r in ok}
    if "cuda" in sources:
        memory_label = "GPU allocated"
    elif "simulated device" in sources:
        memory_label = "device allocated (simulated)"
    else:
        memory_label = "process RSS"
    _plot_timelines(axes[0], ok, policies, memory_label)
    for policy in policies:
        rows = sorted((r for r in ok if r["policy"] == policy), key=lambda r: r["seq"])
        seqs = [r["seq"] for r in rows]
        axes[1].plot(seqs, [r["tokens_per_s"] for r in rows], marker="o", label=policy)
        peak = [gib(r.get("peak_allocated_bytes") or r.get("rss_peak_bytes")) for r in rows]
        axes[2].plot(seqs, peak, marker="o", label=policy)
    axes[1].set(title="throughput", xlabel="sequence length", ylabel="tokens/s", xscale="log")
    ylabel = f"peak {memory_label} (GiB)"
    axes[2].set(title="peak memory", xlabel="sequence length", ylabel=ylabel, xscale="log")
    for axis in axes[1:]:
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_timelines(axis, ok: list[dict], policies: list[str], memory_label: str) -> None:
    """Device (and host and NVMe) memory over one step of each policy, at the longest length."""
    longest = max((r["seq"] for r in ok), default=0)
    for policy in policies:
        record = next((r for r in ok if r["policy"] == policy and r["seq"] == longest), None)
        if record and record.get("timeline"):
            t, dev, host, nvme = zip(*record["timeline"], strict=True)
            (line,) = axis.plot(t, [v / 2**30 for v in dev], label=f"{policy}: {memory_label}")
            if any(host):
                axis.plot(t, [v / 2**30 for v in host], "--", color=line.get_color(), label=f"{policy}: host")
            if any(nvme):
                axis.plot(t, [v / 2**30 for v in nvme], ":", color=line.get_color(), label=f"{policy}: NVMe")
    axis.set(title=f"memory over one step (seq {longest})", xlabel="seconds", ylabel="GiB")
    axis.legend(fontsize=7)


def plot_max_seq(rows: list[dict], path: str, where: str) -> None:
    """Longest length per policy (hatched: a lower bound), with keep's and checkpoint's marked,
    and the device memory at each one's limit split into weights and gradients, actoff's device
    arena and the rest (activations and working memory)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.45 * len(rows) + 2.2), gridspec_kw={"width_ratios": [3, 2]})
    _plot_longest(axes[0], rows, where)
    names = [row["policy"] for row in rows][::-1]
    weights, arena, rest = [], [], []
    for row in rows[::-1]:
        record = row.get("record") or {}
        peak = record.get("peak_allocated_bytes") or 0
        weights.append((record.get("weights_grads_bytes") or 0) / 2**20)
        arena.append((record.get("device_arena_bytes") or 0) / 2**20)
        rest.append(max(0.0, peak / 2**20 - weights[-1] - arena[-1]))
    axes[1].barh(names, weights, color="tab:olive", label="weights + gradients")
    axes[1].barh(names, arena, left=weights, color="tab:orange", label="actoff's device arena")
    axes[1].barh(names, rest, left=[w + a for w, a in zip(weights, arena, strict=True)], color="tab:cyan",
                 label="activations and working memory")  # fmt: skip
    axes[1].set(title="device peak at each one's longest length", xlabel="MiB")
    axes[1].set_yticklabels([])
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot_longest(axis, rows: list[dict], where: str) -> None:
    """A bar per policy, its longest length and ratios written at its end; keep's and
    checkpoint's lengths as vertical lines."""
    names = [row["policy"] for row in rows][::-1]
    shown = rows[::-1]
    colors = ["tab:blue" if is_actoff_policy(r["policy"]) else "tab:gray" for r in shown]
    bars = axis.barh(names, [r["max_seq"] or 0 for r in shown], color=colors)
    for bar, row in zip(bars, shown, strict=True):
        if "lower bound" in row["search"]:
            bar.set_hatch("//")
        ratios = [f"{row[f'x_{name}']}x {name}" for name in ("keep", "checkpoint") if row.get(f"x_{name}")]
        label = f" {row['max_seq']}" + (f"  ({', '.join(ratios)})" if ratios else "")
        axis.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    by_policy = {row["policy"]: row for row in rows}
    for name, style in (("keep", ":"), ("checkpoint", "--")):
        if by_policy.get(name, {}).get("max_seq"):
            axis.axvline(by_policy[name]["max_seq"], color="black", linestyle=style, linewidth=1, label=name)
    axis.set(title=f"longest sequence that trains on {where}", xlabel="tokens (hatched: a lower bound; "
             "blue: actoff policies)")  # fmt: skip
    axis.set_xlim(0, max((r["max_seq"] or 0) for r in rows) * 1.45 or 1)
    axis.legend(fontsize=8, loc="lower right")
