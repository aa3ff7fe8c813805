"""actoff under torch.distributed on CPU: DDP with gloo, two processes on the loopback device."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _helpers import ROOT, free_port

SCRIPT = textwrap.dedent(
    """
    import copy, os, sys
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp
    sys.path.insert(0, {tests!r})

    def worker(rank, world, port, policy, nvme_dir, out):
        os.environ["RANK"] = str(rank)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
        import actoff
        from actoff.reference import Block
        from _helpers import make_model, train_ddp

        # +unused: DDP finds unused parameters (what Hugging Face's Trainer asks for when its own
        # gradient checkpointing is off), which reentrant checkpointing broke
        unused = policy.endswith("+unused")
        policy = policy.removesuffix("+unused")
        base = make_model()
        expected = train_ddp(copy.deepcopy(base), [33] * 3, rank, find_unused=unused)
        model = copy.deepcopy(base)
        # auto: ranks measure apart, under a budget (a CPU device has none) that forces offloading
        extra = {{"host_bandwidth": f"{{50 * (rank + 1)}}MB", "gpu_budget": "400KiB"}} if policy == "auto" else {{}}
        actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0, nvme_dir=nvme_dir, **extra)
        actual = train_ddp(model, [33] * 3, rank, find_unused=unused)  # auto: measures two steps, plans, runs rank 0's plan
        for (la, ga), (lb, gb) in zip(expected, actual):
            if policy == "auto":  # recompute: float32 reassociation at most
                assert torch.allclose(la, lb, rtol=1e-5, atol=1e-6), (rank, la, lb)
                assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ga, gb)), rank
            else:
                assert torch.equal(la, lb), (rank, la, lb)
                assert all(torch.equal(a, b) for a, b in zip(ga, gb)), rank
        if policy != "auto":
            assert actoff.stats().total_bytes_offloaded > 0
        else:  # compared across ranks by the test (see _write_result)
            stats = actoff.stats()
            assert stats.plan != "none" and all(b.placement != "keep" for b in stats.blocks.values())
            _write_result(out, rank, {{k: vars(v) for k, v in stats.auto.items()}})
        if policy == "nvme":  # the rank's own file, named for messages only: none on disk
            from actoff.runtime.runtime import get_runtime

            (store,) = get_runtime().stores.stores()
            assert os.path.basename(store.path).startswith(f"actoff-rank{{rank}}-pid"), store.path
            assert os.listdir(nvme_dir) == [], os.listdir(nvme_dir)
        actoff.reset()  # closes this rank's file
        _finish(rank)

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]), nprocs=2)
    """
)

# Note [ending a worker]: a gloo work object that its worker thread frees while the process
# exits takes the GIL during interpreter finalisation and aborts the process ("terminate
# called without an active exception"; a core dump shows ~AsyncAllgatherWork in
# ProcessGroupGloo::runLoop). It is a torch bug, seen here about once in 40 runs after both
# ranks had passed. So workers compare ranks through files the test reads (no
# all_gather_object), and once both ranks are past the barrier they leave with os._exit,
# skipping finalisation; actoff's own exit handler is tested in tiers/nvme/test_nvme.py.
PRELUDE = textwrap.dedent(
    """
    import json, os

    def _write_result(out, rank, value):
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(value, f)

    def _finish(rank):
        import sys
        import torch.distributed as dist

        dist.barrier()  # both ranks done with gloo before either tears it down
        dist.destroy_process_group()
        print(f"rank {rank} OK", flush=True)
        sys.stderr.flush()
        os._exit(0)
    """
)


def _read_results(out) -> list:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("policy", ["cpu", "nvme", "auto", "checkpoint+unused", "auto+unused"])
def test_ddp_two_ranks(policy, tmp_path, nvme_dir):
    """cpu, nvme and checkpoint: bit for bit against DDP without actoff; auto: one decision for all
    ranks; with ``find_unused_parameters=True`` too (+unused)."""
    script, out = tmp_path / "ddp.py", tmp_path / "out"
    out.mkdir()
    script.write_text(PRELUDE + SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    done = subprocess.run(
        [sys.executable, str(script), str(free_port()), policy, nvme_dir, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "rank 0 OK" in done.stdout and "rank 1 OK" in done.stdout
    assert os.listdir(nvme_dir) == []  # every rank removed its file at exit
    if policy.startswith("auto"):  # one decision for all ranks: rank 0's
        decisions = _read_results(out)
        assert decisions[0] == decisions[1] and decisions[0], decisions


@pytest.mark.sim_device  # the host arena: copies happen on a device with DMA
def test_host_budget_is_shared_by_the_ranks_on_a_host(monkeypatch):
    from _helpers import make_model, train

    import actoff
    from actoff.reference import Block
    from actoff.runtime.runtime import get_runtime

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0, host_budget="400KiB")
    with pytest.warns(RuntimeWarning, match="host budget"):  # a quarter of it is full
        train(model, 1)
    arena = next(iter(get_runtime().arenas.values()))
    assert arena.budget == 100 * 1024 and arena.capacity <= 100 * 1024


FSDP_SCRIPT = textwrap.dedent(
    """
    import copy, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    sys.path.insert(0, {tests!r})

    def worker(rank, world, port, policy):
        # The mesh fits the machine: one GPU per rank on NCCL, else the CPU on gloo. fully_shard's
        # default mesh is on the accelerator whenever there is one, which a gloo group with a
        # CPU model cannot serve (and two ranks cannot share one GPU under NCCL).
        on_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
        device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
        if on_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{{port}}",
                                rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        import actoff
        from actoff.reference import Block
        from _helpers import make_model

        mesh = init_device_mesh(device.type, (world,))

        def run(model, use_actoff):
            model = model.to(device)
            if use_actoff:  # actoff first, then FSDP2 around the same blocks
                # auto: ranks measure apart (their links differ), under a budget that forces offloading
                extra = {{"host_bandwidth": f"{{50 * (rank + 1)}}MB", "gpu_budget": "400KiB"}} if policy == "auto" else {{}}
                actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0, **extra)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            generator = torch.Generator().manual_seed(100 + rank)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            history = []
            for _ in range(4):
                loss = model.loss(torch.randint(0, 256, (2, 33), generator=generator).to(device))
                loss.backward()
                history.append((loss.detach().clone(), [p.grad.full_tensor() for p in model.parameters()]))
                optimizer.step()
                optimizer.zero_grad()
            return history

        base = make_model()
        expected, actual = run(copy.deepcopy(base), False), run(copy.deepcopy(base), True)
        for (la, ga), (lb, gb) in zip(expected, actual):
            if policy == "auto":  # recompute: float32 reassociation at most
                assert torch.allclose(la, lb, rtol=1e-5, atol=1e-6), (rank, la, lb)
                assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ga, gb)), rank
            else:
                assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb)), rank
        stats = actoff.stats()
        assert stats.total_bytes_offloaded > 0
        if policy == "auto":  # one plan for every rank: rank 0's, broadcast (actoff.runtime.distributed)
            assert stats.plan != "none" and all(b.placement != "keep" for b in stats.blocks.values())
            plans = [None] * world
            dist.all_gather_object(plans, (stats.plan, [b.placement for b in stats.blocks.values()]))
            assert plans[0] == plans[1], plans
        # FSDP's unsharded parameters (and their views) are recognised and never offloaded.
        assert all(block.skipped_param_bytes > 0 for block in stats.blocks.values())
        _finish(rank)

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
    """
)


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_fsdp2_two_ranks_bit_exact(tmp_path, policy):
    """FSDP2 around actoff's blocks: bit for bit under ``cpu``; under ``auto`` with a budget, within
    float32 reassociation, and every rank runs rank 0's plan (issue 38, item 8)."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) is not in this torch")
    script = tmp_path / "fsdp.py"
    script.write_text(PRELUDE + FSDP_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    done = subprocess.run(
        [sys.executable, str(script), str(free_port()), policy], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "rank 0 OK" in done.stdout and "rank 1 OK" in done.stdout


PLAN_SCRIPT = textwrap.dedent(
    """
    import copy, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    sys.path.insert(0, {tests!r})

    def worker(rank, world, port, case, cache, out):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
        import actoff
        import actoff.memory.arenas as layout_module
        import actoff.runtime.runtime as runtime_module
        from actoff.reference import Block
        from _helpers import make_model, train_ddp

        solves = []
        real_solve = layout_module.solve
        layout_module.solve = lambda *a, **k: solves.append(1) or real_solve(*a, **k)
        # same: every rank the same length. differ: rank 1 longer, and its last step longer still
        # (a divergence: rank 1 re-plans alone while rank 0 runs on, no collective involved).
        lengths = {{"same": [[33] * 4, [33] * 4], "differ": [[33] * 4, [49, 49, 49, 65]]}}[case][rank]

        base = make_model()
        expected = train_ddp(copy.deepcopy(base), lengths, rank)
        model = copy.deepcopy(base)
        actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0, plan_cache=cache)

        # Copies out held through each forward: one that lands mid-forward lets its device tensor
        # go, and a later save of the same tensor then misses dedup (a record more on one rank than
        # the other, so the ranks' traces, and plans, differ by timing). Noted, not fixed.
        from actoff.device.base import backend_for
        from actoff.device.sim.device import settings_for

        config = actoff.get_config()
        simulated = settings_for(config.sim_device, config.sim_device_memory, config.sim_device_bandwidth)
        streams = backend_for(torch.device("cpu"), simulated).streams
        actual = train_ddp(model, lengths, rank, forward_context=lambda: streams.hold(copies=True))
        for (la, ga), (lb, gb) in zip(expected, actual):
            assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb)), rank
        arena = next(iter(runtime_module.get_runtime().arenas.values()))
        _write_result(out, rank, {{"plan": arena.plan, "source": actoff.stats().host_plan, "solves": len(solves)}})
        _finish(rank)

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]), nprocs=2)
    """
)


@pytest.mark.parametrize("case", ["same", "differ"])
def test_plan_is_solved_on_rank0_and_broadcast(case, tmp_path):
    """Same buffers: rank 1 installs rank 0's plan and solves nothing (the plan cache, shared
    by both ranks, is written by rank 0 alone). Different lengths and a later divergence on
    rank 1: each rank plans its own buffers and nobody waits on a collective that never comes."""
    script, cache, out = tmp_path / "plan.py", tmp_path / "plans", tmp_path / "out"
    out.mkdir()
    script.write_text(PRELUDE + PLAN_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    env = {**os.environ, "ACTOFF_SIM_DEVICE": "1"}  # the host arena: copies on a device with DMA
    done = subprocess.run(
        [sys.executable, str(script), str(free_port()), case, str(cache), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "rank 0 OK" in done.stdout and "rank 1 OK" in done.stdout
    ranks = _read_results(out)
    plans = [r["plan"] for r in ranks]
    if case == "same":
        assert plans[0] is not None and plans[0] == plans[1], plans  # one layout, rank 0's
        assert ranks[1]["solves"] == 0, ("rank 1 solved although rank 0's plan fits its trace", ranks)
        assert ranks[1]["source"].startswith("rank 0 ("), ranks[1]
        assert ranks[0]["source"].startswith("greedy"), ranks[0]
    else:
        assert plans[0] != plans[1], "ranks with different buffers need different plans"
        for rank in ranks:  # each rank solved its own trace
            assert rank["solves"] > 0 and not rank["source"].startswith("rank 0"), ranks
    if case == "same":  # one trace, one entry (the device arena's plans are cached beside it)
        kinds = [json.loads(path.read_text())["key"]["kind"] for path in cache.iterdir()]
        assert kinds.count("host-arena") == 1, kinds


SEQUENCE_PARALLEL_SCRIPT = textwrap.dedent(
    """
    import copy, sys, warnings
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import torch.nn.functional as F
    import torch.distributed._functional_collectives as fc
    sys.path.insert(0, {tests!r})

    HEADS, HIDDEN, LOCAL = 4, 64, 24  # each rank holds 24 of the sequence's 48 tokens

    def gathered_attention(q, k, v):
        # Sequence parallelism: local queries attend over every rank's keys and values.
        rank, world = dist.get_rank(), dist.get_world_size()
        k = fc.all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=dist.group.WORLD)
        v = fc.all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=dist.group.WORLD)
        rows = torch.arange(q.shape[2]) + rank * q.shape[2]
        mask = rows[:, None] >= torch.arange(k.shape[2])[None, :]  # causal over global positions
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    class Block(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.attention = attention
            self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
            self.qkv, self.out = torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
            self.up, self.down = torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x):  # x: (batch, local tokens, hidden)
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
            x = x + self.out(self.attention(q, k, v).transpose(1, 2).reshape(b, s, HIDDEN))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    def worker(rank, world, port, registered):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
        import actoff

        attention = actoff.register_token_mixer(gathered_attention) if registered == "1" else gathered_attention
        torch.manual_seed(0)
        base = torch.nn.Sequential(*[Block(attention) for _ in range(2)])
        x = torch.randn(2, LOCAL * world, HIDDEN, generator=torch.Generator().manual_seed(5))
        shard = x[:, rank * LOCAL : (rank + 1) * LOCAL]

        def run(model):
            history = []
            for _ in range(3):
                loss = model(shard).square().mean()
                loss.backward()
                history.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
                for p in model.parameters():
                    p.grad = None
            return history

        expected = run(copy.deepcopy(base))
        model = copy.deepcopy(base)
        actoff.offload_(model, block_cls=Block, policy="recompute", min_bytes=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actual = run(model)
        messages = [str(w.message) for w in caught if "token-wise" in str(w.message)]
        recomputed = sum(b.bytes_per_tier["recompute"] for b in actoff.stats().blocks.values())
        if registered == "1":  # the gather is inside the mixer: recompute runs on the local shard
            assert not messages, messages
            assert recomputed > 0, actoff.stats()
            for (la, ga), (lb, gb) in zip(expected, actual):  # float32 reassociation at most
                assert torch.allclose(la, lb, rtol=1e-5, atol=1e-6), (rank, la, lb)
                assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ga, gb)), rank
        else:  # a collective outside any mixer: placed whole, with the fix in the warning
            assert messages and all("register_token_mixer" in m and "all_gather" in m for m in messages), messages
            assert recomputed == 0
            for (la, ga), (lb, gb) in zip(expected, actual):
                assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb)), rank
        _finish(rank)

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
    """
)


@pytest.mark.parametrize("registered", [True, False], ids=["mixer", "unregistered"])
def test_sequence_parallel_shard(registered, tmp_path):
    """Each rank holds a shard of the sequence and its attention gathers keys and values from
    all ranks. With that attention a registered token mixer, token-wise recompute works on the
    local shard (its length is the token dimension); without, the block is placed whole, since a
    re-run would call the gather again on one rank alone, and nothing hangs."""
    script = tmp_path / "sp.py"
    script.write_text(PRELUDE + SEQUENCE_PARALLEL_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    done = subprocess.run(
        [sys.executable, str(script), str(free_port()), "1" if registered else "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "rank 0 OK" in done.stdout and "rank 1 OK" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "tokenwise"])
def test_ddp_on_nccl_is_exact_while_the_allreduces_run(policy):
    """One rank on NCCL: DDP's bucket all-reduces run on NCCL's stream during backward, while
    actoff copies back on its own; both are ordered by events, never by the default stream,
    so gradients equal DDP without actoff (``cpu``: bit for bit; ``tokenwise``: reassociation)."""
    import copy

    import torch
    import torch.distributed as dist
    from _helpers import make_model, train_ddp

    import actoff
    from actoff.reference import Block

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        base = make_model(hidden_size=256, intermediate_size=704).cuda()
        expected = train_ddp(copy.deepcopy(base), [513] * 3, 0)
        model = copy.deepcopy(base)
        actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0)
        actual = train_ddp(model, [513] * 3, 0)
        for (la, ga), (lb, gb) in zip(expected, actual, strict=True):
            if policy == "cpu":
                assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
            else:
                torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
                for a, b in zip(ga, gb, strict=True):
                    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        assert actoff.stats().total_bytes_offloaded > 0
    finally:
        dist.destroy_process_group()
