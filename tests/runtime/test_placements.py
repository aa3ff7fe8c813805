"""Placements behind one seam (Note [placements], Note [the policy table]): a policy is an entry
of the policy table and a placement class; the runtime drives every run along one path."""

from typing import ClassVar

import pytest
import torch
from _helpers import assert_same_history, make_model, train

import actoff
from actoff.policy import PolicySpec, policy_names
from actoff.reference import Block
from actoff.runtime.placements import Placement, placement_class, register, unregister
from actoff.runtime.runtime import get_runtime
from actoff.tiers.record import State


class EveryOther(Placement):
    """A toy placement: every other record of a run kept on the device, the rest on the
    policy's tier; it counts the hooks the runtime called."""

    name = "every-other"
    stores_whole = False  # it chooses per record, at placement
    calls: ClassVar[list[str]] = []

    def seal(self) -> list[object]:
        EveryOther.calls.append("seal")
        return []

    def place(self) -> None:
        EveryOther.calls.append("place")
        for record in self.run.records[1::2]:
            if record.state is State.RESIDENT:
                self.tier.place(record)

    def reached(self) -> None:
        EveryOther.calls.append("reached")

    def backward_ended(self) -> None:
        EveryOther.calls.append("backward_ended")


@pytest.fixture
def every_other():
    EveryOther.calls = []
    register(PolicySpec("every-other", placement="every-other", tier="cpu"), EveryOther)
    try:
        yield EveryOther
    finally:
        unregister("every-other")


@pytest.mark.sim_device  # the cpu tier copies on the simulated device: the bytes really move
def test_a_policy_added_from_outside_trains_exactly(every_other):
    assert "every-other" in policy_names() and placement_class("every-other") is EveryOther
    reference = make_model()
    expected = train(reference, 2)
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="every-other", min_bytes=0)
    actual = train(model, 2)
    assert_same_history(expected, actual)  # bit for bit: nothing is recomputed
    stats = actoff.stats()
    for block in stats.blocks.values():
        kept, stored = block.bytes_per_tier["keep"], block.bytes_per_tier["cpu"]
        assert kept > 0 and stored > 0 and kept + stored == block.bytes_saved
    blocks = len(model.layers)
    assert every_other.calls.count("seal") == 2 * blocks
    assert every_other.calls.count("place") == 2 * blocks
    assert every_other.calls.count("reached") == 2 * blocks
    assert every_other.calls.count("backward_ended") == 2 * blocks
    assert all(isinstance(run.placement, EveryOther) for run in get_runtime().step.runs)


def test_a_policy_cannot_take_a_name_or_a_tier_that_is_not_its_own(every_other):
    with pytest.raises(ValueError, match="already in the table"):
        register(PolicySpec("cpu", placement="whole", tier="cpu"))
    with pytest.raises(ValueError, match="tier 'disk'"):
        register(PolicySpec("disk", placement="whole", tier="disk"))
    with pytest.raises(ValueError, match="not registered"):
        register(PolicySpec("nowhere", placement="nowhere", tier="cpu"))
    with pytest.raises(TypeError, match="derives from"):
        register(PolicySpec("odd", placement="odd", tier="cpu"), object)
    with pytest.raises(ValueError, match="built in"):
        unregister("cpu")


def test_an_unregistered_policy_is_refused_by_name(every_other):
    unregister("every-other")
    with pytest.raises(ValueError, match="every-other"):
        actoff.Config(policy="every-other")
    register(PolicySpec("every-other", placement="every-other", tier="cpu"), EveryOther)  # for the fixture


def test_a_compiled_body_gets_the_whole_tier_placement_of_a_policy_that_runs_the_block_again():
    """Without the call (a compiled body) a placement that re-runs the block cannot run it: the
    runtime gives the run the policy's whole-tier placement instead."""
    runtime = get_runtime()
    model = make_model()
    for policy, expected in (
        ("checkpoint", "whole"),
        ("recompute", "whole"),
        ("keep", "keep"),
        ("cpu", "whole"),
    ):
        config = actoff.Config(policy=policy, min_bytes=0)
        run = runtime.enter_scope("block", config, model.layers[0], torch.device("cpu"))
        try:
            assert run.placement.name == expected, policy
        finally:
            runtime.exit_scope(run, failed=True)
    actoff.reset()


# ------------------------------------------------- Note [no silent downgrade] (issue 38, item 2)
class _Pooled(torch.nn.Module):
    """A block whose saves have no token dimension: it pools over the tokens first."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x.mean(dim=1, keepdim=True))))


class _Flat(torch.nn.Module):
    """A block whose input has no token dimension at all (one vector per call)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize(
    ("block", "shape", "why"),
    [
        (_Pooled, (2, 64, 32), "no saved tensor has a token dimension"),
        (_Flat, (32,), "its first input has no token dimension"),
    ],
)
def test_a_recompute_policy_that_recomputes_nothing_says_so_per_block(block, shape, why):
    """``recompute`` on blocks it cannot split stores them whole: gradients exact, one warning,
    and every step's statistics and report name each block and why (it was a warning, once,
    and then nothing a log of the statistics would show)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(block(), block())
    reference = torch.nn.Sequential(block(), block())
    reference.load_state_dict(model.state_dict())
    actoff.offload_(model, block_cls=block, policy="recompute", min_bytes=0)
    x = torch.randn(*shape)
    with pytest.warns(RuntimeWarning, match=why):
        model(x).sum().backward()
    for _ in range(2):  # later steps: no new warning, the statistics still say it
        model(x).sum().backward()
        blocks = actoff.stats().blocks
        assert set(blocks) == {"0", "1"}
        assert all(why in b.stored_whole and b.bytes_per_tier["recompute"] == 0 for b in blocks.values())
    assert "recomputed nothing, stored whole" in str(actoff.report())
    reference(x).sum().backward()
    reference(x).sum().backward()
    reference(x).sum().backward()
    for actual, wanted in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, wanted.grad, rtol=0, atol=0)  # same kernels, same shapes


def test_a_block_recomputed_as_asked_says_nothing():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="recompute", min_bytes=0)
    for _ in range(2):
        model.loss(torch.randint(0, 256, (2, 33))).backward()
    blocks = actoff.stats().blocks
    assert blocks and all(b.stored_whole == "" and b.bytes_per_tier["recompute"] > 0 for b in blocks.values())
    assert actoff.report().stored_whole is None
