"""The ratio lines under the long-context table, and the interleaved timing they read on a CPU:
actoff ``keep`` over ``none`` (hook overhead), ``cpu`` over ``torch_save_on_cpu`` (step time), and
``cpu``'s activation peak over ``keep``'s, each against its target.
"""

from __future__ import annotations

import contextlib
import time

from .policies import build_model, model_config

#: Policies the interleaved timing compares, in pairs (top, bottom) of the ratio lines.
PAIRS = (("keep", "none"), ("cpu", "torch_save_on_cpu"))
PAIR_ROUNDS = 6

#: Targets for the CPU run (ratios within one run; issue 13): actoff's hooks alone cost at most
#: 3% of a step, the host tier at most 5% more than torch_save_on_cpu, and under ``cpu`` the device
#: holds the activations of about two blocks (MEMO's double buffering) out of ``L``.
KEEP_OVERHEAD_TARGET = 1.03
CPU_VS_SAVE_ON_CPU_TARGET = 1.05
ACTIVATION_SLACK = 0.05


def paired_worker(spec: dict):
    """Yield, per sequence length, the least step time (wall and process CPU) of each policy of
    `PAIRS`, measured interleaved in this one process (Note [timing on a shared CPU]).

    The policies share one set of weights: ``none`` and ``torch_save_on_cpu`` run the plain model,
    ``keep`` and ``cpu`` a copy under actoff each. Every round steps each policy once, in a
    rotated order, so that a burst of load from elsewhere falls on all of them alike. Its step
    times are on one thread: they are not the policies' own rows.
    """
    import torch

    # One intra-op thread: process CPU time is then the work done, whereas idle OpenMP workers
    # spin, and spin longer the busier the machine is. The work is what the ratios compare.
    torch.set_num_threads(1)
    config = model_config(spec)
    models = _paired_models(spec, config)
    names = [name for pair in PAIRS for name in pair]
    for seq in spec["seqs"]:
        generator = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, config.vocab_size, (spec["batch"], seq + 1), generator=generator)

        def step(name: str, tokens: torch.Tensor = tokens) -> tuple[float, float]:
            model, context = models[name]
            wall, cpu = time.perf_counter(), time.process_time()
            with context():
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
                )
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
        yield {
            "policy": "interleaved",
            "seq": seq,
            "status": "ok",
            "rounds": PAIR_ROUNDS,
            "step_ms": {name: min(walls[name]) * 1e3 for name in names},
            "step_cpu_ms": {name: min(cpus[name]) * 1e3 for name in names},
        }


def _paired_models(spec: dict, config) -> dict:
    """``policy -> (model, context of its steps)`` for the policies of `PAIRS`, on one set of weights."""
    import copy

    import torch

    import actoff
    from actoff.reference import Block

    torch.manual_seed(0)
    plain = build_model(config, torch.device("cpu"), getattr(torch, spec["dtype"]))
    models = {
        "none": (plain, contextlib.nullcontext),
        "torch_save_on_cpu": (plain, torch.autograd.graph.save_on_cpu),
    }
    for policy in ("keep", "cpu"):
        model = copy.deepcopy(plain)
        actoff.offload_(model, block_cls=Block, config=actoff.Config.from_env(policy=policy))
        models[policy] = (model, contextlib.nullcontext)
    return models


def summarize(records: list[dict], layers: int, *, cuda: bool) -> list[dict]:
    """The ratio lines, per sequence length where their records are all ``ok``: actoff ``keep``
    over ``none`` (hook overhead), ``cpu`` over ``torch_save_on_cpu`` (step time), and ``cpu``'s
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
            (f"cpu / torch_save_on_cpu ({what_time})", ratio("cpu", "torch_save_on_cpu", step_key, seq), CPU_VS_SAVE_ON_CPU_TARGET),
            (f"cpu activation peak / {keep}'s", ratio("cpu", keep, "activation_peak_bytes", seq), target),
        ]  # fmt: skip
        for what, value, bound in candidates:
            if value is not None:
                lines.append(
                    {"seq": seq, "what": what, "ratio": value, "target": bound, "met": value <= bound}
                )
    return lines


def print_ratios(summary: list[dict], interleaved: list[dict]) -> None:
    """The interleaved step times and the ratio lines, under the table."""
    if summary:
        print()
    for record in interleaved:
        if record.get("status") == "ok":
            times = ", ".join(
                f"{name} {record['step_cpu_ms'][name]:.0f} ms ({record['step_ms'][name]:.0f} wall)"
                for name in record["step_cpu_ms"]
            )
            print(f"   seq {record['seq']}: interleaved, least step CPU time of {record['rounds']}: {times}")
    for line in summary:
        print(
            f"   seq {line['seq']}: {line['what']}: {line['ratio']:.3f}x "
            f"(target <= {line['target']:.3f}x: {'met' if line['met'] else 'NOT met'})"
        )
