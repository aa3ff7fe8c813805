"""Shared test helpers: build the reference model and train it with and without actoff."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys

import torch

import actoff
from actoff.reference import Block, ModelConfig, Transformer

#: The tests folder (where this module lives) and the project root above it.
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def free_port(port: int = 0) -> int:
    """A loopback port nobody listens on: ``port`` itself if free (else 0), or any when 0."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return 0
        return sock.getsockname()[1]


def make_model(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.preset("tiny", **changes))


def inject_times(monkeypatch) -> None:
    """auto's forward and attention readers give 1 ms and 0.3 ms a block: measured on a loaded
    machine they would change the plans from run to run."""
    import actoff.runtime.measured

    monkeypatch.setattr(actoff.runtime.measured, "forward_ms", lambda run: 1.0)
    monkeypatch.setattr(actoff.runtime.measured, "attention_ms", lambda run: 0.3)


def sim_steps(model: torch.nn.Module, steps: int, *, seq: int, seed: int = 0):
    """``steps`` steps of ``model``'s loss and backward (tokens of batch 2 drawn from ``seed``) on a
    fresh simulated device: per step, its device peak and ``actoff.stats()``."""
    from actoff.testing import simulated_device

    generator = torch.Generator().manual_seed(seed)
    with simulated_device(seed=0) as device:
        for _ in range(steps):
            device.memory.reset_peak()
            model.loss(torch.randint(0, 256, (2, seq), generator=generator)).backward()
            yield device.memory.peak, actoff.stats()


def keep_peak_of(seq: int, num_layers: int = 4) -> int:
    """The device peak of a step of the reference model at ``seq`` tokens under keep."""
    model = make_model(num_layers=num_layers)
    actoff.offload_(model, block_cls=Block, policy="keep", min_bytes=0)
    peak = max(peak for peak, _ in sim_steps(model, 2, seq=seq))
    actoff.reset()
    return peak


