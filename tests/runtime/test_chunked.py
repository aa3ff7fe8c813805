"""The chunked placement: a block's input stored, its backward run in token chunks (Note [chunked
backward] in actoff.runtime.placements.chunked).

Tolerance: the weights' gradients are sums over the chunks of the same products the unchunked
backward sums in one reduction (and each chunk's attention is its own kernel call), so every entry
is the same float32 sum in another order: within ``RECOMPUTE_TOL`` (rtol 1e-5, atol 1e-6; Note
[reassociation tolerance] in tests/_helpers.py), where errors of 5e-7 of the largest entry are seen.
The forward runs the same kernels on the same shapes: its loss is bit for bit.
"""

import collections
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    FLOAT32_EPS,
    RECOMPUTE_TOL,
    assert_close_history,
    assert_same_history,
    fetches_issued,
    make_model,
    tiny_llama,
    train,
)
from torch import nn

import actoff
from actoff.reference import Block
from actoff.runtime.placements.chunked import ChunkedShapeError, ChunkMismatchError
from actoff.testing import simulated_device


def _chunked(model: nn.Module, chunk_tokens: int, block_cls=Block) -> nn.Module:
    actoff.offload_(model, block_cls=block_cls, policy="chunked", min_bytes=0, chunk_tokens=chunk_tokens)
    return model


@pytest.mark.parametrize("chunk_tokens", [5, 16, 64])
@pytest.mark.parametrize(
    "changes", [{}, {"num_kv_heads": 1}, {"fused_qkv": True}], ids=["gqa", "one_kv_head", "fused_qkv"]
)
def test_gradients_are_the_unchunked_blocks_within_reassociation(chunk_tokens, changes):
    """Chunks of 5 (33 tokens: six chunks and a short last one), 16 and 64 (one chunk: the keys
    pass and the chunk's own causal attention only)."""
    model = make_model(**changes)
    expected = train(copy.deepcopy(model), 2, seq=33)
    actual = train(_chunked(model, chunk_tokens), 2, seq=33)
    assert_close_history(expected, actual)
    # The first forward is the block's own kernels on the same shapes (the second starts from
    # weights that took the reassociated gradients).
    torch.testing.assert_close(actual[0][0], expected[0][0], rtol=0, atol=0)


class _BiasedAttention(nn.Module):
    """Causal self-attention whose query, key and value projections have biases, as Qwen2's."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (p(x).view(batch, seq, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(batch, seq, hidden))


def test_a_key_bias_whose_gradient_is_rounding_noise_is_not_refused():
    """The key bias's gradient is zero in exact arithmetic (softmax does not see a shift of a
    query's scores): rounding noise whole and in chunks alike, which the probe held to its own
    size, refusing the block (a review's reproducer; Qwen2's projections have biases). It is held
    to a hundredth of the block's largest gradient: gradients within reassociation."""
    torch.manual_seed(0)
    model = nn.Sequential(_BiasedAttention(), _BiasedAttention())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 40, 32)
    reference(x).square().sum().backward()
    actoff.offload_(model, block_cls=_BiasedAttention, policy="chunked", min_bytes=0, chunk_tokens=8)
    model(x).square().sum().backward()
    # float32 sums over 40 tokens in another order: within 1e-6 of the largest gradient entry (the
    # loss's squares make entries near 50, so RECOMPUTE_TOL's absolute 1e-6 is under one rounding).
    largest = max(p.grad.abs().max().item() for p in reference.parameters())
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6 * largest)


