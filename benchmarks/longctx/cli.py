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
    python benchmarks/long_context.py --preset 7b --find-max-seq --policies keep,torch_checkpoint,cpu
    torchrun --nproc-per-node 2 benchmarks/long_context.py --seq 1k   # DDP: per rank and in total
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import torch
from _common import JsonLines, format_table, print_header, system_header, write_json

import actoff

from . import calibrate
from .budgets import AUTO_WARMUP, SWEEP_POLICIES, auto_under_budgets, print_auto_figures, print_sweep
from .budgets import sweep as budget_sweep
from .ddp import gather_to_rank0, host_store, torchrun_launch
from .emulate import check_emulation, scaled_budget
from .maxseq import find_max
from .options import DEFAULT_LIKE, DEFAULT_SIM_MEMORY, PRESETS, parse_lengths
from .options import build_parser as _build_parser
from .paired import paired_worker
from .plots import plot
from .policies import (
    ALLOCATOR_VARIANTS,
    DEFAULT_POLICIES,
    MAXSEQ_CPU_POLICIES,
    check_policies,
    shrunk_chunks,
    split_variants,
)
from .rounds import ROUNDS, rounds_worker
from .table import add_derived, failed, report, run_policies
from .tunnel import matching_length, parse_like, scale
from .worker import run_one, worker


def build_parser() -> argparse.ArgumentParser:
    """The command line (also what benchmarks/gpu_session.sh's commands are checked against)."""
    return _build_parser(__doc__)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if not args.worker and threading.current_thread() is threading.main_thread():
        # Stopped from outside (timeout, a launcher): unwind, so that run_one's finally kills
        # the worker process and the JSON lines file is closed, rather than leave a worker on.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.worker:
        return _serve_worker(json.loads(args.worker))

    if args.calibrate:
        return _calibrate(args)
    if args.budgets is not None:
        return _budgets(args)
    preset_name = args.preset or ("7b" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[preset_name]
    if preset_name != "cpu" and not torch.cuda.is_available() and not args.shrink:
        raise SystemExit(f"--preset {preset_name} needs a CUDA GPU; use --preset cpu here, or --shrink")
    cuda = torch.cuda.is_available()
    if args.memory_snapshot and not cuda:
        raise SystemExit("--memory-snapshot reads CUDA's caching allocator; this machine has no CUDA device")
    policies = _policies(args, cuda)
    solo = torchrun_launch() is None and not args.find_max_seq  # Note [auto in the main run]
    if solo and args.auto_budgets > 0 and "auto" in policies and "keep" not in policies:
        raise SystemExit(
            "--auto-budgets: auto's budgets start at keep's peak; add keep to --policies, or give "
            "--auto-budgets 0 to run auto once without a budget"
        )
    like = _like(args, cuda, preset)  # first: a target sets the layers and lengths not given
    lengths = parse_lengths(args.seq or preset["seq"])
    max_seq = parse_lengths(args.max_seq or ("1024k" if cuda else "8k"))[0]
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="actoff-bench-")
    os.makedirs(nvme_dir, exist_ok=True)
    base = _base_spec(args, preset, nvme_dir, capped=not cuda and bool(args.find_max_seq or args.sim_memory))
    if args.emulate_layers:
        check_emulation(policies, base["layers"], args.emulate_layers)

    launch = torchrun_launch()
    if launch is not None and args.find_max_seq:
        raise SystemExit("--find-max-seq runs on one process; launch it without torchrun")
    header = system_header(nvme_dir)
    _store = host_store(launch) if launch is not None else None  # held: it serves every job of the launch
    header.update(_describe(base, preset_name, launch))
    tunnel = (
        _scale_tunnel(like, base, lengths, header) if like is not None and not args.find_max_seq else None
    )
    lead = launch is None or launch["rank"] == 0
    if lead:
        print_header("actoff long-context benchmark", header)
    time_left = _time_left(args)

    out = JsonLines(args.jsonl if lead else None, header)
    try:
        if args.find_max_seq:
            return find_max(policies, base, lengths[0], max_seq, time_left, header, args, out)
        lengths.sort()  # shortest first: a failure skips the longer ones
        if tunnel is not None:
            base["tunnel"] = _tunnel_spec(like, tunnel)
        budgeted = launch is None and args.auto_budgets > 0 and "auto" in policies
        ran = [policy for policy in policies if not (budgeted and policy == "auto")]
        records, interleaved = run_policies(ran, base, lengths, launch, time_left, out, lead)
        if budgeted:  # Note [auto in the main run]
            records += auto_under_budgets(records, base, args.auto_budgets, time_left, out)
        if launch is not None:
            records = gather_to_rank0(records, launch)
            if records is None:
                return 0
    finally:
        out.close()
        if not args.nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return _report_table(records, interleaved, policies, base, header, args, lead, tunnel)


