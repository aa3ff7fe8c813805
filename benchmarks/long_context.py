"""Long-context training benchmark: actoff's policies side by side with the alternatives.

Each policy runs in a fresh process that builds the model once, on the device and in its
dtype, and measures every sequence length in turn, shortest first; the first failure (out of
memory, say) skips the longer lengths, and a crash takes only that policy. Records are
printed as they are made: ``--jsonl`` appends each one to a file at once (flushed), so a run
cut short keeps everything measured so far; ``--time-budget`` stops starting work that could
not finish in time. ``--json`` writes all records at the end; ``--plot`` draws memory over
one step and tokens/s and peak memory against sequence length.

    python benchmarks/long_context.py                       # CPU default, about a minute
    python benchmarks/long_context.py --preset 7b --seq 8k,16k,32k --layers 4 --jsonl out.jsonl
    python benchmarks/long_context.py --preset 7b --find-max-seq --policies keep,checkpoint,cpu
    torchrun --nproc-per-node 2 benchmarks/long_context.py --seq 1k   # DDP: per rank and in total
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# This checkout's actoff (and _common) before any installed copy: a benchmark measures the
# code it sits next to, also when the package is installed elsewhere or not at all.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import JsonLines, format_table, print_header, progress, system_header, write_json

# none: no actoff, autograd keeps every activation; keep: actoff's hooks, nothing moved.
BASELINES = ("none", "checkpoint", "save_on_cpu")
ACTOFF_POLICIES = ("keep", "cpu", "nvme", "tokenwise", "recompute", "auto")
# tokenwise:CPU:NVME gives the token fractions (the rest is recomputed).
DEFAULT_POLICIES = ("none", "keep", "checkpoint", "save_on_cpu", "cpu", "nvme", "tokenwise:0.5:0",
                    "tokenwise:0.25:0.25", "recompute", "auto")  # fmt: skip

PRESETS = {
    # name: model preset, layers, default lengths, batch, dtype
    "cpu": {"model": "small", "layers": 4, "seq": "512,1024", "batch": 1, "dtype": "float32"},
    "1b": {"model": "1b", "layers": 8, "seq": "8k,16k,32k", "batch": 1, "dtype": "bfloat16"},
    "7b": {"model": "7b", "layers": 4, "seq": "4k,8k,16k,32k", "batch": 1, "dtype": "bfloat16"},
}
# Dense bf16 peak FLOP/s for MFU (datasheet values).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def parse_lengths(text: str) -> list[int]:
    """``"4k,8k,16384"`` -> ``[4096, 8192, 16384]``."""
    lengths = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        lengths.append(int(float(part.rstrip("k")) * scale))
    if not lengths or min(lengths) < 2:
        raise SystemExit(f"--seq {text!r}: give lengths like 4k,8k,16384")
    return lengths


# ---------------------------------------------------------------------------------- worker
def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _apply_policy(model, policy: str, nvme_dir: str | None):
    """Returns a context manager to run each step under (for save_on_cpu)."""
    import torch
    import torch.utils.checkpoint

    import actoff
    from actoff.reference import Block

    if policy == "none":
        return contextlib.nullcontext
    if policy == "checkpoint":

        class Checkpointed(torch.nn.Module):
            def __init__(self, block):
                super().__init__()
                self.block = block

            def forward(self, x, cos, sin):
                return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)

        model.layers = torch.nn.ModuleList(Checkpointed(b) for b in model.layers)
        return contextlib.nullcontext
    if policy == "save_on_cpu":
        pin = torch.cuda.is_available()
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)
    # actoff policies read the rest of their settings from ACTOFF_* (e.g. ACTOFF_KEEP_LAST).
    policy, verify = policy.removesuffix("+verify"), policy.endswith("+verify")
    name, *fractions = policy.split(":")
    overrides: dict[str, object] = {"policy": name, "verify": verify or actoff.Config.from_env().verify}
    if fractions:
        overrides["cpu_fraction"] = float(fractions[0])
        overrides["nvme_fraction"] = float(fractions[1]) if len(fractions) > 1 else 0.0
    if nvme_dir and os.environ.get("ACTOFF_NVME_DIR") is None:
        overrides["nvme_dir"] = nvme_dir
    actoff.offload_(model, block_cls=Block, config=actoff.Config.from_env(**overrides))
    return contextlib.nullcontext


#: Variants a policy may carry as suffixes: ``+tile`` runs each block's MLP chunk by chunk
#: (`actoff.tile_`, TILE_TOKENS positions at a time), ``+loss`` computes the head and the loss
#: over chunks of LOSS_TOKENS rows (`actoff.chunked_cross_entropy`), e.g. ``cpu+tile+loss``.
VARIANTS = ("tile", "loss")
TILE_TOKENS = 4096
LOSS_TOKENS = 4096


def split_variants(policy: str) -> tuple[str, frozenset[str]]:
    """``"cpu+tile+loss"`` -> ``("cpu", {"tile", "loss"})``; other suffixes (``+verify``) stay.

    >>> split_variants("checkpoint+loss")
    ('checkpoint', frozenset({'loss'}))
    """
    name, *suffixes = policy.split("+")
    extras = frozenset(s for s in suffixes if s in VARIANTS)
    return "+".join([name, *(s for s in suffixes if s not in VARIANTS)]), extras


def build_model(config, device, dtype):
    """The reference model with its parameters made on ``device`` in ``dtype``: no CPU copy
    first (a 7B-shaped model built on the CPU in float32 took about 15 s per process)."""
    import torch

    from actoff.reference import Transformer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the rotary tables are computed in float32 regardless
    try:
        with torch.device(device):
            return Transformer(config)
    finally:
        torch.set_default_dtype(previous)


def worker(spec: dict):
    """Yield one record per sequence length of ``spec["seqs"]`` (or ``spec["seq"]``), in order.

    The model is built once; after a failure the longer lengths are skipped (they would fail
    too, and the failed step may have left state behind).
    """
    import torch

    from actoff.reference import ModelConfig

    cuda = torch.cuda.is_available()
    ddp = spec.get("ddp")  # {rank, world, address, port} when launched by torchrun
    if ddp is not None:
        import torch.distributed as dist

        os.environ.update(
            RANK=str(ddp["rank"]), WORLD_SIZE=str(ddp["world"]), LOCAL_WORLD_SIZE=str(ddp["local_world"])
        )
        if cuda:
            torch.cuda.set_device(ddp["local_rank"])
        dist.init_process_group("nccl" if cuda else "gloo", store=_rendezvous(ddp, ddp["job"]),
                                rank=ddp["rank"], world_size=ddp["world"])  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = ModelConfig.preset(spec["model"], num_layers=spec["layers"])
    torch.manual_seed(0)
    model = build_model(config, device, getattr(torch, spec["dtype"]))
    policy, extras = split_variants(spec["policy"])
    if "tile" in extras:
        import actoff
        from actoff.reference import MLP

        actoff.tile_(model, module_cls=MLP, max_tokens=TILE_TOKENS)
    step_context = _apply_policy(model, policy, spec.get("nvme_dir"))
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp is not None else model
    hang_after = int(os.environ.get("_ACTOFF_BENCH_HANG_AFTER", "0"))  # tests: a worker that hangs
    failed = None
    for made, seq in enumerate(spec.get("seqs") or [spec["seq"]]):
        if hang_after and made >= hang_after:
            time.sleep(3600)
        record = {**{key: spec[key] for key in ("policy", "batch", "model", "layers", "dtype")}, "seq": seq}
        if ddp is not None:
            record["rank"] = ddp["rank"]
        if failed is not None:
            record.update(status="skipped", error=f"a shorter length failed ({failed})")
        else:
            record.update(_measure(spec, seq, model, net, step_context, config, device))
            if record["status"] != "ok":
                failed = f"seq {seq}: {record['status']}"
                if cuda:
                    torch.cuda.empty_cache()
        yield record


def _measure(spec: dict, seq: int, model, net, step_context, config, device) -> dict:
    """Warm-up and timed steps at one sequence length; the record's measured fields."""
    import torch

    import actoff
    from actoff._runtime import get_runtime

    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, config.vocab_size, (spec["batch"], seq + 1), generator=generator).to(device)
    runtime = get_runtime()

    timeline: list[tuple[float, int, int, int]] = []
    sampling = {"on": False, "t0": 0.0}
    simulated = {"memory": None, "static": 0}  # on a CPU, during the memory step

    def sample() -> None:
        if not sampling["on"]:
            return
        if cuda:
            torch.cuda.synchronize()
            device_bytes = torch.cuda.memory_allocated()
        elif simulated["memory"] is not None:
            device_bytes = simulated["static"] + simulated["memory"].live
        else:
            device_bytes = _rss_bytes()
        host = sum(a.used for a in runtime.arenas.values())
        nvme = sum(s.extents.live_bytes for s in runtime.stores.stores())
        timeline.append((time.perf_counter() - sampling["t0"], device_bytes, host, nvme))

    def after_forward(module, args, output):
        sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: (sample(), grad)[1])

    hooks = [layer.register_forward_hook(after_forward) for layer in model.layers]

    chunked_loss = "loss" in split_variants(spec["policy"])[1]

    def step() -> None:
        with step_context():
            if chunked_loss:  # the head and loss over chunks of tokens: never all the logits
                hidden = model.hidden(tokens[:, :-1]) if net is model else net.module.hidden(tokens[:, :-1])
                loss = actoff.chunked_cross_entropy(
                    hidden, model.head.weight, tokens[:, 1:], shift=False, max_tokens=LOSS_TOKENS
                )
            else:
                logits = net(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
                )
        loss.backward()
        sample()

    cpu_times: list[float] = []  # process CPU seconds per timed step

    def timed_step() -> float:
        if cuda:
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        cpu_times.append(time.process_time() - cpu_start)
        return time.perf_counter() - start

    record: dict = {}
    try:
        for _ in range(spec["warmup"]):
            step()
        for parameter in model.parameters():  # keep grads allocated: static memory counted once
            if parameter.grad is not None:
                parameter.grad.zero_()
        if cuda:
            torch.cuda.synchronize()
            static_bytes = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = [timed_step() for _ in range(max(spec["steps"] - 1, 0))]
            sampling["on"], sampling["t0"] = True, time.perf_counter()
            sample()
            times.append(timed_step())
            sampling["on"] = False
        else:
            times = [timed_step() for _ in range(spec["steps"])]
        stats = actoff.stats()  # of the timed steps
        if not cuda and spec.get("ddp") is None:
            # Note [device memory on a CPU]: one more step on the simulated device, which
            # counts the storages a step allocates (host buffers excluded) as a GPU would.
            memory_fields = _simulated_memory_step(step, model, tokens, simulated, sampling, sample)
    except torch.cuda.OutOfMemoryError as error:
        return {"status": "oom", "error": str(error).splitlines()[0]}
    except Exception as error:  # reported per policy; the other policies still run
        return {"status": "error", "error": f"{type(error).__name__}: {error}"}
    finally:
        for hook in hooks:
            hook.remove()

    times.sort()
    step_s = times[len(times) // 2]
    tokens_per_step = spec["batch"] * seq
    record.update(
        status="ok",
        step_ms=step_s * 1e3,
        # Note [timing on a shared CPU]: the least CPU time of the timed steps; what other
        # processes on the machine do inflates wall time far more than it does this.
        step_cpu_ms=min(cpu_times) * 1e3 if cpu_times else None,
        tokens_per_s=tokens_per_step / step_s,
        act_keep_bytes=sum(b.bytes_per_tier["keep"] for b in stats.blocks.values()),
        act_cpu_bytes=sum(b.bytes_per_tier["cpu"] for b in stats.blocks.values()),
        act_nvme_bytes=sum(b.bytes_per_tier["nvme"] for b in stats.blocks.values()),
        act_recompute_bytes=sum(b.bytes_per_tier["recompute"] for b in stats.blocks.values()),
        copy_ms=sum(b.copy_ms for b in stats.blocks.values()),
        fetch_ms=sum(b.fetch_ms for b in stats.blocks.values()),
        wait_ms=sum(b.wait_ms for b in stats.blocks.values()),
        recompute_ms=sum(b.recompute_ms for b in stats.blocks.values()),
        auto={name: vars(d) for name, d in list(stats.auto.items())[:1]},
        host_arena_bytes=stats.host_capacity,
        nvme_file_bytes=stats.nvme_file_bytes,
        io_backend=stats.io_backend,
        rss_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        timeline=timeline,
    )
    record["recompute_share"] = record["recompute_ms"] / record["step_ms"] if record["step_ms"] else None
    offloaded = record["act_cpu_bytes"] + record["act_nvme_bytes"]
    record["copy_gbps"] = offloaded / (record["copy_ms"] * 1e6) if record["copy_ms"] > 0 else None
    if cuda:
        peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        record.update(
            peak_allocated_bytes=peak_alloc,
            peak_reserved_bytes=peak_reserved,
            fragmentation_bytes=peak_reserved - peak_alloc,
            activation_peak_bytes=peak_alloc - static_bytes,
            static_bytes=static_bytes,
            memory_source="cuda",
        )
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
        flops = config.flops_per_token(seq) * tokens_per_step
        record["mfu"] = flops / step_s / peak if peak and spec["dtype"] == "bfloat16" else None
    else:
        record.update(peak_allocated_bytes=None, peak_reserved_bytes=None, fragmentation_bytes=None,
                      activation_peak_bytes=None, mfu=None, memory_source=None)  # fmt: skip
        if spec.get("ddp") is None:
            record.update(memory_fields)
    return record


def _simulated_memory_step(step, model, tokens, simulated: dict, sampling: dict, sample) -> dict:
    """Note [device memory on a CPU]: a plain CPU device has no allocator to ask, so one more
    step runs inside `actoff.testing.simulated_device`, whose memory mode counts every CPU
    storage allocated while it is active; actoff's host arena and staging buffers are host
    memory and are not counted, as on a GPU. Parameters, gradients (allocated by the earlier
    steps, reused in place) and the tokens are the static bytes; the activation peak is the
    step's peak over what was live when it began. The step is sampled for the memory plot.
    Copies on the simulated device run on its worker threads with no added delay."""
    from actoff.testing import simulated_device

    storages = {}
    for tensor in (*model.parameters(), *model.buffers(), tokens):
        for part in (tensor, tensor.grad):
            if part is not None:
                storage = part.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    static_bytes = sum(storages.values())
    with simulated_device(seed=0, max_delay_s=0.0, max_lag_s=0.0) as device:
        memory = device.memory
        simulated.update(memory=memory, static=static_bytes)
        live_before = memory.live
        memory.reset_peak()
        sampling["on"], sampling["t0"] = True, time.perf_counter()
        sample()
        step()
        sampling["on"] = False
        peak = memory.peak
    simulated["memory"] = None
    return {
        "peak_allocated_bytes": static_bytes + peak,
        "activation_peak_bytes": peak - live_before,
        "static_bytes": static_bytes,
        "memory_source": "simulated device",
    }


#: Policies the interleaved timing compares, in pairs (top, bottom) of the ratio lines.
PAIRS = (("keep", "none"), ("cpu", "save_on_cpu"))
PAIR_ROUNDS = 6


def paired_worker(spec: dict):
    """Yield, per sequence length, the least step time (wall and process CPU) of each policy of
    `PAIRS`, measured interleaved in this one process (Note [timing on a shared CPU]).

    The policies share one set of weights: ``none`` and ``save_on_cpu`` run the plain model,
    ``keep`` and ``cpu`` a copy under actoff each. Every round steps each policy once, in a
    rotated order, so that a burst of load from elsewhere falls on all of them alike. Its step
    times are on one thread: they are not the policies' own rows.
    """
    import copy

    import torch

    import actoff
    from actoff.reference import Block, ModelConfig

    # One intra-op thread: process CPU time is then the work done, whereas idle OpenMP workers
    # spin, and spin longer the busier the machine is. The work is what the ratios compare.
    torch.set_num_threads(1)
    config = ModelConfig.preset(spec["model"], num_layers=spec["layers"])
    torch.manual_seed(0)
    plain = build_model(config, torch.device("cpu"), getattr(torch, spec["dtype"]))
    models = {
        "none": (plain, contextlib.nullcontext),
        "save_on_cpu": (plain, torch.autograd.graph.save_on_cpu),
    }
    for policy in ("keep", "cpu"):
        model = copy.deepcopy(plain)
        actoff.offload_(model, block_cls=Block, config=actoff.Config.from_env(policy=policy))
        models[policy] = (model, contextlib.nullcontext)
    names = [name for pair in PAIRS for name in pair]
    for seq in spec["seqs"]:
        generator = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, config.vocab_size, (spec["batch"], seq + 1), generator=generator)

        def step(name: str, tokens: torch.Tensor = tokens) -> tuple[float, float]:
            model, context = models[name]
            wall, cpu = time.perf_counter(), time.process_time()
            with context():
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                         tokens[:, 1:].reshape(-1))  # fmt: skip
            loss.backward()
            return time.perf_counter() - wall, time.process_time() - cpu

        for name in names:  # warm-up, and gradients allocated once
            step(name)
        walls: dict[str, list[float]] = {name: [] for name in names}
        cpus: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(PAIR_ROUNDS):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                wall, cpu = step(name)
                walls[name].append(wall)
                cpus[name].append(cpu)
        yield {"policy": "interleaved", "seq": seq, "status": "ok", "rounds": PAIR_ROUNDS,
               "step_ms": {name: min(walls[name]) * 1e3 for name in names},
               "step_cpu_ms": {name: min(cpus[name]) * 1e3 for name in names}}  # fmt: skip


