"""Re-runs leave no trace (Note [re-runs leave no trace]) and a block's body runs once per
forward call (Note [probe in the first backward]): caches, buffers, attributes and the objects a
block is given are as without actoff, after forward and after backward.

Tolerances: the steps after the probe's recompute rows on a token slice, within
``RECOMPUTE_TOL`` (float32 reassociation, as in test_tokenwise.py); what forward alone computes
(the cache, the statistics a block logs in forward, buffers) is compared bit for bit.
"""

import copy
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from _helpers import RECOMPUTE_TOL, assert_close_history, make_model, tiny_llama, train
from torch import nn

import actoff
from actoff.reference import Block, ModelConfig

# auto's token-wise placements run these same re-runs (tests/runtime/test_auto.py plans
# them under a budget); its checkpoint placement re-runs a block as tests/runtime/test_checkpoint.py
# checks.
POLICIES = [
    {"policy": "tokenwise", "cpu_fraction": 0.5},
    {"policy": "recompute"},
]
POLICY_IDS = ["tokenwise", "recompute"]


def _recomputed(block: str) -> bool:
    return actoff.stats().blocks[block].bytes_per_tier["recompute"] > 0


# ---------------------------------------------------------------------------------- caches
def _llama():
    model = tiny_llama()
    return model, type(model.model.layers[0])


def _cache_tensors(cache):
    return [tensor.clone() for layer in cache.layers for tensor in (layer.keys, layer.values)]


def _assert_same_tensors(actual, expected):
    assert [t.shape for t in actual] == [t.shape for t in expected]
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_a_training_forward_returns_the_cache_it_returns_without_actoff(overrides):
    """``use_cache=True`` is transformers' default: a training forward of 64 tokens returned keys
    of 96 positions (the probe's 32 rows appended), then 128 after backward (the recompute's)."""
    model, layer_cls = _llama()
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=layer_cls, min_bytes=0, **overrides)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):  # the probe's step, then recomputed steps
        tokens = torch.randint(0, 128, (2, 64), generator=generator)
        expected, actual = reference(input_ids=tokens, labels=tokens), model(input_ids=tokens, labels=tokens)
        expected_cache = _cache_tensors(expected.cache)
        _assert_same_tensors(_cache_tensors(actual.cache), expected_cache)  # after forward
        expected.loss.backward()
        actual.loss.backward()
        _assert_same_tensors(_cache_tensors(actual.cache), expected_cache)  # and after backward
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **RECOMPUTE_TOL, msg=name)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert _recomputed("model.layers.0")


@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_a_cache_fed_to_the_next_chunk_holds_the_first_chunks_positions(overrides):
    """Chunk 1's cache fed into chunk 2 handed over 48 positions instead of 32 (wrong loss), and
    backward through the keys a re-run had written raised the unpack hook's NoneType error."""
    model, layer_cls = _llama()
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=layer_cls, min_bytes=0, **overrides)

    def chunked(net, tokens):
        first = net(input_ids=tokens[:, :32], labels=tokens[:, :32], use_cache=True)
        positions = first.cache.get_seq_length()
        second = net(input_ids=tokens[:, 32:], labels=tokens[:, 32:], cache=first.cache, use_cache=True)
        (first.loss + second.loss).backward()
        return positions, second.loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}

    generator = torch.Generator().manual_seed(2)
    for _ in range(3):  # the probe's step, then recomputed steps
        tokens = torch.randint(0, 128, (2, 64), generator=generator)
        positions, loss, grads = chunked(model, tokens)
        expected_positions, expected_loss, expected_grads = chunked(reference, tokens)
        assert positions == expected_positions == 32
        torch.testing.assert_close(loss, expected_loss, **RECOMPUTE_TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], **RECOMPUTE_TOL, msg=name)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert _recomputed("model.layers.0")


# ---------------------------------------------------------------------------------- the objects a block is given
class State:
    """An object a block is given and writes on: a call count, the last statistic."""

    def __init__(self) -> None:
        self.calls = 0
        self.last_mean = None


class GivenObjectsBlock(Block):
    """Writes on everything it is given: an object's attributes, a list, a dictionary."""

    def forward(self, x, cos, sin, state, seen, extras):
        state.calls += 1
        state.last_mean = x.mean().detach()
        seen.append(x.shape[1])
        extras["last"] = x.shape[1]
        return super().forward(x, cos, sin)


class GivenObjectsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()
        self.config = self.inner.config
        self.layers = nn.ModuleList(GivenObjectsBlock(self.config) for _ in range(2))
        self.layers.load_state_dict(self.inner.layers.state_dict())
        self.state, self.seen, self.extras = State(), [], {}

    def loss(self, tokens):
        from actoff.reference import rope_tables

        self.seen.clear()  # what a block is given decides its conditions: the same every step
        self.extras.clear()
        x = self.inner.embed(tokens[:, :-1])
        cos, sin = rope_tables(x.shape[1], self.config.head_dim)
        self.outputs = []
        for layer in self.layers:
            x = layer(x, cos, sin, self.state, self.seen, self.extras)
            self.outputs.append(x.detach().clone())
        logits = self.inner.head(self.inner.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _observed(model):
    return (model.state.calls, model.state.last_mean, list(model.seen), dict(model.extras))


@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_a_blocks_outputs_and_the_objects_it_was_given_are_as_without_actoff(overrides):
    torch.manual_seed(0)
    model = GivenObjectsModel()
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=GivenObjectsBlock, min_bytes=0, **overrides)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 33), generator=generator)
        expected_loss, loss = reference.loss(tokens), model.loss(tokens)
        for actual, expected in zip(model.outputs, reference.outputs, strict=True):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)  # forward alone: exact
        assert _observed(model) == _observed(reference)  # after forward
        expected_loss.backward()
        loss.backward()
        assert _observed(model) == _observed(reference)  # and after backward
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **RECOMPUTE_TOL, msg=name)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert _recomputed("layers.0")


# ---------------------------------------------------------------------------------- buffers
class BufferBlock(Block):
    """A token-local block that writes buffers in training mode: a call counter and a running
    mean of its MLP's input (as BatchNorm's running statistics), read in eval mode only."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("running_mean", torch.zeros(config.hidden_size))

    def forward(self, x, cos, sin):
        out = super().forward(x, cos, sin)
        if self.training:
            self.calls += 1
            self.running_mean.mul_(0.9).add_(out.detach().mean((0, 1)), alpha=0.1)
            return out
        return out - self.running_mean


class BatchNormBlock(Block):
    """A BatchNorm over the hidden features at the block's end. Its statistics mix the tokens, but
    what the block saves before it is token-local and what it saves itself (the batch statistics)
    has no token dimension: the block is recomputed token-wise, and its re-runs must not count
    as batches."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.norm = nn.BatchNorm1d(config.hidden_size)

    def forward(self, x, cos, sin):
        out = super().forward(x, cos, sin)
        return self.norm(out.reshape(-1, out.shape[-1])).reshape(out.shape)


def _blocks_model(block_cls):
    torch.manual_seed(0)
    model = make_model()
    blocks = nn.ModuleList(block_cls(model.config) for _ in model.layers)
    blocks.load_state_dict(model.layers.state_dict(), strict=False)
    model.layers = blocks
    return model


@pytest.mark.parametrize("block_cls", [BufferBlock, BatchNormBlock], ids=["counter_and_mean", "batch_norm"])
@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_buffers_and_eval_outputs_are_as_without_actoff(block_cls, overrides):
    model = _blocks_model(block_cls)
    reference = copy.deepcopy(model)
    expected = train(reference, 3)
    actoff.offload_(model, block_cls=block_cls, min_bytes=0, **overrides)
    actual = train(model, 3)
    assert_close_history(expected, actual)
    for (name, buffer), other in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buffer, other, rtol=0, atol=0, msg=name)
    counter = (
        model.layers[0].norm.num_batches_tracked if block_cls is BatchNormBlock else model.layers[0].calls
    )
    assert int(counter) == 3 and _recomputed("layers.0")  # was 4 (the probe counted), then more
    model.eval()
    reference.eval()
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(model.loss(tokens), reference.loss(tokens), rtol=0, atol=0)