def _calibrate(args: argparse.Namespace) -> int:
    """``--calibrate``: each target of the GPU run through the tunnel in interleaved rounds, the
    fitted target first (Note [fitting the tunnel]), then the table of overheads."""
    if torch.cuda.is_available():
        raise SystemExit(
            "--calibrate runs the tunnel, on a CPU; on a GPU run --preset 7b --seq 8k,32k --layers 4"
        )
    nvme_dir = tempfile.mkdtemp(prefix="actoff-bench-")
    header = system_header(nvme_dir)
    print_header("actoff wind tunnel calibration", header)
    time_left = _time_left(args)
    measured = calibrate.measured_records()
    fit_like = parse_like(calibrate.FIT_TARGET)
    fit = {"none_ms": measured[("none", fit_like.seq)]["step_ms"], "share": 1.0, "rounds": ROUNDS}
    fit["mfu"] = calibrate.fit_mfu(fit_like, calibrate.LAYERS, fit["none_ms"])
    runs, tunnels = {}, {}
    out = JsonLines(args.jsonl, header)
    try:
        for text in sorted(calibrate.TARGETS, key=lambda target: target != calibrate.FIT_TARGET):
            args.like, args.seq, args.layers = text, None, calibrate.LAYERS
            like = _like(args, False, PRESETS["cpu"])
            gpu = calibrate.fitted_gpu(like.gpu, mfu=fit["mfu"], save_on_cpu_share=fit["share"])
            like = dataclasses.replace(like, gpu=gpu)
            base = _base_spec(args, PRESETS["cpu"], nvme_dir, capped=False)
            seq = int(args.seq)
            tunnel = _scale_tunnel(like, base, [seq], header)
            print(f"{text}: CPU model at {seq} tokens, {header['tunnel']}", flush=True)
            spec = {
                **base,
                "policy": "rounds",
                "policies": list(calibrate.POLICIES),
                "seqs": [seq],
                "rounds": ROUNDS,
                "tunnel": _tunnel_spec(like, tunnel),
            }
            record = run_one(spec, time_left(), out.write)[0]
            if text == calibrate.FIT_TARGET and record.get("status") == "ok":
                gpu_fit = {p: measured[(p, like.seq)]["step_ms"] for p in ("none", calibrate.FIT_POLICY)}
                fit["share"] = calibrate.fit_share(
                    record, gpu_fit[calibrate.FIT_POLICY] / gpu_fit["none"] - 1
                )
                record = calibrate.with_share(record, fit["share"])
            runs[text], tunnels[text] = (like.seq, record), tunnel[seq]
    finally:
        out.close()
        shutil.rmtree(nvme_dir, ignore_errors=True)
    done = [record for _, record in runs.values() if record.get("status") == "ok"]
    for text, (_, record) in runs.items():
        if record.get("status") != "ok":
            print(f"{text}: the rounds failed: {record.get('status')}: {record.get('error')}")
    wall = sum(sum(times) for record in done for times in record["wall_ms"].values())
    stolen = sum(sum(times) for record in done for times in record["stolen_ms"].values())
    fit.update(link=fit_like.gpu.link, stolen_pct=100 * stolen / wall if wall else 0.0)
    sides = {gpu: calibrate.measured_records(path) for gpu, path in calibrate.SIDES.items()}
    rows = calibrate.sides_rows(sides, runs)
    calibrate.print_calibration(rows, fit)
    if args.json:
        write_json(
            args.json,
            header,
            [record for _, record in runs.values()],
            calibration=rows,
            tunnel=tunnels,
            fit=fit,
        )
    return 0 if len(done) == len(runs) and all(row["verdict"] in ("yes", "fitted") for row in rows) else 1


