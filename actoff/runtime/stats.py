"""Statistics: per-block figures of the last step and a readable table (`actoff.stats()`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actoff.config import format_bytes
from actoff.figures import BlockStats
from actoff.policy import BUCKETS

if TYPE_CHECKING:
    from collections.abc import Iterable

    from actoff.memory.arenas import Arenas
    from actoff.memory.device_arena import DeviceArena
    from actoff.tiers.nvme.store import StoreRegistry

    from .auto import AutoObserver
    from .step import Step

__all__ = ["BlockStats", "Stats", "collect", "copy_stats", "snapshot"]


@dataclass
class Stats:
    """A snapshot of actoff's figures. ``str(stats)`` is a table.

    Example:
        >>> import actoff
        >>> snapshot = actoff.stats()
        >>> snapshot.total_bytes_offloaded >= 0
        True
    """

    blocks: dict[str, BlockStats] = field(default_factory=dict)
    steps: int = 0  # backward passes completed since the last reset
    host_capacity: int = 0  # bytes of host arena held
    host_high_water: int = 0  # most host arena bytes in use at once
    host_allocations: int = 0  # host buffers ever allocated (constant after the first step)
    #: Bytes of host arena in pageable memory because pinned memory was capped (ACTOFF_PINNED_BUDGET)
    #: or could not be had (Note [pageable fallback]): copies to and from them are synchronous, the
    #: host waiting for each, and slower (staged through the driver's own pinned buffer).
    host_pageable_bytes: int = 0
    nvme_file_bytes: int = 0  # size of the NVMe files
    io_backend: str = "none"  # I/O engine of the NVMe tier, once used
    auto: dict = field(default_factory=dict)  # block name -> actoff.policy.AutoDecision
    #: The auto policy's plan in force (actoff.runtime.auto): what it is and why, the budget,
    #: the memory outside the blocks it assumed, the step's device peak and the blocks' time
    #: (forwards plus what placements add) it predicts, and the replans so far ("none" and
    #: zeros without a plan). Then the last plan a step ran (the one in force, or the one a
    #: replan replaced): its prediction and that step's measurement.
    plan: str = "none"
    plan_reason: str = ""
    budget_bytes: int = 0
    outside_bytes: int = 0
    predicted_peak_bytes: int = 0
    predicted_step_ms: float = 0.0
    replans: int = 0
    #: The last step ran the plan in force and kept it (auto has settled: its measuring, probing
    #: and calibrating steps are behind; `actoff.runtime.planning.AutoPlans.holds`).
    plan_holds: bool = False
    measured_plan: str = "none"
    measured_predicted_peak_bytes: int = 0
    measured_peak_bytes: int | None = None
    measured_predicted_step_ms: float = 0.0
    measured_step_ms: float | None = None
    #: Steps whose measured device peak exceeded the auto policy's budget, per cause, and the
    #: largest such peak (Note [every step over the budget is said]).
    steps_over_budget: int = 0
    over_budget_causes: dict = field(default_factory=dict)
    over_budget_peak_bytes: int = 0
    host_layout: str = "none"  # the host arena's layout: "greedy:...", "mip", "cache", "rank 0 (...)"
    #: The device arena (actoff.memory.device_arena; none on a plain CPU device or with the planner
    #: off): most bytes of its buffers alive at once in the last step (those of the step before
    #: that still had tenants at its start included), the bytes its layout's
    #: address space spans, the layout's lower bound (most bytes live at once in the traced step),
    #: solve time, method ("bilevel", "cache", ...), buffers taken (one per wave of a block's
    #: tensors and step: Note [a buffer per wave]), requests not served as laid out, and layouts
    #: kept (one per shape of step: Note [a plan per shape]).
    device_arena_bytes: int = 0
    device_layout_bytes: int = 0
    device_lower_bound: int = 0
    device_solve_s: float = 0.0
    device_layout: str = "none"
    device_allocations: int = 0
    device_divergences: int = 0
    device_fallbacks: int = 0  # planned ranges still held: served elsewhere
    device_layouts: int = 0
    # The last step's windows (Note [fetch per saved tensor], Note [copy out at pack]): the bytes
    # backward may fetch ahead and forward may have copying out (None: no window in bytes, as
    # under a prefetch depth, or no cap), and the most each held at once: fetched and not let go
    # (ahead, and what the nodes autograd runs hold), copying out (a save waits past the window).
    fetch_window_bytes: int | None = None
    copy_window_bytes: int | None = None
    fetched_peak_bytes: int = 0
    copying_peak_bytes: int = 0

    # The arenas' figures' names until 0.1 ("plan" is the auto policy's word now); kept a release.
    host_plan = property(lambda self: self.host_layout)
    device_plan = property(lambda self: self.device_layout)
    device_plan_bytes = property(lambda self: self.device_layout_bytes)
    device_plans = property(lambda self: self.device_layouts)

    @property
    def total_bytes_saved(self) -> int:
        return sum(b.bytes_saved for b in self.blocks.values())

    @property
    def total_bytes_offloaded(self) -> int:
        return sum(b.bytes_offloaded for b in self.blocks.values())

    def __str__(self) -> str:
        return "\n".join([*self._table(), *self._footer()])

    def _table(self) -> list[str]:
        """One row per block and a total, with the auto policy's columns where it planned."""
        planned = any(block.placement for block in self.blocks.values())
        header = (
            "block",
            "calls",
            "tensors",
            "saved",
            *BUCKETS,
            "copy ms",
            "fetch ms",
            "wait ms",
            "recompute ms",
        )
        if planned:
            header += ("placement", "pred ms", "meas ms")
        rows = [header]
        rows += [(*_cells(block), *(_plan_cells(block) if planned else ())) for block in self.blocks.values()]
        totals = BlockStats("total", calls=sum(b.calls for b in self.blocks.values()))
        for block in self.blocks.values():
            totals.tensors += block.tensors
            totals.bytes_saved += block.bytes_saved
            for attr in ("copy_ms", "fetch_ms", "wait_ms", "recompute_ms"):
                setattr(totals, attr, getattr(totals, attr) + getattr(block, attr))
            for tier in BUCKETS:
                totals.bytes_per_tier[tier] += block.bytes_per_tier[tier]
        predicted = f"{self.predicted_step_ms:.2f}" if self.plan != "none" else ""
        measured = f"{sum(b.measured_ms for b in self.blocks.values()):.2f}"
        rows.append((*_cells(totals), *(("", predicted, measured) if planned else ())))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        return lines

    def _footer(self) -> list[str]:
        """The step's arenas, the NVMe file, and the auto policy's plan, measurement and decisions."""
        lines = [
            f"steps: {self.steps}   host arena: {format_bytes(self.host_capacity)} in "
            f"{self.host_allocations} allocation(s), high water {format_bytes(self.host_high_water)}, "
            + (f"{format_bytes(self.host_pageable_bytes)} pageable, " if self.host_pageable_bytes else "")
            + f"layout {self.host_layout}   nvme file: {format_bytes(self.nvme_file_bytes)} ({self.io_backend})"
        ]
        if self.device_layout != "none":
            gap = self.device_layout_bytes / self.device_lower_bound - 1 if self.device_lower_bound else 0.0
            lines.append(
                f"device arena: {format_bytes(self.device_arena_bytes)} held at most, in buffers taken "
                f"{self.device_allocations} time(s) (one per wave of a block's tensors and backward), layout "
                f"{format_bytes(self.device_layout_bytes)} = lower bound "
                f"{format_bytes(self.device_lower_bound)} + {gap:.1%} ({self.device_layout}, solved in "
                f"{self.device_solve_s * 1e3:.1f} ms), {self.device_divergences} divergence(s), "
                f"{self.device_fallbacks} fallback(s), {self.device_layouts} layout(s) kept"
            )
        if self.fetched_peak_bytes or self.copying_peak_bytes:
            windows = [
                f"{what} {format_bytes(peak)} at most"
                + (f" (window {format_bytes(window)})" if window is not None else "")
                for what, peak, window in (
                    ("fetched and not let go", self.fetched_peak_bytes, self.fetch_window_bytes),
                    ("copying out", self.copying_peak_bytes, self.copy_window_bytes),
                )
            ]
            lines.append("windows: " + ", ".join(windows))
        if self.plan != "none":
            lines.append(
                f"auto plan: {self.plan} ({self.plan_reason}); budget {format_bytes(self.budget_bytes)}, "
                f"outside the blocks {format_bytes(self.outside_bytes)}; predicted device peak "
                f"{format_bytes(self.predicted_peak_bytes)}, blocks' time {self.predicted_step_ms:.2f} ms; "
                f"{self.replans} replan(s)" + ("; holds" if self.plan_holds else "; settling")
            )
        if self.measured_plan != "none":
            peak = (
                "not counted" if self.measured_peak_bytes is None else format_bytes(self.measured_peak_bytes)
            )
            lines.append(
                f"auto last step ran {self.measured_plan}: device peak {peak} (predicted "
                f"{format_bytes(self.measured_predicted_peak_bytes)}), blocks' time {self.measured_step_ms:.2f} ms "
                f"(predicted {self.measured_predicted_step_ms:.2f} ms)"
            )
        if self.steps_over_budget:
            causes = ", ".join(f"{n} {cause}" for cause, n in self.over_budget_causes.items())
            lines.append(
                f"auto: {self.steps_over_budget} step(s) over the budget ({causes}), the largest peak "
                f"{format_bytes(self.over_budget_peak_bytes)}"
            )
        for name, decision in self.auto.items():
            lines.append(
                f"auto {name}: {decision.placement}, cpu {decision.cpu_fraction:.2f}, nvme "
                f"{decision.nvme_fraction:.2f} ({decision.reason}; link {decision.bandwidth_gbps:.1f} GB/s, "
                f"block forward {decision.t_layer_ms:.2f} ms, attention {decision.attention_ms:.2f} ms, input "
                f"{format_bytes(decision.input_bytes)}, attention {format_bytes(decision.attention_bytes)}, "
                f"other {format_bytes(decision.other_bytes)})"
            )
        return lines