class _GatedShift(nn.Module):
    """Causal attention whose input takes a token shift behind a per-channel gate starting at zero
    (RWKV's time mix): the shift's whole gradient is the gate's, 0.14% of the block's largest."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(hidden)
        self.gate = nn.Parameter(torch.zeros(hidden))
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        for linear in (self.q, self.k, self.v, self.o):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        y = self.norm(x)
        y = y + self.gate * (F.pad(y, (0, 0, 1, 0))[:, :-1] - y)
        q, k, v = (p(y).view(batch, seq, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(batch, seq, hidden))


@pytest.mark.parametrize("half", [False, True], ids=["float32", "bf16_autocast"])
def test_a_token_shift_behind_a_gate_at_zero_is_refused(half):
    """The probe holds a gradient that is rounding noise to a share of the block's largest in
    float32 only: in half precision that floor let this shift through, its gate's gradient 2.4%
    off (a review's reproducer)."""
    torch.manual_seed(0)
    model = _chunked(nn.Sequential(_GatedShift(), _GatedShift()), 256, block_cls=_GatedShift)
    with pytest.raises(ChunkMismatchError, match="first 512 tokens"):
        with torch.autocast("cpu", torch.bfloat16, enabled=half):
            loss = model(torch.randn(2, 520, 32)).square().sum()
        loss.backward()


def test_only_the_inputs_are_stored():
    model = _chunked(make_model(), 8)
    train(model, 1, seq=33)
    for block in actoff.stats().blocks.values():
        assert block.tensors == 3  # the hidden states and the rotary tables, nothing of the body
        assert block.bytes_per_tier["cpu"] == block.bytes_saved > 0
        assert block.recompute_ms > 0  # the runs again in backward, timed as a checkpoint's


def test_backward_holds_a_chunk_where_checkpoint_holds_the_block():
    """On the simulated device (every allocation counted): the step's peak under chunks of 16
    tokens is below the checkpoint's at 257 tokens, which runs the whole block again."""
    model = make_model(num_layers=2, hidden_size=64, intermediate_size=512)
    expected = train(copy.deepcopy(model), 1, seq=257)
    peaks = {}
    for policy, net in (("checkpoint", copy.deepcopy(model)), ("chunked", model)):
        extra = {"chunk_tokens": 16} if policy == "chunked" else {}
        actoff.offload_(net, block_cls=Block, policy=policy, min_bytes=0, **extra)
        with simulated_device(seed=3) as device:
            history = train(net, 1, seq=257)
            peaks[policy] = device.memory.peak
        assert_close_history(expected, history)
        actoff.reset()
    assert peaks["chunked"] < peaks["checkpoint"], peaks


def test_a_blocks_inputs_come_back_at_its_own_backward_not_at_the_next_blocks():
    """(Note [no fetch ahead of chunks]) on the simulated device, where records are copied back,
    the most bytes fetched and not let go at once are one block's inputs; a fetch window in bytes
    still fetches the block before's ahead."""
    model = make_model(num_layers=3, hidden_size=64)
    expected = train(copy.deepcopy(model), 1, seq=64)
    fetched, inputs = {}, {}
    for window in (None, "1GiB"):
        net = copy.deepcopy(model)
        actoff.offload_(
            net, block_cls=Block, policy="chunked", min_bytes=0, chunk_tokens=16, fetch_window=window
        )
        with simulated_device(seed=2):
            history = train(net, 1, seq=64)
            stats = actoff.stats()
        assert_close_history(expected, history)
        fetched[window] = stats.fetched_peak_bytes
        inputs[window] = sorted(block.bytes_saved for block in stats.blocks.values())
        actoff.reset()
    assert inputs[None] == inputs["1GiB"] and len(set(inputs[None])) == 1, inputs  # the same blocks
    one_block = inputs[None][0]
    assert fetched[None] == one_block, (fetched, one_block)
    assert fetched["1GiB"] >= 2 * one_block, (fetched, one_block)


def test_a_chunked_blocks_inputs_are_not_fetched_ahead_by_the_block_after_it_whatever_its_policy():
    """(Note [no fetch ahead of chunks]) ``[cpu, chunked, cpu]`` at the default window of one
    block: the last block's backward fetches nothing of the chunked block's (nor, behind it, the
    first block's), the chunked block's fetches the first block's; a review's case, where the rule
    had been the unpacking block's own."""
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    model = make_model(num_layers=3, hidden_size=64)
    for layer, policy in zip(model.layers, ("cpu", "chunked", "cpu"), strict=True):
        actoff.offload(
            layer, policy=policy, min_bytes=0, **({"chunk_tokens": 16} if policy == "chunked" else {})
        )
    issued = fetches_issued(model.layers)
    with simulated_device(seed=0):
        model.loss(tokens).backward()
    # At each block's output gradient (last block first): which runs' fetches have been issued.
    assert issued == [[False, False, False], [False, False, True], [True, True, True]], issued


def test_once_probed_the_forward_runs_in_chunks_too():
    """(Note [a chunked forward]) the first step's forward runs whole (its rows are the check's and
    the probe's reference), the next ones in chunks, holding less; the losses within
    reassociation (each chunk's attention its own call) and the gradients as the test above."""
    model = make_model(num_layers=2, hidden_size=64, intermediate_size=512)
    expected = train(copy.deepcopy(model), 3, seq=257)
    _chunked(model, 16)
    peaks = []
    with simulated_device(seed=5) as device:
        real = model.hidden

        def hidden(tokens):
            start = device.memory.live
            device.memory.reset_peak()
            out = real(tokens)
            peaks.append(device.memory.peak - start)
            return out

        model.hidden = hidden
        actual = train(model, 3, seq=257)
    assert_close_history(expected, actual)
    # Each later forward under 0.7 of the whole one, not equal to each other: the block's input is
    # let go on the device when its copy to the host lands, before or after the chunks' peak.
    assert max(peaks[1:]) < 0.7 * peaks[0], peaks


def test_under_bf16_autocast_the_rows_check_and_the_gradients_hold():
    """Autocast is restored in the re-runs; the check of a chunk's rows allows bf16 rounding."""
    model = make_model()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    losses = []
    for net in (reference, _chunked(model, 8)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net.loss(tokens)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    # Under autocast a weight's gradient is a bf16 matrix product: rounded once to 8 significant
    # bits (2**-8 of its size) unchunked, once per chunk here (5 chunks) and then summed: at most
    # 6 roundings of 2**-8 of the largest entry apart (a chunk's part taken as no larger).
    for actual, wanted in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            actual.grad, wanted.grad, rtol=0, atol=wanted.grad.abs().max().item() * 6 * 2**-8
        )


# transformers 5 renamed gradient checkpointing; PEFT still reads the old name, which warns.
@pytest.mark.filterwarnings("ignore:`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated:FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_hugging_face_llama_with_its_cache_and_lora(lora):
    """Unmodified Llama layers (position embeddings as a tuple, a fresh cache written once in
    forward); with LoRA only the adapters take gradients, and the frozen weights get none."""
    model = tiny_llama()
    if lora:
        peft = pytest.importorskip("peft", reason="peft is not installed")
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
        )
    reference = copy.deepcopy(model)
    layer_cls = type(reference.get_decoder().layers[0])
    _chunked(model, 8, block_cls=layer_cls)
    tokens = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    out, expected = model(input_ids=tokens, labels=tokens), reference(input_ids=tokens, labels=tokens)
    out.loss.backward()
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=0)
    trained = 0
    for (name, actual), wanted in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (actual.grad is None) == (wanted.grad is None), name
        if wanted.grad is not None:
            trained += 1
            torch.testing.assert_close(actual.grad, wanted.grad, **RECOMPUTE_TOL, msg=name)
    assert trained == (2 * 3 * 2 if lora else sum(1 for _ in model.parameters()))  # layers, targets, A and B
    for layer in out.cache.layers:
        assert layer.keys.shape[-2] == 30  # written once, in forward
    # Probed now, but given a cache its forward still runs whole (Note [a chunked forward]).
    again = model(input_ids=tokens, labels=tokens)
    assert all(layer.keys.shape[-2] == 30 for layer in again.cache.layers)
    torch.testing.assert_close(again.loss, out.loss, rtol=0, atol=0)