def _budgets(args: argparse.Namespace) -> int:
    """``--budgets N``: the budget sweep at one length (Note [a budget sweep])."""
    if args.budgets < 1:
        raise SystemExit(f"--budgets {args.budgets}: give a count of budgets >= 1")
    if args.rounds < 2:
        raise SystemExit(f"--rounds {args.rounds}: give at least 2 rounds (a verdict needs a spread)")
    if args.find_max_seq:
        raise SystemExit("--budgets and --find-max-seq answer different questions: run them apart")
    cuda = torch.cuda.is_available()
    if args.policies is None:
        args.policies = ",".join(SWEEP_POLICIES)
    policies = _policies(args, cuda)
    preset_name = args.preset or ("7b" if cuda else "cpu")
    preset = PRESETS[preset_name]
    like = _like(args, cuda, preset)
    seq = parse_lengths(args.seq or preset["seq"])[0]
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="actoff-bench-")
    base = {**_base_spec(args, preset, nvme_dir, capped=False), "interleave": False}
    base["warmup"] = max(base["warmup"], AUTO_WARMUP)  # auto's timed steps run its plan
    header = system_header(nvme_dir)
    header.update(_describe(base, preset_name, None))
    if like is not None:
        base["tunnel"] = _tunnel_spec(like, _scale_tunnel(like, base, [seq], header))
    header["budgets"] = (
        f"{args.budgets} from keep's peak down to the floor at seq {seq} (Note [a budget sweep])"
    )
    print_header("actoff long-context benchmark: device budgets", header)
    out = JsonLines(args.jsonl, header)
    try:
        uncapped, capped, budgets = budget_sweep(
            policies, base, seq, args.budgets, _time_left(args), out, rounds=args.rounds
        )
    finally:
        out.close()
        if not args.nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    add_derived(uncapped)
    print(
        format_table(
            uncapped,
            [
                ("policy", "policy"),
                ("status", "status"),
                ("step_ms", "step ms"),
                ("step_vs_none", "x none"),
                ("peak_allocated_bytes", "peak bytes"),
            ],
        )
    )
    print("\nwithout a cap: each policy's device peak sets the budgets\n")
    summary = print_sweep(capped, budgets, policies)
    if args.json:
        write_json(args.json, header, uncapped + capped, budgets=budgets, summary=summary)
    return 0 if all(line["met"] for line in summary) else 1


def _serve_worker(spec: dict) -> int:
    """``--worker SPEC``: measure as the spec says, a JSON record a line on stdout."""
    serve = {"interleaved": paired_worker, "rounds": rounds_worker}.get(spec.get("policy"), worker)
    for record in serve(spec):
        print(json.dumps(record), flush=True)
    if spec.get("ddp") is not None:
        # A gloo work freed by its thread during interpreter finalisation aborts the process
        # (a torch bug; "terminate called without an active exception"): the record is out,
        # so leave without finalising.
        sys.stderr.flush()
        os._exit(0)
    return 0


