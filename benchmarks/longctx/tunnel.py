"""The wind tunnel: the simulated device's link scaled so that a CPU run sees a GPU's ratio of
copy time to compute time, and step times compare as on that GPU.

Note [scaling the tunnel]: whether an offloading policy pays is decided by one ratio per
block, R = (bytes the block saves / the host link's rate) / (the block's forward time). On
the target GPU both sides come from its shapes: the bytes a block of the target model saves
per token, counted on the CPU on a short sequence of the target's shapes in its dtype (the
same kernels' saves: flash attention keeps q, k, v, its output and the log-sum-exp, on a CPU
as on a GPU) times the target's length, over the link's measured rate; the forward time from
the block's FLOPs at the GPU's dense peak times a block-level utilisation (`Gpu.mfu`,
calibrated on the measured step times of no offload). On the CPU, a warm-up measures the
forward time of the CPU model's blocks and the bytes they save; the simulated device's link
is then set to ``bytes / (R * time)``, so its copies take the share of a step they would take
on the GPU. Compute, recompute included, runs at the CPU's own speed: ratios of step times
are what carry over, not the times. The tunnel does not model what differs beyond that
ratio: kernel launch overheads, memory-bound kernels, the allocator, the share of the head,
how a step's compute splits between forward and backward (what recompute costs: Note [what
the tunnel cannot carry] in calibrate).

Compute is timed by `UnstolenClock`: wall time less what other processes took from the training
thread, and the simulated device's link runs on the same clock (Note [the device's clock] in
actoff.device.sim.link), so a busy machine gives the ratios of a quiet one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import threading
import time

import torch

#: Threads of the tunnel's compute, its measurement and its runs alike: step-time ratios carry
#: over, not speed, and one thread is the steadiest on a shared machine (two threads contending
#: with another process there made single steps several times slower).
TUNNEL_THREADS = 1
#: Sequence length suffixes of ``--like``.
_SCALE = {"k": 1024, "m": 1024 * 1024}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What a target GPU's side of the ratio needs: its dense bf16 FLOP/s (``flops``), the
    share of it a transformer block's forward reaches (``mfu``), the pinned host link in bytes
    per second each way (``link``), the share of that link PyTorch's ``save_on_cpu`` reaches
    (``save_on_cpu_share``), and its memory."""

    name: str
    flops: float
    mfu: float
    link: float
    save_on_cpu_share: float
    memory: int


#: The targets. H100: 790 TFLOP/s measured on random 8192-cubed bf16 products and a 55 GB/s
#: pinned link (54.4 / 54.9 GB/s measured each way, benchmarks/results/h100-2026-11-23/io.log);
#: two constants are fitted, on one length of that run (Note [fitting the tunnel] in calibrate):
#: the block utilisation ``mfu`` to no offload's step time at 8k (117 ms), and
#: ``save_on_cpu_share`` to ``torch_save_on_cpu``'s overhead at 8k. That share is not a pageable
#: copy's: the H100 run's save_on_cpu used pinned memory (``pin_memory=True``). It is what PyTorch's
#: tool reaches of the pinned link: each saved tensor copied synchronously (the host waits for
#: it) into a pinned buffer of its own from the caching host allocator, and back. The values
#: are those of the quiet calibration of benchmarks/results/cpu-2026-11-28-calibrate/. H200:
#: the same compute and link with 141 GiB. Add a target here with the same figures.
GPUS = {
    "h100": Gpu("H100", 790e12, 0.572, 55e9, 0.88, 80 * 2**30),
    "h200": Gpu("H200", 790e12, 0.572, 55e9, 0.88, 141 * 2**30),
}
#: Target models: presets of `actoff.reference.ModelConfig`.
MODELS = ("1b", "7b", "8b")


@dataclasses.dataclass(frozen=True)
class Like:
    """A target: a GPU, a model preset and a sequence length (``h100:7b@8k``)."""

    gpu: Gpu
    model: str
    seq: int

    @property
    def text(self) -> str:
        return f"{self.gpu.name.lower()}:{self.model}@{self.seq // 1024}k"