_OUTSIDE = nn.Parameter(torch.ones(()))


class _Scratch(nn.Module):
    """A reference block with one change made by ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = make_model().layers[0]
        self.kind = kind
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, cos, sin):
        self.calls += 1  # a buffer the re-runs must give back
        if self.kind == "dropout":
            x = F.dropout(x, 0.1, training=True)
        if self.kind == "twice":
            return self.inner(self.inner(x, cos, sin), cos, sin)
        if self.kind == "mask":
            return (
                x
                + F.scaled_dot_product_attention(
                    x[:, None],
                    x[:, None],
                    x[:, None],
                    attn_mask=torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril(),
                )[:, 0]
            )
        if self.kind == "no_attention":
            return x * 2
        if self.kind == "noise":  # random numbers that are no dropout: each re-run would draw others
            x = x + 0.01 * torch.randn_like(x)
        if self.kind == "outside":  # a weight that is not the block's: it would get no gradient
            return self.inner(x, cos, sin) * _OUTSIDE
        out = self.inner(x, cos, sin)
        if self.kind == "cumsum":  # mixes tokens outside attention: its re-run on a chunk differs
            out = out + x.cumsum(1) * 0.1
        return out


def _scratch_model(kind: str) -> nn.Module:
    model = make_model()
    model.layers[0] = _Scratch(kind)
    return model


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("dropout", "draws dropout"),
        ("twice", "more than once"),
        ("mask", "explicit mask"),
        ("no_attention", "does not call scaled_dot_product_attention"),
        ("outside", "neither an input nor a parameter of the block"),
        ("noise", "draws random numbers"),
    ],
)
def test_a_block_of_another_shape_is_refused_in_forward(kind, says):
    model = _chunked(_scratch_model(kind), 8, block_cls=_Scratch)
    tokens = torch.randint(0, 256, (2, 33))
    with pytest.raises(ChunkedShapeError, match=says) as raised:
        model.loss(tokens)
    assert "'checkpoint'" in str(raised.value)  # and says what takes it


class _Shifted(nn.Module):
    """A reference block whose attention input mixes in the previous token's (a token shift),
    behind an output projection that starts at zero: the outputs do not show the mixing, the
    gradients do."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model().layers[0]
        nn.init.zeros_(self.inner.attn.o_proj.weight)

    def forward(self, x, cos, sin):
        h = self.inner.input_norm(x)
        h = h + 0.5 * F.pad(h[:, :-1], (0, 0, 1, 0))
        x = x + self.inner.attn(h, cos, sin)
        return x + self.inner.mlp(self.inner.post_norm(x))


def test_the_probe_catches_mixing_the_outputs_do_not_show():
    """(Note [the chunked probe]) the rows check passes (the zero projection hides the shift) and
    the gradients would be 12% off; the first backward's probe stops it."""
    model = make_model()
    model.layers[0] = _Shifted()
    _chunked(model, 8, block_cls=_Shifted)
    loss = model.loss(torch.randint(0, 256, (2, 41)))
    with pytest.raises(ChunkMismatchError, match="other gradients"):
        loss.backward()


class _PostNorm(nn.Module):
    """A post-LayerNorm block: its output rows sum to about zero (the rows check scales by their
    magnitudes, not their sums)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model().layers[0]
        self.norm = nn.LayerNorm(64)

    def forward(self, x, cos, sin):
        return self.norm(x + self.inner.attn(x, cos, sin))


@pytest.mark.parametrize("seq", [41, 200])
def test_a_post_norm_block_is_not_refused(seq):
    model = make_model()
    model.layers[0] = _PostNorm()
    reference = copy.deepcopy(model)
    expected = train(reference, 1, seq=seq)
    actual = train(_chunked(model, 7, block_cls=_PostNorm), 1, seq=seq)
    assert_close_history(expected, actual)


def test_a_length_equal_to_the_head_size_runs_as_a_checkpoint_and_says_so():
    """The rotary tables are ``(S, head_dim)``: at S = 16 = head_dim the chunks cannot tell their
    token dimension; the call runs as a checkpoint (exact), with one warning and the reason in the
    statistics (Note [no silent downgrade])."""
    model = make_model()
    expected = train(copy.deepcopy(model), 1, seq=17)  # 16 tokens in, 16 targets
    with pytest.warns(RuntimeWarning, match="several dimensions as long as the sequence"):
        actual = train(_chunked(model, 8), 1, seq=17)
    assert_same_history(expected, actual)
    assert all("several dimensions" in b.stored_whole for b in actoff.stats().blocks.values())


def test_differentiating_twice_raises_instead_of_a_wrong_second_order_gradient():
    model = _chunked(make_model(), 8)
    loss = model.loss(torch.randint(0, 256, (2, 33)))
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        sum(grad.square().sum() for grad in grads).backward()


class _Fp32Mlp(nn.Module):
    """A block whose MLP runs in float32 under the step's bf16 autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model().layers[0]

    def forward(self, x, cos, sin):
        x = x + self.inner.attn(self.inner.input_norm(x), cos, sin)
        with torch.autocast("cpu", enabled=False):
            return x.float() + self.inner.mlp(self.inner.post_norm(x).float())