# ---------------------------------------------------------------------------------- parent
def run_one(spec: dict, timeout_s: float, on_record=None) -> list[dict]:
    """Run one policy over ``spec["seqs"]`` (or one ``spec["seq"]``) in a fresh process.

    Records are passed to ``on_record`` as the worker prints them; lengths the worker never
    reported (it timed out, crashed or ran out of memory outside a step) get a record saying so.
    """
    seqs = spec.get("seqs") or [spec["seq"]]
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    records: list[dict] = []
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            for line in process.stdout:
                if line.startswith("{"):
                    records.append(json.loads(line))
                    if on_record is not None:
                        on_record(records[-1])
            returncode = process.wait()
        finally:
            timed_out = not timer.is_alive() and process.returncode not in (0, None)
            timer.cancel()
            if process.poll() is None:
                process.kill()
                process.wait()
        stderr.seek(0)
        err = stderr.read()
    base = {key: value for key, value in spec.items() if key not in ("seqs", "ddp")}
    for seq in seqs[len(records) :]:
        if timed_out:
            failure = {"status": "timeout", "error": f"over {timeout_s:.0f} s"}
        else:
            tail = (err.strip().splitlines() or ["no output"])[-1]
            status = "oom" if "out of memory" in err.lower() else "crash"
            failure = {"status": status, "error": f"exit {returncode}: {tail}"}
        records.append({**base, "seq": seq, **failure})
        if on_record is not None:
            on_record(records[-1])
    return records


