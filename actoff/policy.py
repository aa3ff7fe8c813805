"""Policies: the one table of what each ``ACTOFF_POLICY`` does, and the pure decisions read from it.

Note [the policy table]: a policy is one `PolicySpec` in `POLICIES` and one placement class (the
lifecycle object the runtime drives for every scope run: actoff.runtime.placements). The table
says which placement runs the policy, where it stores what it stores whole (its tier), whether it
splits activations by token, whether it runs a block again in backward, and which of the settings
that only some policies read it reads. Everything that used to compare policy names derives from
it: the names `Config` accepts, the settings said to have no effect, the tier of a placement, the
statistics' buckets. Adding a policy is `register` with a new spec and a placement class
(actoff.runtime.placements.register).

Also here: the token fractions a run stores, which sealed runs are placed (``keep_last``), a host
budget's share per process, and what the ``auto`` policy reports of its plan per block, with the
host budget's say in it (the plan itself: actoff.budget). No tensors, no devices: tested on plain
numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BUCKETS",
    "OPTIONAL_SETTINGS",
    "POLICIES",
    "TIER_NAMES",
    "AutoDecision",
    "PolicySpec",
    "Settings",
    "budget_share",
    "host_split",
    "ignored_settings",
    "policy_names",
    "read_by",
    "register",
    "runs_to_place",
    "spec",
    "token_fractions",
    "unregister",
    "whole_tier",
]

#: The tiers a policy can store whole on (actoff.tiers.registry has an object for each).
TIER_NAMES = ("keep", "cpu", "nvme")
#: Where a block's saved bytes end up, as the statistics count them: a tier, or recomputed.
BUCKETS = (*TIER_NAMES, "recompute")
#: Settings only some policies read (`PolicySpec.reads`); the others every policy reads.
OPTIONAL_SETTINGS = (
    "cpu_fraction", "nvme_fraction", "host_bandwidth", "gpu_budget", "prefetch_depth", "fetch_window", "copy_window",
    "chunk_tokens",
)  # fmt: skip


class Settings(Protocol):
    """What a policy's decisions read of `actoff.Config` (a structural type: `Config` is one)."""

    policy: str
    cpu_fraction: float
    nvme_fraction: float


def _host_unless_nvme_only(settings: Settings) -> str:
    """Token-wise storage sends what it keeps whole to the host, or to NVMe when its token split
    sends every stored token there."""
    return "nvme" if settings.cpu_fraction == 0 and settings.nvme_fraction > 0 else "cpu"


def _configured(settings: Settings, planned: tuple[float, float] | None) -> tuple[float, float]:
    return settings.cpu_fraction, settings.nvme_fraction


def _none_stored(settings: Settings, planned: tuple[float, float] | None) -> tuple[float, float]:
    return 0.0, 0.0


def _as_planned(settings: Settings, planned: tuple[float, float] | None) -> tuple[float, float]:
    # Measuring (no plan yet): Note [measuring at the floor] in actoff.runtime.auto.
    return (0.0, 0.0) if planned is None else planned


@dataclass(frozen=True)
class PolicySpec:
    """What one policy does (Note [the policy table]).

    >>> spec("recompute").placement, spec("recompute").splits_by_token, spec("checkpoint").reruns_block
    ('tokenwise', True, True)
    """

    name: str
    #: The placement class that runs it (actoff.runtime.placements), by its registered name.
    placement: str
    #: Where it stores what it stores whole (a `TIER_NAMES` entry, or a function of the settings).
    tier: str | Callable[[Settings], str]
    #: Splits saved activations by token range, recomputing what it does not store.
    splits_by_token: bool = False
    #: Runs a block again in backward (checkpoint; the token-wise re-run is `splits_by_token`).
    reruns_block: bool = False
    #: Its placements come from a plan (``auto``): each run's placement is the plan's.
    planned: bool = False
    #: The `OPTIONAL_SETTINGS` it reads.
    reads: tuple[str, ...] = ()
    #: Token fractions ``(cpu, nvme)`` a run stores: of the settings, and of a plan's if planned.
    fractions: Callable[[Settings, tuple[float, float] | None], tuple[float, float]] = _none_stored
    #: Whether it writes to NVMe by its settings alone (then ``nvme_dir`` must be set).
    needs_nvme: Callable[[Settings], bool] = lambda settings: False

    def whole_tier(self, settings: Settings) -> str:
        """The tier it stores whole on under ``settings``."""
        return self.tier if isinstance(self.tier, str) else self.tier(settings)