def _cells(block: BlockStats) -> tuple[str, ...]:
    return (
        block.name,
        str(block.calls),
        str(block.tensors),
        format_bytes(block.bytes_saved),
        *(format_bytes(block.bytes_per_tier[t]) for t in BUCKETS),
        f"{block.copy_ms:.2f}",
        f"{block.fetch_ms:.2f}",
        f"{block.wait_ms:.2f}",
        f"{block.recompute_ms:.2f}",
    )


def _plan_cells(block: BlockStats) -> tuple[str, str, str]:
    if not block.placement:
        return ("", "", "")
    predicted = f"{block.predicted_ms:.2f}" if block.predicted_ms else ""
    return (block.placement, predicted, f"{block.measured_ms:.2f}")


_SUMMED = (
    "tensors", "bytes_saved", "dedup_hits", "skipped_param_bytes", "skipped_small_bytes",
    "skipped_other_bytes", "over_budget_bytes", "run_again_bytes", "write_fallback_bytes", "forwarded", "copy_ms",
    "fetch_ms", "wait_ms", "out_wait_ms", "place_wait_ms", "recompute_ms", "probes", "forward_ms", "predicted_ms", "measured_ms",
)  # fmt: skip


def collect(step: Step) -> dict[str, BlockStats]:
    """Per block name, the figures of one step: calls of a block summed."""
    blocks: dict[str, BlockStats] = {}
    for run in step.runs:
        block = blocks.get(run.name)
        if block is None:
            block = blocks[run.name] = BlockStats(run.name, calls=0)
        source = run.stats
        block.calls += 1
        for name in _SUMMED:
            setattr(block, name, getattr(block, name) + getattr(source, name))
        if source.placement and source.placement not in block.placement.split(", "):
            block.placement = ", ".join(filter(None, (block.placement, source.placement)))
        placement = run.placement
        if placement is not None and placement.asks_recompute and placement.whole_because:
            block.stored_whole = placement.whole_because
        for tier, nbytes in source.bytes_per_tier.items():  # runs kept as is (actoff.runtime.step)
            block.bytes_per_tier[tier] += nbytes
        for record in run.records:
            block.tensors += 1
            block.bytes_saved += record.geometry.nbytes
            record.tier.count(record, block.bytes_per_tier)
    return blocks