def add_derived(records: list[dict]) -> None:
    """Share of transfer time hidden under compute, against ``none`` (no actoff) at the same length."""
    plain = {
        (r["seq"], r.get("rank")): r for r in records if r["policy"] == "none" and r.get("status") == "ok"
    }
    for record in records:
        base = plain.get((record["seq"], record.get("rank")))
        transfer_s = (record.get("copy_ms") or 0) / 1e3 + (record.get("fetch_ms") or 0) / 1e3
        if record.get("status") != "ok" or base is None or transfer_s <= 0:
            record["hidden_share"] = None
            continue
        overhead_s = max(0.0, (record["step_ms"] - base["step_ms"]) / 1e3)
        record["hidden_share"] = max(0.0, 1.0 - overhead_s / transfer_s)
        record["step_vs_none"] = record["step_ms"] / base["step_ms"]
    plain = {(r["policy"], r["seq"], r.get("rank")): r for r in records if r.get("status") == "ok"}
    for record in records:
        base = plain.get((record["policy"].removesuffix("+verify"), record["seq"], record.get("rank")))
        if record["policy"].endswith("+verify") and base is not None and record.get("status") == "ok":
            record["verify_cost"] = record["step_ms"] / base["step_ms"] - 1.0


#: Targets for the CPU run (ratios within one run; issue 13): actoff's hooks alone cost at most
#: 3% of a step, the host tier at most 5% more than save_on_cpu, and under ``cpu`` the device
#: holds the activations of about two blocks (MEMO's double buffering) out of ``L``.
KEEP_OVERHEAD_TARGET = 1.03
CPU_VS_SAVE_ON_CPU_TARGET = 1.05
ACTIVATION_SLACK = 0.05


