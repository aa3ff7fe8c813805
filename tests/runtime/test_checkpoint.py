"""The checkpoint placement: only a block's inputs stored, the block run again in backward.

The recompute runs the same kernels on the same shapes as the forward, so losses and every
gradient equal a run without actoff bit for bit (Note [offloaded checkpoint]).
"""

import copy

import pytest
import torch
from _helpers import assert_same_history, make_model, train
from torch import nn

import actoff
from actoff.reference import Block
from actoff.testing import simulated_device


def _checkpointed(model, **settings):
    actoff.offload_(model, block_cls=Block, policy="checkpoint", min_bytes=0, **settings)
    return model


def test_losses_and_every_gradient_equal_a_run_without_actoff():
    model = make_model(num_layers=3)
    expected = train(copy.deepcopy(model), 3)
    assert_same_history(expected, train(_checkpointed(model), 3))


def test_only_the_inputs_are_stored_and_on_the_host():
    model = _checkpointed(make_model(num_layers=2))
    train(model, 1, seq=33)
    stats = actoff.stats()
    for block in stats.blocks.values():
        assert block.tensors == 3  # the hidden states and the rotary tables, nothing of the body
        assert block.bytes_per_tier["cpu"] == block.bytes_saved > 0
        assert block.bytes_per_tier["keep"] == 0


@pytest.mark.parametrize("seed", [0, 3])
def test_on_an_asynchronous_device_it_is_exact_and_holds_less_than_keep(seed):
    model = make_model(num_layers=4)
    expected = train(copy.deepcopy(model), 2, seq=129)  # activations above the logits and weights
    peaks = {}
    for policy, net in (("keep", copy.deepcopy(model)), ("checkpoint", model)):
        actoff.offload_(net, block_cls=Block, policy=policy, min_bytes=0)
        with simulated_device(seed=seed) as device:
            history = train(net, 2, seq=129)
            peaks[policy] = device.memory.peak
        assert_same_history(expected, history)
        actoff.reset()
    assert peaks["checkpoint"] < peaks["keep"]


def test_parameters_get_gradients_when_no_input_requires_grad():
    """A frozen embedding before the blocks: reentrant checkpointing alone would skip the
    blocks' backward and leave their weights without gradients, silently."""
    model = make_model(num_layers=2)
    model.embed.weight.requires_grad_(False)
    expected = train(copy.deepcopy(model), 2)
    actual = train(_checkpointed(model), 2)
    assert_same_history(expected, actual)
    assert "embed.weight" not in actual[0][1]
    assert all(grad is not None for grad in actual[0][1].values())  # every block weight has one


class MaskedBlock(nn.Module):
    """A block with a tensor keyword argument and dropout: both must come back the same."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.dropout = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.tanh(self.linear(x))) * scale


def _masked_history(offloaded: bool) -> list:
    torch.manual_seed(0)
    blocks = nn.ModuleList(MaskedBlock() for _ in range(2))
    if offloaded:
        actoff.offload_(blocks, block_cls=MaskedBlock, policy="checkpoint", min_bytes=0)
    scale = torch.linspace(0.5, 1.5, 16, requires_grad=True)
    optimizer = torch.optim.SGD([*blocks.parameters(), scale], lr=0.1)
    history = []
    for step in range(2):
        torch.manual_seed(100 + step)
        x = torch.randn(2, 8, 16, requires_grad=True)
        for block in blocks:
            x = block(x, scale=scale)
        loss = x.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in blocks.named_parameters()}
        grads["scale"] = scale.grad.clone()
        history.append((loss.detach(), grads))
        optimizer.step()
    return history


def test_keyword_tensors_and_dropout_come_back_the_same():
    assert_same_history(_masked_history(False), _masked_history(True))
