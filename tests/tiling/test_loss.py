"""chunked_cross_entropy and chunked_loss_: the LM loss over token chunks, equal to the full loss.

Tolerances. Each row of the hidden-state gradient comes from that token's logits alone, as in
the full loss, but a chunk's product has fewer rows, and BLAS may sum it in another order
for fewer rows (a one-row chunk takes the matrix-vector kernel; which row counts change the
kernel depends on the CPU: on an AMD EPYC chunks of 2 to 10 rows do, and under
MKL_CBWR=COMPATIBLE chunks of 27 rows too). So it equals the full loss's within float32 reassociation over the chunked path's
sums, the logits over H, then the hidden gradient over V (Note [reassociation tolerance],
tests/_helpers.py), and so does every gradient upstream of the head, which carries that
gradient through the same kernels on the same shapes. The loss is a float32 sum over tokens
added chunk by chunk, and the head's weight gradient a sum over tokens: both differ from the
full loss by float32 reassociation, a few units in the last place (loss ~5: rtol=1e-6,
atol=1e-5; weight gradients up to ~0.2: rtol=1e-5, atol=1e-6).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from _helpers import NO_CACHE, assert_close_reassociated, make_model, reassociation_tolerance, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

import actoff
from actoff.reference import rope_tables

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

EXACT = {"rtol": 0, "atol": 0}
HIDDEN_GRAD_LEN = 16 + 96  # _inputs(): a chunk's logits sum over H = 16, its hidden gradient over V = 96
LOSS = {"rtol": 1e-6, "atol": 1e-5}  # a float32 sum over tokens, reassociated by chunk
WEIGHT_GRAD = {"rtol": 1e-5, "atol": 1e-6}  # a float32 sum over tokens, reassociated by chunk


def _loss_and_grads(loss_fn, hidden, weight, bias=None):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    bias = None if bias is None else bias.detach().clone().requires_grad_()
    loss = loss_fn(hidden, weight, bias)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, None if bias is None else bias.grad


def _assert_matches(expected, actual):
    torch.testing.assert_close(actual[0], expected[0], **LOSS, equal_nan=True)
    assert_close_reassociated(actual[1], expected[1], reduction_len=HIDDEN_GRAD_LEN)
    torch.testing.assert_close(actual[2], expected[2], **WEIGHT_GRAD)
    if expected[3] is not None:
        torch.testing.assert_close(actual[3], expected[3], **WEIGHT_GRAD)


def _inputs(batch=2, seq=40, hidden_size=16, vocab=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=generator)  # (B, S, H)
    weight = torch.randn(vocab, hidden_size, generator=generator)  # (V, H)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)  # (B, S)
    return hidden, weight, labels


def _hf_loss(labels, vocab, **kwargs):
    return lambda hidden, weight, bias: ForCausalLMLoss(
        F.linear(hidden, weight, bias), labels, vocab, **kwargs
    )


@pytest.mark.parametrize("chunking", [{"chunks": 1}, {"chunks": 4}, {"chunks": 1000}, {"max_tokens": 7}])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_hugging_face_causal_lm_loss(chunking, with_bias):
    hidden, weight, labels = _inputs()
    labels[0, 5:25] = -100  # padding: ignored, and the mean is over the rest
    bias = torch.randn(weight.shape[0]) if with_bias else None
    expected = _loss_and_grads(_hf_loss(labels, 96), hidden, weight, bias)
    actual = _loss_and_grads(
        lambda h, w, b: actoff.chunked_cross_entropy(h, w, labels, bias=b, **chunking), hidden, weight, bias
    )
    # More chunks than tokens (one-row chunks, the matrix-vector kernel) is within the same
    # reassociation tolerance as any other chunking.
    _assert_matches(expected, actual)


def test_the_reassociation_tolerance_catches_a_dropped_chunk():
    """Note [reassociation tolerance] has teeth: a chunk's hidden-gradient rows dropped or taken
    from the next chunk, or one token's row dropped, fail it by orders of magnitude."""
    hidden, weight, labels = _inputs()
    expected = _loss_and_grads(_hf_loss(labels, 96), hidden, weight)[1].reshape(-1, 16)  # (N, H)
    actual = _loss_and_grads(
        lambda h, w, b: actoff.chunked_cross_entropy(h, w, labels, max_tokens=7), hidden, weight
    )[1].reshape(-1, 16)
    assert_close_reassociated(actual, expected, reduction_len=HIDDEN_GRAD_LEN)
    tolerance = reassociation_tolerance(HIDDEN_GRAD_LEN, expected.abs().max().item())
    dropped, shifted, token = actual.clone(), actual.clone(), actual.clone()
    dropped[14:21] = 0  # the third chunk of 7 rows never written
    shifted[14:21] = actual[21:28]  # the third chunk's rows from the fourth
    token[30] = 0  # one token's row missing
    for broken in (dropped, shifted, token):
        with pytest.raises(AssertionError):
            assert_close_reassociated(broken, expected, reduction_len=HIDDEN_GRAD_LEN)
        excess = ((broken - expected).abs() - tolerance["rtol"] * expected.abs()).max().item()
        assert excess > 10_000 * tolerance["atol"]  # not a near miss: four orders of magnitude