def test_backward_does_not_run_under_the_forwards_autocast():
    """Only the re-runs take the forward's autocast: autograd called inside it cast a float32
    MLP's backward to bf16 (3.8e-3 off in one chunk). One chunk: the same kernels as unchunked."""
    model = make_model()
    model.layers[0] = _Fp32Mlp()
    reference = copy.deepcopy(model)
    _chunked(model, 64, block_cls=_Fp32Mlp)
    tokens = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(0))
    for net in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net.loss(tokens)
        loss.backward()
    for name in ("gate_proj", "up_proj", "down_proj"):
        actual = getattr(model.layers[0].inner.mlp, name).weight.grad
        torch.testing.assert_close(
            actual, getattr(reference.layers[0].inner.mlp, name).weight.grad, **RECOMPUTE_TOL
        )


def test_a_block_mixing_tokens_outside_attention_stops_backward():
    """Without the rows check the chunks would run on, with wrong gradients: the cumulative sum
    of a chunk's rows is not the forward's rows."""
    model = _chunked(_scratch_model("cumsum"), 8, block_cls=_Scratch)
    loss = model.loss(torch.randint(0, 256, (2, 33)))
    with pytest.raises(ChunkMismatchError, match="did not give the rows"):
        loss.backward()


def test_the_re_runs_leave_the_block_as_the_forward_left_it():
    model = _chunked(_scratch_model("plain"), 8, block_cls=_Scratch)
    model.loss(torch.randint(0, 256, (2, 33))).backward()  # five chunks, run twice each
    assert int(model.layers[0].calls) == 1


def test_state_a_block_changes_changes_once_a_step_as_without_actoff():
    """(Note [state a chunked forward changes]) once probed, the forward runs in chunks, which
    called the block's forward once per chunk and per keys pass: its counter stood at 17 after 3
    steps (before). The changed state is given back and the block runs whole from then on: the
    counter goes up once a step, and the gradients are the unchunked block's."""
    model = _scratch_model("plain")
    expected = train(copy.deepcopy(model), 3)
    with pytest.warns(RuntimeWarning, match="changes its own state"):  # said once, and in the statistics
        actual = train(_chunked(model, 8, block_cls=_Scratch), 3)
    assert int(model.layers[0].calls) == 3
    assert "changes its own state" in actoff.stats().blocks["layers.0"].stored_whole
    assert_close_history(expected, actual)


class _Holder:
    """A plain object a block keeps its figures in."""

    def __init__(self) -> None:
        self.stats = {"losses": []}


class _Collector:
    """A callable object that collects losses (a second review's: callables were not walked)."""

    def __init__(self) -> None:
        self.losses: list = []

    def __call__(self, loss) -> None:
        self.losses.append(loss)


class _Slotted:
    __slots__ = ("loss",)


class _Keeps(nn.Module):
    """A reference block that keeps an auxiliary loss outside its output, ``how`` says where (a
    review's reproducers, all of which trained on without the loss's gradient)."""

    def __init__(self, inner: nn.Module, how: str) -> None:
        super().__init__()
        self.inner, self.how, self.losses, self.logs, self.holder = inner, how, [], {"aux": []}, _Holder()
        self.register_buffer("aux_buffer", torch.zeros(()))
        self.written = torch.zeros(())
        self.collect, self.queue, self.slotted = _Collector(), collections.deque(), _Slotted()
        # One object reached twice: first with no depth left, then from nearer (was skipped).
        shared: dict = {"losses": []}
        self.deep = {"a": {"b": shared}}
        self.near = shared

    def forward(self, x, cos, sin, given=None):
        out = self.inner(x, cos, sin)
        aux = out.square().mean()
        if self.how == "attribute":
            self.aux = aux
        elif self.how == "list":
            self.losses.append(aux)
        elif self.how == "buffer":
            self.aux_buffer = aux
        elif self.how == "tuple":
            self.pair = (aux, 1)
        elif self.how == "list in a dict":
            self.logs["aux"].append(aux)
        elif self.how == "plain object":
            self.holder.stats["losses"].append(aux)
        elif self.how == "written in place":
            self.written.copy_(aux)
        elif self.how == "list given":
            given.append(aux)
        elif self.how == "collector":
            self.collect(aux)
        elif self.how == "deque":
            self.queue.append(aux)
        elif self.how == "slots":
            self.slotted.loss = aux
        elif self.how == "reached twice":
            self.near["losses"].append(aux)
        return out


