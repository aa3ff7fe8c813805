"""actoff on an unmodified Hugging Face Llama (tiny random config: nothing is downloaded)."""

import copy
import warnings

import pytest
import torch
from _helpers import NO_CACHE, assert_same_history, tiny_llama

import actoff

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")


def _model():
    return tiny_llama(**NO_CACHE)


def _train(model, steps=3):
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 48), generator=generator)
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        history.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history


@pytest.mark.parametrize(
    ("overrides", "exact"),
    [
        ({"policy": "cpu"}, True),
        ({"policy": "nvme"}, True),
        ({"policy": "tokenwise", "cpu_fraction": 0.5}, False),
        ({"policy": "recompute"}, False),
    ],
)
def test_llama_decoder_layers(overrides, exact, nvme_dir):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = _model()
    reference = copy.deepcopy(model)
    expected = _train(reference)
    actoff.offload_(model, block_cls=LlamaDecoderLayer, min_bytes=0, nvme_dir=nvme_dir, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: the layers are recomputed token-wise
        actual = _train(model)
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, actual, strict=True):
        torch.testing.assert_close(loss_b, loss_a, **tolerance)
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], **tolerance)
    stats = actoff.stats()
    assert set(stats.blocks) == {"model.layers.0", "model.layers.1"}
    if overrides["policy"] in ("tokenwise", "recompute"):
        assert stats.blocks["model.layers.0"].bytes_per_tier["recompute"] > 0


@pytest.mark.parametrize("policy", ["cpu", "tokenwise", "recompute"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_llama_gradient_checkpointing_offloads_the_layer_inputs(reentrant, policy):
    """Hugging Face checkpoints each layer's ``forward``, inside actoff's scope: checkpoint saves
    the layer's input through actoff, which places it (Note [under checkpointing]). Token-wise
    policies store the inputs only, with one warning; before, they also stored every attention
    output, which nothing read back (TRL turns checkpointing on by default)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = _model()
    reference = copy.deepcopy(model)
    for net in (model, reference):
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    expected = _train(reference)
    fractions = {"cpu_fraction": 0.5} if policy == "tokenwise" else {}  # read by tokenwise only
    actoff.offload_(model, block_cls=LlamaDecoderLayer, min_bytes=0, policy=policy, **fractions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = _train(model)
    assert_same_history(expected, actual)
    stats = actoff.stats()
    assert stats.steps == 3
    hidden_states = 2 * 48 * 64 * 4  # (B, S, H) float32: all that is placed
    for block in stats.blocks.values():
        assert block.bytes_offloaded == block.bytes_per_tier["cpu"] == hidden_states
    messages = [str(w.message) for w in caught if str(w.message).startswith("actoff")]
    assert len(messages) == (0 if policy == "cpu" else 1), messages


def _hf_offload(model, every_n_layers, monkeypatch):
    """Hugging Face's own offloaded checkpointing (transformers 5: ``save_on_cpu(pin_memory=True)``
    around a non-reentrant checkpoint of every ``every_n_layers``-th layer's forward)."""
    import inspect

    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None or "offload" not in inspect.signature(enable).parameters:
        pytest.skip(
            f"transformers {transformers.__version__} has no activation_checkpointing_enable(offload=)"
        )
    if not torch.accelerator.is_available():
        # Without an accelerator it still asks save_on_cpu to pin, and pinning raises ("requires a
        # CUDA or other accelerator backend"); pinning alone is left out, its code path kept.
        import transformers.modeling_utils as modeling_utils

        unpinned = torch.autograd.graph.save_on_cpu
        monkeypatch.setattr(
            modeling_utils, "save_on_cpu", lambda **kw: unpinned(device_type=kw["device_type"])
        )
    enable(offload=True, every_n_layers=every_n_layers)


@pytest.mark.parametrize(
    ("block_cls", "placed", "warned"),
    [
        # actoff around Hugging Face's checkpointing: each layer is actoff's scope, and in the
        # checkpointed ones (0, 2) save_on_cpu, inside the scope, takes checkpoint's inputs.
        ("LlamaDecoderLayer", {"model.layers.1", "model.layers.3"}, None),
        # Hugging Face's offload enclosing actoff's scopes: the MLPs of layers 0 and 2 run inside
        # its checkpoint, which gets their saves (Note [under checkpointing]), with one warning.
        ("LlamaMLP", {"model.layers.1.mlp", "model.layers.3.mlp"}, "inside torch.utils.checkpoint"),
    ],
    ids=["actoff_around_hf", "hf_around_actoff"],
)
def test_hugging_faces_offloaded_checkpointing_composes_both_ways(block_cls, placed, warned, monkeypatch):
    """Issue 38 (item 5): ``activation_checkpointing_enable(offload=True, every_n_layers=2)``
    checkpoints layers 0 and 2 with their inputs on the host; actoff places what is left to it,
    bit for bit, and `actoff.stats` shows only what actoff placed."""
    model = tiny_llama(num_hidden_layers=4, **NO_CACHE)
    reference = copy.deepcopy(model)
    for net in (model, reference):
        _hf_offload(net, every_n_layers=2, monkeypatch=monkeypatch)
    expected = _train(reference)
    actoff.offload_(model, block_cls=block_cls, policy="cpu", min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = _train(model)
    assert_same_history(expected, actual)
    messages = [str(w.message) for w in caught if str(w.message).startswith("actoff")]
    assert len(messages) == (0 if warned is None else 1), messages
    assert warned is None or warned in messages[0]
    stats = actoff.stats()
    offloaded = {name for name, block in stats.blocks.items() if block.bytes_offloaded}
    assert offloaded == placed
    for name in placed:
        assert stats.blocks[name].bytes_per_tier["cpu"] == stats.blocks[name].bytes_saved > 0
