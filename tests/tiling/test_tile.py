"""tile_: token-local modules run chunk by chunk, equal to the untiled module.

Tolerances. A tiled module computes each output row and each row of the input gradient from
that token alone, as the untiled one does, but its products have a chunk's rows, and BLAS may
pick another kernel, summing in another order, for fewer rows (a one-row product always
does; which row counts do depends on the CPU: under MKL_CBWR=COMPATIBLE chunks of 54 rows of
the MLP do). So these equal the untiled module's within float32 reassociation over the sums
on the chunked path (Note [reassociation tolerance], tests/_helpers.py): for the MLP, its
output over H then I (``MLP_OUT_LEN``), its input gradient, recomputing gate and up (H), back
through down (H) and through gate and up together (2 I) (``MLP_GRAD_X_LEN``). Only a tiled
module inside a ``cpu`` scope, against tiling alone, runs the same kernels on the same shapes:
that is bit-exact (rtol=0, atol=0). Parameter gradients are sums over tokens that the tiled
module adds chunk by chunk: they differ by float32 reassociation: a few units in the last
place of the largest gradient entry (up to ~50 here, one float32 ulp of that ~4e-6), so
rtol=1e-5, atol=1e-5.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    NO_CACHE,
    ROOT,
    assert_close_reassociated,
    assert_history_as_placed,
    make_model,
    tiny_llama,
    train,
)
from torch.utils._python_dispatch import TorchDispatchMode

import actoff
from actoff import Config
from actoff.reference import MLP, Block, ModelConfig, RMSNorm, Transformer
from actoff.tiling.tile import tiled_chunk_count

REASSOCIATED = {"rtol": 1e-5, "atol": 1e-5}  # float32 sums over chunks instead of one sum
_H, _I = 64, 176  # the tiny preset's hidden and intermediate sizes
MLP_OUT_LEN = _H + _I  # gate and up sum over H, down over I
MLP_GRAD_X_LEN = 2 * _H + 2 * _I  # gate and up recomputed (H), back through down (H), gate and up (2 I)


def _mlp(seed=0, **changes):
    torch.manual_seed(seed)
    return MLP(ModelConfig.preset("tiny", **changes))


def _forward_backward(module, x, grad_out, *args, **kwargs):
    """Output, input gradient and parameter gradients of one forward and backward."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    out = module(x, *args, **kwargs)
    out.backward(grad_out)
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}
    return out.detach(), x.grad, grads