class _Gives(nn.Module):
    """Calls a `_Keeps` block with a list of its own as an argument."""

    def __init__(self, keeps: _Keeps, given: list) -> None:
        super().__init__()
        self.keeps, self.given = keeps, given

    def forward(self, x, cos, sin):
        return self.keeps(x, cos, sin, given=self.given)


KEPT = [
    "attribute", "list", "buffer", "tuple", "list in a dict", "plain object", "written in place", "list given",
    "collector", "deque", "slots", "reached twice",
]  # fmt: skip


@pytest.mark.parametrize("how", KEPT)
def test_an_auxiliary_loss_kept_outside_the_output_is_refused_not_left_without_its_gradient(how):
    """Run without grad, the kept loss had no graph: a loss adding it gave the weights none of its
    gradient (before: the step trained on; a list given to the block got nothing at all, the
    block's call getting a copy). Refused, naming where, the block as it was."""
    model = make_model()
    given: list = []
    model.layers = nn.ModuleList(_Gives(_Keeps(layer, how), given) for layer in model.layers)
    _chunked(model, 8, block_cls=_Keeps)
    says = (
        "changes a list or dictionary it is given"
        if how == "list given"
        else "keeps a tensor outside its output"
    )
    with pytest.raises(ChunkedShapeError, match=says) as raised:
        model.loss(torch.randint(0, 256, (2, 33)))
    assert "'checkpoint'" in str(raised.value)
    for layer in (outer.keeps for outer in model.layers):
        assert not hasattr(layer, "aux") and not hasattr(layer, "pair") and layer.losses == []
        assert layer.logs == {"aux": []} and layer.holder.stats == {"losses": []} and given == []
        assert layer.aux_buffer.item() == 0 and layer.written.item() == 0
        assert layer.collect.losses == [] and len(layer.queue) == 0 and layer.near == {"losses": []}
        assert not hasattr(layer.slotted, "loss")


class _Counts(nn.Module):
    """A reference block counting its calls two levels down (a second review's: changed per chunk)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.stats = inner, {"moe": {"tokens": torch.zeros((), dtype=torch.long), "lengths": []}}

    def forward(self, x, cos, sin):
        self.stats["moe"]["tokens"] += x.shape[1]
        self.stats["moe"]["lengths"].append(x.shape[1])
        return self.inner(x, cos, sin)


def test_state_two_levels_down_changes_once_a_call():
    model = make_model()
    model.layers = nn.ModuleList(_Counts(layer) for layer in model.layers)
    expected = train(copy.deepcopy(model), 3)
    with pytest.warns(RuntimeWarning, match="changes its own state"):
        actual = train(_chunked(model, 8, block_cls=_Counts), 3)
    for layer in model.layers:
        assert int(layer.stats["moe"]["tokens"]) == 3 * 32 and layer.stats["moe"]["lengths"] == [32] * 3
    assert_close_history(expected, actual)


class _CountsCalls(_Counts):
    """`_Counts`, also counting its calls where `Reached` does not look (a ``functools.partial``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__(inner)
        self.calls = functools.partial(lambda held: held, [])

    def forward(self, x, cos, sin):
        self.calls().append(x.shape[1])
        return super().forward(x, cos, sin)


def test_reset_forgets_the_probes_and_the_state_it_learned():
    """`actoff.reset` forgets what a runtime learned (token-wise probes, auto's plans); the chunked
    placement's probes and its blocks that change their state were kept for the process, so after
    a reset the same steps ran other calls than the first time (no probe, no run in chunks)."""
    model = make_model()
    model.layers = nn.ModuleList(_CountsCalls(layer) for layer in model.layers)
    runs = []
    for _ in range(2):
        _chunked(model, 8, block_cls=_CountsCalls)
        with pytest.warns(RuntimeWarning, match="changes its own state"):
            train(model, 3)
        runs.append(list(model.layers[0].calls()))
        model.layers[0].calls().clear()
        actoff.reset()
    assert runs[1] == runs[0]
    assert len(runs[0]) > 3 * 2  # probes and chunks: more than a forward and a run again a step


class _ScalesByItsCalls(Block):
    """A reference block dividing its input by a step counter it keeps in a buffer."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, cos, sin):
        self.calls += 1
        return super().forward(x / (1 + self.calls), cos, sin)


def test_each_chunk_runs_again_from_the_state_its_forward_began_with():
    """(Note [runs again start where the forward did]) the chunks ran again on the counter as
    the forward left it, one call later each: the rows differed and the step stopped. Now
    every chunk's call starts from the forward's state: within float32 reassociation."""
    model = make_model()
    blocks = nn.ModuleList(_ScalesByItsCalls(model.config) for _ in model.layers)
    blocks.load_state_dict(model.layers.state_dict(), strict=False)
    model.layers = blocks
    expected = train(copy.deepcopy(model), 3)
    with pytest.warns(RuntimeWarning, match="changes its own state"):
        actual = train(_chunked(model, 8, block_cls=_ScalesByItsCalls), 3)
    assert_close_history(expected, actual)
    assert [int(layer.calls) for layer in model.layers] == [3, 3]


@pytest.mark.filterwarnings("ignore:`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated:FutureWarning")
def test_a_layer_under_hugging_faces_gradient_checkpointing_is_refused_with_the_fix():
    """Its checkpoint ran the layer again outside the chunks: PyTorch's 'Recomputed values ...
    have different metadata' in backward, naming no block (a new user's trial)."""
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _chunked(model, 8, block_cls=type(model.get_decoder().layers[0]))
    tokens = torch.randint(0, 128, (2, 30))
    with pytest.raises(ChunkedShapeError, match=r"gradient_checkpointing_disable\(\)"):
        model(input_ids=tokens, labels=tokens).loss.backward()


class _ViewsAWeight(Block):
    """A reference block mixing its input by a transposed view of a weight of its own (Hugging
    Face's mixtures of experts keep their experts in 3-D weights and use views of them)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.mix = nn.Parameter(
            torch.eye(config.hidden_size) + 0.01 * torch.randn(config.hidden_size, config.hidden_size)
        )

    def forward(self, x, cos, sin):
        return super().forward(x @ self.mix.transpose(0, 1), cos, sin)