def summarize(records: list[dict], layers: int, *, cuda: bool) -> list[dict]:
    """The ratio lines, per sequence length where their records are all ``ok``: actoff ``keep``
    over ``none`` (hook overhead), ``cpu`` over ``save_on_cpu`` (step time), and ``cpu``'s
    activation peak over ``keep``'s (``none``'s without a keep row) against ``2/L + 5%``.

    Note [timing on a shared CPU]: each policy runs in its own process, minutes apart from the
    others; on a machine shared with other work its step times then vary by several times from
    run to run, wall time and CPU time alike. So on a CPU the step-time ratios come from the
    ``interleaved`` record (`paired_worker`: the four policies stepped in turn in one process,
    least process CPU time of each), or, without one, from the least CPU time of each
    policy's own steps. On CUDA they compare the median wall time (the GPU is not shared)."""
    ok = {(r["policy"], r["seq"]): r for r in records if r.get("status") == "ok" and "rank" not in r}
    step_key = "step_ms" if cuda else "step_cpu_ms"
    what_time = "step time" if cuda else "step CPU time"

    def ratio(top: str, bottom: str, key: str, seq: int) -> float | None:
        interleaved = ok.get(("interleaved", seq))
        if interleaved is not None and key in ("step_ms", "step_cpu_ms"):
            times = interleaved[key]
            return times[top] / times[bottom] if times.get(top) and times.get(bottom) else None
        a, b = ok.get((top, seq)), ok.get((bottom, seq))
        if a is None or b is None or not a.get(key) or not b.get(key):
            return None
        return a[key] / b[key]

    if any(policy == "interleaved" for policy, _ in ok):
        what_time = f"least step CPU time, interleaved in one process over {PAIR_ROUNDS} rounds"
    lines = []
    for seq in sorted({seq for _, seq in ok}):
        keep = "keep" if ("keep", seq) in ok else "none"
        target = 2 / layers + ACTIVATION_SLACK
        candidates = [
            (f"keep overhead (actoff keep / none, {what_time})", ratio("keep", "none", step_key, seq),
             KEEP_OVERHEAD_TARGET),
            (f"cpu / save_on_cpu ({what_time})", ratio("cpu", "save_on_cpu", step_key, seq), CPU_VS_SAVE_ON_CPU_TARGET),
            (f"cpu activation peak / {keep}'s", ratio("cpu", keep, "activation_peak_bytes", seq), target),
        ]  # fmt: skip
        for what, value, bound in candidates:
            if value is not None:
                lines.append(
                    {"seq": seq, "what": what, "ratio": value, "target": bound, "met": value <= bound}
                )
    return lines


