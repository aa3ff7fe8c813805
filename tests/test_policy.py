"""Policy decisions on plain numbers: tiers, fractions, keep_last, budgets, MEMO's closed form."""

import pytest

from actoff import Config
from actoff.policy import auto_fractions, budget_share, runs_to_place, token_fractions, whole_tier


def test_whole_tier_of_each_policy():
    assert whole_tier(Config(policy="keep")) == "keep"
    assert whole_tier(Config(policy="cpu")) == "cpu"
    assert whole_tier(Config(policy="recompute")) == "cpu"
    assert (
        whole_tier(Config(policy="tokenwise", cpu_fraction=0.0, nvme_fraction=0.5, nvme_dir="/tmp")) == "nvme"
    )


def test_token_fractions_and_placement_order():
    assert token_fractions(Config(policy="tokenwise", cpu_fraction=0.25), None) == (0.25, 0.0)
    assert token_fractions(Config(policy="auto"), None) is None  # first step: measured, stored whole
    assert token_fractions(Config(policy="auto"), _auto()) == (pytest.approx(0.8), 0.0)
    assert [runs_to_place(n, 2) for n in range(5)] == [0, 0, 0, 1, 2]
    assert budget_share(1000, 3) == 333 and budget_share(None, 8) is None


def _auto(**changes):
    values = dict(bandwidth_bytes_per_s=10e9, t_layer_s=0.01, input_bytes=10_000_000, attention_bytes=10_000_000,
                  other_bytes=100_000_000, num_layers=10, host_budget=None, nvme_available=False)  # fmt: skip
    values.update(changes)
    return auto_fractions(**values)


def test_auto_link_bound():
    decision = _auto()  # 10 GB/s x 10 ms = 100 MB per layer; 20 MB fixed; 80 of 100 MB other
    assert decision.cpu_fraction == pytest.approx(0.8) and decision.nvme_fraction == 0
    assert decision.reason == "host link bound"


def test_auto_clips_to_zero_and_one():
    assert _auto(bandwidth_bytes_per_s=1e9).cpu_fraction == 0.0  # link cannot even carry the fixed part
    assert _auto(bandwidth_bytes_per_s=1e12).cpu_fraction == 1.0


def test_auto_budget_bound_and_nvme_spill():
    budget = 8 * 60_000_000  # 60 MB per layer over n - 2 = 8 layers: 40 MB of the other 100 MB
    decision = _auto(host_budget=budget)
    assert decision.cpu_fraction == pytest.approx(0.4) and decision.reason == "host budget bound"
    spill = _auto(host_budget=budget, nvme_available=True)
    assert spill.cpu_fraction == pytest.approx(0.4) and spill.nvme_fraction == pytest.approx(0.4)
    assert "NVMe" in spill.reason
