"""Scopes under activation checkpointing (Note [under checkpointing]): inside torch's checkpoint
(reentrant or not) or another saved-tensor hooks context a scope passes through with one
warning and checkpoint recomputes as without actoff; a checkpoint inside the scope composes:
actoff places the inputs checkpoint keeps, and token-wise policies store those only, warned.

Every run is compared bit for bit with the same checkpointed model without actoff: nothing is
recomputed on fewer rows.
"""

import copy
import functools
import warnings

import pytest
import torch
from _helpers import assert_same_history, make_model, train
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import actoff
from actoff.reference import MLP, Block

IMPLS = [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT]
IMPL_IDS = ["non_reentrant", "reentrant"]


@pytest.fixture
def mlp_runs(monkeypatch):
    """How many times the MLPs ran (forward and recompute): 2 a step for 2 blocks without
    checkpointing, 4 with it."""
    runs = []
    forward = MLP.forward

    def counted(self, x):
        runs.append(x.shape)
        return forward(self, x)

    monkeypatch.setattr(MLP, "forward", counted)
    return runs


def _checkpointed(model, impl):
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block)
    )
    return model


def _fractions(policy: str) -> dict:
    return {"cpu_fraction": 0.5} if policy == "tokenwise" else {}  # read by tokenwise only


def _actoff_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("actoff")]


@pytest.mark.parametrize("policy", ["cpu", "tokenwise"])
@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_a_scope_inside_torch_checkpoint_leaves_its_block_to_checkpoint_with_one_warning(
    impl, policy, mlp_runs
):
    """Non-reentrant: actoff's hooks inside took every saved tensor from checkpoint, which then
    recomputed nothing (MLPs ran 2 times a step, not 4) and actoff held the whole block, silently.
    Reentrant: every recompute in backward was a scope run of its own, and a step
    (``stats().steps`` was 6 after 3 steps)."""
    model = make_model()
    expected = train(_checkpointed(copy.deepcopy(model), impl), 3)
    actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0, **_fractions(policy))
    _checkpointed(model, impl)
    mlp_runs.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(model, 3)
    assert_same_history(expected, actual)
    assert len(mlp_runs) == 3 * 4  # checkpoint recomputes every block in backward
    messages = _actoff_warnings(caught)
    assert len(messages) == 1, messages
    where = "during backward" if impl is CheckpointImpl.REENTRANT else "inside torch.utils.checkpoint"
    assert where in messages[0] and "block_cls=CheckpointWrapper" in messages[0]
    stats = actoff.stats()
    assert stats.steps == 0 and stats.blocks == {}  # actoff ran no scope: none is counted


@pytest.mark.parametrize("policy", ["cpu", "tokenwise", "recompute"])
@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_a_checkpoint_inside_the_scope_offloads_the_inputs_it_keeps(impl, policy, mlp_runs):
    """The checkpointed module as the scope: checkpoint saves the block's inputs through actoff's
    hooks, which place them (offloaded checkpointing). Token-wise policies store those inputs only
    (before: their inputs and attention outputs, most of them never read back), and say so."""
    model = make_model()
    expected = train(_checkpointed(copy.deepcopy(model), impl), 3)
    _checkpointed(model, impl)
    actoff.offload_(model, block_cls=CheckpointWrapper, policy=policy, min_bytes=0, **_fractions(policy))
    mlp_runs.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(model, 3)
    assert_same_history(expected, actual)
    assert len(mlp_runs) == 3 * 4
    stats = actoff.stats()
    assert stats.steps == 3  # the user's steps, not one per recompute
    inputs = 2 * 32 * 64 * 4 + 2 * 32 * 16 * 4  # x (2, 32, 64), cos and sin (32, 16): float32
    for block in stats.blocks.values():
        assert block.bytes_offloaded == block.bytes_per_tier["cpu"] == inputs
        assert block.bytes_per_tier["recompute"] == 0
    messages = _actoff_warnings(caught)
    if policy == "cpu":
        assert messages == []
    else:
        assert len(messages) == 1 and "recomputes nothing token-wise" in messages[0], messages
        assert "torch.utils.checkpoint" in messages[0]


def test_a_scope_inside_save_on_cpu_is_left_to_it():
    model = make_model()
    reference = copy.deepcopy(model)
    with torch.autograd.graph.save_on_cpu():
        expected = train(reference, 2)
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    warned = pytest.warns(RuntimeWarning, match="inside torch.autograd.graph.save_on_cpu")
    with warned as caught, torch.autograd.graph.save_on_cpu():
        actual = train(model, 2)
    assert len(_actoff_warnings(caught)) == 1
    assert_same_history(expected, actual)
    assert actoff.stats().blocks == {}


def test_enclosing_names_the_context():
    from actoff.runtime.enclosing import enclosing, hooks_kind

    assert enclosing() is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert enclosing().startswith("a saved-tensor hooks context")
    seen = []

    def body(x):
        seen.append(enclosing())
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False).sum().backward()
    torch.utils.checkpoint.checkpoint(body, x, use_reentrant=True).sum().backward()
    assert seen == [
        "torch.utils.checkpoint (non-reentrant)",
        "torch.utils.checkpoint's recompute in backward",
        None,  # the reentrant forward: no hooks, grad off
        "during backward",
    ]
    assert hooks_kind(print).startswith("a saved-tensor hooks context (builtins.print")