def _probe(policy: str, base: dict, seq: int, timeout_s, on_record) -> bool:
    """One training step of ``policy`` at ``seq`` in a fresh process; whether it trained."""
    if callable(timeout_s):  # the time left, asked at each probe
        timeout_s = timeout_s()
    if timeout_s <= 0:
        raise TimeoutError("time budget spent")
    spec = {**base, "policy": policy, "seq": seq, "steps": 1, "warmup": 0}
    status = run_one(spec, timeout_s, on_record)[0]["status"]
    if status == "timeout":  # cut off, not failed: it says nothing about the length
        raise TimeoutError(f"the probe at {seq} ran out of time")
    return status == "ok"


def find_max_seq(policy: str, base: dict, start: int, limit: int, timeout_s,
                 on_record=None) -> tuple[int, int, bool]:  # fmt: skip
    """Doubling then bisection to the longest length that trains.

    ``timeout_s`` is seconds per probe, or a function giving them (the time left). Returns
    the longest length that trained, the number of probes, and whether the search finished
    (False when the time ran out: the length is then a lower bound).
    """
    probes, good, bad, seq = 0, 0, None, start
    try:
        while seq <= limit:
            probes += 1
            ok = _probe(policy, base, seq, timeout_s, on_record)
            print(f"   {policy:<12} seq {seq:>8}: {'ok' if ok else 'fails'}", file=sys.stderr, flush=True)
            if not ok:
                bad = seq
                break
            good, seq = seq, seq * 2
        if bad is None:
            return good, probes, True
        step = max(256, start // 8)
        while bad - good > step:
            middle = (good + bad) // 2 // step * step or step
            if middle in (good, bad):
                break
            probes += 1
            ok = _probe(policy, base, middle, timeout_s, on_record)
            print(f"   {policy:<12} seq {middle:>8}: {'ok' if ok else 'fails'}", file=sys.stderr, flush=True)
            good, bad = (middle, bad) if ok else (good, middle)
    except TimeoutError:  # the time ran out before or during a probe: ``good`` is a lower bound
        return good, probes - 1, False
    return good, probes, True


def gib(value: float | None) -> float | None:
    return None if value is None else value / 2**30


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.get("status") == "ok"]
    policies = list(dict.fromkeys(r["policy"] for r in ok))
    longest = max((r["seq"] for r in ok), default=0)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    sources = {r.get("memory_source") for r in ok}
    if "cuda" in sources:
        memory_label = "GPU allocated"
    elif "simulated device" in sources:
        memory_label = "device allocated (simulated)"
    else:
        memory_label = "process RSS"
    for policy in policies:
        record = next((r for r in ok if r["policy"] == policy and r["seq"] == longest), None)
        if record and record.get("timeline"):
            t, dev, host, nvme = zip(*record["timeline"], strict=True)
            (line,) = axes[0].plot(t, [v / 2**30 for v in dev], label=f"{policy}: {memory_label}")
            if any(host):
                axes[0].plot(
                    t, [v / 2**30 for v in host], "--", color=line.get_color(), label=f"{policy}: host"
                )
            if any(nvme):
                axes[0].plot(
                    t, [v / 2**30 for v in nvme], ":", color=line.get_color(), label=f"{policy}: NVMe"
                )
    axes[0].set(title=f"memory over one step (seq {longest})", xlabel="seconds", ylabel="GiB")
    axes[0].legend(fontsize=7)
    for policy in policies:
        rows = sorted((r for r in ok if r["policy"] == policy), key=lambda r: r["seq"])
        seqs = [r["seq"] for r in rows]
        axes[1].plot(seqs, [r["tokens_per_s"] for r in rows], marker="o", label=policy)
        peak = [gib(r.get("peak_allocated_bytes") or r.get("rss_peak_bytes")) for r in rows]
        axes[2].plot(seqs, peak, marker="o", label=policy)
    axes[1].set(title="throughput", xlabel="sequence length", ylabel="tokens/s", xscale="log")
    ylabel = f"peak {memory_label} (GiB)"
    axes[2].set(title="peak memory", xlabel="sequence length", ylabel=ylabel, xscale="log")
    for axis in axes[1:]:
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """The command line (also what benchmarks/gpu_session.sh's commands are checked against)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape and defaults (cpu without a GPU, else 7b)",
    )
    parser.add_argument("--seq", help="sequence lengths, e.g. 4k,8k,16k")
    parser.add_argument("--layers", type=int, help="number of blocks")
    parser.add_argument("--batch", type=int)
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma list of {', '.join(BASELINES + ACTOFF_POLICIES)}; tokenwise:CPU:NVME sets fractions",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nvme-dir", help="directory for the nvme policy (default: a temp dir)")
    parser.add_argument("--json", help="write all records to this path at the end")
    parser.add_argument("--jsonl", help="append each record to this path as it is made (JSON lines)")
    parser.add_argument("--plot", help="write a PNG to this path")
    parser.add_argument(
        "--find-max-seq", action="store_true", help="longest trainable length per policy (CUDA)"
    )
    parser.add_argument("--max-seq", default="1024k", help="upper limit for --find-max-seq")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process (one policy)")
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole run: no process outlives it, none starts late",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def check_policies(text: str) -> list[str]:
    """The policies of ``--policies``, or SystemExit naming the one that is not known."""
    policies = [p.strip().lower() for p in text.split(",") if p.strip()]
    for policy in policies:
        base, *suffixes = policy.split("+")
        unknown = [s for s in suffixes if s not in (*VARIANTS, "verify")]
        if unknown:
            raise SystemExit(f"policy {policy!r}: unknown suffix +{unknown[0]}; known: +tile, +loss, +verify")
        name, *fractions = base.split(":")
        if name not in BASELINES + ACTOFF_POLICIES or (fractions and name != "tokenwise"):
            raise SystemExit(
                f"unknown policy {policy!r}: choose from {', '.join(BASELINES + ACTOFF_POLICIES)}"
                " (each may end in +tile, +loss, +verify)"
            )
        try:
            [float(f) for f in fractions]
        except ValueError:
            raise SystemExit(
                f"policy {policy!r}: write tokenwise:CPU_FRACTION:NVME_FRACTION, e.g. tokenwise:0.5:0"
            ) from None
    return policies


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if not args.worker and threading.current_thread() is threading.main_thread():
        # Stopped from outside (timeout, a launcher): unwind, so that run_one's finally kills
        # the worker process and the JSON lines file is closed, rather than leave a worker on.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.worker:
        spec = json.loads(args.worker)
        for record in paired_worker(spec) if spec.get("policy") == "interleaved" else worker(spec):
            print(json.dumps(record), flush=True)
        if spec.get("ddp") is not None:
            # A gloo work freed by its thread during interpreter finalisation aborts the process
            # (a torch bug; "terminate called without an active exception"): the record is out,
            # so leave without finalising.
            sys.stderr.flush()
            os._exit(0)
        return 0

    import torch

    preset_name = args.preset or ("7b" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[preset_name]
    if preset_name != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--preset {preset_name} needs a CUDA GPU; use --preset cpu here")
    policies = check_policies(args.policies)
    lengths = parse_lengths(args.seq or preset["seq"])
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="actoff-bench-")
    os.makedirs(nvme_dir, exist_ok=True)
    base = {"model": preset["model"], "layers": args.layers or preset["layers"], "batch": args.batch or preset["batch"],
            "dtype": preset["dtype"], "steps": args.steps, "warmup": args.warmup, "nvme_dir": nvme_dir}  # fmt: skip

    launch = _torchrun_launch()
    if launch is not None and args.find_max_seq:
        raise SystemExit("--find-max-seq runs on one process; launch it without torchrun")
    header = system_header(nvme_dir)
    _store = _host_store(launch) if launch is not None else None  # held: it serves every job of the launch
    if launch is not None:
        header["ranks"] = f"{launch['world']} (DDP; per rank and in total)"
    header.update(
        preset=preset_name,
        model=f"{base['model']}-shaped, {base['layers']} layers, batch {base['batch']}, {base['dtype']}",
    )
    lead = launch is None or launch["rank"] == 0
    if lead:
        print_header("actoff long-context benchmark", header)
    started_s = time.perf_counter()

    def time_left() -> float:
        """Seconds a new process may run: the per-process timeout, within the time budget."""
        if args.time_budget is None:
            return args.timeout
        return min(args.timeout, args.time_budget - (time.perf_counter() - started_s))

    out = JsonLines(args.jsonl if lead else None, header)
    try:
        if args.find_max_seq:
            return _find_max(policies, base, lengths[0], parse_lengths(args.max_seq)[0], time_left, header,
                             args, out)  # fmt: skip
        lengths.sort()  # shortest first: a failure skips the longer ones
        interleaved: list[dict] = []
        shown = progress(policies, len(policies), lambda policy: policy) if lead else policies
        records = []
        for index, policy in enumerate(shown):
            spec = {**base, "policy": policy, "seqs": lengths}
            if (
                launch is not None
            ):  # every job its own key space in the launch's store, the same on every rank
                spec["ddp"] = {**launch, "job": f"job{index}"}
            if time_left() <= 0:
                late = {"status": "not run", "error": "--time-budget spent"}
                for seq in lengths:
                    records.append({**base, "policy": policy, "seq": seq, **late})
                    out.write(records[-1])
                continue
            records.extend(run_one(spec, time_left(), out.write))
        wanted = {name for pair in PAIRS for name in pair}
        if not torch.cuda.is_available() and launch is None and wanted <= set(policies) and time_left() > 0:
            # Note [timing on a shared CPU]: the ratio lines' step times, interleaved.
            spec = {**base, "policy": "interleaved", "seqs": lengths}
            interleaved = run_one(spec, time_left(), out.write)
        if launch is not None:
            records = _gather_to_rank0(records, launch)
            if records is None:
                return 0
    finally:
        out.close()
        if not args.nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    order = {policy: i for i, policy in enumerate(policies)}
    records.sort(key=lambda r: (str(r.get("rank", "")), r["seq"], order.get(r["policy"], len(order))))
    add_derived(records)
    for record in records:
        for key in ("act_keep_bytes", "act_cpu_bytes", "act_nvme_bytes", "act_recompute_bytes", "peak_allocated_bytes",
                    "peak_reserved_bytes", "fragmentation_bytes", "activation_peak_bytes", "rss_peak_bytes"):  # fmt: skip
            record[key.replace("_bytes", "_gib")] = gib(record.get(key))
    columns = [
        *([("rank", "rank")] if any("rank" in r for r in records) else []),
        ("policy", "policy"), ("seq", "seq"), ("status", "status"), ("step_ms", "step ms"), ("step_cpu_ms", "CPU ms"),
        ("tokens_per_s", "tok/s"), ("mfu", "MFU"), ("peak_allocated_gib", "peak GiB"),
        ("peak_reserved_gib", "reserved GiB"), ("fragmentation_gib", "frag GiB"),
        ("activation_peak_gib", "act peak GiB"), ("act_keep_gib", "keep GiB"), ("act_cpu_gib", "cpu GiB"),
        ("act_nvme_gib", "nvme GiB"), ("act_recompute_gib", "recomp GiB"), ("copy_gbps", "copy GB/s"),
        ("hidden_share", "hidden"), ("wait_ms", "wait ms"), ("recompute_share", "recomp share"),
        ("rss_peak_gib", "RSS GiB"),
    ]  # fmt: skip
    print(format_table(records, columns))
    for record in records:
        if record.get("verify_cost") is not None:
            print(f"   ACTOFF_VERIFY cost for {record['policy'].removesuffix('+verify')} at seq {record['seq']}: "
                  f"{record['verify_cost'] * 100:+.1f}% step time")  # fmt: skip
    for record in records:
        if record.get("status") != "ok":
            print(f"   {record['policy']} seq {record['seq']}: {record['status']}: {record.get('error', '')}")
    summary = summarize(records + interleaved, base["layers"], cuda=torch.cuda.is_available())
    if summary:
        print()
    for record in interleaved:
        if record.get("status") == "ok":
            times = ", ".join(f"{name} {record['step_cpu_ms'][name]:.0f} ms ({record['step_ms'][name]:.0f} wall)"
                              for name in record["step_cpu_ms"])  # fmt: skip
            print(f"   seq {record['seq']}: interleaved, least step CPU time of {record['rounds']}: {times}")
    for line in summary:
        print(f"   seq {line['seq']}: {line['what']}: {line['ratio']:.3f}x "
              f"(target <= {line['target']:.3f}x: {'met' if line['met'] else 'NOT met'})")  # fmt: skip
    where = (
        "the simulated device (one extra step)"
        if any(r.get("memory_source") == "simulated device" for r in records)
        else "the GPU"
    )
    print("\nnone: no actoff; keep: actoff's hooks, nothing moved. keep/cpu/nvme/recomp GiB: activation bytes "
          "actoff placed per tier; hidden: share of copy time not added to the step compared with none; wait ms: "
          "backward waiting for copies back; recomp share: token-wise re-forward time / step time; peak and act "
          f"peak GiB: device memory, measured on {where}; step times on the device itself.")  # fmt: skip
    out_summary = {"summary": summary}
    if args.jsonl and lead:
        with open(args.jsonl, "a") as handle:
            handle.write(json.dumps(out_summary) + "\n")
    if args.json:
        write_json(args.json, header, records, summary=summary, interleaved=interleaved)
    if args.plot:
        plot(records, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if all(r.get("status") == "ok" for r in records) else 1


def _torchrun_launch() -> dict | None:
    """Rank facts when torchrun launched this process with more than one rank, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return {
        "rank": int(os.environ["RANK"]),
        "world": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        "address": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "port": int(os.environ.get("MASTER_PORT", "29500")),
    }