def test_a_view_of_a_weight_is_the_weight():
    """The forward's check refused a transposed view of the block's weight as 'a tensor that takes
    gradients and is neither an input nor a parameter' (a new user's trial, on Qwen2-MoE and
    Mixtral's 3-D experts); its gradient reaches the weight through the view."""
    model = make_model()
    blocks = nn.ModuleList(_ViewsAWeight(model.config) for _ in model.layers)
    blocks.load_state_dict(model.layers.state_dict(), strict=False)
    model.layers = blocks
    expected = train(copy.deepcopy(model), 2)
    assert_close_history(expected, train(_chunked(model, 8, block_cls=_ViewsAWeight), 2))


class _HalvesAParameter(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.scale = inner, nn.Parameter(torch.ones(()))

    def forward(self, x, cos, sin):
        with torch.no_grad():
            self.scale.mul_(0.5)
        return self.inner(x, cos, sin) * self.scale


def test_a_block_writing_into_its_parameter_is_refused_and_the_parameter_left_as_one_call_leaves_it():
    """A block halving a parameter in forward: its first backward's runs again halved it once
    more (0.25 where the forward left 0.5) and the step trained on without a word; the second
    stopped on the rows. Parameters are not copied to be given back (Note [runs again start
    where the forward did]): the first forward stops, naming the parameter and the fix."""
    from actoff.runtime.placements.checkpoint import StateChangedError

    model = make_model()
    model.layers = nn.ModuleList(_HalvesAParameter(layer) for layer in model.layers)
    _chunked(model, 8, block_cls=_HalvesAParameter)
    with pytest.raises(
        StateChangedError, match=r"block 'layers.0' wrote into its parameter 'scale'.*chunked"
    ):
        model.loss(torch.randint(0, 256, (2, 32)))


@pytest.mark.parametrize("kind", ["looks", "replaces", "pre"])
def test_a_block_with_a_forward_hook_inside_is_refused(kind):
    """A hook inside the block would see its forward run without grad and in chunks (once per
    chunk and keys pass once probed: before, a hook that looks saw 8-token rows 8 times a step,
    one that replaces an output acted in forward only, and an output it keeps had no graph)."""
    model = _chunked(make_model(), 8)
    mlp = model.layers[0].mlp
    if kind == "pre":
        mlp.register_forward_pre_hook(lambda module, args: None)
    else:
        mlp.register_forward_hook(lambda module, args, output: None if kind == "looks" else output * 1.5)
    with pytest.raises(ChunkedShapeError, match="forward hook on its MLP"):
        model.loss(torch.randint(0, 256, (2, 33)))


def test_a_function_scope_is_refused():
    @actoff.offload(policy="chunked", min_bytes=0, name="fn")
    def block(x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    with pytest.raises(ChunkedShapeError, match="needs the block's module"):
        block(torch.randn(1, 2, 8, 4, requires_grad=True))


def test_the_chunk_setting_is_validated():
    with pytest.raises(ValueError, match="ACTOFF_CHUNK_TOKENS"):
        actoff.Config.from_env({"ACTOFF_CHUNK_TOKENS": "0"})
    assert actoff.Config(policy="chunked", chunk_tokens="512").chunk_tokens == 512


# A function's values on plain tensors: the simulated device adds nothing, and PyTorch's lower-right
# bias (a tensor subclass) cannot be made under its modes (the reason for `_CausalTail` off CUDA).
@pytest.mark.no_sim_device
@pytest.mark.parametrize("key_blocks", [1, 3], ids=["earlier_keys_in_one_call", "in_three"])
@pytest.mark.parametrize("gqa", [True, False], ids=["grouped_keys", "a_key_head_per_query_head"])
@pytest.mark.parametrize(
    "length, start, batch, scale",
    [(40, 27, 1, None), (2100, 700, 1, None), (40, 27, 2, 0.3)],
    ids=["short", "long", "two_sequences_scaled"],
)
def test_the_lower_right_attention_paths_give_the_whole_sequences_rows(
    monkeypatch, gqa, length, start, batch, scale, key_blocks
):
    """The chunk's attention both ways it is served: through PyTorch's lower-right bias (the CUDA
    path: keys repeated per query head for its kernel; here on the CPU, where the bias makes a
    mask) and in two flash calls merged by their log-sum-exp (`_CausalTail`, off CUDA: the earlier
    keys with the query heads of a key head folded into the rows, the chunk's own causal), values
    and gradients against the last rows of causal attention over the whole sequence in float64.
    The bound is the float32 error of SDPA itself over the whole sequence (measured here against
    the same float64 reference), twice, plus one rounding of the largest value: a key's gradient
    sums over up to 1400 query rows, so no fixed tolerance fits every length."""
    from actoff.runtime.placements import chunk_attention
    from actoff.runtime.placements.chunk_attention import _CausalTail, _lower_right_kernel

    monkeypatch.setattr(chunk_attention, "KEY_BLOCK", -(-start // key_blocks))  # the earlier keys: start
    torch.manual_seed(0)
    heads = 2 if gqa else 8
    q = torch.randn(batch, 8, length, 4, requires_grad=True)
    k, v = (torch.randn(batch, heads, length, 4, requires_grad=True) for _ in range(2))
    extra = {"scale": scale, "enable_gqa": gqa}

    def last_rows(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)[
            ..., start:, :
        ]
        return [out, *torch.autograd.grad(out.square().sum(), (q, k, v))]

    exact = last_rows(*(t.detach().double().requires_grad_() for t in (q, k, v)))
    sdpa = last_rows(q, k, v)
    for served in (
        _lower_right_kernel(q[..., start:, :], k, v, length - start, extra),
        _CausalTail.apply(q[..., start:, :], k, v, extra),
    ):
        found = [served, *torch.autograd.grad(served.square().sum(), (q, k, v))]
        for got, own, wanted in zip(found, sdpa, exact, strict=True):
            bound = 2 * (own.double() - wanted).abs().max() + FLOAT32_EPS * wanted.abs().max()
            assert (got.double() - wanted).abs().max() <= bound


@pytest.mark.no_sim_device
def test_a_chunks_key_gradients_go_into_the_running_sums_a_key_block_at_a_time(monkeypatch):
    """Served with ``into`` (Note [a chunk's key gradients in place]), the chunk's attention adds
    its key and value gradients to those buffers and gives the keys none: the values it returns
    otherwise, bit for bit (the same calls on the same keys), and its backward makes no tensor of
    the keys' length: what it allocates is a key block's and the chunk's rows' (under a quarter
    of one key tensor here; the gradients returned whole are two key tensors, and their joins two more)."""
    from actoff.device.sim.memory import DeviceMemory
    from actoff.runtime.placements import chunk_attention

    monkeypatch.setattr(chunk_attention, "KEY_BLOCK", 256)
    torch.manual_seed(0)
    length, start = 8192, 8128
    rows = torch.randn(1, 8, length - start, 16, requires_grad=True)
    keys, values = (torch.randn(1, 2, length, 16, requires_grad=True) for _ in range(2))
    extra = {"scale": None, "enable_gqa": True}
    out = chunk_attention._CausalTail.apply(rows, keys, values, extra)
    returned = torch.autograd.grad(out.square().sum(), (rows, keys, values))
    into = (torch.zeros_like(keys), torch.zeros_like(values))
    loss = chunk_attention._CausalTail.apply(rows, keys, values, {**extra, "into": into}).square().sum()
    memory = DeviceMemory()
    with memory:
        grad_rows, grad_keys = torch.autograd.grad(loss, (rows, keys), allow_unused=True)
    assert grad_keys is None
    assert torch.equal(grad_rows, returned[0])
    assert torch.equal(into[0], returned[1]) and torch.equal(into[1], returned[2])
    assert memory.peak < keys.numel() * keys.element_size() // 4, memory.peak


@pytest.mark.no_sim_device
@pytest.mark.parametrize("flash", [True, False], ids=["flash_takes_the_groups", "keys_repeated"])
def test_grouped_keys_go_to_the_lower_right_kernel_unrepeated_where_flash_takes_them(monkeypatch, flash):
    """Where the flash kernel takes grouped keys (a recent GPU, half precision: told here by
    patching PyTorch's check), the chunk's call gets the key heads as they are (before: repeated
    per query head, 4x Llama-3.1-8B's keys and their gradients up to the chunk's end); else
    repeated for the memory-efficient kernel. Values and gradients as the whole sequence's either way."""
    from actoff.runtime.placements import chunk_attention

    monkeypatch.setattr(chunk_attention, "can_use_flash_attention", lambda params, debug=False: flash)
    heads_seen = []
    real = chunk_attention._ATTENTION

    def spy(q, k, v, **kwargs):
        heads_seen.append(k.shape[-3])
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(chunk_attention, "_ATTENTION", spy)
    torch.manual_seed(0)
    q = torch.randn(1, 8, 40, 4, requires_grad=True)
    k, v = (torch.randn(1, 2, 40, 4, requires_grad=True) for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[..., 27:, :]
    served = chunk_attention._lower_right_kernel(
        q[..., 27:, :], k, v, 13, {"scale": None, "enable_gqa": True}
    )
    assert heads_seen == [2 if flash else 8]
    torch.testing.assert_close(served, whole, **RECOMPUTE_TOL)
    wanted = torch.autograd.grad(whole.square().sum(), (q, k, v))
    for got, grad in zip(torch.autograd.grad(served.square().sum(), (q, k, v)), wanted, strict=True):
        torch.testing.assert_close(got, grad, **RECOMPUTE_TOL)


# Shapes SDPA takes that PyTorch's CPU flash kernels, called directly, do not (a review's
# reproducers: an error in backward, or NaN rows and a corrupted heap with keys broadcast).
@pytest.mark.no_sim_device
@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 4, 40, 8), (1, 4, 40, 8), (1, 4, 40, 8)),
        ((1, 4, 40, 8), (1, 4, 40, 8), (1, 4, 40, 12)),
        ((8, 40, 8), (8, 40, 8), (8, 40, 8)),
        ((1, 4, 40, 8), (1, 1, 40, 8), (1, 1, 40, 8)),
    ],
    ids=[
        "keys_broadcast_over_the_batch",
        "value_heads_of_another_size",
        "three_dim",
        "one_key_head_broadcast",
    ],
)
def test_a_chunks_attention_of_any_shape_sdpa_takes_gives_the_whole_sequences_rows(shapes):
    """A chunk's attention served off CUDA (`ChunkMode`: the flash kernels where they take the
    shapes, else blocks of rows run again in backward) against the last rows of SDPA over the
    whole sequence: values and the gradients of the queries, keys and values."""
    from actoff.runtime.placements.chunk_attention import ChunkMode

    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, requires_grad=True) for shape in shapes)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., 27:, :]
    wanted = torch.autograd.grad(whole.square().sum(), (q, k, v))
    mode = ChunkMode(27, 40, k.detach(), v.detach())
    with mode:
        served = F.scaled_dot_product_attention(
            q[..., 27:, :], k[..., 27:, :], v[..., 27:, :], is_causal=True
        )
    torch.testing.assert_close(served, whole, **RECOMPUTE_TOL)
    got = torch.autograd.grad(served.square().sum(), (q, *mode.served))
    for got_grad, grad in zip(got, wanted, strict=True):
        torch.testing.assert_close(got_grad, grad, **RECOMPUTE_TOL)


