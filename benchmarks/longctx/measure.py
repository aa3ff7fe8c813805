"""One sequence length measured inside a worker: warm-up and timed steps, and the record's fields
(step time, bytes per tier, device memory and a timeline of it over one step).

Device memory comes from CUDA's allocator (or actoff's replay allocator under ``+replay``), from
the simulated device when the worker runs on one with a cap (Note [a capped device on a CPU]),
or else on a CPU from one more step on the simulated device (Note [device memory on a CPU]).
"""

from __future__ import annotations

import os
import resource
import time

import torch

import actoff
from actoff.device.cuda import peak_counters
from actoff.reference import next_token_loss

from .policies import HEAD_AND_LOSS, LOSS_TOKENS, split_variants
from .tunnel import tunnel_device
from .warmup import warm_up

# Dense bf16 peak FLOP/s for MFU (datasheet values).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Timeline:
    """Device, host and NVMe bytes over one step, sampled after each block's forward and
    backward while on: the memory plot's points, ``(seconds since start, device, host, nvme)``.

    On CUDA a sample synchronizes the device (the bytes allocated are the host's view of a
    device that may lag), so it is sampled in a step of its own, never in a timed one (Note
    [no synchronization in timed steps])."""

    def __init__(self, cuda: bool, capped=None) -> None:
        self.cuda, self.capped = cuda, capped
        self.points: list[tuple[float, int, int, int]] = []
        self.on, self.t0 = False, 0.0
        self.simulated = None  # on a CPU, during the memory step: the simulated device's memory
        self.static = 0  # ... and the bytes live outside it (weights, gradients, tokens)

    def start(self) -> None:
        self.on, self.t0 = True, time.perf_counter()
        self.sample()

    def stop(self) -> None:
        self.on = False

    def sample(self) -> None:
        if not self.on:
            return
        if self.cuda:
            torch.cuda.synchronize()
            device_bytes = cuda_memory()[0]
        elif self.capped is not None:
            device_bytes = self.capped.live
        elif self.simulated is not None:
            device_bytes = self.static + self.simulated.live
        else:
            device_bytes = _rss_bytes()
        held = actoff.held_bytes()
        self.points.append((time.perf_counter() - self.t0, device_bytes, held["cpu"], held["nvme"]))

    def watch(self, layers) -> list:
        """Hooks sampling after each layer's forward and after its gradient (in backward)."""

        def after_forward(module, args, output):
            self.sample()
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: (self.sample(), grad)[1])

        return [layer.register_forward_hook(after_forward) for layer in layers]