def parse_like(text: str) -> Like:
    """``"h100:7b@8k"`` -> the target, or SystemExit naming what is wrong.

    >>> like = parse_like("h100:8b@32k")
    >>> like.gpu.name, like.model, like.seq
    ('H100', '8b', 32768)
    """
    try:
        gpu_name, rest = text.lower().split(":")
        model, seq_text = rest.split("@")
        scale = _SCALE.get(seq_text[-1], 1)
        seq = int(float(seq_text.rstrip("km")) * scale)
    except ValueError:
        raise SystemExit(f"--like {text!r}: write GPU:MODEL@LENGTH, e.g. h100:7b@8k") from None
    if gpu_name not in GPUS:
        raise SystemExit(f"--like {text!r}: unknown GPU {gpu_name!r}; known: {', '.join(GPUS)} (tunnel.GPUS)")
    if model not in MODELS:
        raise SystemExit(f"--like {text!r}: unknown model {model!r}; known: {', '.join(MODELS)}")
    if seq < 2:
        raise SystemExit(f"--like {text!r}: the length must be at least 2 tokens")
    return Like(GPUS[gpu_name], model, seq)


def block_flops(config, seq: int) -> float:
    """Forward FLOPs of one block on ``seq`` tokens: its products and causal attention.

    >>> from actoff.reference import ModelConfig
    >>> round(block_flops(ModelConfig.preset("7b"), 8192) / 1e12, 2)
    3.87
    """
    return 2 * config.block_params() * seq + 2 * seq * seq * config.hidden_size


def matching_length(like: Like, model: str) -> int:
    """The CPU model's length at which attention takes the share of a block's FLOPs it takes in
    the target's (a multiple of 64): its cost grows as S^2 against the products' S, so a CPU
    length picked this way keeps the mix of compute the target has.

    >>> matching_length(parse_like("h100:7b@8k"), "small"), matching_length(parse_like("h100:7b@32k"), "small")
    (448, 1856)
    """
    from actoff.reference import ModelConfig

    target, cpu = ModelConfig.preset(like.model), ModelConfig.preset(model)
    # attention / products = 2 S^2 H / (2 P S) = S H / P: equal on both sides.
    seq = like.seq * target.hidden_size / target.block_params() * cpu.block_params() / cpu.hidden_size
    return max(64, round(seq / 64) * 64)


