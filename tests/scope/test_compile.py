"""torch.compile around offload scopes: each scope is a graph break around a compiled block body.

The reference of every comparison is the same model under the same compile setup without
actoff: offloading must not change a single bit of what the compiled code computes, with one
exception. Compiled whole under inductor, the model without actoff is one graph, while actoff's
scopes break it at every block: inductor fuses the code around the blocks otherwise (the
embedding, the residual adds, the loss), and on some CPUs sums in another order (13 step-0
gradients differed by up to 2.2e-8 on one). There the guarantee is bit for bit against the
same compiled model with its scopes passing through (``no_offload()``: the same graph breaks),
and within float32 reassociation against the model compiled without actoff
(`test_a_model_compiled_whole_by_inductor_is_exact_against_the_same_graph_breaks`).
"""

import collections
import copy
import gc
import sys
import warnings

import pytest
import torch
from _helpers import NO_CACHE, assert_close_history, assert_same_history, make_model, tiny_llama, train

import actoff
from actoff.reference import Block
from actoff.runtime.runtime import Runtime, get_runtime
from actoff.runtime.step import ScopeRun

pytestmark = [
    # Dynamo reads `.grad` of every non-leaf tensor it takes as a frame input (a block's
    # hidden state) and hides the warning that gives by replacing `warnings.showwarning`
    # (safe_has_grad, torch/_dynamo/variables/builder.py), which this suite's "error" filter
    # acts before. torch's own warning: it fires for compiled layers without actoff too.
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
    # Inductor imports torch.utils.mkldnn, which uses the deprecated `torch.jit.script_method`.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # Under ACTOFF_SIM_DEVICE=1: streams and copies simulated, memory not counted (Dynamo
    # refuses to compile under the counter's Python dispatch mode).
    pytest.mark.no_sim_memory,
]