def _policies(args: argparse.Namespace, cuda: bool) -> list[str]:
    """The policies to run: ``--policies``, checked, or the defaults of the mode."""
    if args.policies is None:
        args.policies = ",".join(MAXSEQ_CPU_POLICIES if args.find_max_seq and not cuda else DEFAULT_POLICIES)
    policies = check_policies(args.policies)
    cuda_only = [p for p in policies if split_variants(p)[1] & ALLOCATOR_VARIANTS.keys()]
    if cuda_only and not cuda:
        raise SystemExit(
            f"policy {cuda_only[0]!r}: +expandable and +replay choose how CUDA memory is allocated; "
            "this machine has no CUDA device (leave them out here)"
        )
    return policies


def _base_spec(args: argparse.Namespace, preset: dict, nvme_dir: str, capped: bool) -> dict:
    """What every worker's spec shares: the model, its dtype, the steps, the NVMe directory, the
    chunk sizes and, on a capped simulated device, its memory."""
    base = {"model": preset["model"], "layers": args.layers or preset["layers"], "batch": args.batch or preset["batch"],
            "dtype": preset["dtype"], "steps": args.steps, "warmup": args.warmup, "nvme_dir": nvme_dir,
            "tile_tokens": preset.get("tile_tokens"), "loss_tokens": preset.get("loss_tokens")}  # fmt: skip
    for key in ("shrink", "lora", "emulate_layers", "memory_snapshot"):
        if getattr(args, key, None):
            base[key] = getattr(args, key)
    if base.get("shrink"):  # chunks shrink with the widths: the proxy chunks where the model would
        base["tile_tokens"], base["loss_tokens"] = shrunk_chunks(base, args.shrink)
    if base.get("shrink") or base.get("lora"):
        base["interleave"] = False  # the interleaved ratio lines time the cpu preset's plain model
    if base.get("emulate_layers"):  # Note [emulated layers]: the L-block model's budget, N blocks' share
        total = actoff.Config.from_env().host_budget
        if total is not None:
            base["host_budget"] = scaled_budget(total, base["layers"], base["emulate_layers"])
    if capped:  # Note [a capped device on a CPU]
        size = args.sim_memory or os.environ.get("ACTOFF_SIM_DEVICE_MEMORY") or DEFAULT_SIM_MEMORY
        try:
            base["sim_memory"] = actoff.parse_size(size, what="--sim-memory")
        except ValueError as error:
            raise SystemExit(str(error)) from None
        if base["sim_memory"] <= 0:
            raise SystemExit(f"--sim-memory={size!r}: give a size > 0, e.g. 128MiB")
    if args.find_max_seq:
        # Each probe: a warm-up step, in which actoff traces its buffers and plans them, then
        # the step measured, the first to hold the planned device arena: a length that fits only
        # before the plan does not train. No timeline: a probe asks whether the step fits.
        base.update(steps=1, warmup=1, timeline=False)
    return base


def _describe(base: dict, preset_name: str, launch: dict | None) -> dict:
    """The header's lines about this run: the ranks, the preset and model, chunks, device memory."""
    lines = {}
    if launch is not None:
        lines["ranks"] = f"{launch['world']} (DDP; per rank and in total)"
    lines.update(
        preset=preset_name,
        model=f"{base['model']}-shaped, {base['layers']} layers, batch {base['batch']}, {base['dtype']}",
    )
    if base.get("tile_tokens") or base.get("loss_tokens"):
        lines["chunks"] = f"+tile {base['tile_tokens']} tokens, +loss {base['loss_tokens']} tokens"
    if base.get("sim_memory"):
        lines["device_memory"] = (
            f"simulated device of {actoff.format_bytes(base['sim_memory'])} "
            "(ACTOFF_SIM_DEVICE_MEMORY; host buffers not counted)"
        )
    if base.get("shrink"):
        lines["model"] += f", widths / {base['shrink']} (--shrink)"
    if base.get("lora"):
        lines["lora"] = f"rank {base['lora']} adapters on a frozen base (--lora)"
    if base.get("emulate_layers"):
        budget = base.get("host_budget")
        lines["emulated"] = (
            f"{base['emulate_layers']} blocks: {base['layers']} built, a device ballast for the "
            f"rest; host budget {actoff.format_bytes(budget) if budget else 'none'} "
            f"(ACTOFF_HOST_BUDGET x {base['layers']}/{base['emulate_layers']}; Note [emulated layers])"
        )
    return lines


