"""``--plot``: the time/memory plane per length (step time over no offload's against the device
peak, the Pareto front drawn) and memory over one step (the table), or the longest sequence per
policy and the device memory at it (``--find-max-seq``).
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
    policies = list(dict.fromkeys(r.get("label", r["policy"]) for r in ok))
    lengths = sorted({r["seq"] for r in ok})
    fig, axes = plt.subplots(1, len(lengths) + 1, figsize=(6 * (len(lengths) + 1), 5), squeeze=False)
    sources = {r.get("memory_source") for r in ok}
    if "cuda" in sources:
        memory_label = "GPU allocated"
    elif "simulated device" in sources:
        memory_label = "device allocated (simulated)"
    else:
        memory_label = "process RSS"
    for axis, seq in zip(axes[0], lengths, strict=False):
        _plot_plane(axis, [r for r in ok if r["seq"] == seq], seq, memory_label)
    _plot_timelines(axes[0][-1], ok, policies, memory_label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points no other point beats on both axes (less memory and less time), by memory.

    >>> pareto_front([(1, 5, "a"), (2, 2, "b"), (3, 3, "c"), (4, 1, "d")])
    [(1, 5, 'a'), (2, 2, 'b'), (4, 1, 'd')]
    """
    front: list[tuple[float, float, str]] = []
    for point in sorted(points):
        if not front or point[1] < front[-1][1]:
            front.append(point)
    return front


def _plot_plane(axis, rows: list[dict], seq: int, memory_label: str) -> None:
    """Step time over none's (y) against the device peak (x), each policy a labelled point,
    actoff's filled and PyTorch's hollow, the front a line."""
    points = [
        (gib(r["peak_allocated_bytes"]) * 1024, r["step_vs_none"], r.get("label", r["policy"]))
        for r in rows
        if r.get("peak_allocated_bytes") and r.get("step_vs_none")
    ]
    for x, y, label in points:
        actoff_policy = is_actoff_policy(label.split("<=")[0])
        budgeted = "<=" in label  # auto under a budget (Note [auto in the main run]): a star
        axis.scatter(
            [x],
            [y],
            s=90 if budgeted else 40,
            marker="*" if budgeted else "o" if actoff_policy else "s",
            facecolors="C2" if budgeted else "C0" if actoff_policy else "none",
            edgecolors="C2" if budgeted else "C0" if actoff_policy else "C3",
        )
        axis.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    budgets = sorted({r["budget_bytes"] for r in rows if r.get("label", "").startswith("auto<=")})
    for budget in budgets:  # each budget auto was given, where its point must lie left of
        axis.axvline(gib(budget) * 1024, color="C2", lw=0.6, ls=":")
    front = pareto_front(points)
    if front:
        axis.step(
            [x for x, _, _ in front],
            [y for _, y, _ in front],
            where="post",
            color="0.5",
            lw=1,
            label="front: less memory costs more time",
        )
        axis.legend(fontsize=7)
    axis.set(
        title=f"time against memory, seq {seq}",
        xlabel=f"peak {memory_label} (MiB)",
        ylabel="step time / none's",
    )
    axis.grid(alpha=0.3)


def _plot_timelines(axis, ok: list[dict], policies: list[str], memory_label: str) -> None:
    """Device (and host and NVMe) memory over one step of each policy, at the longest length."""
    longest = max((r["seq"] for r in ok), default=0)
    for policy in policies:
        record = next((r for r in ok if r.get("label", r["policy"]) == policy and r["seq"] == longest), None)
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
    """Longest length per policy (hatched: a lower bound), with keep's and torch_checkpoint's marked,
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
    axes[1].barh(
        names,
        rest,
        left=[w + a for w, a in zip(weights, arena, strict=True)],
        color="tab:cyan",
        label="activations and working memory",
    )
    axes[1].set(title="device peak at each one's longest length", xlabel="MiB")
    axes[1].set_yticklabels([])
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot_longest(axis, rows: list[dict], where: str) -> None:
    """A bar per policy, its longest length and ratios written at its end; keep's and
    torch_checkpoint's lengths as vertical lines."""
    names = [row["policy"] for row in rows][::-1]
    shown = rows[::-1]
    colors = ["tab:blue" if is_actoff_policy(r["policy"]) else "tab:gray" for r in shown]
    bars = axis.barh(names, [r["max_seq"] or 0 for r in shown], color=colors)
    for bar, row in zip(bars, shown, strict=True):
        if "lower bound" in row["search"]:
            bar.set_hatch("//")
        ratios = [
            f"{row[f'x_{name}']}x {name}" for name in ("keep", "torch_checkpoint") if row.get(f"x_{name}")
        ]
        label = f" {row['max_seq']}" + (f"  ({', '.join(ratios)})" if ratios else "")
        axis.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    by_policy = {row["policy"]: row for row in rows}
    for name, style in (("keep", ":"), ("torch_checkpoint", "--")):
        if by_policy.get(name, {}).get("max_seq"):
            axis.axvline(by_policy[name]["max_seq"], color="black", linestyle=style, linewidth=1, label=name)
    axis.set(
        title=f"longest sequence that trains on {where}",
        xlabel="tokens (hatched: a lower bound; blue: actoff policies)",
    )
    axis.set_xlim(0, max((r["max_seq"] or 0) for r in rows) * 1.45 or 1)
    axis.legend(fontsize=8, loc="lower right")