_DEPTH = ("prefetch_depth", "fetch_window", "copy_window")  # the windows (auto plans its own)
_BUILT_IN = (
    PolicySpec("keep", placement="kept", tier="keep", reads=_DEPTH),
    PolicySpec("recompute", placement="tokenwise", tier="cpu", splits_by_token=True, reads=_DEPTH),
    PolicySpec("cpu", placement="whole", tier="cpu", reads=_DEPTH),
    PolicySpec("nvme", placement="whole", tier="nvme", reads=_DEPTH, needs_nvme=lambda settings: True),
    PolicySpec("tokenwise", placement="tokenwise", tier=_host_unless_nvme_only, splits_by_token=True,
               reads=("cpu_fraction", "nvme_fraction", *_DEPTH), fractions=_configured,
               needs_nvme=lambda settings: settings.nvme_fraction > 0),
    PolicySpec("checkpoint", placement="checkpoint", tier="cpu", reruns_block=True, reads=_DEPTH),
    PolicySpec("chunked", placement="chunked", tier="cpu", reruns_block=True, reads=("chunk_tokens", *_DEPTH)),
    PolicySpec("auto", placement="planned", tier="cpu", splits_by_token=True, reruns_block=True, planned=True,
               reads=("host_bandwidth", "gpu_budget", "chunk_tokens"), fractions=_as_planned),
)  # fmt: skip
#: Every policy by name, in the order the README lists them (Note [the policy table]).
POLICIES: dict[str, PolicySpec] = {entry.name: entry for entry in _BUILT_IN}
_BUILT_IN_NAMES = frozenset(POLICIES)
_lock = threading.Lock()


def register(entry: PolicySpec) -> PolicySpec:
    """Add a policy to the table (its placement class is registered beside it:
    actoff.runtime.placements.register). A name already taken raises ``ValueError``.

    >>> register(PolicySpec("cpu", placement="whole", tier="cpu"))
    Traceback (most recent call last):
    ValueError: policy 'cpu' is already in the table
    """
    if isinstance(entry.tier, str) and entry.tier not in TIER_NAMES:
        raise ValueError(f"policy {entry.name!r} stores on tier {entry.tier!r}; tiers: {TIER_NAMES}")
    unknown = [name for name in entry.reads if name not in OPTIONAL_SETTINGS]
    if unknown:
        raise ValueError(
            f"policy {entry.name!r} reads {unknown}; settings read by some policies: {OPTIONAL_SETTINGS}"
        )
    with _lock:
        if entry.name in POLICIES:
            raise ValueError(f"policy {entry.name!r} is already in the table")
        POLICIES[entry.name] = entry
    return entry


def unregister(name: str) -> PolicySpec | None:
    """Remove a policy `register` added (built-in policies stay); returns its entry, if any."""
    with _lock:
        if name in _BUILT_IN_NAMES:
            raise ValueError(f"policy {name!r} is built in")
        return POLICIES.pop(name, None)


def policy_names() -> tuple[str, ...]:
    """Every value ``ACTOFF_POLICY`` accepts.

    >>> policy_names()[:3]
    ('keep', 'recompute', 'cpu')
    """
    return tuple(POLICIES)


def spec(name: str) -> PolicySpec:
    """The table's entry for policy ``name`` (validated by `actoff.Config`, so known)."""
    return POLICIES[name]


def whole_tier(settings: Settings) -> str:
    """Where a policy puts what it stores whole: the block's input, mixer saves, fallbacks.

    >>> from actoff import Config
    >>> whole_tier(Config(policy="recompute")), whole_tier(Config(policy="keep"))
    ('cpu', 'keep')
    """
    return spec(settings.policy).whole_tier(settings)


def read_by(setting: str) -> tuple[str, ...]:
    """The policies that read ``setting``, one of `OPTIONAL_SETTINGS`.

    >>> read_by("gpu_budget")
    ('auto',)
    """
    return tuple(name for name, entry in POLICIES.items() if setting in entry.reads)


def ignored_settings(policy: str, names: object) -> list[str]:
    """Which of the settings ``names`` (set by the user) ``policy`` does not read.

    >>> ignored_settings("cpu", ["cpu_fraction", "min_bytes"]), ignored_settings("tokenwise", ["cpu_fraction"])
    (['cpu_fraction'], [])
    """
    reads = spec(policy).reads
    return [name for name in names if name in OPTIONAL_SETTINGS and name not in reads]


def token_fractions(settings: Settings, planned: tuple[float, float] | None) -> tuple[float, float]:
    """Token fractions ``(cpu, nvme)`` a token-wise run stores (the rest is recomputed): under
    ``auto`` the ones its plan gives the run (``planned``), or none while it measures (the
    probe step: Note [measuring at the floor] in actoff.runtime.auto).

    >>> from actoff import Config
    >>> token_fractions(Config(policy="recompute"), None)
    (0.0, 0.0)
    >>> token_fractions(Config(policy="auto"), None), token_fractions(Config(policy="auto"), (0.5, 0.0))
    ((0.0, 0.0), (0.5, 0.0))
    """
    return spec(settings.policy).fractions(settings, planned)


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
    fetch_window: int = 0  # the step's windows in bytes (``prefetch_depth`` 0: they say how far)
    copy_window: int = 0


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
