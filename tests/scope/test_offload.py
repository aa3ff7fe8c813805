"""offload on a class, an instance or a function; offload_ in place; errors and pass-through."""

import copy
import gc
import warnings

import pytest
import torch
from _helpers import assert_same_history, make_model, train

import actoff
import actoff.scope.offload
from actoff.reference import Block


def test_decorating_a_class_makes_every_instance_a_scope():
    @actoff.offload(policy="cpu", min_bytes=0)
    class Tanh(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.linear(x).tanh()

    first, second = Tanh(), Tanh()
    x = torch.randn(8, 16, requires_grad=True)
    second(first(x)).sum().backward()
    assert set(actoff.stats().blocks) == {"Tanh#0", "Tanh#1"}
    assert actoff.stats().total_bytes_offloaded > 0
    # Names are per instance and go with it: a later instance gets a new one, never a dead
    # instance's (its id may be reused), and the class keeps no entry for the dead.
    names = Tanh.forward.__actoff_scope__._names
    assert len(names) == 2
    del first, second
    gc.collect()
    assert len(names) == 0
    Tanh()(x).sum().backward()
    assert set(actoff.stats().blocks) == {"Tanh#2"}


def test_bare_decorator_without_arguments_uses_the_global_config():
    actoff.set_config(policy="cpu", min_bytes=0)

    @actoff.offload
    class Square(torch.nn.Module):
        def forward(self, x):
            return x * x

    x = torch.randn(64, requires_grad=True)
    Square()(x * 1.0).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=0, atol=0)
    assert actoff.stats().blocks["Square#0"].bytes_per_tier["cpu"] > 0


def test_instance_offload_returns_the_same_module_and_keeps_state_dict():
    model = make_model()
    keys = set(model.state_dict())
    layer = model.layers[0]
    assert actoff.offload(layer, policy="cpu", min_bytes=0) is layer
    assert set(model.state_dict()) == keys
    copy.deepcopy(model)  # still copyable
    train(model, 1)
    assert set(actoff.stats().blocks) == {"Block#0"}


def test_offload_twice_does_not_nest():
    model = make_model()
    actoff.offload(model.layers[0], policy="keep", min_bytes=0, name="first")
    actoff.offload(model.layers[0], policy="cpu", min_bytes=0, name="second")
    train(model, 1)
    assert set(actoff.stats().blocks) == {"second"}
    assert actoff.stats().blocks["second"].bytes_per_tier["cpu"] > 0


def test_offload_function():
    @actoff.offload(policy="cpu", min_bytes=0, name="fn")
    def gelu_mlp(x, weight):
        return torch.nn.functional.gelu(x @ weight)

    x = torch.randn(16, 32, requires_grad=True)
    weight = torch.randn(32, 32, requires_grad=True)
    gelu_mlp(x * 1.0, weight).sum().backward()
    got = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    gelu_mlp.__wrapped__(x * 1.0, weight).sum().backward()
    torch.testing.assert_close(got[0], x.grad, rtol=0, atol=0)
    torch.testing.assert_close(got[1], weight.grad, rtol=0, atol=0)


def test_offload_with_filter_fn_names_scopes_by_qualified_name():
    model = make_model()
    reference = copy.deepcopy(model)
    actoff.offload_(
        model,
        filter_fn=lambda module, name: name.startswith("layers.") and name.count(".") == 1,
        policy="cpu",
        min_bytes=0,
    )
    assert_same_history(train(reference, 2), train(model, 2))
    assert set(actoff.stats().blocks) == {"layers.0", "layers.1"}


def test_offload_with_explicit_config():
    model = make_model()
    config = actoff.Config(policy="cpu", min_bytes=0, keep_last=1)
    actoff.offload_(model, block_cls=Block, config=config)
    train(model, 1)
    blocks = actoff.stats().blocks
    assert blocks["layers.0"].bytes_per_tier["cpu"] > 0
    assert blocks["layers.1"].bytes_per_tier["cpu"] == 0


def test_a_policy_given_as_a_keyword_takes_the_rest_from_the_environment(monkeypatch, tmp_path):
    """policy="nvme" as a keyword with ACTOFF_NVME_DIR set: the directory counts (it was
    checked against the defaults, which have none, and refused)."""
    monkeypatch.setenv("ACTOFF_NVME_DIR", str(tmp_path))
    actoff.set_config()
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="nvme", min_bytes=0)
    train(model, 1)
    assert actoff.stats().blocks["layers.0"].bytes_per_tier["nvme"] > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, TypeError, "exactly one of block_cls"),
        ({"block_cls": Block, "filter_fn": lambda m, n: True}, TypeError, "exactly one of block_cls"),
        ({"block_cls": torch.nn.LSTM}, ValueError, "no submodule of Transformer matched"),
        (
            {"block_cls": "Blok"},
            ValueError,
            "matched block_cls='Blok'.* Its module classes: Attention, Block",
        ),
        ({"block_cls": [Block, 3]}, TypeError, "a class name or a list of them .* got 3 \\(int\\)"),
        # The keyword passed is named, not the environment variable (ACTOFF_POLICY, say).
        (
            {"block_cls": Block, "polcy": "cpu"},
            TypeError,
            "offload_\\(\\): got an unexpected keyword 'polcy'",
        ),
        ({"block_cls": Block, "policy": "turbo"}, ValueError, "offload_\\(\\): policy='turbo' is not valid"),
        (
            {"block_cls": Block, "cpu_fraction": 2},
            ValueError,
            "offload_\\(\\): cpu_fraction=2.0 is out of range",
        ),
    ],
)
def test_offload_inplace_errors(kwargs, error, message):
    with pytest.raises(error, match=message) as caught:
        actoff.offload_(make_model(), **kwargs)
    assert "ACTOFF_" not in str(caught.value)