def test_num_items_in_batch_divides_the_sum_as_hugging_face_does():
    hidden, weight, labels = _inputs()
    for count in (torch.tensor(50), 50):  # a tensor (the Trainer's) or an int
        expected = _loss_and_grads(_hf_loss(labels, 96, num_items_in_batch=count), hidden, weight)
        actual = _loss_and_grads(
            lambda h, w, b, n=count: actoff.chunked_cross_entropy(
                h, w, labels, chunks=3, num_items_in_batch=n
            ),
            hidden,
            weight,
        )
        _assert_matches(expected, actual)


def test_ignore_index_and_chunks_where_every_label_is_ignored():
    hidden, weight, labels = _inputs(batch=1, seq=64)
    labels[0, :40] = 7  # a custom ignore_index over the first chunks, whole
    chunked = lambda h, w, b: actoff.chunked_cross_entropy(h, w, labels, max_tokens=16, ignore_index=7)  # noqa: E731
    expected = _loss_and_grads(_hf_loss(labels, 96, ignore_index=7), hidden, weight)
    actual = _loss_and_grads(chunked, hidden, weight)
    _assert_matches(expected, actual)
    assert actual[1][0, :39].abs().max() == 0  # tokens with nothing to predict get no gradient

    labels.fill_(7)  # nothing to predict anywhere: NaN (0/0) and zero gradients, as in torch
    expected = _loss_and_grads(_hf_loss(labels, 96, ignore_index=7), hidden, weight)
    actual = _loss_and_grads(chunked, hidden, weight)
    assert expected[0].isnan() and actual[0].isnan()
    _assert_matches(expected, actual)


def test_unshifted_labels_and_flat_tokens():
    hidden, weight, labels = _inputs()
    flat_hidden, flat_labels = hidden.reshape(-1, 16), labels.reshape(-1)  # (N, H), (N,)
    expected = _loss_and_grads(
        lambda h, w, b: F.cross_entropy(F.linear(h, w), flat_labels), flat_hidden, weight
    )
    actual = _loss_and_grads(
        lambda h, w, b: actoff.chunked_cross_entropy(h, w, flat_labels, shift=False, chunks=5),
        flat_hidden,
        weight,
    )
    _assert_matches(expected, actual)


def _reference_hidden(model, tokens):
    """The reference Transformer's forward up to (not including) its head: (B, S, H)."""
    x = model.embed(tokens)
    cos, sin = rope_tables(tokens.shape[1], model.config.head_dim, model.config.rope_theta, dtype=x.dtype)
    for layer in model.layers:
        x = layer(x, cos, sin)
    return model.norm(x)


def test_reference_model_loss_and_every_gradient():
    model = make_model()
    chunked = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    expected_loss = model.loss(tokens)
    expected_loss.backward()
    hidden = _reference_hidden(chunked, tokens[:, :-1])
    loss = actoff.chunked_cross_entropy(
        hidden, chunked.head.weight, tokens[:, 1:], shift=False, max_tokens=10
    )
    loss.backward()
    torch.testing.assert_close(loss, expected_loss, **LOSS)
    for (name, param), (_, reference) in zip(
        chunked.named_parameters(), model.named_parameters(), strict=True
    ):
        # Only the head's weight sums over chunks; everything before it gets the hidden gradient,
        # equal within reassociation over the logits (H = 64) then the vocabulary (V = 256), through
        # the same kernels on the same shapes: within that tolerance, of each gradient's scale.
        message = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        if name == "head.weight":
            torch.testing.assert_close(param.grad, reference.grad, **WEIGHT_GRAD, msg=message)
        else:
            assert_close_reassociated(param.grad, reference.grad, reduction_len=64 + 256, msg=message)