def _host_store(launch: dict):
    """The key-value store every job of this launch meets in, or None when torchrun's agent hosts it.

    torchrun's agent already serves a store on MASTER_ADDR:MASTER_PORT for the whole launch
    (``TORCHELASTIC_USE_AGENT_STORE``); under another launcher rank 0 hosts one there itself, for
    as long as this process runs. Either way no second port is needed.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or launch["rank"] != 0:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(launch["address"], launch["port"], launch["world"], is_master=True,
                         timeout=timedelta(minutes=10), wait_for_workers=False)  # fmt: skip


def _rendezvous(launch: dict, name: str):
    """A client of the launch's store with keys under ``name``: one process group per job, no new port."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(launch["address"], launch["port"], launch["world"], is_master=False,
                          timeout=timedelta(minutes=10))  # fmt: skip
    return dist.PrefixStore(f"actoff-bench/{name}/", store)


def _gather_to_rank0(records: list[dict], launch: dict) -> list[dict] | None:
    """All ranks' records on rank 0, plus a ``total`` row per (policy, length); None elsewhere.

    Through the launch's store (a key per rank), not a process group: no collective, so
    nothing of gloo's is left to tear down at exit.
    """
    store = _rendezvous(launch, "gather")
    store.set(f"rank{launch['rank']}", json.dumps(records))
    if launch["rank"] != 0:
        return None
    gathered = [json.loads(store.get(f"rank{rank}")) for rank in range(launch["world"])]
    rows = [record for part in gathered for record in part]
    totals = []
    for policy, seq in dict.fromkeys((r["policy"], r["seq"]) for r in rows):
        group = [r for r in rows if r["policy"] == policy and r["seq"] == seq]
        total = {"policy": policy, "seq": seq, "rank": "total", "status": "ok"}
        if all(r.get("status") == "ok" for r in group):
            total["step_ms"] = max(r["step_ms"] for r in group)  # the step ends with the slowest rank
            total["tokens_per_s"] = sum(r["tokens_per_s"] for r in group)
        else:
            total["status"] = "failed on a rank"
        totals.append(total)
    return rows + totals


def _find_max(policies: list[str], base: dict, start: int, limit: int, time_left, header: dict, args,
              out: JsonLines) -> int:  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--find-max-seq needs a CUDA GPU: on a CPU every tier shares the same host memory")
    records = []
    for done, policy in enumerate(policies):
        # An equal share of the time left for each policy still to search: the first one cannot
        # spend it all (a long search probes many lengths, each a fresh process).
        deadline = time.monotonic() + time_left() / (len(policies) - done)

        def share_left(deadline=deadline) -> float:
            return min(time_left(), deadline - time.monotonic())

        longest, probes, finished = find_max_seq(policy, base, start, limit, share_left, out.write)
        records.append({"policy": policy, "max_seq": longest, "probes": probes,
                        "search": "done" if finished else "cut short by --time-budget (a lower bound)"})  # fmt: skip
        out.write({"result": records[-1]})
    print(format_table(records, [("policy", "policy"), ("max_seq", "longest seq"), ("probes", "probes"),
                                 ("search", "search")]))  # fmt: skip
    if args.json:
        write_json(args.json, header, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
