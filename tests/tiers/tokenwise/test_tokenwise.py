"""Token-wise recompute: fractions and layouts, fallbacks that warn, partial FLOPs, mixers.

Tolerance: the recomputed rows come from a re-run on fewer rows, and a backend may pick
another kernel, with another summation order, for fewer rows (GPU GEMM tiling; BLAS on some
CPUs: MKL on an AMD EPYC did so for the chunked loss): ``RECOMPUTE_TOL`` (tests/_helpers.py),
float32 reassociation. Blocks placed whole (a fallback) run the same kernels on the same
shapes as without actoff and are checked bit for bit.
"""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close_history, assert_same_history, make_model, train
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import actoff
import actoff.runtime.measured
from actoff.reference import Block, ModelConfig, RMSNorm, rope_tables
from actoff.runtime.runtime import get_runtime

FRACTIONS = [(0.5, 0.0), (0.3, 0.3), (0.0, 0.0), (1.0, 0.0)]


class SBHModel(nn.Module):
    """The reference blocks driven with (S, B, H) activations (token dimension 0)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SBHBlock(config) for _ in range(config.num_layers))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def loss(self, tokens):
        x = self.embed(tokens[:, :-1]).transpose(0, 1).contiguous()  # (S, B, H)
        cos, sin = rope_tables(x.shape[0], self.config.head_dim)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(x.transpose(0, 1))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class SBHBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inner = Block(config)

    def forward(self, x, cos, sin):  # x: (S, B, H)
        return self.inner(x.transpose(0, 1), cos, sin).transpose(0, 1)


def _run(model_factory, block_cls, steps=3, **overrides):
    model = model_factory()
    reference = copy.deepcopy(model)
    expected = train(reference, steps)
    actoff.offload_(model, block_cls=block_cls, min_bytes=0, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback may happen on these blocks
        actual = train(model, steps)
    return expected, actual


@pytest.mark.parametrize(("cpu_fraction", "nvme_fraction"), FRACTIONS)
@pytest.mark.parametrize("layout", ["BSH", "SBH"])
def test_tokenwise_gradients(cpu_fraction, nvme_fraction, layout, nvme_dir):
    if layout == "BSH":
        factory, block_cls, token_dim = make_model, Block, 1
    else:
        torch.manual_seed(0)
        factory = lambda: SBHModel(ModelConfig.preset("tiny"))  # noqa: E731
        block_cls, token_dim = SBHBlock, 0
    expected, actual = _run(
        factory,
        block_cls,
        policy="tokenwise",
        cpu_fraction=cpu_fraction,
        nvme_fraction=nvme_fraction,
        nvme_dir=nvme_dir,
        token_dim=token_dim,
    )
    assert_close_history(expected, actual)  # recomputed on fewer rows: not bit for bit on every CPU
    tiers = next(iter(actoff.stats().blocks.values())).bytes_per_tier
    seq = 32
    recompute_share = 1 - round(seq * cpu_fraction) / seq - round(seq * nvme_fraction) / seq
    assert (tiers["recompute"] > 0) == (recompute_share > 0)
    assert (tiers["nvme"] > 0) == (nvme_fraction > 0)


def test_recompute_policy_grouped_kv_heads_several_steps():
    config = {"num_heads": 8, "num_kv_heads": 2, "hidden_size": 64}
    expected, actual = _run(lambda: make_model(**config), Block, steps=4, policy="recompute")
    assert_close_history(expected, actual)
    block = actoff.stats().blocks["layers.0"]
    assert block.bytes_per_tier["recompute"] > block.bytes_per_tier["cpu"] > 0


def test_retain_graph_rebuilds_twice():
    model = make_model()
    reference = copy.deepcopy(model)
    expected = train(reference, 2, retain_graph=True)
    actoff.offload_(model, block_cls=Block, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    assert_close_history(expected, train(model, 2, retain_graph=True))


# ---------------------------------------------------------------------------------- fallbacks
class MatmulAttentionBlock(nn.Module):
    """Attention written out with matmul and softmax: not a registered token mixer."""

    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.norm = RMSNorm(hidden, 1e-5)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.heads = heads

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return x + self.out(torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, h))


class ArangeRopeBlock(Block):
    """RoPE tables built from arange(S) inside the block: positions change with a slice."""

    def forward(self, x, cos, sin):
        cos, sin = rope_tables(x.shape[1], cos.shape[-1])
        return super().forward(x, cos, sin)


class DropoutBlock(Block):
    def forward(self, x, cos, sin):
        return F.dropout(super().forward(x, cos, sin), p=0.1, training=True)


class AttentionDropoutBlock(MatmulAttentionBlock):
    """Dropout inside attention (served in a re-run, which so draws fewer random numbers),
    then a dropout module, whose mask the re-run then cannot draw again."""

    def __init__(self, hidden=64, heads=4):
        super().__init__(hidden, heads)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        return x + self.drop(self.out(attn.transpose(1, 2).reshape(b, s, h)))


class CumsumMixerBlock(Block):
    """An unknown token mixer (a running sum over tokens) before the MLP."""

    def forward(self, x, cos, sin):
        return super().forward(x.cumsum(dim=1) / x.shape[1], cos, sin)


class TinyModel(nn.Module):
    def __init__(self, block_factory):
        super().__init__()
        self.config = ModelConfig.preset("tiny")
        self.embed = nn.Embedding(256, 64)
        self.layers = nn.ModuleList(block_factory() for _ in range(2))
        self.head = nn.Linear(64, 256, bias=False)

    def loss(self, tokens):
        x = self.embed(tokens[:, :-1])
        cos, sin = rope_tables(x.shape[1], 16, device=x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize(
    "block_factory",
    [
        MatmulAttentionBlock,
        lambda: ArangeRopeBlock(ModelConfig.preset("tiny")),
        AttentionDropoutBlock,
        lambda: CumsumMixerBlock(ModelConfig.preset("tiny")),
    ],
    ids=["matmul_attention", "arange_rope", "attention_dropout", "unknown_mixer"],
)
def test_blocks_that_cannot_be_recomputed_fall_back_with_one_warning(block_factory):
    torch.manual_seed(0)
    model = TinyModel(block_factory)
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    expected = train(reference, 3)
    block_cls = type(model.layers[0])
    actoff.offload_(model, block_cls=block_cls, policy="tokenwise", cpu_fraction=0.25, min_bytes=0)
    torch.manual_seed(5)
    with pytest.warns(RuntimeWarning) as caught:
        actual = train(model, 3)
    # Probed in the first backward (Note [probe in the first backward]): the last block first.
    messages = sorted(str(w.message) for w in caught if "cannot be recomputed token-wise" in str(w.message))
    assert len(messages) == 2, messages  # one per block, not one per step
    assert "'layers.0'" in messages[0] and "placed whole (cpu)" in messages[0]
    if block_cls is AttentionDropoutBlock:  # the dropout module is named
        assert "dropout module 'drop' (p=0.1) in training mode" in messages[0], messages[0]
    assert_same_history(expected, actual)  # whole placement is exact
    assert actoff.stats().blocks["layers.0"].bytes_per_tier["recompute"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("policy", ["tokenwise", "recompute"])
def test_dropout_is_recomputed_with_the_forwards_masks(policy, device):
    """(Note [dropout in a re-run]) A dropout drew other masks on a token slice, so every block
    with dropout (LoRA's ``lora_dropout``, GPT-2's residual dropout) was placed whole. On CUDA the
    fused kernel's branch runs (it saved nothing, and every such block fell back to whole)."""
    torch.manual_seed(0)
    model = TinyModel(lambda: DropoutBlock(ModelConfig.preset("tiny"))).to(device)
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    expected = train(reference, 3)
    fractions = {"cpu_fraction": 0.25} if policy == "tokenwise" else {}  # read by tokenwise only
    actoff.offload_(model, block_cls=DropoutBlock, policy=policy, min_bytes=0, **fractions)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        actual = train(model, 3)
    assert_close_history(expected, actual)
    assert actoff.stats().blocks["layers.0"].bytes_per_tier["recompute"] > 0


