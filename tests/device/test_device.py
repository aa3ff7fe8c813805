"""Device interface: CPU copies; on CUDA, forced stream races and memory against prediction."""

import copy

import pytest
import torch
from _helpers import assert_same_history, make_model, train

import actoff
from actoff.device.base import CpuBackend, backend_for
from actoff.reference import Block, ModelConfig, Transformer


def test_cpu_backend_round_trip_with_padding():
    backend = CpuBackend()
    host = backend.host_empty(64)
    assert host.dtype == torch.uint8 and not host.is_pinned()
    src = torch.arange(16, dtype=torch.float32)
    dst = host[:64].view(torch.float32)
    ticket = backend.copy_to_host(dst, src)
    assert ticket.query() and ticket.elapsed_ms() >= 0
    out, ticket = backend.copy_to_device(dst, pad=3)
    backend.wait(ticket)
    assert out.shape == (19,) and torch.equal(out[3:], src)


def test_backend_for_is_cached_per_device():
    assert backend_for(torch.device("cpu")) is backend_for(torch.device("cpu"))


@pytest.mark.gpu
def test_forced_race_still_exact():
    # Slow the compute stream down after the activations are produced: a copy that does not
    # wait for the compute stream would read unfinished data, and a fetch that the compute
    # stream does not wait for would be used before it lands.
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", hidden_size=256, intermediate_size=704)).cuda()
    reference = copy.deepcopy(model)

    class Sleepy(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, cos, sin):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU spinning before the block's kernels
            return self.block(x, cos, sin)

    for model_ in (model, reference):
        model_.layers = torch.nn.ModuleList(Sleepy(b) for b in model_.layers)
    actoff.offload_(model, block_cls=Sleepy, policy="cpu", min_bytes=0)

    def stall():
        torch.cuda._sleep(20_000_000)

    expected = train(reference, 3, seq=257, before_backward=stall)
    assert_same_history(expected, train(model, 3, seq=257, before_backward=stall))
    assert actoff.stats().total_bytes_offloaded > 0


@pytest.mark.gpu
def test_cpu_policy_lowers_peak_memory_by_what_it_offloads():
    def peak(policy, planner="greedy"):
        actoff.reset()
        torch.manual_seed(0)
        model = Transformer(ModelConfig.preset("small", num_layers=16)).cuda()
        if policy != "none":
            config = actoff.Config(policy=policy, min_bytes=0, planner=planner)
            actoff.offload_(model, block_cls=Block, config=config)
        tokens = torch.randint(0, 1024, (2, 2049), device="cuda")
        model.loss(tokens).backward()  # warm-up: arenas, cuBLAS workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model.loss(tokens).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), actoff.stats().total_bytes_offloaded  # of this step

    keep_peak, _ = peak("keep")
    cpu_peak, offloaded = peak("cpu")
    unplanned_peak, _ = peak("cpu", planner="off")  # without the device arena, for the figures
    print(
        f"keep peak {keep_peak}, cpu peak {cpu_peak} (planner off: {unplanned_peak}), offloaded {offloaded}"
    )
    assert offloaded > 0
    # Issue 2's criterion. The last run's copy and the prefetched run are resident at the
    # peak, so with 16 blocks at most 2/16 of the offloaded bytes are still on the device.
    # Seen on an H100 (2026-11-23): 3.99 GB lower of 9.99 GB offloaded (0.40): the math SDPA
    # (float32, grouped KV heads) saved its weights as two views, each copied; one record since
    # (Note [views of one storage]; 0.52 -> 0.87 on the simulated device). Not yet rerun there.
    assert keep_peak - cpu_peak >= 0.8 * offloaded


@pytest.mark.gpu
def test_cuda_pinned_arena_and_exact_gradients():
    model = make_model().cuda()
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)

    assert_same_history(train(reference, 3, seq=65), train(model, 3, seq=65))
    (arena,) = actoff.runtime.runtime.get_runtime().arenas.values()
    # After the first step the planner's single chunk serves the plan; the bump chunks went back.
    chunks = [*arena._chunks, *([arena.planned] if arena.planned is not None else [])]
    assert chunks and all(chunk.buffer.is_pinned() for chunk in chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("cause", ["pinning fails", "pinned budget"])
def test_cuda_pageable_fallback_gives_exact_gradients(cause, monkeypatch):
    """(Note [pageable fallback]) Pinning that fails, or a pinned budget smaller than the arena,
    gives pageable chunks on CUDA: their copies are synchronous, the gradients the same."""
    from actoff.device.cuda import CudaStreams

    if cause == "pinning fails":
        real = CudaStreams.host_empty

        def capped(self, nbytes, *, pinned=True):
            if pinned:
                raise RuntimeError("CUDA error: out of memory")
            return real(self, nbytes, pinned=False)

        monkeypatch.setattr(CudaStreams, "host_empty", capped)
    model = make_model().cuda()
    reference = copy.deepcopy(model)
    budget = 256 * 1024 if cause == "pinned budget" else None
    settings = {"pinned_budget": budget} if budget else {}
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0, **settings)
    expected = train(reference, 3, seq=65)
    with pytest.warns(RuntimeWarning, match="pinned|PINNED") as warned:
        actual = train(model, 3, seq=65)
    assert_same_history(expected, actual)
    assert len(warned) == 1
    (arena,) = actoff.runtime.runtime.get_runtime().arenas.values()
    chunks = [*arena._chunks, *([arena.planned] if arena.planned is not None else [])]
    assert chunks and all(chunk.buffer.is_pinned() != chunk.pageable for chunk in chunks)
    stats = actoff.stats()
    assert stats.host_pageable_bytes > 0 and arena.memory.pinned_bytes <= (budget or 0)