class _SavedBytes:
    """Bytes of the distinct tensors autograd saves (parameters left out), as actoff counts them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: dict[tuple, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage().data_ptr()
        if storage not in self.params:
            key = (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            self.seen[key] = tensor.numel() * tensor.element_size()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.seen.values())


@functools.lru_cache(maxsize=8)
def saved_bytes_per_token(model: str, dtype: torch.dtype = torch.bfloat16, tokens: int = 64) -> float:
    """Bytes one block of the ``model`` preset saves per token in ``dtype``: counted on the CPU
    on ``tokens`` tokens (Note [scaling the tunnel]).

    >>> round(saved_bytes_per_token("7b") / 1e3, 1)  # the H100 run's keep: 195.2 KB per token
    195.2
    """
    from actoff.reference import Block, ModelConfig, rope_tables

    config = ModelConfig.preset(model)
    with torch.device("meta"):  # shapes are what counts: uninitialised weights (a 7B block's init took 1.2 s)
        block = Block(config)
    block = block.to_empty(device="cpu").to(dtype)
    x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(tokens, config.head_dim, config.rope_theta, dtype=dtype)
    counter = _SavedBytes(block)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
        block(x, cos, sin)
    return counter.total / tokens


def target_ratio(like: Like) -> dict:
    """The target's side: a block's saved bytes, their copy time, its forward time and R."""
    from actoff.reference import ModelConfig

    config = ModelConfig.preset(like.model)
    saved = saved_bytes_per_token(like.model) * like.seq
    copy_s = saved / like.gpu.link
    forward_s = block_flops(config, like.seq) / (like.gpu.flops * like.gpu.mfu)
    return {
        "saved_bytes": saved,
        "copy_ms": copy_s * 1e3,
        "forward_ms": forward_s * 1e3,
        "ratio": copy_s / forward_s,
    }


class UnstolenClock:
    """Seconds of ``time.perf_counter`` less the time the thread that made the clock (the
    training thread) waited for a CPU while it could run: what other processes took from it.

    Linux counts that wait per thread (``run_delay``, the second figure of
    ``/proc/self/task/TID/schedstat``), adding each wait when the thread runs again; read from
    another thread while the training thread is still waiting, the clock would run ahead and
    then back, so it never goes back (it stands still instead). ``available`` is False where the
    count cannot be read: the clock is then ``perf_counter`` itself.

    >>> clock = UnstolenClock()
    >>> first = clock(); second = clock()
    >>> second >= first and clock.stolen_s() >= 0
    True
    """

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(
                f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY
            )
        except OSError:
            self._fd = None
        self.available = self._fd is not None
        self._last = float("-inf")

    def stolen_s(self) -> float:
        """Seconds the thread has waited, runnable, for a CPU since it started."""
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9

    def __call__(self) -> float:
        now = time.perf_counter() - self.stolen_s()
        if now < self._last:
            now = self._last
        self._last = now
        return now

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


def tunnel_device(spec: dict, seq: int, capped=None, clock=None):
    """A worker's device for its warm-up and timed steps: under ``--like``, the simulated device with the link
    rate scaled for this length (Note [scaling the tunnel]), copies without random delays, timed
    by ``clock`` (a new `tunnel.UnstolenClock` of the calling thread by default), and on a capped
    device (``capped``: Note [a capped device on a CPU]) that device's memory, so that its
    capacity and counts are the tunnel's (auto plans under them); else the worker's own (None
    is entered)."""
    import contextlib

    from actoff.testing import simulated_device

    tunnel = spec.get("tunnel") or {}
    rate = tunnel.get("bandwidth", {}).get(str(seq))
    if rate is None:
        return contextlib.nullcontext()
    return simulated_device(
        seed=0,
        max_delay_s=0.0,
        max_lag_s=0.0,
        bandwidth=rate,
        track_memory=False,
        # PyTorch's save_on_cpu copies at this share (Note [save_on_cpu on the simulated device])
        pageable_rate=tunnel["save_on_cpu_share"],
        memory=capped,
        clock=clock or UnstolenClock(),
    )


def measure_cpu_block(
    model: str, layers: int, seq: int, dtype: torch.dtype, batch: int = 1, steps: int = 3
) -> dict:
    """The CPU's side: the forward time of the CPU model's blocks on ``seq`` tokens, on
    `UnstolenClock` (the least of each step's median over the blocks, after one warm-up) and the
    bytes a block saves."""
    from actoff.reference import ModelConfig, Transformer, rope_tables

    torch.manual_seed(0)
    config = ModelConfig.preset(model, num_layers=layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        net = Transformer(config)
    finally:
        torch.set_default_dtype(previous)
    times: list[float] = []
    started: dict[int, float] = {}
    clock = UnstolenClock()

    def before(module, args):
        started[id(module)] = clock()

    def after(module, args, output):
        times.append(clock() - started.pop(id(module)))

    hooks = [
        h
        for layer in net.layers
        for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))
    ]
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    medians = []
    threads = torch.get_num_threads()
    torch.set_num_threads(TUNNEL_THREADS)
    try:
        for step in range(steps + 1):
            times.clear()
            net.loss(tokens).backward()
            if step:  # the warm-up's first calls are cold
                medians.append(statistics.median(times))
    finally:
        torch.set_num_threads(threads)
        clock.close()
        for hook in hooks:
            hook.remove()
    x = net.embed(tokens[:, :-1])
    cos, sin = rope_tables(seq, config.head_dim, config.rope_theta, dtype=x.dtype)
    counter = _SavedBytes(net)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
        net.layers[0](x, cos, sin)
    return {"forward_ms": min(medians) * 1e3, "saved_bytes": counter.total}


def scale(like: Like, model: str, layers: int, seq: int, dtype: torch.dtype, batch: int = 1) -> dict:
    """The link rate that gives the CPU run (``model``, ``layers``, ``seq``) the target's ratio,
    with both sides: the record's ``tunnel`` object."""
    target = target_ratio(like)
    cpu = measure_cpu_block(model, layers, seq, dtype, batch)
    bandwidth = cpu["saved_bytes"] / (target["ratio"] * cpu["forward_ms"] / 1e3)
    return {
        "target": like.text,
        "gpu": dataclasses.asdict(like.gpu),
        "ratio": target["ratio"],
        "target_block": {key: target[key] for key in ("saved_bytes", "copy_ms", "forward_ms")},
        "cpu_block": {"model": model, "layers": layers, "seq": seq, **cpu},
        "bandwidth": bandwidth,
    }