TIERS = ("keep", "cpu", "nvme")
# Inductor compiles C++ on this CPU: about 30 s for the block's graphs with a cold cache (then
# cached on disk and shared by the tiers), 20 s more for the graphs around the blocks of a
# whole model. Per-layer compile runs by default, one case per tier; whole-model compile, which
# puts the same block graphs between the same scope calls, with ACTOFF_RUN_SLOW=1.
CASES = [
    pytest.param(
        backend,
        placement,
        policy,
        id=f"{backend}-{placement}-{policy}",
        marks=[
            *([pytest.mark.slow] if (backend, placement) == ("inductor", "model") else []),
            *([pytest.mark.nvme] if policy == "nvme" else []),
        ],
    )
    for backend in ("eager", "aot_eager", "inductor")
    for placement in ("model", "layers")
    for policy in TIERS
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles anew: graphs cached for another test's model would be reused or
    count towards Dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(model: torch.nn.Module, placement: str, backend: str, **options) -> torch.nn.Module:
    if placement == "model":  # train() calls model.loss, which calls the compiled model
        model.compile(backend=backend, **options)
    elif placement == "layers":
        for layer in model.layers:
            layer.compile(backend=backend, **options)
    else:  # "wrapped": torch.compile(layer), an OptimizedModule in the ModuleList
        for index, layer in enumerate(model.layers):
            model.layers[index] = torch.compile(layer, backend=backend, **options)
    return model


def _reference_and_offloaded(placement: str, backend: str, steps: int = 2, **overrides):
    """The same initial model trained compiled without actoff, then compiled with actoff."""
    model = make_model()
    reference = copy.deepcopy(model)
    expected = train(_compiled(reference, placement, backend), steps)
    torch._dynamo.reset()
    actoff.offload_(model, block_cls=Block, **overrides)
    actual = train(_compiled(model, placement, backend), steps)
    return expected, actual


def _tiers() -> dict[str, dict[str, int]]:
    return {name: block.bytes_per_tier for name, block in actoff.stats().blocks.items()}


def _assert_all_in(policy: str) -> None:
    """Every block's saves went to ``policy``'s tier, and only there."""
    tiers = _tiers()
    assert tiers, "no block was offloaded"
    for name, per_tier in tiers.items():
        assert per_tier[policy] > 0, (name, per_tier)
        assert sum(per_tier.values()) == per_tier[policy], (name, per_tier)


@pytest.mark.parametrize(("backend", "placement", "policy"), CASES)
def test_compiled_training_is_bit_exact(backend, placement, policy, request):
    options = {"nvme_dir": request.getfixturevalue("nvme_dir")} if policy == "nvme" else {}
    expected, actual = _reference_and_offloaded(placement, backend, policy=policy, min_bytes=0, **options)
    if (backend, placement) == ("inductor", "model"):  # other graph breaks: see the module's docstring
        assert_close_history(expected, actual)
    else:
        assert_same_history(expected, actual)
    assert set(_tiers()) == {"layers.0", "layers.1"}
    _assert_all_in(policy)


def test_a_model_compiled_whole_by_inductor_is_exact_against_the_same_graph_breaks():
    """Whole-model inductor: bit for bit against the same compiled model with its scopes passing
    through (the same graphs: Dynamo has no guard on actoff's state, so nothing recompiles), within
    float32 reassociation against the model compiled without actoff (one graph, fused otherwise)."""
    model = make_model()
    initial = copy.deepcopy(model.state_dict())
    expected = train(_compiled(copy.deepcopy(model), "model", "inductor"), 2)
    torch._dynamo.reset()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    _compiled(model, "model", "inductor")
    with actoff.no_offload():
        same_breaks = train(model, 2)
    model.load_state_dict(initial)
    actual = train(model, 2)
    assert_same_history(same_breaks, actual)
    assert_close_history(expected, actual)  # RECOMPUTE_TOL: float32 reassociation
    _assert_all_in("cpu")


def test_torch_compile_of_each_layer_is_bit_exact():
    expected, actual = _reference_and_offloaded("wrapped", "aot_eager", policy="cpu", min_bytes=0)
    assert_same_history(expected, actual)
    _assert_all_in("cpu")


def test_one_graph_serves_every_block():
    # The block body is one code object for all scopes; identical blocks pass its guards, so
    # a deeper model compiles no more graphs (and never nears Dynamo's recompile limit).
    graphs: collections.Counter = collections.Counter()

    def counting_backend(graph_module, example_inputs):
        key = len(graphs)
        graphs[key] = 0

        def run(*args):
            graphs[key] += 1
            return graph_module.forward(*args)

        return run

    model = actoff.offload_(make_model(num_layers=6), block_cls=Block, policy="cpu", min_bytes=0)
    train(_compiled(model, "layers", counting_backend), 2)
    assert list(graphs.values()) == [6 * 2], graphs  # one graph, run by every block every step
    _assert_all_in("cpu")


def test_a_new_length_every_step_is_bit_exact():
    # From the second length on Dynamo compiles with symbolic sizes; actoff's copies and arena
    # offsets must never see them (the original crash: "symbolic sizes reached a copy").
    lengths = [33, 17, 40]
    model = make_model()
    reference = copy.deepcopy(model)
    _compiled(reference, "model", "aot_eager")
    expected = [step for seq in lengths for step in train(reference, 1, seq=seq)]
    torch._dynamo.reset()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    _compiled(model, "model", "aot_eager")
    actual = [step for seq in lengths for step in train(model, 1, seq=seq)]
    assert_same_history(expected, actual)


@pytest.mark.parametrize(
    ("policy", "placement"),
    [("tokenwise", "model"), ("tokenwise", "layers"), ("recompute", "layers"), ("auto", "model")],
)
def test_tokenwise_under_compile_falls_back_whole_with_one_warning(policy, placement):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fractions = {"cpu_fraction": 0.5} if policy == "tokenwise" else {}  # read by tokenwise only
        expected, actual = _reference_and_offloaded(
            placement, "aot_eager", steps=3, policy=policy, min_bytes=0, **fractions
        )
    ours = [w for w in caught if "actoff" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert ours[0].category is RuntimeWarning
    message = str(ours[0].message)
    assert f"policy {policy!r} does not recompute blocks that run inside torch.compile" in message
    assert "'layers.0'" in message and "placed whole (cpu)" in message
    assert "saves" in message  # why: a compiled body's saves are not the eager forward's
    assert not [w for w in caught if w not in ours], [str(w.message) for w in caught]
    assert_same_history(expected, actual)  # placed whole: exact, not merely close
    _assert_all_in("cpu")


def test_tokenwise_still_recomputes_eager_blocks_after_a_compiled_model():
    # The fallback belongs to compiled calls, not to the block: the same blocks run eagerly
    # later recompute token-wise again.
    with pytest.warns(RuntimeWarning, match="torch.compile"):
        _reference_and_offloaded("layers", "eager", 1, policy="tokenwise", min_bytes=0, cpu_fraction=0.5)
    actoff.reset()
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="tokenwise", min_bytes=0, cpu_fraction=0.5)
    train(model, 2)  # the first step is the probe's (Note [probe in the first backward])
    assert all(per_tier["recompute"] > 0 for per_tier in _tiers().values())


def test_no_offload_and_no_grad_are_decided_when_the_compiled_model_runs():
    # Dynamo has no guard on actoff's state: whether a call is a scope is decided at run time,
    # so one compiled model serves both ways (eval mode with gradients is placed as training).
    model = actoff.offload_(make_model(), block_cls=Block, policy="cpu", min_bytes=0)
    _compiled(model, "model", "aot_eager")
    tokens = torch.randint(0, 256, (2, 33))
    with actoff.no_offload():
        model.loss(tokens).backward()
    assert actoff.stats().blocks == {}
    with torch.no_grad():
        model.loss(tokens)
    assert actoff.stats().blocks == {}
    model.eval()
    model.loss(tokens).backward()
    _assert_all_in("cpu")


def test_a_function_scope_inside_a_compiled_function_is_bit_exact():
    weight = torch.randn(64, 64, requires_grad=True)

    def mlp(x, w):
        return torch.nn.functional.gelu(x @ w) @ w.t()

    def step(fn):
        compiled = torch.compile(lambda x: fn(x.tanh(), weight).sum(), backend="aot_eager")
        x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        loss = compiled(x)
        loss.backward()
        grads = (x.grad.clone(), weight.grad.clone())
        weight.grad = None
        return loss.detach(), grads

    expected = step(mlp)
    torch._dynamo.reset()
    actual = step(actoff.offload(mlp, name="mlp", policy="cpu", min_bytes=0))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    _assert_all_in("cpu")
    assert set(_tiers()) == {"mlp"}


def test_fullgraph_says_why_it_cannot_hold_a_scope():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="actoff offload scope"):
        compiled(torch.randint(0, 256, (2, 16)))
    assert get_runtime().thread.stack == []


