"""Token plans: the key of the conditions that decide what a block saves, plans held per module by
identity, forgotten when the module dies (Note [probes per module and conditions]), and a probe
of one length serving the others (Note [a probe serves other lengths])."""

import gc

import pytest
import torch
from torch import nn

from actoff.owners import ByOwner
from actoff.rerun.conditions import conditions
from actoff.rerun.state import autocast_state
from actoff.tiers.tokenwise.probes import ProbeResult, transferred
from actoff.tiers.tokenwise.tokens import Canon

CPU = torch.device("cpu")


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 8))


def _key(x: torch.Tensor, module: nn.Module | None = None, *extra, grad: bool = True) -> tuple:
    return conditions([x, *extra], None, module, grad, autocast_state(CPU))


def test_same_metadata_is_the_same_key_whatever_the_values():
    block = _block()
    assert _key(torch.zeros(2, 16, 8), block) == _key(torch.randn(2, 16, 8), block)


@pytest.mark.parametrize(
    "change",
    ["batch", "length", "dtype", "strides", "requires_grad", "autocast", "grad_mode", "flag", "plain_value"],
)
def test_what_changes_the_saves_changes_the_key(change):
    block = _block()
    x = torch.zeros(2, 16, 8)
    key = _key(x, block, True)
    if change == "batch":  # a smaller last batch
        other = _key(torch.zeros(1, 16, 8), block, True)
    elif change == "length":
        other = _key(torch.zeros(2, 17, 8), block, True)
    elif change == "dtype":
        other = _key(x.double(), block, True)
    elif change == "strides":
        other = _key(torch.zeros(16, 2, 8).transpose(0, 1), block, True)
    elif change == "requires_grad":
        other = _key(x.clone().requires_grad_(), block, True)
    elif change == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            other = _key(x, block, True)
    elif change == "grad_mode":
        other = _key(x, block, True, grad=False)
    elif change == "flag":
        other = _key(x, block, False)
    else:
        assert change == "plain_value"
        other = _key(x, block, 3)
    assert other != key


@pytest.mark.parametrize("change", ["dropout_eval", "frozen", "dtype"])
def test_module_state_that_changes_the_saves_changes_the_key(change):
    block = _block()
    x = torch.zeros(2, 16, 8)
    key = _key(x, block)
    if change == "dropout_eval":
        block[1].eval()  # one submodule: the block itself still trains
    elif change == "frozen":
        block[0].requires_grad_(False)  # a frozen base: its input is not saved for a weight grad
    else:
        block.double()
    assert _key(x, block) != key


def test_other_inputs_count_by_type_when_not_plain():
    class Cache:
        pass

    x = torch.zeros(2, 16, 8)
    assert _key(x, None, Cache()) == _key(x, None, Cache())
    assert _key(x, None, Cache()) != _key(x, None, None)


def test_entries_go_with_their_owner():
    plans = ByOwner()
    first, second = _block(), _block()
    plans.put(first, "first")
    plans.put(second, "second")
    assert (plans.get(first), plans.get(second), len(plans)) == ("first", "second", 2)
    del first
    gc.collect()
    assert len(plans) == 1 and plans.get(second) == "second"
    assert plans.setdefault(second, lambda: "other") == "second"


def test_owners_count_by_identity_not_equality():
    class EqualToAll(nn.Module):  # defines __eq__, so it is unhashable too
        def __eq__(self, other):
            return True

    plans = ByOwner()
    first, second = EqualToAll(), EqualToAll()
    plans.put(first, "first")
    assert plans.get(second) is None
    assert plans.setdefault(second, lambda: "second") == "second"
    assert plans.get(first) == "first"


def test_owners_without_weak_references_are_held():
    plans = ByOwner()
    owner = len  # a builtin takes no weak reference
    plans.put(owner, "held")
    assert plans.get(len) == "held" and len(plans) == 1


# ---------------------------------------------------------------------------------- other lengths
def _probed_at(seq_len: int) -> ProbeResult:
    view = ((2, seq_len, 8), (8 * seq_len, 8, 1))
    saves = ((0, -1), ((view[0], view[1], torch.float32, False),), 1)
    return ProbeResult({0: Canon(view[0], view[1], 1)}, saves)


def test_a_probe_serves_a_forward_that_differs_by_its_length_only():
    """(Note [a probe serves other lengths])"""
    probed, other = _probed_at(16), _probed_at(24)
    views = {0: ((other.saves[1][0][0], other.saves[1][0][1]), None)}
    assert transferred(probed, other.saves, views, 24).canons == other.canons


@pytest.mark.parametrize("change", ["events", "dtype", "rank", "another_dimension", "mixer_calls"])
def test_a_probe_of_another_length_does_not_serve_other_saves(change):
    probed = _probed_at(16)
    events, ((size, stride, dtype, whole),), mixers = _probed_at(24).saves
    if change == "events":
        events = (0, 0)
    elif change == "dtype":
        dtype = torch.bfloat16
    elif change == "rank":
        size, stride = (48, 8), (8, 1)
    elif change == "another_dimension":  # the batch changed too
        size, stride = (3, 24, 8), (192, 8, 1)
    else:
        mixers = 2
    saves = (events, ((size, stride, dtype, whole),), mixers)
    assert transferred(probed, saves, {0: ((size, stride), None)}, 24) is None