class _Recorder(TorchDispatchMode):
    """The largest storage any op returns (bytes), and the dtypes of every matrix product."""

    def __init__(self):
        super().__init__()
        self.largest_bytes = 0
        self.matmul_dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.matmul_dtypes.update(arg.dtype for arg in args if isinstance(arg, torch.Tensor))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest_bytes = max(self.largest_bytes, tensor.untyped_storage().nbytes())
        return out


def test_peak_logits_memory_is_one_chunk():
    # Sizes where the logits dwarf everything else (hidden 16-wide, the head 512 x 16): the
    # largest tensor in forward and backward is one chunk's float32 logits, never all of them.
    tokens, hidden_size, vocab, chunks = 256, 16, 512, 8
    hidden, weight, labels = _inputs(batch=1, seq=tokens, hidden_size=hidden_size, vocab=vocab)
    chunk_logits_bytes = tokens // chunks * vocab * 4
    full_logits_bytes = tokens * vocab * 4
    for loss_fn, bound in (
        (_hf_loss(labels, vocab), None),
        (lambda h, w, b: actoff.chunked_cross_entropy(h, w, labels, chunks=chunks), chunk_logits_bytes),
    ):
        with _Recorder() as recorder:
            _loss_and_grads(loss_fn, hidden, weight)
        if bound is None:
            assert recorder.largest_bytes >= full_logits_bytes  # the measure sees the full logits
        else:
            assert recorder.largest_bytes <= bound