class QuietWritesBlock(Block):
    """State written so that no version counter sees it: a buffer through ``.data`` (an EMA), and
    a counter held as a plain tensor attribute, written in place."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.register_buffer("ema", torch.zeros(config.hidden_size))
        self.tally = torch.zeros(())

    def forward(self, x, cos, sin):
        out = super().forward(x, cos, sin)
        self.ema.data.mul_(0.9).add_(out.detach().mean((0, 1)), alpha=0.1)
        self.tally += 1
        return out


@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_writes_no_version_counter_sees_are_given_back(overrides):
    """(Review of issue 28) buffers were given back when their version changed: one written
    through ``.data`` kept the re-runs' values, and a tensor attribute kept their counts."""
    model = _blocks_model(QuietWritesBlock)
    reference = copy.deepcopy(model)
    expected = train(reference, 3)
    actoff.offload_(model, block_cls=QuietWritesBlock, min_bytes=0, **overrides)
    assert_close_history(expected, train(model, 3))
    assert _recomputed("layers.0")
    for layer, other in zip(model.layers, reference.layers, strict=True):
        torch.testing.assert_close(layer.ema, other.ema, rtol=0, atol=0)
        assert float(layer.tally) == float(other.tally) == 3


@pytest.mark.parametrize("closed_over", [False, True], ids=["module_as_argument", "closed_over"])
def test_a_function_scope_gives_back_the_state_of_the_modules_it_ran(closed_over):
    """(Review of issue 28) a function scope restored no module: a BatchNorm it ran counted every
    re-run as a batch. Its forward now notes the modules it runs."""
    from actoff.reference import rope_tables

    def run_layer(layer, x, cos, sin):
        return layer(x, cos, sin)

    def steps(model, call):
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(0, 256, (2, 33), generator=generator)
            x = model.embed(tokens[:, :-1])
            cos, sin = rope_tables(32, model.config.head_dim)
            for layer in model.layers:
                x = call(layer, x, cos, sin)
            model.head(model.norm(x)).logsumexp(-1).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    model = _blocks_model(BatchNormBlock)
    reference = copy.deepcopy(model)
    expected = steps(reference, run_layer)
    if closed_over:
        scopes = {
            id(layer): actoff.offload(
                lambda x, c, s, layer=layer: layer(x, c, s), policy="recompute", min_bytes=0
            )
            for layer in model.layers
        }
        grads = steps(model, lambda layer, x, c, s: scopes[id(layer)](x, c, s))
    else:
        grads = steps(model, actoff.offload(run_layer, policy="recompute", min_bytes=0))
    assert any(block.bytes_per_tier["recompute"] > 0 for block in actoff.stats().blocks.values())
    for (name, buffer), other in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buffer, other, rtol=0, atol=0, msg=name)
    for actual, wanted in zip(grads, expected, strict=True):
        torch.testing.assert_close(actual, wanted, **RECOMPUTE_TOL)


# ---------------------------------------------------------------------------------- auxiliary losses, logged statistics
class AuxLossBlock(Block):
    """A mixture of experts' habits: an auxiliary loss appended to a list on the model
    (``aux_losses``) and one stored on the block (``self.l_aux``, DeepSpeed-MoE's pattern), both
    summed into the loss after forward; a statistic logged on the block in forward."""

    def __init__(self, config: ModelConfig, aux_losses: list) -> None:
        super().__init__(config)
        self.aux_losses = aux_losses

    def forward(self, x, cos, sin):
        out = super().forward(x, cos, sin)
        self.aux_losses.append(1e-2 * out.pow(2).mean())
        self.l_aux = 1e-2 * out.abs().mean()
        self.logged_norm = out.detach().norm()
        return out


def _aux_model():
    torch.manual_seed(0)
    model = make_model()
    model.aux_losses = []
    blocks = nn.ModuleList(AuxLossBlock(model.config, model.aux_losses) for _ in model.layers)
    blocks.load_state_dict(model.layers.state_dict())
    model.layers = blocks
    return model


