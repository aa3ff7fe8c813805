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
from typing import NamedTuple

# This checkout's actoff (and _common) before any installed copy: a benchmark measures the
# code it sits next to, also when the package is installed elsewhere or not at all.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import JsonLines, format_table, print_header, progress, system_header, write_json

from actoff.config import format_bytes, parse_size

# none: no actoff, autograd keeps every activation; keep: actoff's hooks, nothing moved.
BASELINES = ("none", "checkpoint", "save_on_cpu")
ACTOFF_POLICIES = ("keep", "cpu", "nvme", "tokenwise", "recompute", "auto")
# tokenwise:CPU:NVME gives the token fractions (the rest is recomputed).
# --find-max-seq on a CPU: the baselines and actoff's policies, each plain and with tiling and
# the chunked loss. Of the token-wise family, recompute (block inputs and attention outputs in
# host memory, the rest rebuilt in backward) needs the least device memory: its device arena
# holds one block's rebuilt activations where cpu's holds two blocks' fetched ones.
MAXSEQ_CPU_POLICIES = tuple(f"{name}{variant}" for variant in ("", "+tile+loss")
                            for name in ("keep", "checkpoint", "save_on_cpu", "cpu", "recompute", "auto"))  # fmt: skip
# ... and recompute+tile+loss with ACTOFF_PLANNER=off, to weigh what the device arena costs.
MAXSEQ_CPU_POLICIES += ("recompute+tile+loss+noplan",)
DEFAULT_SIM_MEMORY = "128MiB"
DEFAULT_POLICIES = ("none", "keep", "checkpoint", "save_on_cpu", "cpu", "nvme", "tokenwise:0.5:0",
                    "tokenwise:0.25:0.25", "recompute", "auto")  # fmt: skip

PRESETS = {
    # name: model preset, layers, default lengths, batch, dtype
    # On the CPU tiles and loss chunks of 256 tokens: the lengths that fit a small simulated
    # device are a few thousand tokens, and 4096-token chunks would be most of the working memory.
    "cpu": {
        "model": "small",
        "layers": 4,
        "seq": "512,1024",
        "batch": 1,
        "dtype": "float32",
        "tile_tokens": 256,
        "loss_tokens": 256,
    },
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


def _apply_policy(model, policy: str, nvme_dir: str | None, planner_off: bool = False):
    """Returns a context manager to run each step under (for save_on_cpu). ``planner_off``: an
    actoff policy with ``ACTOFF_PLANNER=off`` (the ``+noplan`` variant)."""
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
        if not pin and actoff.get_config().sim_device_memory is not None:
            return _save_on_simulated_host  # Note [save_on_cpu on the simulated device]
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
    if planner_off:
        overrides["planner"] = "off"
    actoff.offload_(model, block_cls=Block, config=actoff.Config.from_env(**overrides))
    return contextlib.nullcontext


def _save_on_simulated_host():
    """Note [save_on_cpu on the simulated device]: on a CPU ``torch.autograd.graph.save_on_cpu``
    keeps each saved tensor as it is (``tensor.cpu()`` of a CPU tensor is the tensor), so under
    the simulated device's memory model it would cost what ``keep`` costs. This is what it does
    on a GPU: pack copies every saved tensor, parameters' views included, into host memory
    (allocated outside the device's count, as pinned memory is), and unpack copies it back into
    a new device tensor."""
    import torch
    from torch.utils._mode_utils import no_dispatch

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        with no_dispatch():  # host memory: not the device's
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout)
            host.copy_(tensor)
        return host

    def unpack(host: torch.Tensor) -> torch.Tensor:
        return host.clone()  # a device allocation, as ``.to(device)`` is

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