def copy_stats(block: BlockStats) -> BlockStats:
    """An independent copy (the per-tier dictionary included)."""
    copy = BlockStats(**{k: v for k, v in vars(block).items() if k != "bytes_per_tier"})
    copy.bytes_per_tier = dict(block.bytes_per_tier)
    return copy


def window_figures(step: Step) -> dict[str, int | None]:
    """The `Stats` fields of ``step``'s windows: in force (the auto plan's, else the settings')
    and the most bytes each held."""
    config = step.runs[0].config if step.runs else None
    return {
        "fetch_window_bytes": step.window
        if step.window is not None or config is None
        else config.fetch_window,
        "copy_window_bytes": step.copy_window
        if step.copy_window is not None or config is None
        else config.copy_window,
        "fetched_peak_bytes": step.fetches.peak,
        "copying_peak_bytes": step.outbound_peak,
    }


def snapshot(
    blocks: dict[str, BlockStats],
    steps: int,
    arenas: Arenas,
    stores: StoreRegistry,
    auto: AutoObserver,
    windows: dict[str, int | None] | None = None,
) -> Stats:
    """A `Stats` of the runtime's figures: blocks copied, host arenas and NVMe stores summed, and
    the last step's windows (`window_figures`)."""
    return Stats(
        blocks={name: copy_stats(b) for name, b in blocks.items()},
        steps=steps,
        host_capacity=sum(a.capacity for a in arenas.values()),
        host_high_water=max((a.high_water for a in arenas.values()), default=0),
        host_allocations=sum(a.num_allocations for a in arenas.values()),
        host_pageable_bytes=sum(a.memory.pageable_bytes for a in arenas.values()),
        nvme_file_bytes=stores.file_bytes(),
        io_backend=stores.backend_name(),
        auto=auto.decisions(),
        **auto.summary(),
        host_layout=next((a.plan_method for a in arenas.values() if a.plan is not None), "none"),
        **_device_arena_figures(arenas.on_device.values()),
        **(windows or {}),
    )


def _device_arena_figures(device_arenas: Iterable[DeviceArena]) -> dict[str, Any]:
    """The `Stats` fields of the device arenas, summed (one per device; one in practice)."""
    figures = [arena.stats() for arena in device_arenas]
    return {
        "device_arena_bytes": sum(f["bytes"] for f in figures),
        "device_layout_bytes": sum(f["plan_bytes"] for f in figures),
        "device_lower_bound": sum(f["lower_bound"] for f in figures),
        "device_solve_s": sum(f["solve_s"] for f in figures),
        "device_layout": next((f["method"] for f in figures if f["method"] != "none"), "none"),
        "device_allocations": sum(f["allocations"] for f in figures),
        "device_divergences": sum(f["divergences"] for f in figures),
        "device_fallbacks": sum(f["fallbacks"] for f in figures),
        "device_layouts": sum(f["plans"] for f in figures),
    }
