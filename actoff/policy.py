"""Policy: where a block's activations go, as pure functions of the settings and measurements.

The whole-tensor tier of each policy, the token fractions of the token-wise policies, which
sealed runs are placed (``keep_last``), a host budget's share per process, and the ``auto``
policy's decision (MEMO's closed form). No tensors, no devices: tested on plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config

__all__ = [
    "READ_BY",
    "TOKENWISE_POLICIES",
    "AutoDecision",
    "auto_fractions",
    "budget_share",
    "ignored_settings",
    "runs_to_place",
    "token_fractions",
    "whole_tier",
]

#: Policies that split saved activations by token range (the rest of a block is recomputed).
TOKENWISE_POLICIES = ("tokenwise", "recompute", "auto")


def whole_tier(config: Config) -> str:
    """Where a policy puts what it stores whole: the block's input, mixer saves, fallbacks.

    >>> whole_tier(Config(policy="recompute")), whole_tier(Config(policy="keep"))
    ('cpu', 'keep')
    """
    if config.policy in ("cpu", "nvme", "keep"):
        return config.policy
    return (
        "nvme"
        if config.policy == "tokenwise" and config.cpu_fraction == 0 and config.nvme_fraction > 0
        else "cpu"
    )


#: Settings only some policies read, and which (Config's field documentation says what they do).
READ_BY: dict[str, tuple[str, ...]] = {
    "cpu_fraction": ("tokenwise",),
    "nvme_fraction": ("tokenwise",),
    "host_bandwidth": ("auto",),
}


def ignored_settings(policy: str, names: object) -> list[str]:
    """Which of the settings ``names`` (set by the user) ``policy`` does not read.

    >>> ignored_settings("cpu", ["cpu_fraction", "min_bytes"]), ignored_settings("tokenwise", ["cpu_fraction"])
    (['cpu_fraction'], [])
    """
    return [name for name in names if name in READ_BY and policy not in READ_BY[name]]


def token_fractions(config: Config, decision: AutoDecision | None) -> tuple[float, float] | None:
    """Token fractions ``(cpu, nvme)`` a token-wise run stores (the rest is recomputed), or
    ``None`` when the run is to be stored whole: ``auto`` before its decision (the first step
    measures). Call only for `TOKENWISE_POLICIES`.

    >>> token_fractions(Config(policy="recompute"), None)
    (0.0, 0.0)
    >>> token_fractions(Config(policy="auto"), None) is None
    True
    """
    if config.policy == "auto":
        return None if decision is None else (decision.cpu_fraction, decision.nvme_fraction)
    if config.policy == "recompute":
        return 0.0, 0.0
    return config.cpu_fraction, config.nvme_fraction


def runs_to_place(sealed: int, keep_last: int) -> int:
    """How many of ``sealed`` runs waiting (oldest first) to place now: all but the last
    ``keep_last``, which backward needs first.

    >>> runs_to_place(3, 1), runs_to_place(1, 2)
    (2, 0)
    """
    return max(0, sealed - keep_last)


def budget_share(budget: int | None, ranks_per_host: int) -> int | None:
    """One process's share of a per-host budget (``None``: no cap).

    >>> budget_share(400, 4), budget_share(None, 4) is None
    (100, True)
    """
    return None if budget is None else budget // max(1, ranks_per_host)


@dataclass(frozen=True)
class AutoDecision:
    """The `auto` policy's choice for one block shape, with its inputs (reported in stats)."""

    cpu_fraction: float
    nvme_fraction: float
    bandwidth_gbps: float  # host link, bytes per ns
    t_layer_ms: float
    input_bytes: int
    attention_bytes: int
    other_bytes: int
    host_budget_per_layer: float | None
    reason: str


def auto_fractions(
    *,
    bandwidth_bytes_per_s: float,
    t_layer_s: float,
    input_bytes: int,
    attention_bytes: int,
    other_bytes: int,
    num_layers: int,
    host_budget: int | None,
    nvme_available: bool,
) -> AutoDecision:
    """MEMO's closed form for the stored fraction of the token-local activations.

    ``alpha = clip(min((B*T - S_in - S_attn) / S_other, (M_cpu/(n-2) - S_in - S_attn) / S_other), 0, 1)``:
    store as much as the host link can copy during one block's forward, within the host budget.
    When the budget binds and an NVMe directory is set, the part the link could still hide
    goes to NVMe instead of being recomputed.

    >>> d = auto_fractions(bandwidth_bytes_per_s=1e9, t_layer_s=0.01, input_bytes=2_000_000,
    ...                    attention_bytes=2_000_000, other_bytes=12_000_000, num_layers=8,
    ...                    host_budget=None, nvme_available=False)
    >>> round(d.cpu_fraction, 3)
    0.5
    """
    fixed = input_bytes + attention_bytes
    other = max(other_bytes, 1)
    alpha_time = (bandwidth_bytes_per_s * t_layer_s - fixed) / other
    per_layer = None if host_budget is None else host_budget / max(num_layers - 2, 1)
    alpha_memory = float("inf") if per_layer is None else (per_layer - fixed) / other
    clip = lambda value: min(max(value, 0.0), 1.0)  # noqa: E731
    cpu = clip(min(alpha_time, alpha_memory))
    nvme = 0.0
    reason = "host link bound" if alpha_time <= alpha_memory else "host budget bound"
    if nvme_available and alpha_memory < alpha_time:
        nvme = clip(alpha_time) - cpu
        reason = "host budget bound; spilling to NVMe"
    return AutoDecision(
        cpu_fraction=cpu,
        nvme_fraction=max(nvme, 0.0),
        bandwidth_gbps=bandwidth_bytes_per_s / 1e9,
        t_layer_ms=t_layer_s * 1e3,
        input_bytes=input_bytes,
        attention_bytes=attention_bytes,
        other_bytes=other_bytes,
        host_budget_per_layer=per_layer,
        reason=reason,
    )