def _like(args: argparse.Namespace, cuda: bool, preset: dict):
    """The tunnel's target (`tunnel.Like`), or None: on CUDA (the real thing), under
    ``--like none``, or for ``--find-max-seq`` (memory, not time) unless asked for. An explicit
    target sets what is not given: the target model's layer count and the CPU length with the
    target's share of attention (`tunnel.matching_length`)."""
    if args.shrink:
        if args.like is not None and args.like.lower() != "none":
            raise SystemExit("--like measures the cpu preset's blocks; leave out --shrink with it")
        return None
    text = args.like if args.like is not None else (None if cuda or args.find_max_seq else DEFAULT_LIKE)
    if text is None or text.lower() == "none":
        return None
    if cuda:
        raise SystemExit(
            "--like scales the simulated device's link on a CPU; on CUDA the GPU is measured itself"
        )
    like = parse_like(text)
    if args.like is not None and args.layers is None:
        from actoff.reference import ModelConfig

        args.layers = ModelConfig.preset(like.model).num_layers  # 2 of 4 blocks in flight is not 2 of 32
    if args.like is not None and args.seq is None:
        args.seq = str(matching_length(like, preset["model"]))
    return like


def _scale_tunnel(like, base: dict, lengths: list[int], header: dict) -> dict:
    """Per length, the link rate that gives the CPU model the target's ratio (a warm-up on the
    CPU measures its side), and a header line saying so."""
    import torch

    tunnel = {
        seq: scale(like, base["model"], base["layers"], seq, getattr(torch, base["dtype"]), base["batch"])
        for seq in lengths
    }
    first = next(iter(tunnel.values()))
    rates = ", ".join(f"{seq}: {actoff.format_bytes(t['bandwidth'])}/s" for seq, t in tunnel.items())
    header["tunnel"] = (
        f"like {like.text}: a block's copy / forward time = {first['ratio']:.2f} as there "
        f"(link {rates}; Note [scaling the tunnel])"
    )
    return tunnel


def _tunnel_spec(like, tunnel: dict) -> dict:
    """The workers' ``tunnel``: the link rate per length, the share PyTorch's save_on_cpu gets."""
    return {
        "bandwidth": {str(seq): scaled["bandwidth"] for seq, scaled in tunnel.items()},
        "save_on_cpu_share": like.gpu.save_on_cpu_share,
    }


def _time_left(args: argparse.Namespace):
    """From now: a function of the seconds a new process may run, the per-process timeout
    within what is left of the time budget."""
    started_s = time.perf_counter()

    def time_left() -> float:
        if args.time_budget is None:
            return args.timeout
        return min(args.timeout, args.time_budget - (time.perf_counter() - started_s))

    return time_left


def _report_table(
    records: list[dict],
    interleaved: list[dict],
    policies: list[str],
    base: dict,
    header: dict,
    args: argparse.Namespace,
    lead: bool,
    tunnel: dict | None = None,
) -> int:
    """The table and its ratio lines printed, then written as asked; 1 if a record is not ok."""
    summary = report(records, interleaved, policies, base["layers"])
    budgets = sorted({r["budget_bytes"] for r in records if r["policy"] == "auto" and r.get("budget_bytes")})
    print_auto_figures(records, budgets)  # auto under the main run's budgets: Note [auto in the main run]
    extra = {"tunnel": tunnel} if tunnel is not None else {}
    if args.jsonl and lead:
        with open(args.jsonl, "a") as handle:
            handle.write(json.dumps({"summary": summary, **extra}) + "\n")
    if args.json:
        write_json(args.json, header, records, summary=summary, interleaved=interleaved, **extra)
    if args.plot:
        plot(records, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if not failed(records) else 1