def test_dynamo_never_traces_actoff(monkeypatch):
    # The root cause of the crashes: Dynamo traced the runtime (placement, the pack hook,
    # Handle objects it then dropped half-built). Every hook and lifecycle step must run as
    # plain Python, outside tracing and with Dynamo's frame callback off.
    frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
    traced: list[str] = []

    def spy(cls, name):
        original = getattr(cls, name)

        def watched(*args, **kwargs):
            if torch.compiler.is_compiling() or frame_callback() not in (None, False):
                traced.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, watched)

    for name in ("enter_scope", "_seal", "_place", "unpack", "_release", "end_backward"):
        spy(Runtime, name)
    spy(ScopeRun, "pack")
    model = actoff.offload_(make_model(), block_cls=Block, policy="cpu", min_bytes=0)
    train(_compiled(model, "model", "aot_eager"), 2)
    assert traced == []
    _assert_all_in("cpu")


def test_nothing_is_reported_as_ignored(monkeypatch, capfd):
    # The original crash printed "Exception ignored in Handle.__del__": an object dropped
    # half-built. Collect what Python reports as unraisable over compiled training and after.
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    model = actoff.offload_(make_model(), block_cls=Block, policy="cpu", min_bytes=0)
    train(_compiled(model, "model", "aot_eager"), 2)
    del model
    torch._dynamo.reset()
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}" for u in unraisable] == []
    assert "Exception ignored" not in capfd.readouterr().err


def test_an_exception_in_a_compiled_block_leaves_actoff_clean():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    _compiled(model, "layers", "aot_eager")
    bad = torch.randn(2, 8, 7, requires_grad=True)  # wrong hidden size: fails in the block body
    cos, sin = torch.ones(8, 16), torch.zeros(8, 16)
    with pytest.raises(RuntimeError):
        model.layers[0](bad, cos, sin)
    runtime = get_runtime()
    assert runtime.thread.stack == []
    assert runtime.step is not None and runtime.step.aborted
    # The hooks were removed: a save outside any scope is the tensor itself again.
    x = torch.randn(4, 4, requires_grad=True)
    assert isinstance(x.exp().grad_fn._saved_result, torch.Tensor)
    # And the next steps train normally (compared with the same compiled layers without actoff).
    reference = make_model()
    for layer in reference.layers:
        layer.compile(backend="aot_eager")
    assert_same_history(train(reference, 1), train(model, 1))


# ---------------------------------------------------------------- Hugging Face models
def _hf_train(model: torch.nn.Module, steps: int = 2) -> list:
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


def _hf_model(kind: str) -> tuple[torch.nn.Module, type]:
    """A tiny random Llama or GPT-2 (nothing downloaded) and its decoder layer class."""
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    torch.manual_seed(0)
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return tiny_llama(**NO_CACHE), LlamaDecoderLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa"), GPT2Block


@pytest.mark.parametrize(
    ("kind", "policy"), [("llama", "cpu"), pytest.param("gpt2", "nvme", marks=pytest.mark.nvme)]
)
def test_hugging_face_model_compiled_whole_is_bit_exact(kind, policy, nvme_dir):
    model, layer_cls = _hf_model(kind)
    reference = copy.deepcopy(model)
    expected = _hf_train(torch.compile(reference, backend="aot_eager"))
    torch._dynamo.reset()
    actoff.offload_(model, block_cls=layer_cls, policy=policy, min_bytes=0, nvme_dir=nvme_dir)
    actual = _hf_train(torch.compile(model, backend="aot_eager"))
    assert_same_history(expected, actual)
    assert len(_tiers()) == 2
    _assert_all_in(policy)