@pytest.mark.parametrize("policy", ["tokenwise", "recompute"])
def test_forward_hooks_inside_a_block_see_the_forward_only(policy):
    """(Note [re-runs without forward hooks]) neither the probe (in the first backward) nor the
    recompute (of some rows, in backward) fires the forward hooks of the block's submodules."""
    model = make_model()
    seen = []
    for layer in model.layers:
        layer.mlp.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    overrides = {"cpu_fraction": 0.25} if policy == "tokenwise" else {}
    actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0, **overrides)
    for length in (33, 33, 49):  # probed, planned, probed again
        seen.clear()
        model.loss(torch.randint(0, 256, (2, length))).backward()
        assert seen == [(2, length - 1, 64)] * len(model.layers)
    assert actoff.stats().blocks["layers.0"].bytes_per_tier["recompute"] > 0


def test_registered_mixer_is_served_from_the_stored_output():
    calls = []
    sdpa = F.scaled_dot_product_attention

    def my_attention(q, k, v):
        calls.append(q.shape[2])
        return sdpa(q, k, v, is_causal=True)

    my_attention = actoff.register_token_mixer(my_attention)
    assert actoff.register_token_mixer(my_attention) is my_attention

    class MixerBlock(Block):
        def forward(self, x, cos, sin):
            original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = lambda q, k, v, **kw: my_attention(q, k, v)
            try:
                return super().forward(x, cos, sin)
            finally:
                F.scaled_dot_product_attention = original

    torch.manual_seed(0)
    model = TinyModel(lambda: MixerBlock(ModelConfig.preset("tiny", num_kv_heads=4)))
    reference = copy.deepcopy(model)
    expected = train(reference, 2)
    calls.clear()
    actoff.offload_(model, block_cls=MixerBlock, policy="recompute", min_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actual = train(model, 2)
    assert_close_history(expected, actual)
    assert set(calls) == {32}  # only full-length forward calls: never called in the re-run


def test_register_token_mixer_rejects_non_functions():
    with pytest.raises(TypeError, match="expects a function"):
        actoff.register_token_mixer(3)


# ---------------------------------------------------------------------------------- FLOPs
class CountAttention(torch.overrides.TorchFunctionMode):
    """Counts scaled_dot_product_attention calls that really execute (an outer mode sees a
    call only when actoff's own mode passes it on)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _attention_flops(counter) -> int:
    # FlopCounterMode counts SDPA on CUDA; its CPU kernel is not counted at all.
    return sum(v for op, v in counter.get_flop_counts()["Global"].items() if "attention" in str(op))


@pytest.mark.parametrize("recompute_fraction", [0.5, 1.0])
def test_recompute_is_partial_and_skips_attention(recompute_fraction):
    from actoff.reference import Transformer

    config = ModelConfig.preset("tiny", hidden_size=128, intermediate_size=352, num_heads=4, num_kv_heads=4)
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 129))
    model = Transformer(config)
    with FlopCounterMode(display=False) as forward_only, torch.no_grad():
        model.layers[0](model.embed(tokens[:, :-1]), *rope_tables(128, config.head_dim))
    token_local = forward_only.get_total_flops() - _attention_flops(forward_only)  # one block
    assert token_local > 0

    plain = copy.deepcopy(model)
    with FlopCounterMode(display=False) as plain_counter, CountAttention() as plain_attention:
        plain.loss(tokens).backward()

    actoff.offload_(
        model, block_cls=Block, policy="tokenwise", cpu_fraction=1.0 - recompute_fraction, min_bytes=0
    )
    model.loss(tokens).backward()  # first step: verification adds a re-run; measure the next
    with FlopCounterMode(display=False) as counter, CountAttention() as attention:
        model.loss(tokens).backward()

    extra = counter.get_total_flops() - plain_counter.get_total_flops()
    expected = recompute_fraction * token_local * config.num_layers
    assert abs(extra - expected) <= 0.02 * expected, (extra, expected)
    assert attention.calls == plain_attention.calls == config.num_layers  # never recomputed
    assert _attention_flops(counter) == _attention_flops(plain_counter)


# ---------------------------------------------------------------------------------- auto
def _block_bytes(model) -> int:
    """What one block of ``model`` saves (a step under keep)."""
    probe = copy.deepcopy(model)
    actoff.offload_(probe, block_cls=Block, policy="keep", min_bytes=0)
    train(probe, 1)
    saved = actoff.stats().blocks["layers.0"].bytes_saved
    actoff.reset()
    return saved


@pytest.mark.no_sim_device  # its budget is for the blocks' bytes: a plain CPU device counts no other
def test_auto_measures_at_the_floor_then_plans_under_the_budget(monkeypatch):
    # A plain CPU device has no budget of its own: ACTOFF_GPU_BUDGET gives one (and its memory
    # is not counted: the budget is for what the blocks save). 1.6 blocks' worth cannot keep a
    # block, nor bring one back while a whole one is fetched ahead of it; and a slow link
    # (20 MB/s) cannot hide much: the plan recomputes. Forward times are injected (1 ms a
    # block, attention none): measured, they grow with the machine's load, and so would what
    # the link hides. The plan stores what it can and recomputes the rest, token-wise or whole.
    monkeypatch.setattr(actoff.runtime.measured, "forward_ms", lambda run: 1.0)
    monkeypatch.setattr(actoff.runtime.measured, "attention_ms", lambda run: 0.0)
    model = make_model()
    budget = int(1.6 * _block_bytes(model))
    reference = copy.deepcopy(model)
    expected = train(reference, 2) + train(reference, 2)
    actoff.offload_(
        model, block_cls=Block, policy="auto", min_bytes=0, host_bandwidth="20MB", gpu_budget=budget
    )
    history = train(model, 2)
    stats = actoff.stats()  # measuring: every block streamed to the host (Note [measuring at the floor])
    assert stats.blocks["layers.0"].placement == "measuring"
    assert stats.blocks["layers.0"].bytes_per_tier["cpu"] == stats.blocks["layers.0"].bytes_saved
    assert stats.plan != "none"  # made at the end of the second step
    assert set(stats.auto) == {"layers.0", "layers.1"}
    decision = stats.auto["layers.0"]
    assert decision.bandwidth_gbps == pytest.approx(0.02) and decision.t_layer_ms == pytest.approx(1.0)
    assert decision.input_bytes > 0 and decision.attention_bytes > 0 and decision.other_bytes > 0
    assert stats.predicted_peak_bytes <= budget
    history += train(model, 2)  # the plan runs
    stats = actoff.stats()
    offloaded = [block for block in stats.blocks.values() if block.placement != "keep"]
    assert offloaded and all(block.placement not in ("measuring", "probing") for block in offloaded)
    assert all(block.recompute_ms > 0 for block in offloaded)
    assert "auto plan:" in str(stats) and "placement" in str(stats)
    assert_close_history(expected, history)


@pytest.mark.no_sim_device  # its budget is for the blocks' bytes: a plain CPU device counts no other
def test_auto_spills_to_nvme_when_the_host_budget_binds(nvme_dir):
    # A free link (1 TB/s): everything the budget cannot keep is stored, none recomputed; the
    # host budget holds a share of it, and NVMe takes the rest.
    model = make_model(num_layers=4)
    budget = int(2.5 * _block_bytes(model))  # two blocks back at once: one fetched ahead
    actoff.offload_(
        model,
        block_cls=Block,
        policy="auto",
        min_bytes=0,
        host_bandwidth="1TB",
        host_budget="200KiB",
        nvme_dir=nvme_dir,
        gpu_budget=budget,
    )
    train(model, 3)
    decision = actoff.stats().auto["layers.0"]
    assert decision.placement == "tokenwise:1"
    assert "spilling to NVMe" in decision.reason
    assert decision.cpu_fraction < 1.0 and decision.nvme_fraction > 0
    assert decision.cpu_fraction + decision.nvme_fraction == pytest.approx(1.0)


@pytest.mark.no_sim_device  # its budget is for the blocks' bytes: a plain CPU device counts no other
def test_auto_measures_the_link_when_not_given():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="auto", min_bytes=0, gpu_budget=2 * _block_bytes(model))
    train(model, 2)
    decision = actoff.stats().auto["layers.0"]
    assert decision.bandwidth_gbps > 0.05  # a memcpy on this CPU


def test_auto_keeps_everything_on_a_device_without_a_budget():
    # A plain CPU device: no capacity, no ACTOFF_GPU_BUDGET. Nothing to fit: kept from the
    # first step, as under keep, and nothing measured or planned.
    model = make_model()
    expected = train(copy.deepcopy(model), 2)
    actoff.offload_(model, block_cls=Block, policy="auto", min_bytes=0)
    assert_same_history(expected, train(model, 2))
    stats = actoff.stats()
    assert stats.plan == "none" and not stats.auto
    assert all(b.bytes_per_tier["keep"] == b.bytes_saved > 0 for b in stats.blocks.values())


@pytest.mark.sim_device  # the host arena: copies happen on a device with DMA
def test_host_memory_falls_with_the_stored_fraction():
    highs = []
    for cpu_fraction in (1.0, 0.5, 0.0):
        actoff.reset()
        model = make_model()
        actoff.offload_(model, block_cls=Block, policy="tokenwise", cpu_fraction=cpu_fraction, min_bytes=0)
        # The probe's step is stored whole (Note [probe in the first backward]): at 3 tokens, so
        # that its high water is below the others'; 32 tokens then split at once (Note [a probe
        # serves other lengths]).
        train(model, 1, seq=4)
        train(model, 2)
        highs.append(actoff.stats().host_high_water)
    assert highs[0] > highs[1] > highs[2] > 0  # inputs and attention outputs always stored


def test_rows_served_from_the_device_are_never_written_to_nvme(monkeypatch, nvme_dir):
    """SSDTrain's forwarding: the last block's packed rows are still on the device when
    backward starts and are served from there; once used, their NVMe write, not started yet,
    is skipped. It used to start then if the copy out had ended: a write of bytes nobody
    reads, and an extent more in just those steps, which grew the file after warm-up
    (test_soak[tokenwise] on the simulated device)."""
    from actoff.testing import simulated_device
    from actoff.tiers.nvme.store import NvmeStore

    writes = []
    real_write = NvmeStore.write

    def counted_write(self, buffer, nbytes, **where):
        writes.append(nbytes)
        return real_write(self, buffer, nbytes, **where)

    monkeypatch.setattr(NvmeStore, "write", counted_write)
    expected = train(make_model(), 3)
    model = make_model()
    actoff.offload_(
        model,
        block_cls=Block,
        policy="tokenwise",
        cpu_fraction=0.25,
        nvme_fraction=0.25,
        min_bytes=0,
        nvme_dir=nvme_dir,
    )
    with simulated_device(seed=3) as device:
        real_loss = model.loss

        def held_loss(tokens):
            device.drain()  # the previous step's copies: nothing left to force open the hold
            with device.hold(copies=True):  # no write starts in forward
                return real_loss(tokens)

        model.loss = held_loss
        # Every copy out has ended when backward starts: the last block's could be written.
        actual = train(model, 3, before_backward=device.drain)
    assert_close_history(expected, actual)
    # One packed buffer per block but the last, from the second step on (the first is the probe's,
    # stored whole: Note [probe in the first backward]).
    assert len(writes) == 2 * (len(model.layers) - 1)
    assert get_runtime().stores.stores()[0].extents.live_bytes == 0


# ---------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
def test_peak_memory_falls_with_the_stored_fraction():
    from actoff.reference import Transformer

    def peak(cpu_fraction):
        actoff.reset()
        torch.manual_seed(0)
        model = Transformer(ModelConfig.preset("small", num_layers=8)).cuda()
        actoff.offload_(
            model, block_cls=Block, policy="tokenwise", cpu_fraction=cpu_fraction, min_bytes=0, keep_last=0
        )
        # The probe's step is stored whole (Note [probe in the first backward]), and the host's
        # high water counts since the arena began: the probe runs at 4 tokens, below the others
        # (Note [a probe serves other lengths]), as in test_host_memory_falls_with_the_stored_fraction.
        model.loss(torch.randint(0, 1024, (1, 5), device="cuda")).backward()
        tokens = torch.randint(0, 1024, (1, 4097), device="cuda")
        model.loss(tokens).backward()  # warm-up: arenas, kernels' workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model.loss(tokens).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), actoff.stats().host_high_water

    (keep, keep_host), (half, half_host), (none, none_host) = peak(1.0), peak(0.5), peak(0.0)
    assert none_host < half_host < keep_host
    # On the device, stored and recomputed rows both leave it; the peak must not grow as the
    # stored fraction falls (rebuilt rows in backward are the same size as fetched ones).
    assert none <= half * 1.02 and half <= keep * 1.02, (keep, half, none)


@pytest.mark.gpu
def test_forced_race_under_tokenwise_is_close():
    torch.manual_seed(0)
    model = make_model(hidden_size=256, intermediate_size=704).cuda()
    reference = copy.deepcopy(model)

    def stall():
        torch.cuda._sleep(20_000_000)

    expected = train(reference, 3, seq=257, before_backward=stall)
    actoff.offload_(model, block_cls=Block, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    actual = train(model, 3, seq=257, before_backward=stall)
    # GPU GEMMs may tile fewer rows differently: float32 reassociation only.
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, actual, strict=True):
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-4, atol=1e-5)
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-3, atol=1e-5)


class ScaledBlock(Block):
    """A block whose output depends on state the user may change between forward and backward."""

    scale = 1.0

    def forward(self, x, cos, sin):
        return super().forward(x * ScaledBlock.scale, cos, sin)


@pytest.mark.parametrize("verify", [True, False])
def test_verify_catches_a_block_that_changed_before_backward(verify):
    torch.manual_seed(0)
    model = TinyModel(lambda: ScaledBlock(ModelConfig.preset("tiny")))
    actoff.offload_(
        model, block_cls=ScaledBlock, policy="recompute", min_bytes=0, verify=verify, verify_interval=1
    )
    tokens = torch.randint(0, 256, (2, 33))
    model.loss(tokens).backward()  # first step: probe passes
    loss = model.loss(tokens)
    ScaledBlock.scale = 1.5  # the re-run in backward now computes something else
    try:
        if verify:
            with pytest.raises(RuntimeError, match="differ from the copy kept at forward time"):
                loss.backward()
        else:
            loss.backward()  # without ACTOFF_VERIFY this goes unnoticed: why the check exists
    finally:
        ScaledBlock.scale = 1.0


@pytest.mark.parametrize("policy", ["tokenwise", "recompute"])
def test_a_steps_inputs_held_as_they_are_go_with_the_step_not_with_the_collector(policy):
    """A token-wise run holds its block's inputs for the re-run: those under ``min_bytes`` (the
    rotary tables) as they are. The step's runs and records form cycles, so what they held went
    when the collector broke them: the tables sat on the device into the next steps (16 KiB over
    the static bytes in the benchmark's smoke run). With the collector off, every step now ends
    with the device holding what the last one ended with."""
    import gc

    from actoff.testing import simulated_device

    model = make_model()
    actoff.offload_(model, block_cls=Block, policy=policy)  # min_bytes 64 KiB: the tables are small
    enabled = gc.isenabled()
    gc.disable()
    try:
        with simulated_device(seed=0) as device:
            live = []
            for step in range(4):
                train(model, 1, seq=65, seed=step)
                live.append(device.memory.live)
    finally:
        if enabled:
            gc.enable()
    assert live[1:] == [live[1]] * 3, live  # after the first step (its gradients are new)