class Step:
    """One training step (forward, loss, backward) on ``tokens``; on a capped device it marks
    the end of each phase: the bytes live then and the peak within it (`phases`)."""

    def __init__(self, spec: dict, model, net, tokens, step_context, cuda: bool, capped, timeline) -> None:
        self.model, self.net, self.tokens, self.step_context = model, net, tokens, step_context
        self.cuda, self.capped, self.timeline = cuda, capped, timeline
        self.chunked_loss = "loss" in split_variants(spec["policy"])[1]
        self.loss_tokens = spec.get("loss_tokens") or LOSS_TOKENS
        self.phases: list[tuple[str, int, int]] = []  # (phase, device bytes live after it, peak during it)
        self.cpu_times: list[float] = []  # process CPU seconds per timed step
        self.auto = split_variants(spec["policy"])[0] == "auto"
        self.plans: list[
            str
        ] = []  # under auto, the plan each timed step ran (Note [auto decides on a warm step])
        # What timed steps are timed by: in the tunnel its `UnstolenClock` (the link's too)
        self.clock = time.perf_counter

    def mark(self, phase: str) -> None:
        """The end of a phase of the step on the capped device: its peak, then a new one."""
        if self.capped is not None:
            self.phases.append((phase, self.capped.live, self.capped.peak))
            self.capped.reset_peak()

    def __call__(self) -> None:
        self.phases.clear()
        self.mark("start")
        with self.step_context():
            # The logits stay referenced through backward, as in a training loop's body: they
            # count in the step's peak.
            output, _logits, loss = self._forward()
            self.mark("loss")
            if self.capped is not None and output is not None and output.requires_grad:
                output.register_hook(lambda grad: (self.mark("loss backward"), grad)[1])
            # The blocks' (normed) output is not: a loop through Hugging Face's chunked_loss_
            # never sees it, and one that kept it would hold a row a token through the blocks'
            # backward (on the 8B proxy a fifth of the chunked placement's bytes there). What the
            # norm or the head saves of it is theirs (in auto's head+loss scope, placed by auto).
            del output
        loss.backward()
        self.mark("blocks backward")
        self.timeline.sample()

    def _forward(self):
        """The blocks' output (normed, or not where the norm runs in auto's head+loss scope;
        None under DDP: the model runs whole), the logits (None under the chunked loss: never
        all of them at once) and the loss."""
        model, net, tokens = self.model, self.net, self.tokens
        if self.chunked_loss:  # the head and loss over chunks of tokens: never all the logits
            hidden = model.hidden(tokens[:, :-1]) if net is model else net.module.hidden(tokens[:, :-1])
            self.mark("forward")
            loss = actoff.chunked_cross_entropy(
                hidden, model.head.weight, tokens[:, 1:], shift=False, max_tokens=self.loss_tokens
            )
            return hidden, None, loss
        if net is not model:
            logits = net(tokens[:, :-1])
            return None, logits, next_token_loss(logits, tokens[:, 1:])
        scoped = getattr(model, "scoped_head_and_loss", None)  # Note [auto plans the head and loss too]
        if scoped is not None:
            output = model.blocks_output(tokens[:, :-1])
            self.mark("forward")
            return output, *scoped(output, tokens[:, 1:])
        hidden = model.hidden(tokens[:, :-1])  # the same as model(...), with the head apart for the phases
        self.mark("forward")
        logits = model.head(hidden)
        return hidden, logits, next_token_loss(logits, tokens[:, 1:])

    def timed(self) -> float:
        """One step; its seconds on `clock` (its process CPU seconds go to `cpu_times`)."""
        if self.cuda:
            torch.cuda.synchronize()
        start, cpu_start = self.clock(), time.process_time()
        self()
        if self.cuda:
            torch.cuda.synchronize()
        self.cpu_times.append(time.process_time() - cpu_start)
        seconds = self.clock() - start
        if self.auto:  # the plan it ran, where that plan holds
            stats = actoff.stats()
            self.plans.append(stats.measured_plan if stats.plan_holds else f"settling ({stats.plan_reason})")
        return seconds