def _aux_steps(model, steps=3):
    """Train ``steps`` steps on the loss plus both auxiliary losses; per step the loss and the
    gradients, and what was seen: entries in the list after forward and after backward, the
    statistic logged in forward and what the block holds after backward."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    history, seen = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 33), generator=generator)
        model.aux_losses.clear()
        loss = model.loss(tokens)
        counted = len(model.aux_losses)
        loss = loss + sum(model.aux_losses) + sum(layer.l_aux for layer in model.layers)
        logged = [layer.logged_norm.clone() for layer in model.layers]
        loss.backward()
        kept = [layer.logged_norm.clone() for layer in model.layers]
        seen.append((counted, len(model.aux_losses), logged, kept))
        history.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history, seen


@pytest.mark.parametrize("overrides", POLICIES, ids=POLICY_IDS)
def test_auxiliary_losses_and_logged_statistics_are_the_forwards(overrides):
    """The probe ran the body twice in the first forward: the list held 4 entries, the logged
    statistic was the probe's, and backward through the probe's ``self.l_aux`` raised the unpack
    hook's NoneType error."""
    model = _aux_model()
    reference = copy.deepcopy(model)
    expected, expected_seen = _aux_steps(reference)
    actoff.offload_(model, block_cls=AuxLossBlock, min_bytes=0, **overrides)
    actual, seen = _aux_steps(model)
    assert_close_history(expected, actual)
    for step, ((counted, after, logged, kept), (counted_ref, after_ref, logged_ref, _)) in enumerate(
        zip(seen, expected_seen, strict=True)
    ):
        assert counted == after == counted_ref == after_ref == 2, step  # the body ran once per call
        for value, held, expected_value in zip(logged, kept, logged_ref, strict=True):
            # The forward's statistic after forward and after backward; within reassociation from
            # the second step on (the weights come from recomputed gradients).
            torch.testing.assert_close(held, value, rtol=0, atol=0)
            torch.testing.assert_close(value, expected_value, **RECOMPUTE_TOL)
    assert _recomputed("layers.0")


# ---------------------------------------------------------------------------------- left_as_found
def test_left_as_found_gives_back_attributes_lists_and_buffers():
    from actoff.rerun.isolation import left_as_found

    module = nn.BatchNorm1d(2)
    module.history = [1]
    given = State()
    with left_as_found(module, [given, 3, None]):
        module(torch.randn(4, 2))
        module.history.append(2)
        module.new = 1
        given.calls = 5
    assert int(module.num_batches_tracked) == 0 and module.running_mean.abs().sum() == 0
    assert module.history == [1] and not hasattr(module, "new") and given.calls == 0


def test_left_as_found_gives_back_the_values_of_tensors_held_in_a_list_or_a_dictionary():
    """A scale kept in a list, halved in place by each run: the runs again in a chunked backward
    halved it once more each (before: only the list's items were compared, by identity), and the
    next step's forward read a quarter of it instead of a half."""
    from actoff.rerun.isolation import left_as_found

    module = nn.Linear(2, 2)
    module.scales, module.stats = [torch.ones(1)], {"sum": torch.zeros(2)}
    with left_as_found(module, []):
        module.scales[0].mul_(0.5)
        module.stats["sum"] += 1
    assert module.scales[0].item() == 1 and module.stats["sum"].tolist() == [0, 0]


# ---------------------------------------------------------------------------------- once per call
class CountedBlock(Block):
    """Counts its body's runs in a list it closes over (a side effect outside the block's modules,
    which a re-run in backward repeats, as torch's checkpoint's does)."""

    runs: ClassVar[list] = []

    def forward(self, x, cos, sin):
        CountedBlock.runs.append(torch.is_grad_enabled())
        return super().forward(x, cos, sin)


@pytest.mark.parametrize("overrides", POLICIES[:2], ids=POLICY_IDS[:2])
def test_a_blocks_body_runs_once_per_forward_call(overrides):
    """(Note [probe in the first backward]) The probe re-ran every block in the first forward."""
    model = _blocks_model(CountedBlock)
    actoff.offload_(model, block_cls=CountedBlock, min_bytes=0, **overrides)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        CountedBlock.runs.clear()
        loss = model.loss(torch.randint(0, 256, (2, 33), generator=generator))
        assert len(CountedBlock.runs) == len(model.layers), step  # once per call in forward
        loss.backward()
        # In backward one re-run per block: the probe's (step 0), then the recompute's.
        assert len(CountedBlock.runs) == 2 * len(model.layers), step
    assert actoff.stats().blocks["layers.0"].probes == 0 and _recomputed("layers.0")