def _assert_same(
    expected, actual, *, out_len=MLP_OUT_LEN, grad_x_len=MLP_GRAD_X_LEN, grad_params=REASSOCIATED
):
    """Output and input gradient within reassociation over ``out_len`` and ``grad_x_len`` terms
    (Note [reassociation tolerance]); parameter gradients within ``grad_params``."""
    assert_close_reassociated(actual[0], expected[0], reduction_len=out_len)
    if expected[1] is None:
        assert actual[1] is None
    else:
        assert_close_reassociated(actual[1], expected[1], reduction_len=grad_x_len)
    assert expected[2].keys() == actual[2].keys()
    for name, grad in expected[2].items():
        if grad is None:
            assert actual[2][name] is None, name
        else:
            torch.testing.assert_close(
                actual[2][name], grad, **grad_params, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize(
    "chunking", [{"chunks": 1}, {"chunks": 3}, {"chunks": 5}, {"max_tokens": 16}, {"max_tokens": 1}]
)
def test_tiled_mlp_equals_the_untiled_mlp(chunking):
    mlp = _mlp()
    tiled = actoff.tile_(copy.deepcopy(mlp), module_cls=MLP, **chunking)
    # (B, S, H); max_tokens=1: chunks of two rows, another kernel on every CPU, same tolerance
    x = torch.randn(2, 80, 64, requires_grad=True)
    grad_out = torch.randn(2, 80, 64)
    _assert_same(_forward_backward(mlp, x, grad_out), _forward_backward(tiled, x, grad_out))


def test_token_dim_zero():
    mlp = _mlp()
    tiled = actoff.tile_(copy.deepcopy(mlp), module_cls=MLP, chunks=4, token_dim=0)
    x = torch.randn(64, 2, 64, requires_grad=True)  # (S, B, H)
    grad_out = torch.randn(64, 2, 64)
    _assert_same(_forward_backward(mlp, x, grad_out), _forward_backward(tiled, x, grad_out))
    assert tiled_chunk_count(tiled, 64) == 4


class _LargestAllocation(TorchDispatchMode):
    """Largest storage any op returns (bytes): what a tiled module must keep to one chunk."""

    def __init__(self):
        super().__init__()
        self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest_bytes = max(self.largest_bytes, tensor.untyped_storage().nbytes())
        return out


def test_working_memory_is_one_chunk_of_the_intermediate():
    # Sizes where the MLP intermediate (S x I) dwarfs everything else: input, output and
    # weights are 16-wide, so the largest allocation is the intermediate, of one chunk if tiled.
    hidden, intermediate, seq, chunks = 16, 256, 512, 8
    mlp = _mlp(hidden_size=hidden, num_heads=2, num_kv_heads=1, intermediate_size=intermediate)
    tiled = actoff.tile_(copy.deepcopy(mlp), module_cls=MLP, chunks=chunks)
    x = torch.randn(1, seq, hidden, requires_grad=True)
    full_intermediate_bytes = seq * intermediate * 4
    chunk_intermediate_bytes = full_intermediate_bytes // chunks
    tiled(x[:, :32])  # the first call's probe (16 rows) is not part of the measure
    for module, bound in ((mlp, None), (tiled, chunk_intermediate_bytes)):
        with _LargestAllocation() as largest:
            module(x).sum().backward()
        if bound is None:
            assert largest.largest_bytes >= full_intermediate_bytes  # the measure sees the untiled peak
        else:
            assert largest.largest_bytes <= bound


def test_inside_an_offload_scope_the_saved_input_is_placed_by_the_policy():
    # The tiled MLP's input is saved through saved-tensor hooks, so the scope places it: under
    # `cpu` nothing changes (the same kernels on the same shapes: bit-exact against tiling
    # alone); under `recompute` the block is re-run token-wise with the tiled MLP inside, on
    # fewer rows: within the recompute tolerance (RECOMPUTE_TOL, tests/_helpers.py).
    model = make_model()
    tiled = actoff.tile_(copy.deepcopy(model), module_cls=MLP, chunks=4)
    expected = train(tiled)
    for policy in ("cpu", "recompute"):
        actoff.reset()
        both = actoff.offload_(copy.deepcopy(model), block_cls=Block, policy=policy, min_bytes=0)
        actoff.tile_(both, module_cls=MLP, chunks=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: the block is recomputed token-wise
            actual = train(both)
        assert_history_as_placed(expected, actual, recomputed=policy == "recompute")
        tier = "recompute" if policy == "recompute" else "cpu"
        assert actoff.stats().blocks["layers.0"].bytes_per_tier[tier] > 0


def test_tiled_training_follows_untiled_training():
    model = make_model()
    expected = train(copy.deepcopy(model), steps=3)
    actual = train(actoff.tile_(model, module_cls=(MLP, RMSNorm), max_tokens=8), steps=3)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, actual, strict=True):
        # Three SGD steps on reassociated gradients: the weights drift apart by ~1e-8.
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], **REASSOCIATED)