def test_autocast_recomputes_the_logits_in_the_forward_dtype():
    hidden, weight, labels = _inputs()
    results = []
    for loss_fn in (
        _hf_loss(labels, 96),
        lambda h, w, b: actoff.chunked_cross_entropy(h, w, labels, chunks=4),
    ):
        hidden_leaf, weight_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(hidden_leaf, weight_leaf, None)
        with _Recorder() as recorder:  # backward outside the autocast block, as in training
            loss.backward()
        results.append((loss.detach(), hidden_leaf.grad, weight_leaf.grad, recorder.matmul_dtypes))
    (loss_a, grad_h_a, grad_w_a, dtypes_a), (loss_b, grad_h_b, grad_w_b, dtypes_b) = results
    assert dtypes_a == dtypes_b == {torch.bfloat16}  # the recompute's head matmul ran in bf16 too
    assert loss_b.dtype == torch.float32  # logits upcast before the loss, as Hugging Face does
    torch.testing.assert_close(loss_b, loss_a, **LOSS)  # bf16 logits alike; float32 sums reassociated
    # Rows computed alike, in bf16 with float32 sums, but on fewer rows: reassociated over H and V,
    # and bf16 roundings another order may send the other way: the logits, their gradient and
    # the hidden-gradient product, and the softmax scales a logit's rounding by up to |logit|
    # (~17 here; one-ulp flips of every logit at once move this gradient by 2.9 eps(bf16) of its
    # largest entry, measured): 4 roundings, 3% of the largest entry.
    assert_close_reassociated(
        grad_h_b, grad_h_a, reduction_len=HIDDEN_GRAD_LEN, dtype=torch.bfloat16, roundings=4
    )
    # Four chunk products each rounded to bf16 (2**-9 relative) and summed in float32, vs one
    # product rounded once: within 2% of the largest entry.
    torch.testing.assert_close(grad_w_b, grad_w_a, rtol=2e-2, atol=2e-2 * grad_w_a.abs().max().item())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, TypeError, "exactly one of chunks=N or max_tokens=N"),
        ({"chunks": 2, "labels": torch.zeros(2, 39, dtype=torch.long)}, ValueError, r"do not match"),
        ({"chunks": 2, "weight": torch.zeros(96, 8)}, ValueError, r"weight \(96, 8\) is not \(V, H\)"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    hidden, weight, labels = _inputs()
    arguments = {"weight": weight, "labels": labels, **kwargs}
    with pytest.raises(error, match=message):
        actoff.chunked_cross_entropy(hidden, arguments.pop("weight"), arguments.pop("labels"), **arguments)


# ---------------------------------------------------------------------------- Hugging Face


def _llama(tie_word_embeddings=False):
    return tiny_llama(**NO_CACHE, tie_word_embeddings=tie_word_embeddings)


def _hf_train(model, steps=3, **call_kwargs):
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 48), generator=generator)
        labels = tokens.clone()
        labels[1, :12] = -100  # a padded prompt
        output = model(input_ids=tokens, labels=labels, **call_kwargs)
        output.loss.backward()
        history.append((output, {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_hugging_face_llama_trains_as_with_its_own_loss(tie_word_embeddings):
    model = _llama(tie_word_embeddings)
    reference = copy.deepcopy(model)
    expected = _hf_train(reference)
    actual = _hf_train(actoff.chunked_loss_(model, max_tokens=20))
    for (output_a, grads_a), (output_b, grads_b) in zip(expected, actual, strict=True):
        assert output_b.logits is None  # never materialised
        torch.testing.assert_close(output_b.loss, output_a.loss, **LOSS)
        for name in grads_a:
            # The head's weight (and, tied, the embedding) sums over chunks; then three SGD steps on
            # reassociated weights: every gradient within float32 reassociation of the reference.
            torch.testing.assert_close(grads_b[name], grads_a[name], **WEIGHT_GRAD)


def test_hugging_face_call_variants():
    model = _llama()
    reference = copy.deepcopy(model)
    actoff.chunked_loss_(model, chunks=3)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    expected = reference(input_ids=tokens, labels=tokens)

    # Without labels the model runs unchanged: real logits, for generation and evaluation.
    torch.testing.assert_close(model(input_ids=tokens).logits, expected.logits, **EXACT)
    # Positional labels (input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels).
    torch.testing.assert_close(model(tokens, None, None, None, None, tokens).loss, expected.loss, **LOSS)
    # return_dict=False: a tuple whose first element is the loss.
    as_tuple = model(input_ids=tokens, labels=tokens, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], expected.loss, **LOSS)
    # Caller-shifted labels (shift_labels) and the Trainer's num_items_in_batch go through as in HF.
    shift_labels = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    count = torch.tensor(30)
    kwargs = {"shift_labels": shift_labels, "num_items_in_batch": count}
    torch.testing.assert_close(
        model(input_ids=tokens, labels=tokens, **kwargs).loss,
        reference(input_ids=tokens, labels=tokens, **kwargs).loss,
        **LOSS,
    )
    assert "forward" not in model.lm_head.__dict__  # the head is left as it was


def test_hugging_face_llama_with_offload_tile_and_chunked_loss():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

    model = _llama()
    expected = _hf_train(copy.deepcopy(model))
    actoff.offload_(model, block_cls=LlamaDecoderLayer, policy="cpu", min_bytes=0)
    actoff.tile_(model, module_cls=LlamaMLP, chunks=4)
    actoff.chunked_loss_(model, max_tokens=32)
    actual = _hf_train(model)
    for (output_a, grads_a), (output_b, grads_b) in zip(expected, actual, strict=True):
        torch.testing.assert_close(output_b.loss, output_a.loss, **LOSS)
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], **WEIGHT_GRAD)
    assert actoff.stats().total_bytes_offloaded > 0


class _ScaledLogits(torch.nn.Module):
    """A causal LM that scales its logits after the head (as Cohere does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.lm_head = torch.nn.Linear(8, 32, bias=False)

    def forward(self, input_ids, labels=None):
        return CausalLMOutputWithPast(logits=self.lm_head(self.embed(input_ids)) * 0.5)


def test_models_the_chunked_loss_cannot_reproduce_are_refused():
    model = actoff.chunked_loss_(_ScaledLogits(), chunks=2)
    tokens = torch.randint(0, 32, (1, 8))
    assert model(tokens).logits.shape == (1, 8, 32)  # without labels: untouched
    with pytest.raises(
        RuntimeError, match="_ScaledLogits changes the logits after lm_head.*remove chunked_loss_"
    ):
        model(tokens, labels=tokens)
    with pytest.raises(TypeError, match="Sequential has no lm_head.*chunked_cross_entropy"):
        actoff.chunked_loss_(torch.nn.Sequential(torch.nn.Linear(2, 2)), chunks=2)
    with pytest.raises(TypeError, match="exactly one of chunks=N or max_tokens=N"):
        actoff.chunked_loss_(_llama())