def train(
    model: torch.nn.Module,
    steps: int = 3,
    *,
    batch: int = 2,
    seq: int = 33,
    seed: int = 1,
    retain_graph: bool = False,
    before_backward=None,
):
    """Run ``steps`` SGD steps; return per step the loss and every parameter's gradient.

    Tokens are drawn on the CPU (same on every device) and moved to the model's device;
    ``before_backward()`` runs between forward and backward (e.g. to stall a stream).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    history = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device)
        loss = model.loss(tokens)
        if before_backward is not None:
            before_backward()
        loss.backward(retain_graph=retain_graph)
        if retain_graph:
            loss.backward()
        # A trainable parameter without a gradient is kept as None, for the comparison to catch.
        grads = {
            name: None if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        history.append((loss.detach().clone(), grads))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history


def train_ddp(
    model: torch.nn.Module, lengths: list[int], rank: int, *, find_unused: bool = False, forward_context=None
):
    """DDP around ``model``, one SGD step per sequence length (tokens drawn per rank); per
    step the loss and the gradients, in parameter order. Needs an initialised process group.
    ``forward_context``: a callable giving the context each forward runs in."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    history = []
    for length in lengths:
        tokens = torch.randint(0, 256, (2, length), generator=generator).to(next(model.parameters()).device)
        with forward_context() if forward_context is not None else contextlib.nullcontext():
            logits = ddp(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        history.append((loss.detach().clone(), [p.grad.clone() for p in ddp.parameters()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history


def assert_same_history(expected, actual) -> None:
    """Losses and every gradient bit for bit (rtol=0, atol=0), step by step."""
    assert len(expected) == len(actual)
    for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(expected, actual, strict=True)):
        torch.testing.assert_close(
            loss_b, loss_a, rtol=0, atol=0, msg=lambda m, s=step: f"step {s} loss: {m}"
        )
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(
                grads_b[name],
                grads_a[name],
                rtol=0,
                atol=0,
                msg=lambda m, s=step, n=name: f"step {s} grad {n}: {m}",
            )


#: Recomputed rows against the forward's: float32 reassociation (a kernel picked for fewer rows).
RECOMPUTE_TOL = {"rtol": 1e-5, "atol": 1e-6}

#: float32 machine epsilon, 2**-23 (twice the unit roundoff u = 2**-24).
FLOAT32_EPS = torch.finfo(torch.float32).eps


def reassociation_tolerance(
    reduction_len: int, scale: float, *, dtype: torch.dtype = torch.float32, roundings: int = 0
) -> dict[str, float]:
    """``rtol`` and ``atol`` between two results that sum the same terms in another order.

    Note [reassociation tolerance]: chunking (``tile_``, the chunked loss, a re-run on a
    token slice) runs a matrix product on fewer rows, and BLAS may pick another kernel, with
    another blocking of the reduction, for fewer rows (which row counts do depends on the CPU:
    MKL on an AMD EPYC does for chunks of 2 to 10 rows where an Intel CPU did not, and
    ``MKL_CBWR=COMPATIBLE`` for more). Each entry is then the same float32 sum of K terms
    t_i = a_i·b_i added in another order. Any order is within γ_K·Σ|t_i| ≈ K·u·Σ|t_i| of the
    exact dot product (Higham, Accuracy and Stability of Numerical Algorithms, §3.1, (3.5)),
    so two orders are within 2K·u·Σ|t_i| = K·eps·Σ|t_i|. Products in a chain (an
    MLP: over H, then over I) add their lengths, to first order: ``reduction_len`` is the sum
    of the reduction lengths a value went through on the chunked path.

    Σ|t_i| is not known from the result; ``scale`` stands for it: the largest |entry| of the
    expected tensor. For terms of random sign Σ|t_i| is ~sqrt(K) times a typical entry, but the
    bound adds every rounding with the same sign, while roundings add like a random walk, ~
    sqrt(K) smaller: the two leave the bound above the real differences (measured on the
    chunked loss, the tiled MLP and the reference model, with chunks down to one row, i.e.
    another kernel, and under ``MKL_CBWR=COMPATIBLE``: at most 6.5·eps·scale, against
    K·eps·scale for K = 112 to 480).

    Half precision (``dtype``, e.g. bf16 under autocast): a float32 accumulation rounded to
    ``dtype`` may round to the neighbouring value when the order changes, one ulp, at most
    eps(dtype) relative; ``roundings`` counts those roundings along the chain.

    It still catches a bug: rtol = K·eps is 1e-5 to 6e-5 here, while a dropped, duplicated or
    misplaced chunk or token changes its rows by their own size (relative 1), four to five
    orders of magnitude more (``test_loss.py::test_the_reassociation_tolerance_catches_a_dropped_chunk``).
    """
    bound = reduction_len * FLOAT32_EPS
    if dtype != torch.float32:
        bound += roundings * torch.finfo(dtype).eps
    return {"rtol": bound, "atol": bound * scale}


def assert_close_reassociated(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    reduction_len: int,
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
    roundings: int = 0,
    msg=None,
) -> None:
    """``actual`` equals ``expected`` up to float32 reassociation over ``reduction_len`` terms
    (Note [reassociation tolerance]); ``scale`` defaults to the largest |entry| of ``expected``."""
    if scale is None:
        scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    tolerance = reassociation_tolerance(reduction_len, scale, dtype=dtype, roundings=roundings)
    torch.testing.assert_close(actual, expected, **tolerance, msg=msg)


def assert_close_history(expected, actual, tolerance=RECOMPUTE_TOL) -> None:
    """Losses and every gradient within ``tolerance``, step by step."""
    assert len(expected) == len(actual)
    for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(expected, actual, strict=True)):
        torch.testing.assert_close(loss_b, loss_a, **tolerance, msg=lambda m, s=step: f"step {s} loss: {m}")
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(
                grads_b[name], grads_a[name], **tolerance, msg=lambda m, s=step, n=name: f"step {s} {n}: {m}"
            )


def assert_history_as_placed(expected, actual, *, recomputed: bool) -> None:
    """Bit for bit where every saved tensor came back whole (keep, cpu, nvme: the same kernels on
    the same shapes as without actoff); within ``RECOMPUTE_TOL`` where rows were recomputed on a
    slice of the tokens (fewer rows: BLAS may sum them in another order, Note [reassociation
    tolerance])."""
    if recomputed:
        assert_close_history(expected, actual)
    else:
        assert_same_history(expected, actual)


def baseline_and_offloaded(steps: int = 3, *, model_changes=None, train_kwargs=None, **overrides):
    """Train the same initial model without actoff and with actoff(**overrides)."""
    model = make_model(**(model_changes or {}))
    reference = copy.deepcopy(model)
    expected = train(reference, steps, **(train_kwargs or {}))
    actoff.offload_(model, block_cls=Block, **overrides)
    actual = train(model, steps, **(train_kwargs or {}))
    return expected, actual


def run_without_deadlock(script: str, done: str, what: str, timeout: float) -> None:
    """Run ``script`` in a fresh Python process; it must print ``done`` and exit 0. Running past
    ``timeout`` seconds fails the test as a deadlock: ``what`` waited for a lock it held."""
    import pytest

    try:
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlocked: {what} waited for a lock it held")
    assert result.returncode == 0 and done in result.stdout, result.stderr


class HostEngine:
    """The host core behind the methods `Replay` calls (arenas are torch uint8 tensors)."""

    def __init__(self):
        from actoff._C import HostReplayAllocator

        self.core = HostReplayAllocator()
        self.arenas = []
        self._log = []

    def begin_record(self):
        self.core.begin_record()

    def begin_step(self):
        self.core.begin_step()

    def end_step(self):
        self._log = self.core.end_step()

    def log(self):
        return self._log

    def set_plan(self, sizes, offsets, arena_bytes, lower_bound=0):
        self.lower_bound = lower_bound  # what CudaEngine keeps for actoff.replay_allocator_stats()
        if not self.arenas or self.arenas[-1].numel() < arena_bytes:
            self.arenas.append(torch.empty(max(arena_bytes, 1), dtype=torch.uint8))
        arena = self.arenas[-1]
        self.core.set_plan(list(sizes), list(offsets), arena.data_ptr(), arena.numel())

    def clear_plan(self):
        self.core.clear_plan()

    def stats(self):
        return self.core.stats()


#: The settings of the tiny Llama several tests train without a cache (`tiny_llama(**NO_CACHE)`).
NO_CACHE = {"vocab_size": 256, "intermediate_size": 176, "max_position_embeddings": 128, "use_cache": False}


def tiny_llama(**changes):
    """A 2-layer Hugging Face Llama (hidden 64, 4 heads, 2 KV heads, SDPA), seeded, its config
    changed by ``changes``; skips the test when transformers is not installed."""
    import pytest

    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    settings = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = transformers.LlamaConfig(**{**settings, **changes})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def fetches_issued(layers) -> list[list[bool]]:
    """A list filled, at each layer's output gradient in backward (the last layer's first), with
    whether each scope run of the step has had a fetch issued (Note [fetch per saved tensor])."""
    from actoff.runtime.runtime import get_runtime

    issued: list[list[bool]] = []

    def at_backward(module, args, output):
        output.register_hook(
            lambda grad: issued.append([run.fetch_issued for run in get_runtime().step.runs])
        )

    for layer in layers:
        layer.register_forward_hook(at_backward)
    return issued
