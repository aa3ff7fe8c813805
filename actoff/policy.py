"""Policy: where a block's activations go, as pure functions of the settings and measurements.

The whole-tensor tier of each policy, the token fractions of the token-wise policies, which
sealed runs are placed (``keep_last``), a host budget's share per process, and what the ``auto``
policy reports of its plan per block, with the host budget's say in it (the plan itself:
actoff.budget). No tensors, no devices: tested on plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config

__all__ = [
    "READ_BY",
    "TOKENWISE_POLICIES",
    "AutoDecision",
    "budget_share",
    "host_split",
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
    "gpu_budget": ("auto",),
    "prefetch_depth": ("keep", "cpu", "nvme", "tokenwise", "recompute", "checkpoint"),
}


def ignored_settings(policy: str, names: object) -> list[str]:
    """Which of the settings ``names`` (set by the user) ``policy`` does not read.

    >>> ignored_settings("cpu", ["cpu_fraction", "min_bytes"]), ignored_settings("tokenwise", ["cpu_fraction"])
    (['cpu_fraction'], [])
    """
    return [name for name in names if name in READ_BY and policy not in READ_BY[name]]


def token_fractions(config: Config, planned: tuple[float, float] | None) -> tuple[float, float]:
    """Token fractions ``(cpu, nvme)`` a token-wise run stores (the rest is recomputed): under
    ``auto`` the ones its plan gives the run (``planned``), or none while it measures (the
    ``recompute`` placement: Note [measuring at recompute] in actoff.runtime.auto). Call only for
    `TOKENWISE_POLICIES`.

    >>> token_fractions(Config(policy="recompute"), None)
    (0.0, 0.0)
    >>> token_fractions(Config(policy="auto"), None), token_fractions(Config(policy="auto"), (0.5, 0.0))
    ((0.0, 0.0), (0.5, 0.0))
    """
    if config.policy == "auto":
        return (0.0, 0.0) if planned is None else planned
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
    """The `auto` policy's plan for one block, with what it was planned from (reported in stats).

    ``placement`` is ``keep``, ``tokenwise:A`` (a share ``A`` of the token-local bytes stored,
    ``cpu_fraction`` of the tokens in host memory and ``nvme_fraction`` on NVMe, the rest
    recomputed) or ``checkpoint``; ``prefetch_depth`` is the step's. The measurements: the
    host link, the block's forward and attention times (a warm step's), its saved bytes by
    class (inputs, attention's saves and what else is stored whole, the token-local rest).
    """

    placement: str
    cpu_fraction: float
    nvme_fraction: float
    prefetch_depth: int
    bandwidth_gbps: float  # host link, bytes per ns
    t_layer_ms: float
    attention_ms: float
    input_bytes: int
    attention_bytes: int
    other_bytes: int
    host_budget_per_layer: float | None
    reason: str


def host_split(
    stored: float,
    *,
    fixed_bytes: int,
    other_bytes: int,
    host_budget_per_layer: float | None,
    nvme_available: bool,
) -> tuple[float, float, str]:
    """Token fractions ``(cpu, nvme)`` for a planned stored share of the token-local bytes, and
    why: in host memory as far as a block's share of the host budget holds it (MEMO's memory
    bound: ``(M_cpu / (n - 2) - S_in - S_attn) / S_other``), the rest on NVMe when a directory is
    set, else recomputed.

    >>> host_split(0.5, fixed_bytes=4, other_bytes=12, host_budget_per_layer=None, nvme_available=False)
    (0.5, 0.0, 'planned')
    >>> host_split(1.0, fixed_bytes=4, other_bytes=12, host_budget_per_layer=7, nvme_available=True)
    (0.25, 0.75, 'host budget bound; spilling to NVMe')
    """
    if host_budget_per_layer is None:
        return stored, 0.0, "planned"
    room = min(max((host_budget_per_layer - fixed_bytes) / max(other_bytes, 1), 0.0), 1.0)
    if stored <= room:
        return stored, 0.0, "planned"
    if nvme_available:
        return room, stored - room, "host budget bound; spilling to NVMe"
    return room, 0.0, "host budget bound; recomputing the rest"