def test_a_bad_policy_in_the_environment_is_named_as_the_variable(monkeypatch):
    monkeypatch.setenv("ACTOFF_POLICY", "turbo")
    monkeypatch.setattr(actoff.config, "_global_config", None)  # read from the environment again
    with pytest.raises(ValueError, match="ACTOFF_POLICY"):
        actoff.offload(torch.nn.Linear(2, 2), min_bytes=0)


@pytest.mark.parametrize("block_cls", ["Block", ["Block"], ("Attention", "MLP"), [Block, "MLP"]])
def test_block_cls_takes_classes_class_names_and_lists_of_them(block_cls):
    """Hugging Face users think in class names (a model's ``_no_split_modules``): a name was a bare
    isinstance TypeError."""
    model = actoff.offload_(make_model(), block_cls=block_cls, policy="cpu", min_bytes=0)
    train(model, 1)
    names = set(actoff.stats().blocks)
    if block_cls in ("Block", ["Block"]):
        assert names == {"layers.0", "layers.1"}
    elif block_cls == ("Attention", "MLP"):
        assert names == {"layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"}
    else:  # the blocks; their MLPs are nested scopes, which pass through
        assert names == {"layers.0", "layers.1"}


def test_block_cls_names_match_base_classes_and_hugging_faces_no_split_modules():
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    actoff.offload_(model, block_cls=model._no_split_modules, policy="cpu", min_bytes=0)
    tokens = torch.randint(0, 64, (1, 8))
    model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
    assert set(actoff.stats().blocks) == {"model.layers.0", "model.layers.1"}

    class Subclassed(Block):
        pass

    model = make_model()
    model.layers[1] = Subclassed(model.config)
    actoff.offload_(model, block_cls="Block", policy="cpu", min_bytes=0)
    train(model, 1)
    assert set(actoff.stats().blocks) == {"layers.0", "layers.1"}


@pytest.mark.parametrize(
    ("overrides", "ignored"),
    [
        (
            {"policy": "cpu", "cpu_fraction": 0.5},
            "offload_\\(cpu_fraction=0.5\\) has no effect under policy='cpu'",
        ),
        ({"policy": "keep", "host_bandwidth": "1GB"}, "host_bandwidth is read by policy 'auto'"),
        (
            {"policy": "recompute", "cpu_fraction": 0.5, "nvme_fraction": 0.2},
            "nvme_fraction is read by policy 'tokenwise'",
        ),
    ],
)
def test_settings_the_policy_ignores_are_said_once(overrides, ignored):
    """``cpu_fraction`` with ``policy="cpu"`` was silently ignored."""
    with pytest.warns(UserWarning, match=ignored) as caught:
        actoff.offload_(make_model(), block_cls=Block, **overrides)
    assert len(caught) == 1  # once for the call, not once per block


def test_settings_the_policy_reads_are_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actoff.offload_(make_model(), block_cls=Block, policy="tokenwise", cpu_fraction=0.5)
        actoff.offload_(make_model(), block_cls=Block, policy="auto", host_bandwidth="1GB")


@pytest.mark.parametrize(
    ("source", "ignored"),
    [
        ("environment", "ACTOFF_GPU_BUDGET \\(Config.gpu_budget\\)=1048576 has no effect under policy 'cpu'"),
        ("set_config", "ACTOFF_CPU_FRACTION \\(Config.cpu_fraction\\)=0.5 has no effect under policy 'cpu'"),
        (
            "config",
            "ACTOFF_HOST_BANDWIDTH \\(Config.host_bandwidth\\)=1000000000 has no effect under policy 'keep'",
        ),
    ],
)
def test_settings_from_the_environment_or_a_config_that_the_policy_ignores_are_said(
    source, ignored, monkeypatch
):
    """(Review of issue 28) only keywords of offload/offload_ were checked: the same setting from
    the environment, set_config or a Config went unsaid."""
    monkeypatch.setattr(actoff.scope.offload, "_UNREAD_SAID", set())
    config = None
    if source == "environment":
        monkeypatch.setenv("ACTOFF_GPU_BUDGET", "1MiB")
        actoff.set_config()
    elif source == "set_config":
        actoff.set_config(cpu_fraction=0.5)
    else:
        config = actoff.Config(policy="keep", host_bandwidth="1GB")
    model = make_model()
    actoff.offload_(model, block_cls=Block, min_bytes=0, **({"config": config} if config else {}))
    try:
        with pytest.warns(UserWarning, match=ignored) as caught:
            train(model, 2)
        assert len([w for w in caught if "has no effect" in str(w.message)]) == 1  # once, not per call
    finally:
        monkeypatch.delenv("ACTOFF_GPU_BUDGET", raising=False)
        actoff.set_config()


def test_offload_rejects_other_objects():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        actoff.offload(42)
    with pytest.raises(TypeError, match="got class int"):
        actoff.offload(int)
    with pytest.raises(TypeError, match="offload_\\(\\) takes an nn.Module"):
        actoff.offload_("model", block_cls=Block)
    with pytest.raises(TypeError, match="expects an actoff.Config"):
        actoff.offload(torch.nn.Linear(2, 2), config={"policy": "cpu"})