class _LoRALinear(torch.nn.Module):
    """A frozen base projection plus a trainable low-rank update, as PEFT's LoRA adds."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.1)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def test_lora_adapters_get_their_gradients_and_the_frozen_base_none():
    mlp = _mlp()
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, _LoRALinear(getattr(mlp, name)))
    tiled = actoff.tile_(copy.deepcopy(mlp), module_cls=MLP, chunks=4)
    x = torch.randn(2, 64, 64, requires_grad=True)
    grad_out = torch.randn(2, 64, 64)
    expected, actual = _forward_backward(mlp, x, grad_out), _forward_backward(tiled, x, grad_out)
    # The MLP's sums, plus each adapter's rank-4 product on the way (gate or up, then down).
    _assert_same(expected, actual, out_len=MLP_OUT_LEN + 2 * 4, grad_x_len=MLP_GRAD_X_LEN + 4 * 4)
    assert actual[2]["up_proj.base.weight"] is None and actual[2]["up_proj.lora_a"] is not None


def test_input_without_grad_still_trains_the_parameters():
    mlp = _mlp()
    tiled = actoff.tile_(copy.deepcopy(mlp), module_cls=MLP, chunks=4)
    x = torch.randn(2, 64, 64)  # e.g. the output of a frozen embedding
    grad_out = torch.randn(2, 64, 64)
    expected, actual = _forward_backward(mlp, x, grad_out), _forward_backward(tiled, x, grad_out)
    assert actual[1] is None
    _assert_same(expected, actual)


class _ScaledNorm(torch.nn.Module):
    """A token-local module with pass-through arguments: a per-feature scale tensor and an eps."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(size, size)

    def forward(self, x, scale, *, eps=1e-6, shift=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale
        return self.proj(x if shift is None else x + shift)


def test_pass_through_arguments_are_given_whole_and_get_their_gradients():
    torch.manual_seed(0)
    module = _ScaledNorm(32)
    tiled = actoff.tile_(copy.deepcopy(module), module_cls=_ScaledNorm, chunks=3)
    x = torch.randn(2, 48, 32, requires_grad=True)
    grad_out = torch.randn(2, 48, 32)
    shift = torch.randn(32)  # a pass-through tensor without grad, as a keyword
    results = []
    for candidate in (module, tiled):
        scale = torch.linspace(0.5, 1.5, 32).requires_grad_()  # one that needs a gradient
        results.append((_forward_backward(candidate, x, grad_out, scale, eps=1e-5, shift=shift), scale.grad))
    (expected, scale_grad_a), (actual, scale_grad_b) = results
    # Out: the mean of squares and proj sum over 32 features each; the input gradient recomputes
    # those (64), goes back through proj (32) and the norm's sum over features (32).
    _assert_same(expected, actual, out_len=2 * 32, grad_x_len=4 * 32)
    torch.testing.assert_close(scale_grad_b, scale_grad_a, **REASSOCIATED)  # a sum over tokens, too


class _Recorder(torch.nn.Module):
    """Records the dtype its projection computes in, on every call (forward and recompute)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(size, size)
        self.dtypes = []

    def forward(self, x):
        y = self.proj(x)
        self.dtypes.append((torch.is_grad_enabled(), y.dtype))
        return F.gelu(y)


def test_autocast_is_re_entered_when_chunks_are_recomputed():
    torch.manual_seed(0)
    module = _Recorder(32)
    tiled = actoff.tile_(copy.deepcopy(module), module_cls=_Recorder, chunks=4)
    x = torch.randn(2, 64, 32, requires_grad=True)
    grad_out = torch.randn(2, 64, 32)
    results = []
    for candidate in (module, tiled):
        x_leaf = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = candidate(x_leaf)
        out.float().backward(grad_out)  # backward outside the autocast block, as in training
        results.append((out, x_leaf.grad, candidate.proj.weight.grad))
    recomputes = [dtype for grad_enabled, dtype in tiled.dtypes if grad_enabled]
    assert recomputes == [torch.bfloat16] * 4  # one recompute per chunk, in the forward's dtype
    (out_a, grad_x_a, grad_w_a), (out_b, grad_x_b, grad_w_b) = results
    assert out_b.dtype == out_a.dtype == torch.bfloat16
    # Rows computed alike, in bf16 with float32 sums over 32 features, on fewer rows: another
    # order may round a bf16 value the other way (Note [reassociation tolerance]). Out: proj's
    # and gelu's roundings (one-ulp flips of every proj output at once move it by 1.3 eps(bf16)
    # of its largest entry, measured); the input gradient: the recomputed proj and the product
    # back (64 terms), gelu's gradient at a flipped input, its rounding and the product's (0.6).
    assert_close_reassociated(out_b, out_a, reduction_len=32, dtype=torch.bfloat16, roundings=2)
    assert_close_reassociated(grad_x_b, grad_x_a, reduction_len=64, dtype=torch.bfloat16, roundings=3)
    # Four chunk products each rounded to bf16 (2**-9 relative) and summed in float32, vs one
    # product rounded once: within 2% of the largest entry.
    scale = grad_w_a.abs().max().item()
    torch.testing.assert_close(grad_w_b, grad_w_a, rtol=2e-2, atol=2e-2 * scale)


def test_dropout_draws_the_same_mask_in_the_recompute():
    # The gradient must be that of the forward's own mask: grad_x = (mask * g / (1 - p)) @ W,
    # with the mask read off the output (dropped entries are exactly zero). Without the RNG
    # replay the recompute would draw another mask and this would fail.
    torch.manual_seed(0)
    probability = 0.5
    module = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.Dropout(probability))
    actoff.tile_(module, module_cls=torch.nn.Sequential, chunks=4)
    x = torch.randn(2, 64, 32, requires_grad=True)
    grad_out = torch.randn(2, 64, 32)
    out = module(x)
    out.backward(grad_out)
    mask = (out != 0).float()
    assert 0.3 < mask.mean().item() < 0.7  # dropout did drop (the probe ran in eval mode)
    weight = module[0].weight
    expected = (mask * grad_out / (1 - probability)) @ weight
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)  # one matmul vs two: reassociated


class _Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


class _CumulativeMix(torch.nn.Module):
    def forward(self, x):
        return x.cumsum(dim=1)  # causal: row t depends on rows 0..t


class _MeanMix(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(dim=1, keepdim=True)


class _PositionsInside(torch.nn.Module):
    def forward(self, x):
        return x + torch.arange(x.shape[1], dtype=x.dtype)[:, None]  # positions from the chunk's length


class _MaskedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.proj(x) * mask[..., None]  # mask (B, S): token-aligned, but passed whole


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        (_CumulativeMix(), (), r"_CumulativeMix\) is not token-local: output rows 8\.\.16"),
        (_MeanMix(), (), r"_MeanMix\) is not token-local"),
        (_PositionsInside(), (), r"_PositionsInside\) is not token-local"),
        (_MaskedMLP(), (torch.ones(2, 32),), r"_MaskedMLP\) failed on a slice of its tokens"),
    ],
)
def test_modules_that_are_not_token_local_are_refused_on_the_first_call(module, args, message):
    outer = _Outer(module)
    actoff.tile_(outer, module_cls=type(module), chunks=2)
    with pytest.raises(ValueError, match=message) as raised:
        outer(torch.randn(2, 32, 8), *args)
    assert "inner (" in str(raised.value)  # the qualified name within the model
    assert "leave" in str(raised.value)  # and the fix


def test_attention_is_refused_with_the_fix():
    model = make_model()
    actoff.tile_(model, filter_fn=lambda module, name: name == "layers.1.attn", chunks=2)
    with pytest.raises(ValueError, match=r"layers\.1\.attn \(Attention\).*(failed|not token-local)"):
        model.loss(torch.randint(0, 256, (2, 33)))


def test_eval_and_no_grad_run_chunked_and_equal():
    mlp = _mlp()
    tiled = actoff.tile_(copy.deepcopy(mlp), module_cls=MLP, chunks=3)
    x = torch.randn(2, 48, 64)
    with torch.no_grad():
        assert_close_reassociated(tiled(x), mlp(x), reduction_len=MLP_OUT_LEN)


def test_filter_fn_and_nested_matches_tile_the_outer_module_only():
    model = make_model()
    actoff.tile_(model, filter_fn=lambda module, name: name.endswith("mlp") or "mlp." in name, chunks=2)
    assert tiled_chunk_count(model.layers[0].mlp, 10) == 2
    assert tiled_chunk_count(model.layers[0].mlp.up_proj, 10) == 0  # inside a tiled module: not again


def test_a_deep_copy_of_a_tiled_model_uses_its_own_weights():
    model = actoff.tile_(make_model(), module_cls=MLP, chunks=2)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in clone.layers[0].mlp.parameters():
            parameter.zero_()
    x = torch.randn(1, 8, 64)
    assert clone.layers[0].mlp(x).abs().max() == 0
    assert model.layers[0].mlp(x).abs().max() > 0


def test_settings_give_the_chunking_and_tile_arguments_win(monkeypatch):
    monkeypatch.setenv("ACTOFF_TILE_MAX_TOKENS", "4")
    actoff.set_config()
    model = actoff.tile_(Transformer(ModelConfig.preset("tiny")), module_cls=MLP)
    assert tiled_chunk_count(model.layers[0].mlp, 10) == 3
    actoff.tile_(model, module_cls=MLP, chunks=5)  # arguments win, and tiling again re-tiles
    assert tiled_chunk_count(model.layers[0].mlp, 10) == 5
    assert Config.from_env({"ACTOFF_TILE_CHUNKS": "8"}).tile_chunks == 8
    assert Config.from_env({"ACTOFF_TILE_CHUNKS": "none"}).tile_chunks is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ACTOFF_TILE_CHUNKS": "0"}, "ACTOFF_TILE_CHUNKS.*0 is out of range.*>= 1"),
        ({"ACTOFF_TILE_MAX_TOKENS": "lots"}, "ACTOFF_TILE_MAX_TOKENS.*'lots' is not an integer"),
        ({"ACTOFF_TILE_CHUNKS": "4", "ACTOFF_TILE_MAX_TOKENS": "512"}, "both set.*unset the other"),
    ],
)
def test_bad_tile_settings_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Config.from_env(env)


def test_tile_without_a_chunking_says_how_to_give_one():
    with pytest.raises(TypeError, match="chunks=N or max_tokens=N, or one of ACTOFF_TILE_CHUNKS"):
        actoff.tile_(make_model(), module_cls=MLP)
    with pytest.raises(ValueError, match="no submodule of Transformer matched"):
        actoff.tile_(make_model(), module_cls=torch.nn.Conv1d, chunks=2)


@pytest.mark.parametrize("module_cls", ["MLP", ["MLP"], MLP, ("RMSNorm", MLP), [RMSNorm, "MLP"]])
def test_module_cls_takes_classes_class_names_and_lists_of_them(module_cls):
    """Issue 38 (item 7): ``offload_``'s convention; a name was a bare ``isinstance`` TypeError."""
    model = actoff.tile_(make_model(), module_cls=module_cls, chunks=2)
    tiled = {name for name, module in model.named_modules() if tiled_chunk_count(module, 8)}
    mlps = {f"layers.{index}.mlp" for index in range(2)}
    norms = {f"layers.{index}.{norm}" for index in range(2) for norm in ("input_norm", "post_norm")} | {
        "norm"
    }
    assert tiled == (mlps if module_cls in ("MLP", ["MLP"], MLP) else mlps | norms)
    train(model, 1)


@pytest.mark.parametrize(
    ("module_cls", "error", "message"),
    [
        (
            "LlamaMLP",
            ValueError,
            "matched module_cls='LlamaMLP'; nothing would be tiled. Its module classes: ",
        ),
        (
            [MLP, 3],
            TypeError,
            "tile_\\(module_cls=...\\) takes an nn.Module subclass, a class name or a list",
        ),
    ],
)
def test_a_module_cls_that_matches_nothing_names_the_models_classes(module_cls, error, message):
    with pytest.raises(error, match=message) as caught:
        actoff.tile_(make_model(), module_cls=module_cls, chunks=2)
    if error is ValueError:
        assert "Attention, Block, Embedding" in str(caught.value)


def test_hugging_face_llama_mlp_trains_tiled_as_untiled():
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = tiny_llama(**NO_CACHE)
    reference = copy.deepcopy(model)
    actoff.tile_(model, module_cls=LlamaMLP, chunks=3)

    def hf_train(module, steps=3):
        generator = torch.Generator().manual_seed(1)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
        history = []
        for _ in range(steps):
            tokens = torch.randint(0, 256, (2, 48), generator=generator)
            module(input_ids=tokens, labels=tokens).loss.backward()
            history.append({n: p.grad.clone() for n, p in module.named_parameters()})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return history

    for grads_a, grads_b in zip(hf_train(reference), hf_train(model), strict=True):
        for name in grads_a:
            # Reassociated MLP weight sums, then three SGD steps on them: float32, ~1e-7 apart.
            torch.testing.assert_close(grads_b[name], grads_a[name], **REASSOCIATED)


def test_a_mixture_of_experts_block_that_flattens_its_input_trains_tiled_at_batch_two():
    """Hugging Face's MoE blocks are token-local (each token routed alone) and flatten their
    input with .view: a chunk along the tokens of a batch of two is strided, so tile_ hands it
    over contiguous (before, the first call's probe refused the block, blaming its arguments)."""
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM._from_config(config, attn_implementation="sdpa")
    reference = copy.deepcopy(model)
    actoff.tile_(model, module_cls=type(model.model.layers[0].mlp), max_tokens=16)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    losses = []
    for module in (reference, model):
        losses.append(module(input_ids=tokens, labels=tokens).loss)
        losses[-1].backward()
    assert tiled_chunk_count(model.model.layers[0].mlp, 48) == 3
    torch.testing.assert_close(losses[1], losses[0], **REASSOCIATED)
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, **REASSOCIATED, msg=name)


def test_readme_tiling_example_runs():
    import os
    import re

    root = ROOT
    with open(os.path.join(root, "README.md")) as handle:
        section = handle.read().split("## Tiled compute and chunked loss", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert tiled_chunk_count(model.layers[0].mlp, 64) == 4
    assert model.head.weight.grad is not None and model.layers[0].mlp.up_proj.weight.grad is not None