#: Variants a policy may carry as suffixes: ``+tile`` runs each block's MLP chunk by chunk
#: (`actoff.tile_`, TILE_TOKENS positions at a time), ``+loss`` computes the head and the loss
#: over chunks of LOSS_TOKENS rows (`actoff.chunked_cross_entropy`), e.g. ``cpu+tile+loss``;
#: ``+noplan`` runs an actoff policy with ``ACTOFF_PLANNER=off``: no device arena, actoff's
#: backward buffers allocated per request and freed after their last use (and the host arena
#: bump-allocated), to weigh what the arena costs in device memory. On CUDA, ``+expandable`` runs
#: the worker with PyTorch's ``expandable_segments:True`` and ``+replay`` under actoff's replay
#: allocator (``ACTOFF_ALLOCATOR=replay``): with ``+noplan`` and the plain policy, four ways to
#: allocate the device's memory, compared by fragmentation and longest sequence.
VARIANTS = ("tile", "loss", "noplan", "expandable", "replay")
#: The worker's environment under each allocator variant (set before CUDA starts).
ALLOCATOR_VARIANTS = {
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "replay": {"ACTOFF_ALLOCATOR": "replay"},
}
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
    # Note [a capped device on a CPU]: with ACTOFF_SIM_DEVICE_MEMORY the whole worker, model
    # included, runs on the simulated device's memory, which raises out of memory past the cap.
    with _capped_device_memory(cuda) as memory:
        torch.manual_seed(0)
        model = build_model(config, device, getattr(torch, spec["dtype"]))
        policy, extras = split_variants(spec["policy"])
        if "tile" in extras:
            import actoff
            from actoff.reference import MLP

            actoff.tile_(model, module_cls=MLP, max_tokens=spec.get("tile_tokens") or TILE_TOKENS)
        step_context = _apply_policy(model, policy, spec.get("nvme_dir"), planner_off="noplan" in extras)
        net = torch.nn.parallel.DistributedDataParallel(model) if ddp is not None else model
        hang_after = int(os.environ.get("_ACTOFF_BENCH_HANG_AFTER", "0"))  # tests: a worker that hangs
        failed = None
        for made, seq in enumerate(spec.get("seqs") or [spec["seq"]]):
            if hang_after and made >= hang_after:
                time.sleep(3600)
            record = {
                **{key: spec[key] for key in ("policy", "batch", "model", "layers", "dtype")},
                "seq": seq,
            }
            if ddp is not None:
                record["rank"] = ddp["rank"]
            if failed is not None:
                record.update(status="skipped", error=f"a shorter length failed ({failed})")
            else:
                record.update(_measure(spec, seq, model, net, step_context, config, device, memory))
                if record["status"] != "ok":
                    failed = f"seq {seq}: {record['status']}"
                    if cuda:
                        torch.cuda.empty_cache()
            yield record


def _capped_device_memory(cuda: bool):
    """Note [a capped device on a CPU]: the simulated device's memory model, capped at
    ``ACTOFF_SIM_DEVICE_MEMORY``, when that is set on a CPU (``--sim-memory`` sets it for the
    workers); else nothing. Entered before the model is built, so weights and gradients count
    as a GPU's would; actoff's host buffers and save_on_cpu's copies do not. A run past the cap
    is out of memory, as on a GPU of that size. Kernels' internal scratch is not seen (the
    count is of the storages operators return), nor an optimizer's state (the steps have none).
    """
    import actoff
    from actoff.testing import device_memory

    if cuda or actoff.get_config().sim_device_memory is None:
        return contextlib.nullcontext()
    return device_memory()


