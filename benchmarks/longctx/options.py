"""The long-context benchmark's command line: its presets and options (`build_parser`), and the
lengths it takes (`parse_lengths`)."""

from __future__ import annotations

import argparse

from .budgets import MAIN_AUTO_BUDGETS, SWEEP_POLICIES, SWEEP_ROUNDS
from .policies import ACTOFF_POLICIES, BASELINES

__all__ = ["DEFAULT_LIKE", "DEFAULT_SIM_MEMORY", "PRESETS", "build_parser", "parse_lengths"]

DEFAULT_SIM_MEMORY = "128MiB"
#: The tunnel of the CPU table (Note [scaling the tunnel]): a 7B block on an H100 at 8k tokens.
DEFAULT_LIKE = "h100:7b@8k"
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
    # Llama-3.1-8B's shapes; on a CPU only with --shrink (its widths divided: the same shape, small).
    "8b": {"model": "8b", "layers": 4, "seq": "32k,128k", "batch": 1, "dtype": "bfloat16"},
}


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


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The command line (also what benchmarks/gpu_session.sh's commands are checked against)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _model_options(parser)
    _run_options(parser)
    _question_options(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _model_options(parser: argparse.ArgumentParser) -> None:
    """What is trained: the model's shape, size, adapters, batch."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape and defaults (cpu without a GPU, else 7b)",
    )
    parser.add_argument("--seq", help="sequence lengths, e.g. 4k,8k,16k")
    parser.add_argument("--layers", type=int, help="number of blocks")
    parser.add_argument(
        "--shrink",
        type=int,
        help="divide the preset's hidden, MLP and vocabulary sizes by this (heads kept): its shape at a size "
        "a CPU trains; any preset runs on a CPU with it (e.g. --preset 8b --shrink 32)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="a frozen base with trainable LoRA adapters of this rank on the attention and MLP projections "
        "(peft's where installed, else actoff's benchmark adapters)",
    )
    parser.add_argument(
        "--emulate-layers",
        type=int,
        metavar="L",
        help="stand for a model of L blocks on the --layers built: a device ballast for the others and "
        "ACTOFF_HOST_BUDGET (the L-block model's) scaled by layers / L (Note [emulated layers])",
    )
    parser.add_argument(
        "--memory-snapshot",
        metavar="DIR",
        help="on CUDA: torch.cuda.memory._snapshot() at the start of the first timed step, written to DIR "
        "and summarised in the record (the allocator records stacks from the start: do not time this run)",
    )
    parser.add_argument("--batch", type=int)


def _run_options(parser: argparse.ArgumentParser) -> None:
    """How it is run and where its figures go."""
    parser.add_argument(
        "--policies",
        help=f"comma list of {', '.join(BASELINES + ACTOFF_POLICIES)}; tokenwise:CPU:NVME sets fractions; "
        "+tile, +loss variants (default: all, or for --find-max-seq on a CPU each of keep, torch_checkpoint, "
        "torch_save_on_cpu, cpu, recompute, auto, plain and +tile+loss)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nvme-dir", help="directory for the nvme policy (default: a temp dir)")
    parser.add_argument("--json", help="write all records to this path at the end")
    parser.add_argument("--jsonl", help="append each record to this path as it is made (JSON lines)")
    parser.add_argument("--plot", help="write a PNG to this path")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process (one policy)")
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole run: no process outlives it, none starts late",
    )


def _question_options(parser: argparse.ArgumentParser) -> None:
    """Which question it answers beyond the table, and on what device."""
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
    parser.add_argument(
        "--like",
        help="on a CPU: the wind tunnel, the simulated device's link scaled so a block's copy-to-compute "
        "ratio is that of a target GPU and model at a length, e.g. h100:7b@8k, h100:8b@32k, h200:8b@128k "
        f"(default on a CPU: {DEFAULT_LIKE}; 'none': no link, copies at memcpy speed). An explicit target "
        "also sets --layers to the target model's unless given",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="on a CPU: the tunnel against the committed H100 run (7B-shaped, 4 layers, 8k and 32k): "
        "step-time ratios to none side by side with their errors",
    )
    parser.add_argument(
        "--auto-budgets",
        type=int,
        default=MAIN_AUTO_BUDGETS,
        help="auto runs under N device budgets from keep's peak down to the least peak of the policies, at "
        f"the longest length, instead of once without one (default {MAIN_AUTO_BUDGETS}; 0: once, no budget)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=SWEEP_ROUNDS,
        help=f"with --budgets: the capped runs in N interleaved rounds, each cell's median and spread over "
        f"them (default {SWEEP_ROUNDS}; a verdict needs a spread: at least 2)",
    )
    parser.add_argument(
        "--budgets",
        type=int,
        help="N device budgets from keep's peak down to the floor (the least peak of the policies), every "
        "policy under each at one length: on a CPU the simulated device's capacity with the tunnel's link, on "
        "CUDA ACTOFF_GPU_BUDGET and a hard cap; auto's step time against the fastest that fits (default "
        "policies: " + ", ".join(SWEEP_POLICIES) + ")",
    )
