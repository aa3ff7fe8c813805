"""Policy decisions on plain numbers: tiers, fractions, keep_last, budgets, the host budget's
share of an auto plan."""

import pytest

from actoff import Config
from actoff.policy import budget_share, host_split, runs_to_place, token_fractions, whole_tier


def test_whole_tier_of_each_policy():
    assert whole_tier(Config(policy="keep")) == "keep"
    assert whole_tier(Config(policy="cpu")) == "cpu"
    assert whole_tier(Config(policy="recompute")) == "cpu"
    assert (
        whole_tier(Config(policy="tokenwise", cpu_fraction=0.0, nvme_fraction=0.5, nvme_dir="/tmp")) == "nvme"
    )


def test_token_fractions_and_placement_order():
    assert token_fractions(Config(policy="tokenwise", cpu_fraction=0.25), None) == (0.25, 0.0)
    assert token_fractions(Config(policy="auto"), None) == (0.0, 0.0)  # measuring: recompute
    assert token_fractions(Config(policy="auto"), (0.8, 0.1)) == (0.8, 0.1)  # its plan's
    assert [runs_to_place(n, 2) for n in range(5)] == [0, 0, 0, 1, 2]
    assert budget_share(1000, 3) == 333 and budget_share(None, 8) is None


def _split(stored, **changes):
    values = dict(
        fixed_bytes=20_000_000, other_bytes=100_000_000, host_budget_per_layer=None, nvme_available=False
    )
    values.update(changes)
    return host_split(stored, **values)


def test_a_planned_share_stays_in_host_memory_without_a_host_budget():
    assert _split(0.8) == (0.8, 0.0, "planned")
    assert _split(0.0) == (0.0, 0.0, "planned")


def test_the_host_budget_bounds_the_host_share_and_nvme_takes_the_rest():
    # 60 MB per layer: 40 of the other 100 MB fit beside the 20 MB of inputs and attention.
    cpu, nvme, reason = _split(0.8, host_budget_per_layer=60_000_000)
    assert (cpu, nvme) == (pytest.approx(0.4), 0.0) and "recomputing" in reason
    cpu, nvme, reason = _split(0.8, host_budget_per_layer=60_000_000, nvme_available=True)
    assert (cpu, nvme) == (pytest.approx(0.4), pytest.approx(0.4)) and "NVMe" in reason
    assert _split(0.3, host_budget_per_layer=60_000_000) == (0.3, 0.0, "planned")  # it fits
    assert _split(1.0, host_budget_per_layer=10_000_000)[:2] == (0.0, 0.0)  # not even the fixed part