def _measure(spec: dict, seq: int, model, net, step_context, config, device, capped=None) -> dict:
    """Warm-up and timed steps at one sequence length; the record's measured fields.

    ``capped``: the simulated device's memory when the worker runs on it with a cap (Note [a
    capped device on a CPU]); the memory figures then come from it, phase by phase.
    """
    import torch

    import actoff
    from actoff.runtime.runtime import get_runtime

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
            device_bytes = _cuda_memory()[0]
        elif capped is not None:
            device_bytes = capped.live
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

    phases: list[tuple[str, int, int]] = []  # (phase, device bytes live after it, peak during it)

    def mark(phase: str) -> None:
        """The end of a phase of the step on the capped device: its peak, then a new one."""
        if capped is not None:
            phases.append((phase, capped.live, capped.peak))
            capped.reset_peak()

    def step() -> None:
        phases.clear()
        mark("start")
        with step_context():
            if chunked_loss:  # the head and loss over chunks of tokens: never all the logits
                hidden = model.hidden(tokens[:, :-1]) if net is model else net.module.hidden(tokens[:, :-1])
                mark("forward")
                loss = actoff.chunked_cross_entropy(
                    hidden, model.head.weight, tokens[:, 1:], shift=False,
                    max_tokens=spec.get("loss_tokens") or LOSS_TOKENS,
                )  # fmt: skip
            else:
                if net is model:  # the same as model(...), with the head apart for the phases
                    hidden = model.hidden(tokens[:, :-1])
                    mark("forward")
                    logits = model.head(hidden)
                else:
                    hidden, logits = None, net(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
                )
            mark("loss")
            if capped is not None and hidden is not None and hidden.requires_grad:
                hidden.register_hook(lambda grad: (mark("loss backward"), grad)[1])
        loss.backward()
        mark("blocks backward")
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
        if cuda or capped is not None:
            if cuda:
                torch.cuda.synchronize()
                static_bytes = _cuda_memory(reset=True)[0]
            else:
                static_bytes = capped.live
            times = [timed_step() for _ in range(max(spec["steps"] - 1, 0))]
            sampling["on"], sampling["t0"] = True, time.perf_counter()
            sample()
            times.append(timed_step())
            sampling["on"] = False
        else:
            times = [timed_step() for _ in range(spec["steps"])]
        stats = actoff.stats()  # of the timed steps
        if capped is not None:
            memory_fields = _capped_memory_fields(model, tokens, capped, static_bytes, phases, stats)
        elif not cuda and spec.get("ddp") is None:
            # Note [device memory on a CPU]: one more step on the simulated device, which
            # counts the storages a step allocates (host buffers excluded) as a GPU would.
            memory_fields = _simulated_memory_step(step, model, tokens, simulated, sampling, sample)
    except torch.cuda.OutOfMemoryError as error:
        return {"status": "oom", "error": str(error).splitlines()[0]}
    except Exception as error:  # reported per policy; the other policies still run
        if "out of memory" in str(error):  # raised through a hook or autograd, which rewrap errors
            return {"status": "oom", "error": str(error).splitlines()[0]}
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
        _, peak_alloc, peak_reserved = _cuda_memory()
        record.update(
            peak_allocated_bytes=peak_alloc,
            peak_reserved_bytes=peak_reserved,
            fragmentation_bytes=peak_reserved - peak_alloc,
            activation_peak_bytes=peak_alloc - static_bytes,
            static_bytes=static_bytes,
            memory_source=_memory_source(spec["policy"]),
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


def _memory_source(policy: str) -> str:
    replay = "replay" in split_variants(policy)[1]
    return "replay allocator (peaks over the process)" if replay else "cuda"


def _cuda_memory(reset: bool = False) -> tuple[int, int, int]:
    """CUDA bytes allocated now, most allocated and most reserved since the last ``reset``:
    PyTorch's figures, or under ``+replay`` the replay allocator's (torch's read nothing under
    a pluggable allocator; the replay allocator's peaks run over the process, warm-up included,
    whose requests are the measured step's)."""
    import torch

    import actoff

    replay = actoff.replay_allocator_stats()
    if replay.installed:
        return replay.live_bytes, replay.peak_bytes, replay.peak_reserved_bytes
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _capped_memory_fields(model, tokens, memory, static_bytes: int, phases: list, stats) -> dict:
    """The memory figures of the last step on the capped simulated device (Note [a capped
    device on a CPU]): what was live before it (weights and gradients, the tokens, actoff's
    device arena, anything else kept across steps), its peak, and per phase (forward through
    the blocks, the loss, the loss's backward, the blocks' backward) the bytes live at its end
    and its peak, all counted from the same zero as the cap."""
    storages: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        for part in (tensor, tensor.grad):
            if part is not None:
                storage = part.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    peak = max((phase_peak for _, _, phase_peak in phases), default=memory.peak)
    return {
        "peak_allocated_bytes": peak,
        "activation_peak_bytes": peak - static_bytes,
        "static_bytes": static_bytes,
        "weights_grads_bytes": sum(storages.values()),
        "tokens_bytes": tokens.untyped_storage().nbytes(),
        "device_arena_bytes": stats.device_arena_bytes,
        "sim_capacity_bytes": memory.capacity,
        "phases": [list(phase) for phase in phases[1:]],  # after "start"
        "memory_source": "simulated device",
    }


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
    extra = {key: value for variant in split_variants(spec["policy"])[1]
             for key, value in ALLOCATOR_VARIANTS.get(variant, {}).items()}  # fmt: skip
    if spec.get("sim_memory"):  # Note [a capped device on a CPU]
        extra.update(ACTOFF_SIM_DEVICE="1", ACTOFF_SIM_DEVICE_MEMORY=f"{spec['sim_memory']}B")
    env = {**os.environ, **extra} if extra else None
    records: list[dict] = []
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
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
    spec = {"steps": 1, "warmup": 1, **base, "policy": policy, "seq": seq}
    status = run_one(spec, timeout_s, on_record)[0]["status"]
    if status == "timeout":  # cut off, not failed: it says nothing about the length
        raise TimeoutError(f"the probe at {seq} ran out of time")
    return status == "ok"


class MaxSeq(NamedTuple):
    """What `find_max_seq` found: the longest length that trained, the shortest that failed
    (None: none did), the probes run, and whether the search finished (False: the time ran
    out, and ``longest`` is a lower bound; so it is when nothing failed up to the limit)."""

    longest: int
    failed: int | None
    probes: int
    finished: bool


def find_max_seq(policy: str, base: dict, start: int, limit: int, timeout_s, on_record=None, *,
                 precision: float = 0.0) -> MaxSeq:  # fmt: skip
    """Doubling then bisection to the longest length that trains.

    ``timeout_s`` is seconds per probe, or a function giving them (the time left). Bisection
    stops when the bracket is at most ``max(256, start // 8)`` tokens wide, or ``precision``
    times the longest length found (a relative width, for lengths short next to 256). A
    probe that times out ends the search: what was found is a lower bound.
    """
    probes, good, bad, seq = 0, 0, None, start
    step = max(256, start // 8) if not precision else max(1, int(start * precision))
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
            return MaxSeq(good, None, probes, True)
        while bad - good > max(step, int(good * precision)):
            middle = (good + bad) // 2 // step * step or step
            if middle in (good, bad):
                break
            probes += 1
            ok = _probe(policy, base, middle, timeout_s, on_record)
            print(f"   {policy:<12} seq {middle:>8}: {'ok' if ok else 'fails'}", file=sys.stderr, flush=True)
            good, bad = (middle, bad) if ok else (good, middle)
    except TimeoutError:  # the time ran out before or during a probe: ``good`` is a lower bound
        return MaxSeq(good, bad, probes - 1, False)
    return MaxSeq(good, bad, probes, True)


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
        help=f"comma list of {', '.join(BASELINES + ACTOFF_POLICIES)}; tokenwise:CPU:NVME sets fractions; "
        "+tile, +loss variants (default: all, or for --find-max-seq on a CPU each of keep, checkpoint, "
        "save_on_cpu, cpu, recompute, auto, plain and +tile+loss)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nvme-dir", help="directory for the nvme policy (default: a temp dir)")
    parser.add_argument("--json", help="write all records to this path at the end")
    parser.add_argument("--jsonl", help="append each record to this path as it is made (JSON lines)")
    parser.add_argument("--plot", help="write a PNG to this path")
    parser.add_argument(
        "--find-max-seq",
        action="store_true",
        help="longest trainable length per policy: doubling from the first --seq, then bisection (on a CPU: "
        "on the simulated device with --sim-memory)",
    )
    parser.add_argument("--max-seq", help="upper limit for --find-max-seq (default 1024k; 8k on a CPU)")
    parser.add_argument(
        "--sim-memory",
        help="on a CPU: train on the simulated device with this much device memory (e.g. 128MiB; sets "
        "ACTOFF_SIM_DEVICE=1 and ACTOFF_SIM_DEVICE_MEMORY for the workers); past it a step is out of "
        f"memory. --find-max-seq uses ACTOFF_SIM_DEVICE_MEMORY or {DEFAULT_SIM_MEMORY} without it",
    )
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
            raise SystemExit(
                f"policy {policy!r}: unknown suffix +{unknown[0]}; known: +tile, +loss, +noplan, "
                "+expandable, +replay, +verify"
            )
        name, *fractions = base.split(":")
        needs_actoff = {"noplan": "turns off actoff's planner", "replay": "plans by actoff's scopes"}
        for variant, what in needs_actoff.items():
            if variant in suffixes and name not in ACTOFF_POLICIES:
                raise SystemExit(f"policy {policy!r}: +{variant} {what}; {name} does not use actoff")
        if name not in BASELINES + ACTOFF_POLICIES or (fractions and name != "tokenwise"):
            raise SystemExit(
                f"unknown policy {policy!r}: choose from {', '.join(BASELINES + ACTOFF_POLICIES)}"
                " (each may end in +tile, +loss, +noplan, +expandable, +replay, +verify)"
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
    cuda = torch.cuda.is_available()
    capped = not cuda and (args.find_max_seq or args.sim_memory)
    if args.policies is None:
        args.policies = ",".join(MAXSEQ_CPU_POLICIES if args.find_max_seq and not cuda else DEFAULT_POLICIES)
    policies = check_policies(args.policies)
    cuda_only = [p for p in policies if split_variants(p)[1] & ALLOCATOR_VARIANTS.keys()]
    if cuda_only and not cuda:
        raise SystemExit(
            f"policy {cuda_only[0]!r}: +expandable and +replay choose how CUDA memory is allocated; "
            "this machine has no CUDA device (leave them out here)"
        )
    lengths = parse_lengths(args.seq or preset["seq"])
    max_seq = parse_lengths(args.max_seq or ("1024k" if cuda else "8k"))[0]
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="actoff-bench-")
    os.makedirs(nvme_dir, exist_ok=True)
    base = {"model": preset["model"], "layers": args.layers or preset["layers"], "batch": args.batch or preset["batch"],
            "dtype": preset["dtype"], "steps": args.steps, "warmup": args.warmup, "nvme_dir": nvme_dir,
            "tile_tokens": preset.get("tile_tokens"), "loss_tokens": preset.get("loss_tokens")}  # fmt: skip
    if capped:  # Note [a capped device on a CPU]
        size = args.sim_memory or os.environ.get("ACTOFF_SIM_DEVICE_MEMORY") or DEFAULT_SIM_MEMORY
        try:
            base["sim_memory"] = parse_size(size, what="--sim-memory")
        except ValueError as error:
            raise SystemExit(str(error)) from None
        if base["sim_memory"] <= 0:
            raise SystemExit(f"--sim-memory={size!r}: give a size > 0, e.g. 128MiB")
    if args.find_max_seq:
        # Each probe: a warm-up step, in which actoff traces its buffers and plans them, then
        # the step measured, the first to hold the planned device arena: a length that fits only
        # before the plan does not train.
        base.update(steps=1, warmup=1)

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
    if base.get("tile_tokens") or base.get("loss_tokens"):
        header["chunks"] = f"+tile {base['tile_tokens']} tokens, +loss {base['loss_tokens']} tokens"
    if base.get("sim_memory"):
        header["device_memory"] = (f"simulated device of {format_bytes(base['sim_memory'])} "
                                   "(ACTOFF_SIM_DEVICE_MEMORY; host buffers not counted)")  # fmt: skip
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
            return _find_max(policies, base, lengths[0], max_seq, time_left, header, args, out)
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
            spec = {**base, "policy": "interleaved", "seqs": lengths, "sim_memory": None}  # uncapped
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


#: Targets of the longest-sequence search (issue 16), as ratios within one run, same model and
#: memory: the best actoff configuration trains at least this many times keep's longest length,
#: and checkpoint's.
MAXSEQ_VS_KEEP_TARGET = 4.0
MAXSEQ_VS_CHECKPOINT_TARGET = 1.5


def _find_max(policies: list[str], base: dict, start: int, limit: int, time_left, header: dict, args,
              out: JsonLines) -> int:  # fmt: skip
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not base.get("sim_memory"):
        raise SystemExit(
            "--find-max-seq on a CPU runs on the simulated device with a capacity: give --sim-memory"
        )
    found: list[dict] = []  # every probe's record: the breakdown at the limit reads them

    def on_record(record: dict) -> None:
        found.append(record)
        out.write(record)

    rows = []
    for done, policy in enumerate(policies):
        # An equal share of the time left for each policy still to search: the first one cannot
        # spend it all (a long search probes many lengths, each a fresh process).
        deadline = time.monotonic() + time_left() / (len(policies) - done)

        def share_left(deadline=deadline) -> float:
            return min(time_left(), deadline - time.monotonic())

        # On a CPU the lengths are short next to the GPU's 256-token grain: stop at 1/16 instead.
        result = find_max_seq(
            policy, base, start, limit, share_left, on_record, precision=0.0 if cuda else 1 / 16
        )
        rows.append({"policy": policy, "max_seq": result.longest, "fails_at": result.failed,
                     "probes": result.probes, "search": _search_state(result, limit)})  # fmt: skip
        out.write({"result": rows[-1]})
    add_max_seq_ratios(rows)
    for row in rows:
        record = next((r for r in found if r["policy"] == row["policy"] and r["seq"] == row["max_seq"]
                       and r.get("status") == "ok"), None)  # fmt: skip
        peak = record.get("peak_allocated_bytes") if record else None
        row["peak_mib"] = f"{peak / 2**20:.1f}" if peak else None
        row["record"] = record
    print()
    print(format_table(rows, [("policy", "policy"), ("max_seq", "longest seq"), ("fails_at", "fails at"),
                              ("x_keep", "x keep"), ("x_checkpoint", "x checkpoint"), ("peak_mib", "peak MiB"),
                              ("probes", "probes"), ("search", "search")]))  # fmt: skip
    where = f"{format_bytes(base['sim_memory'])} simulated device" if not cuda else "the GPU"
    print(f"\nlongest seq: the longest length that trained (forward, loss, backward, two steps) on {where}; "
          "fails at: the shortest that ran out of memory; x keep / x checkpoint: longest seq over theirs "
          "(>=: a lower bound, <=: an upper bound, ?: both sides bounds); peak MiB: the device peak at the "
          "longest length. actoff configurations: keep, cpu, nvme, tokenwise, recompute, auto (+tile: "
          "actoff.tile_ on the MLPs, +loss: actoff.chunked_cross_entropy).\n")  # fmt: skip
    summary = max_seq_summary(rows)
    for line in summary:
        print(f"   {line['text']}")
    best, default = best_actoff(rows), best_actoff(rows, default_planner=True)
    for row in [best] + ([default] if default is not best else []):
        if row is not None and row["record"] is not None:
            print()
            for line in where_memory_goes(row["record"]):
                print(line)
    if args.plot:
        plot_max_seq(rows, args.plot, where)
        print(f"plot written to {args.plot}")
    records = [{key: value for key, value in row.items() if key != "record"} for row in rows]
    if args.jsonl:
        out.write({"summary": summary})
    if args.json:
        write_json(args.json, header, records, summary=summary, probes=found)
    return 0


def _search_state(result: MaxSeq, limit: int) -> str:
    if not result.finished:
        return "cut short by --time-budget (a lower bound)"
    if result.failed is None:
        return f"reached --max-seq {limit} (a lower bound)"
    return "done"


def add_max_seq_ratios(rows: list[dict]) -> None:
    """Add ``x_keep`` and ``x_checkpoint`` (text: ``"4.50"``, ``">=4.50"``, ``"<=0.80"``, ``"?"``)
    and their values to rows of `_find_max`, against the plain ``keep`` and ``checkpoint`` rows.

    >>> rows = [{"policy": "keep", "max_seq": 1000, "search": "done"},
    ...         {"policy": "cpu", "max_seq": 4500, "search": "cut short by --time-budget (a lower bound)"}]
    >>> add_max_seq_ratios(rows)
    >>> rows[1]["x_keep"], rows[1]["x_keep_value"], rows[1]["x_checkpoint"]
    ('>=4.50', 4.5, None)
    """
    by_policy = {row["policy"]: row for row in rows}
    for name in ("keep", "checkpoint"):
        bottom = by_policy.get(name)
        for row in rows:
            ratio = max_seq_ratio(row, bottom) if bottom is not None else None
            row[f"x_{name}"] = (
                None if ratio is None else ratio[1] + f"{ratio[0]:.2f}" if ratio[1] != "?" else "?"
            )
            row[f"x_{name}_value"] = None if ratio is None else ratio[0]
            row[f"x_{name}_bound"] = None if ratio is None else ratio[1]


def max_seq_ratio(top: dict, bottom: dict) -> tuple[float, str] | None:
    """``top``'s longest length over ``bottom``'s, and what it is: ``""`` (measured), ``">="``
    (``top`` is a lower bound), ``"<="`` (``bottom`` is), ``"?"`` (both are).

    >>> max_seq_ratio({"max_seq": 3000, "search": "done"}, {"max_seq": 1000, "search": "done"})
    (3.0, '')
    """
    if not top.get("max_seq") or not bottom.get("max_seq"):
        return None
    top_bound, bottom_bound = "lower bound" in top["search"], "lower bound" in bottom["search"]
    kind = "?" if top_bound and bottom_bound else ">=" if top_bound else "<=" if bottom_bound else ""
    return top["max_seq"] / bottom["max_seq"], kind


def _verdict(value: float, kind: str, target: float) -> str:
    """met / NOT met / undecided, for a ratio that may be a bound."""
    if kind == "?" or (kind == ">=" and value < target) or (kind == "<=" and value >= target):
        return "undecided: a bound on the wrong side of the target"
    return "met" if value >= target else "NOT met"


def is_actoff_policy(policy: str) -> bool:
    """Whether ``policy`` places activations with actoff (``cpu+tile+loss`` yes, ``checkpoint+loss`` no)."""
    return split_variants(policy)[0].split(":")[0].split("+")[0] in ACTOFF_POLICIES


def best_actoff(rows: list[dict], *, default_planner: bool = False) -> dict | None:
    """The actoff row with the longest length (``default_planner``: leaving out ``+noplan``)."""
    candidates = [r for r in rows if is_actoff_policy(r["policy"]) and r["max_seq"]
                  and not (default_planner and "noplan" in split_variants(r["policy"])[1])]  # fmt: skip
    return max(candidates, key=lambda r: r["max_seq"]) if candidates else None


def max_seq_summary(rows: list[dict]) -> list[dict]:
    """The ratio lines: the best actoff configuration (the longest length among actoff's
    policies, with any variants) against keep and checkpoint with their targets; the same for
    the best with actoff's default planner when the best turned it off (``+noplan``); then the
    best against the longest configuration without actoff's placement, for scale.

    >>> rows = [{"policy": "keep", "max_seq": 1000, "search": "done"},
    ...         {"policy": "checkpoint", "max_seq": 3000, "search": "done"},
    ...         {"policy": "recompute+tile+loss", "max_seq": 4800, "search": "done"}]
    >>> [line["text"] for line in max_seq_summary(rows)]  # doctest: +NORMALIZE_WHITESPACE
    ['best actoff configuration: recompute+tile+loss, longest 4800 vs keep 1000: 4.80x (target >= 4x: met)',
     'best actoff configuration: recompute+tile+loss, longest 4800 vs checkpoint 3000: 1.60x (target >= 1.5x: met)']
    """
    best = best_actoff(rows)
    if best is None:
        return []
    by_policy = {row["policy"]: row for row in rows}
    lines = []
    default = best_actoff(rows, default_planner=True)
    contenders = [("best actoff configuration", best)]
    if default is not None and default is not best:
        contenders.append(("best with actoff's default planner", default))
    for what, top in contenders:
        for name, target in (("keep", MAXSEQ_VS_KEEP_TARGET), ("checkpoint", MAXSEQ_VS_CHECKPOINT_TARGET)):
            bottom = by_policy.get(name)
            ratio = max_seq_ratio(top, bottom) if bottom is not None else None
            if ratio is None:
                continue
            value, kind = ratio
            verdict = _verdict(value, kind, target)
            lines.append({"policy": top["policy"], "vs": name, "ratio": value, "bound": kind, "target": target,
                          "met": verdict == "met", "verdict": verdict,
                          "text": f"{what}: {top['policy']}, longest {top['max_seq']} vs {name} "
                                  f"{bottom['max_seq']}: {kind}{value:.2f}x (target >= {target:g}x: {verdict})"})  # fmt: skip
    others = [r for r in rows if not is_actoff_policy(r["policy"]) and r["max_seq"]
              and r["policy"] not in ("keep", "checkpoint")]  # fmt: skip
    if others and lines:
        rival = max(others, key=lambda r: r["max_seq"])
        ratio = max_seq_ratio(best, rival)
        if ratio is not None:
            lines.append({"policy": best["policy"], "vs": rival["policy"], "ratio": ratio[0], "bound": ratio[1],
                          "target": None, "met": None, "verdict": "for scale",
                          "text": f"for scale, the longest without actoff's placement: {rival['policy']} "
                                  f"{rival['max_seq']}; {best['policy']} reaches {ratio[1]}{ratio[0]:.2f}x "
                                  "of it"})  # fmt: skip
    return lines


def where_memory_goes(record: dict) -> list[str]:
    """Where the device memory of one capped probe (Note [a capped device on a CPU]) goes, as
    lines: the cap, what stays across steps (weights and gradients, the tokens), what autograd
    saved and where actoff put it, and per phase of the step the bytes live at its end and the
    peak within it over the step's start (working memory), naming the phase of the peak.

    >>> record = {"policy": "cpu", "seq": 2048, "sim_capacity_bytes": 2**27, "static_bytes": 2**24,
    ...           "weights_grads_bytes": 2**24, "tokens_bytes": 0, "device_arena_bytes": 2**20,
    ...           "act_keep_bytes": 0, "act_cpu_bytes": 2**25, "act_nvme_bytes": 0, "act_recompute_bytes": 0,
    ...           "peak_allocated_bytes": 2**25, "phases": [["forward", 2**24 + 2**22, 2**25]]}
    >>> print(where_memory_goes(record)[-1])
       forward                 live at its end  +4.00 MiB  peak  +16.00 MiB  <- the step's peak
    """
    if not record.get("phases"):
        return []
    mib = lambda value: f"{value / 2**20:.2f} MiB"  # noqa: E731
    static = record["static_bytes"]
    other = static - record["weights_grads_bytes"] - record["tokens_bytes"]
    capacity = record.get("sim_capacity_bytes")
    lines = [
        f"where the device memory goes at the limit: {record['policy']} at seq {record['seq']}, peak "
        f"{mib(record['peak_allocated_bytes'])}" + (f" of {mib(capacity)}" if capacity else ""),
        f"   weights + gradients   {mib(record['weights_grads_bytes'])}",
        f"   tokens                {mib(record['tokens_bytes'])}",
        f"   other kept across steps  {mib(other)}",
        "   saved for backward by actoff's scopes: on the device (keep) "
        f"{mib(record['act_keep_bytes'])}; off it: cpu {mib(record['act_cpu_bytes'])}, nvme "
        f"{mib(record['act_nvme_bytes'])}, recomputed in backward {mib(record['act_recompute_bytes'])}",
        f"   actoff's device arena (its backward buffers: fetched and rebuilt activations) "
        f"{mib(record['device_arena_bytes'])} at most at once (a buffer per wave of a block's tensors, alive while they are)",
        "   per phase, over the step's start (weights, gradients, tokens):",
    ]
    peak = max(phase_peak for _, _, phase_peak in record["phases"])
    for phase, live, phase_peak in record["phases"]:
        lines.append(f"   {phase:<22}  live at its end {'+' + mib(live - static):>10}  peak {'+' + mib(phase_peak - static):>11}"
                     + ("  <- the step's peak" if phase_peak == peak else ""))  # fmt: skip
    return lines


def plot_max_seq(rows: list[dict], path: str, where: str) -> None:
    """Longest length per policy (hatched: a lower bound), with keep's and checkpoint's marked,
    and the device memory at each one's limit split into weights and gradients, actoff's device
    arena and the rest (activations and working memory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 0.45 * len(rows) + 2.2), gridspec_kw={"width_ratios": [3, 2]})
    names = [row["policy"] for row in rows][::-1]
    shown = rows[::-1]
    colors = ["tab:blue" if is_actoff_policy(r["policy"]) else "tab:gray" for r in shown]
    bars = axes[0].barh(names, [r["max_seq"] or 0 for r in shown], color=colors)
    for bar, row in zip(bars, shown, strict=True):
        if "lower bound" in row["search"]:
            bar.set_hatch("//")
        ratios = [f"{row[f'x_{name}']}x {name}" for name in ("keep", "checkpoint") if row.get(f"x_{name}")]
        label = f" {row['max_seq']}" + (f"  ({', '.join(ratios)})" if ratios else "")
        axes[0].text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    by_policy = {row["policy"]: row for row in rows}
    for name, style in (("keep", ":"), ("checkpoint", "--")):
        if by_policy.get(name, {}).get("max_seq"):
            axes[0].axvline(
                by_policy[name]["max_seq"], color="black", linestyle=style, linewidth=1, label=name
            )
    axes[0].set(title=f"longest sequence that trains on {where}", xlabel="tokens (hatched: a lower bound; "
                "blue: actoff policies)")  # fmt: skip
    axes[0].set_xlim(0, max((r["max_seq"] or 0) for r in rows) * 1.45 or 1)
    axes[0].legend(fontsize=8, loc="lower right")
    weights, arena, rest = [], [], []
    for row in shown:
        record = row.get("record") or {}
        peak = record.get("peak_allocated_bytes") or 0
        weights.append((record.get("weights_grads_bytes") or 0) / 2**20)
        arena.append((record.get("device_arena_bytes") or 0) / 2**20)
        rest.append(max(0.0, peak / 2**20 - weights[-1] - arena[-1]))
    axes[1].barh(names, weights, color="tab:olive", label="weights + gradients")
    axes[1].barh(names, arena, left=weights, color="tab:orange", label="actoff's device arena")
    axes[1].barh(names, rest, left=[w + a for w, a in zip(weights, arena, strict=True)], color="tab:cyan",
                 label="activations and working memory")  # fmt: skip
    axes[1].set(title="device peak at each one's longest length", xlabel="MiB")
    axes[1].set_yticklabels([])
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