def measure(
    spec: dict, seq: int, model, net, step_context, config, device, capped=None, ballast=None
) -> dict:
    """Warm-up and timed steps at one sequence length; the record's measured fields.

    ``capped``: the simulated device's memory when the worker runs on it with a cap (Note [a
    capped device on a CPU]); the memory figures then come from it, phase by phase.
    ``ballast``: under ``--emulate-layers``, the `Ballast` that stands for the blocks not built.
    """
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, config.vocab_size, (spec["batch"], seq + 1), generator=generator).to(device)
    timeline = Timeline(cuda, capped)
    step = Step(spec, model, net, tokens, step_context, cuda, capped, timeline)
    hooks = timeline.watch(model.layers)
    extra: dict = {}
    try:
        with tunnel_device(spec, seq, capped) as device:
            if device is not None:  # the tunnel: its clock times the steps
                step.clock = device.settings.clock
            static_bytes, times, peaks = _run_steps(spec, step, model, cuda, capped, ballast, seq, extra)
        stats = actoff.stats()  # of the timed steps
        memory_fields = _memory_fields(spec, step, model, tokens, static_bytes, stats, ballast)
    except torch.cuda.OutOfMemoryError as error:
        return {"status": "oom", "error": str(error).splitlines()[0]}
    except Exception as error:  # reported per policy; the other policies still run
        if "out of memory" in str(error):  # raised through a hook or autograd, which rewrap errors
            return {"status": "oom", "error": str(error).splitlines()[0]}
        return {"status": "error", "error": f"{type(error).__name__}: {error}"}
    finally:
        for hook in hooks:
            hook.remove()
        if ballast is not None:
            ballast.release_held()

    times.sort()
    step_s = times[len(times) // 2]
    record = {
        "status": "ok",
        **_step_fields(spec, seq, step_s, step.cpu_times, stats),
        "timeline": timeline.points,
        **extra,
    }
    if step.auto:
        record["auto_timed_plans"] = step.plans
    record["recompute_share"] = record["recompute_ms"] / record["step_ms"] if record["step_ms"] else None
    offloaded = record["act_cpu_bytes"] + record["act_nvme_bytes"]
    record["copy_gbps"] = offloaded / (record["copy_ms"] * 1e6) if record["copy_ms"] > 0 else None
    if cuda:
        record.update(_cuda_fields(spec, seq, config, step_s, static_bytes, peaks))
    else:
        record.update(
            peak_allocated_bytes=None,
            peak_reserved_bytes=None,
            fragmentation_bytes=None,
            activation_peak_bytes=None,
            mfu=None,
            memory_source=None,
        )
        if spec.get("ddp") is None:
            record.update(memory_fields)
    return record


def _run_steps(
    spec: dict, step: Step, model, cuda: bool, capped, ballast, seq: int, extra: dict
) -> tuple[int | None, list[float], tuple[int, int, int] | None]:
    """The warm-up steps, the timed ones, then on CUDA or a capped device one more, untimed,
    sampled for the timeline (Note [no synchronization in timed steps]): the device bytes live
    before the timed steps, their times, and on CUDA their memory figures (`cuda_memory`).
    Fields for the record go to ``extra``: the ballast's bytes, the memory snapshot's summary."""
    warm_up(spec, step, extra)
    for parameter in model.parameters():  # keep grads allocated: static memory counted once
        if parameter.grad is not None:
            parameter.grad.zero_()
    if ballast is not None:  # Note [emulated layers]: what the blocks not built would hold
        extra.update(ballast.hold(spec, seq, actoff.stats()))
    if not cuda and capped is None:
        return None, [step.timed() for _ in range(spec["steps"])], None
    if cuda:
        torch.cuda.synchronize()
        static_bytes = cuda_memory(reset=True)[0]
        if spec.get("memory_snapshot"):
            from .snapshot import take_snapshot

            extra["snapshot"] = take_snapshot(spec["memory_snapshot"], spec["policy"], seq)
    else:
        static_bytes = capped.live
    times = [step.timed() for _ in range(spec["steps"])]
    peaks = cuda_memory() if cuda else None  # the timed steps', before the sampled step
    if spec.get("timeline", True):
        step.timeline.start()
        step()
        step.timeline.stop()
    return static_bytes, times, peaks


# Note [no synchronization in timed steps]: a timeline sample on CUDA synchronizes the device,
# which serializes the copies that a policy overlaps with compute (the H100 run's cpu step:
# 290 ms sampled against 235 ms not). So no timed step is sampled: the timeline comes from one
# more step after them, and the memory peaks are read before it, since a synchronized step
# also frees copy sources sooner than a real one would.


def _memory_fields(
    spec: dict, step: Step, model, tokens, static_bytes: int | None, stats, ballast=None
) -> dict:
    """The device memory figures of a worker on a CPU: from the capped device, or from one more
    step on the simulated device (not under DDP: none there); none on CUDA (`_cuda_fields`)."""
    if step.capped is not None:
        return capped_memory_fields(model, tokens, step.capped, static_bytes, step.phases, stats)
    if not step.cuda and spec.get("ddp") is None:
        # (Note [device memory on a CPU]) One more step on the simulated device, which
        # counts the storages a step allocates (host buffers excluded) as a GPU would.
        return simulated_memory_step(
            step, model, tokens, step.timeline, ballast.total_bytes if ballast else 0
        )
    return {}


def _step_fields(spec: dict, seq: int, step_s: float, cpu_times: list[float], stats) -> dict:
    """Step time, throughput, and what actoff did in the timed steps (`actoff.stats`)."""
    blocks = stats.blocks.values()
    return {
        "step_ms": step_s * 1e3,
        # (Note [timing on a shared CPU]) The least CPU time of the timed steps; what other
        # processes on the machine do inflates wall time far more than it does this.
        "step_cpu_ms": min(cpu_times) * 1e3 if cpu_times else None,
        "tokens_per_s": spec["batch"] * seq / step_s,
        "act_keep_bytes": sum(b.bytes_per_tier["keep"] for b in blocks),
        "act_cpu_bytes": sum(b.bytes_per_tier["cpu"] for b in blocks),
        # Of them, the head and loss scope's, once a step, not a block's (Note [auto plans the head and loss too])
        "head_and_loss_cpu_bytes": sum(
            b.bytes_per_tier["cpu"] for n, b in stats.blocks.items() if n == HEAD_AND_LOSS
        ),
        "act_nvme_bytes": sum(b.bytes_per_tier["nvme"] for b in blocks),
        "act_recompute_bytes": sum(b.bytes_per_tier["recompute"] for b in blocks),
        "copy_ms": sum(b.copy_ms for b in blocks),
        "fetch_ms": sum(b.fetch_ms for b in blocks),
        "wait_ms": sum(b.wait_ms for b in blocks),
        "recompute_ms": sum(b.recompute_ms for b in blocks),
        "auto": {name: vars(d) for name, d in list(stats.auto.items())[:1]},
        "auto_plan": None if stats.plan == "none" else stats.plan,
        "auto_replans": stats.replans,
        # auto's own figures of the last plan a step ran: the budget it planned under, the device
        # peak it measured, the blocks' time it predicted and measured (the budget sweep prints them)
        **(
            {
                "auto_budget_bytes": stats.budget_bytes,
                "auto_measured_peak_bytes": stats.measured_peak_bytes,
                "auto_predicted_peak_bytes": stats.measured_predicted_peak_bytes,
                "auto_predicted_step_ms": stats.measured_predicted_step_ms,
                "auto_measured_step_ms": stats.measured_step_ms,
            }
            if stats.measured_plan != "none"
            else {}
        ),
        "host_arena_bytes": stats.host_capacity,
        # actoff's device arena: its planned size and the lower bound no layout undercuts
        "device_layout_bytes": stats.device_layout_bytes,
        "device_lower_bound_bytes": stats.device_lower_bound,
        "nvme_file_bytes": stats.nvme_file_bytes,
        "io_backend": stats.io_backend,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _cuda_fields(
    spec: dict, seq: int, config, step_s: float, static_bytes: int, peaks: tuple[int, int, int]
) -> dict:
    """CUDA's memory figures of the timed steps (``peaks``: `cuda_memory` after them), the
    replay allocator's plan against its lower bound where it planned, and the model FLOP
    utilisation (bf16 only)."""
    _, peak_alloc, peak_reserved = peaks
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    flops = config.flops_per_token(seq) * spec["batch"] * seq
    return {
        "peak_allocated_bytes": peak_alloc,
        "peak_reserved_bytes": peak_reserved,
        "fragmentation_bytes": peak_reserved - peak_alloc,
        "activation_peak_bytes": peak_alloc - static_bytes,
        "static_bytes": static_bytes,
        "memory_source": memory_source(spec["policy"]),
        "reserved_vs_allocated": peak_reserved / peak_alloc if peak_alloc else None,
        **replay_plan_fields(),
        "mfu": flops / step_s / peak if peak and spec["dtype"] == "bfloat16" else None,
    }


def replay_plan_fields() -> dict:
    """Under the replay allocator, its arena against the lower bound of its last plan (the most
    bytes of planned requests live at once: no layout of them is smaller); else nothing."""
    replay = actoff.replay_allocator_stats()
    if not replay.installed or not replay.plan_lower_bound_bytes:
        return {}
    return {
        "replay_arena_bytes": replay.arena_bytes,
        "replay_plan_lower_bound_bytes": replay.plan_lower_bound_bytes,
        "replay_arena_vs_bound": replay.arena_bytes / replay.plan_lower_bound_bytes,
    }


def memory_source(policy: str) -> str:
    replay = "replay" in split_variants(policy)[1]
    return "replay allocator" if replay else "cuda"


def cuda_memory(reset: bool = False) -> tuple[int, int, int]:
    """CUDA bytes allocated now, most allocated and most reserved since the last ``reset`` (which
    starts them from now): the allocator's own counters (torch's, or under ``+replay`` the replay
    allocator's), with what ``auto``'s memory watch carried across its restarts of them (Note
    [one peak counter, two readers] in actoff.device.cuda)."""
    counters = peak_counters(torch.device("cuda"))
    if reset:
        counters.program_peaks(reset=True)
    live = counters.read()[0]
    peak, reserved = counters.program_peaks()
    return live, peak, reserved


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` and of their gradients."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        for part in (tensor, tensor.grad):
            if part is not None:
                storage = part.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def capped_memory_fields(model, tokens, memory, static_bytes: int, phases: list, stats) -> dict:
    """The memory figures of the last step on the capped simulated device (Note [a capped
    device on a CPU]): what was live before it (weights and gradients, the tokens, actoff's
    device arena, anything else kept across steps), its peak, and per phase (forward through
    the blocks, the loss, the loss's backward, the blocks' backward) the bytes live at its end
    and its peak, all counted from the same zero as the cap."""
    peak = max((phase_peak for _, _, phase_peak in phases), default=memory.peak)
    return {
        "peak_allocated_bytes": peak,
        "activation_peak_bytes": peak - static_bytes,
        "static_bytes": static_bytes,
        "weights_grads_bytes": _storage_bytes((*model.parameters(), *model.buffers())),
        "tokens_bytes": tokens.untyped_storage().nbytes(),
        "device_arena_bytes": stats.device_arena_bytes,
        "sim_capacity_bytes": memory.capacity,
        "phases": [list(phase) for phase in phases[1:]],  # after "start"
        "memory_source": "simulated device",
    }


def simulated_memory_step(step: Step, model, tokens, timeline: Timeline, ballast_bytes: int = 0) -> dict:
    """Note [device memory on a CPU]: a plain CPU device has no allocator to ask, so one more
    step runs inside `actoff.testing.simulated_device`, whose memory mode counts every CPU
    storage allocated while it is active; actoff's host arena and staging buffers are host
    memory and are not counted, as on a GPU. Parameters, gradients (allocated by the earlier
    steps, reused in place) and the tokens are the static bytes; the activation peak is the
    step's peak over what was live when it began. The step is sampled for the memory plot.
    Copies on the simulated device run on its worker threads with no added delay. Under
    ``--emulate-layers`` the ballast (``ballast_bytes``) is static too (Note [emulated layers])."""
    from actoff.testing import simulated_device

    static_bytes = _storage_bytes((*model.parameters(), *model.buffers(), tokens)) + ballast_bytes
    with simulated_device(seed=0, max_delay_s=0.0, max_lag_s=0.0) as device:
        memory = device.memory
        timeline.simulated, timeline.static = memory, static_bytes
        live_before = memory.live
        memory.reset_peak()
        timeline.start()
        step()
        timeline.stop()
        peak = memory.peak
    timeline.simulated = None
    return {
        "peak_allocated_bytes": static_bytes + peak,
        "activation_peak_bytes": peak - live_before,
        "static_bytes": static_bytes,
        "memory_source": "simulated device",
    }