@pytest.mark.gpu
def test_on_cuda_the_chunks_hold_less_than_a_checkpoint_and_train_the_same():
    """The CUDA path (the lower-right bias, bf16): gradients within bf16 rounding of the unchunked
    block's, and the step's peak under a checkpoint's at 16k tokens of a 4-block model."""
    model = make_model(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1536)
    model = model.cuda().to(torch.bfloat16)
    tokens = torch.randint(
        0, 256, (1, 16385), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    peaks, grads = {}, {}
    for policy in ("none", "checkpoint", "chunked"):
        net = copy.deepcopy(model)
        if policy != "none":
            extra = {"chunk_tokens": 2048} if policy == "chunked" else {}
            actoff.offload_(net, block_cls=Block, policy=policy, min_bytes=0, **extra)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        net.loss(tokens).backward()
        torch.cuda.synchronize()
        peaks[policy] = torch.cuda.max_memory_allocated()
        grads[policy] = [p.grad.float() for p in net.parameters()]
        actoff.reset()
    for got, wanted in zip(grads["chunked"], grads["none"], strict=True):
        # bf16: each chunk's products rounded once more (8 chunks: 9 roundings of 2**-8).
        torch.testing.assert_close(got, wanted, rtol=0, atol=wanted.abs().max().item() * 9 * 2**-8)
    assert peaks["chunked"] < peaks["checkpoint"], peaks


def test_the_rows_check_sums_a_step_of_tokens_at_a_time():
    """`row_sums` of a bf16 output in steps of 16 tokens: the same sums as all at once, bit for bit
    (each token's row is reduced alone, the same 128 values in the same order), its temporaries a
    step's float32 copies (3 x 16 x 128 x 4 bytes) and each step's sums (a 512-byte block each:
    64 steps, 32 KiB), not the output's at full length (3 copies of 512 KiB): the chunked forward
    keeps these sums of a whole block's output, and at full length they were its peak on the 8B
    proxy (Note [a chunked forward])."""
    from actoff.device.sim.memory import DeviceMemory
    from actoff.runtime.placements.chunk_backward import row_sums

    x = torch.randn(2, 1024, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    whole = row_sums(x, 1)
    memory = DeviceMemory()
    with memory:
        stepped = row_sums(x, 1, step=16)
    torch.testing.assert_close(stepped, whole, rtol=0, atol=0)
    full_copy = 1024 * 2 * 64 * 4
    assert memory.peak < full_copy // 4, memory.peak


def test_a_chunked_forward_holds_its_output_keys_and_values_and_a_chunk():
    """(Note [a chunked forward]) once probed, a block's forward in chunks of 16 of 1024 tokens
    holds beyond its input its output (one row a token), its keys and values at full length (2 of
    4 heads each: one row between them) and one chunk's activations (under 0.2 of a row here):
    under 2.5 rows, where the rows check's sums of the whole output at once added 0.84."""
    from actoff.reference import rope_tables

    model = make_model(num_layers=1, hidden_size=64, intermediate_size=128)
    _chunked(model, 16)
    seq, peaks = 1024, []
    row = 2 * seq * 64 * 4  # one (2, 1024, 64) float32 tensor
    cos, sin = rope_tables(
        seq, model.config.head_dim, model.config.rope_theta, device="cpu", dtype=torch.float32
    )
    with simulated_device(seed=0) as device:
        for _ in range(3):
            x = torch.randn(2, seq, 64, requires_grad=True)
            start = device.memory.live
            device.memory.reset_peak()
            out = model.layers[0](x, cos, sin)
            peaks.append((device.memory.peak - start) / row)
            out.sum().backward()
    assert peaks[0] > 4 and max(peaks[1:]) < 2.5, peaks  # the first forward runs whole: the probe's
