"""The longest sequence a Llama-3.1-8B-shaped model trains on one GPU, projected from the device
bytes per token measured on its CPU proxy (issue 39's arithmetic, from measurements).

Note [a projection from the proxy]: ``long_context.py --preset 8b --shrink K`` trains the 8B
shape with hidden, MLP and vocabulary divided by K (heads kept) on the simulated device, which
counts every allocation. Its records give, per policy, the step's activation peak (the device
bytes over the weights, gradients and tokens live at the step's start) at each length, and each
phase's. Here:
1. Per policy, phase and block count, the line through (length, activation peak) at the
   `FIT_LENGTHS` longest lengths: its slope is the device bytes per token, its intercept what
   does not grow with the length (the loss's and the tiles' chunks, LoRA's state, kernels'
   scratch). A step's peak is the most of its phases' peaks (forward, loss, the loss's
   backward, the blocks' backward: `phases` in the simulated device's records, less the bytes
   live at the step's start), each a line of its own: a flat one (the loss's chunks) binds at
   short lengths, the steepest at long ones, so each is projected alone and the one that binds
   first at the full model's lengths names the row (``binds``). Records without phases (CUDA's,
   an uncapped simulated device's), or whose phases differ, give the step's peak, one line, at
   its longest lengths only. Two block counts split each
   slope into a part per block (what each block leaves on the device: torch_checkpoint's
   inputs) and a part that does not grow with the blocks (the block at work, the one fetched
   ahead).
2. The full model's bytes per token: K times the proxy's at 32 blocks (every width is K times
   larger; per-head terms such as SDPA's log-sum-exp, 128 B a token a block, are scaled too: an
   overstatement of at most 4 KiB a token per block whose saves are on the device). The
   intercept is scaled by K**2 (the chunks' tokens and the vocabulary are both divided by K).
3. The longest length: the device's budget (actoff's CUDA default, total less max(2 GiB, 5%)),
   less the weights (bf16; full fine-tune: and their bf16 gradients, the optimizer's state off the
   device, as ALST runs it) and the scaled intercept, over the bytes per token; the shortest of
   the phases'. The host bytes at that length are the proxy's bytes sent to host memory per
   token and block, times K and 32 (the head and loss scope's, where auto ran one, once: not
   per block); past `HOST_BYTES` the rest is NVMe's.
Full fine-tune uses LoRA's measured bytes per token: a full fine-tune saves at least those (the
frozen base's inputs are saved for the adapters anyway), so its lengths are upper bounds.

    python benchmarks/projection.py proxy-l2.jsonl proxy-l4.jsonl --shrink 32 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

from _common import format_table

from actoff.budget import cuda_budget
from actoff.reference import ModelConfig

#: The GPUs projected onto: total memory as CUDA reports it (an H100 80GB HBM3, the H200 of
#: benchmarks/results/h200-2026-11-28/).
GPUS = {"H100 80GB": 81559 * 2**20, "H200 141GB": 143771 * 2**20}
#: The host memory the target machine gives the tier (issue 39: 128 GB), NVMe past it.
HOST_BYTES = 128 * 10**9
#: Lengths a line is fitted to per policy and block count: the longest measured.
FIT_LENGTHS = 2
#: The length the projection is held to.
TARGET_TOKENS = 2**20
MODES = ("lora", "full")


@dataclass(frozen=True)
class Line:
    """``intercept + slope * tokens``, fitted to ``points`` measured ones."""

    intercept: float
    slope: float
    points: int
    worst: float  # the largest relative residual of a point

    def at(self, tokens: float) -> float:
        return self.intercept + self.slope * tokens


def fit(points: list[tuple[int, int]]) -> Line:
    """The least-squares line through ``(tokens, bytes)`` points (two or more lengths).

    >>> line = fit([(1000, 3000), (2000, 5000), (4000, 9000)])
    >>> line.intercept, line.slope, line.worst
    (1000.0, 2.0, 0.0)
    """
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise ValueError(f"a line needs two lengths or more, got {sorted(set(xs))}")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    intercept = mean_y - slope * mean_x
    worst = max(abs(intercept + slope * x - y) / y for x, y in zip(xs, ys, strict=True))
    return Line(intercept, slope, len(xs), worst)


def longest(points: list[tuple[int, int]], count: int = FIT_LENGTHS) -> list[tuple[int, int]]:
    """The points at the ``count`` longest lengths (Note [a projection from the proxy]).

    >>> longest([(2048, 9), (8192, 30), (4096, 15)])
    [(4096, 15), (8192, 30)]
    """
    lengths = sorted({tokens for tokens, _ in points})[-count:]
    return sorted(point for point in points if point[0] in lengths)


def per_block(lines: dict[int, Line]) -> tuple[float, float, float]:
    """From lines at two block counts (the fewest and the most): bytes per token per block, per
    token apart from the blocks, and the intercept (the larger count's).

    >>> per_block({2: Line(10, 700, 3, 0), 4: Line(12, 1100, 3, 0)})
    (200.0, 300.0, 12)

    A part per block below zero is the slopes' noise (a block cannot hold less than none): zero.

    >>> per_block({2: Line(10, 7804, 2, 0), 4: Line(12, 7756, 2, 0)})
    (0.0, 7804.0, 12)
    """
    if len(lines) < 2:
        raise ValueError(f"the bytes per block need runs at two block counts, got {sorted(lines)}")
    (few, low), (many, high) = min(lines.items()), max(lines.items())
    each = max(0.0, (high.slope - low.slope) / (many - few))  # less than none: the lines' noise
    return each, low.slope - few * each, high.intercept


def weights_bytes(config: ModelConfig, mode: str) -> int:
    """Device bytes of the model's state: bf16 weights, with their bf16 gradients under a full
    fine-tune (the optimizer's state off the device); LoRA's adapters and their state are small
    and left out (they are in the proxy's intercept).

    >>> weights_bytes(ModelConfig.preset("8b"), "lora") / 1e9  # Llama-3.1-8B: 8.03 B parameters
    16.06...
    """
    params = config.num_layers * config.block_params() + 2 * config.vocab_size * config.hidden_size
    params += config.hidden_size  # the final norm
    return params * 2 * (2 if mode == "full" else 1)


def attention_floor(config: ModelConfig) -> int:
    """Bytes per token a whole-sequence attention cannot do without at a block's backward: k, v
    and their gradients, the residual stream and its gradient, in bf16 (issue 39's ~30 KB)."""
    kv = config.num_kv_heads * config.head_dim
    return 2 * (4 * kv + 2 * config.hidden_size)


def load(paths: list[str]) -> list[dict]:
    """The ok records of ``long_context.py --jsonl`` files (headers and failures left out)."""
    records = []
    for path in paths:
        with open(path) as lines:
            records += [r for r in map(json.loads, lines) if r.get("status") == "ok" and "policy" in r]
    return records


def one_count(records: list[dict]) -> dict[str, list[int]]:
    """The policies with a line at one block count only (a count needs two lengths for its line),
    with the counts that have one: they cannot be split per block.

    >>> runs = [("a", 2, 64), ("a", 2, 128), ("a", 4, 64), ("a", 4, 128), ("b", 2, 64), ("b", 2, 128),
    ...         ("b", 4, 64)]  # b's 4 blocks were cut after one length
    >>> one_count([{"policy": p, "layers": layers, "seq": seq} for p, layers, seq in runs])
    {'b': [2]}
    """
    lengths: dict[str, dict[int, set[int]]] = {}
    for record in records:
        lengths.setdefault(record["policy"], {}).setdefault(record["layers"], set()).add(record["seq"])
    fitted = {
        policy: sorted(n for n, seqs in counts.items() if len(seqs) >= 2)
        for policy, counts in lengths.items()
    }
    return {policy: counts for policy, counts in sorted(fitted.items()) if len(counts) < 2}


def phase_peaks(record: dict) -> dict[str, int]:
    """A record's activation bytes at each phase's peak (Note [a projection from the proxy]): the
    phase's peak less the bytes live at the step's start; without phases, the step's as ``step``.

    >>> phase_peaks({"static_bytes": 10, "activation_peak_bytes": 25, "phases": [["forward", 12, 20], ["loss", 12, 35]]})
    {'forward': 10, 'loss': 25}
    >>> phase_peaks({"activation_peak_bytes": 25})
    {'step': 25}
    """
    phases = record.get("phases")
    if not phases or record.get("static_bytes") is None:
        return {"step": record["activation_peak_bytes"]}
    return {name: peak - record["static_bytes"] for name, _live, peak in phases}


def _phase_lines(mine: list[dict], shrink: int, layers_full: int) -> dict[str, tuple[float, float, float]]:
    """Per phase: its full model's bytes per token, of which per block, and its intercept scaled
    (Note [a projection from the proxy], steps 1 and 2). Records whose phases differ (some
    without any) are fitted by the step's peak, one line (``step``)."""
    peaks = [phase_peaks(r) for r in mine]
    if any(set(p) != set(peaks[0]) for p in peaks):
        peaks = [{"step": r["activation_peak_bytes"]} for r in mine]
    scaled = {}
    for name in sorted(peaks[0]):
        points = {
            layers: longest(
                [(r["seq"], p[name]) for r, p in zip(mine, peaks, strict=True) if r["layers"] == layers]
            )
            for layers in sorted({r["layers"] for r in mine})
        }
        # A count cut after one length has no line: its policy was left out (`one_count`), or every
        # policy was, and `per_block` says why.
        lines = {layers: fit(p) for layers, p in points.items() if len({t for t, _ in p}) > 1}
        each, apart, intercept = per_block(lines)
        scaled[name] = (shrink * (apart + layers_full * each), shrink * each, intercept * shrink**2)
    return scaled


#: The most tokens a row says (a phase whose line does not grow sets no bound): 2**40.
UNBOUNDED = 2**40


def _reach(room: float, per_token: float) -> float:
    """Tokens ``per_token`` bytes each fit in ``room``, at most `UNBOUNDED`.

    >>> _reach(10.0, 2.0), _reach(-1.0, 2.0), _reach(10.0, 0.0) == UNBOUNDED
    (5.0, 0, True)
    """
    if room <= 0:
        return 0
    return min(room / per_token, UNBOUNDED) if per_token > 0 else UNBOUNDED


def _host_per_token(record: dict, layers: int) -> float:
    """The proxy's bytes per token sent to host memory, its blocks' scaled to ``layers`` blocks;
    the head and loss scope's (auto's: Note [auto plans the head and loss too]) once, as the
    full model has one.

    >>> _host_per_token({"act_cpu_bytes": 4096, "seq": 16, "layers": 2}, 32)  # older records: blocks only
    4096.0
    >>> _host_per_token({"act_cpu_bytes": 4096, "head_and_loss_cpu_bytes": 1024, "seq": 16, "layers": 2}, 32)
    3136.0
    """
    head = record.get("head_and_loss_cpu_bytes", 0)
    return ((record["act_cpu_bytes"] - head) / record["layers"] * layers + head) / record["seq"]


def project(records: list[dict], shrink: int, preset: str = "8b") -> list[dict]:
    """A row per policy, mode and GPU: the proxy's figures scaled to the full model (Note [a
    projection from the proxy]), phase by phase, and the longest length they leave room for,
    named by the phase that binds there. Policies run at one block count only are left out
    (`one_count`), unless no policy has two."""
    config = ModelConfig.preset(preset)
    rows = []
    policies = sorted({r["policy"] for r in records} - set(one_count(records)))
    for policy in policies or sorted({r["policy"] for r in records}):  # none: per_block says why
        mine = [r for r in records if r["policy"] == policy]
        lines = _phase_lines(mine, shrink, config.num_layers)
        host_per_token = shrink * statistics.median(_host_per_token(r, config.num_layers) for r in mine)
        for mode in MODES:
            for gpu, total in GPUS.items():
                room = cuda_budget(total) - weights_bytes(config, mode)
                reaches = {name: _reach(room - c, per_token) for name, (per_token, _, c) in lines.items()}
                binds = min(reaches, key=lambda name: reaches[name])
                per_token, each, _ = lines[binds]
                reach = int(reaches[binds])
                host = host_per_token * reach
                rows.append(
                    {
                        "policy": policy,
                        "mode": mode,
                        "gpu": gpu,
                        "binds": binds,
                        "kib_per_token": per_token / 2**10,
                        "kib_per_block": each / 2**10,
                        "x_attention_floor": per_token / attention_floor(config),
                        "longest_k": reach / 2**10,
                        "x_target": reach / TARGET_TOKENS,
                        "host_gb": min(host, HOST_BYTES) / 1e9,
                        "nvme_gb": max(0.0, host - HOST_BYTES) / 1e9,
                        "phases_k": {name: r / 2**10 for name, r in reaches.items()},
                    }
                )
    return rows


COLUMNS = [
    ("policy", "policy"),
    ("mode", "mode"),
    ("gpu", "GPU"),
    ("binds", "binds in"),
    ("kib_per_token", "KiB/token"),
    ("kib_per_block", "of which per block"),
    ("x_attention_floor", "x attention floor"),
    ("longest_k", "longest (Ki tokens)"),
    ("x_target", "x 2**20"),
    ("host_gb", "host GB"),
    ("nvme_gb", "NVMe GB"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="+", help="long_context.py --jsonl files of the proxy, two block counts"
    )
    parser.add_argument("--shrink", type=int, required=True, help="the runs' --shrink (1: the model itself)")
    parser.add_argument("--preset", default="8b", help="the runs' --preset (default 8b)")
    parser.add_argument("--json", help="write the rows to this path")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    records = load(args.runs)
    rows = project(records, args.shrink, args.preset)
    floor = attention_floor(ModelConfig.preset(args.preset))
    print(
        f"attention floor (k, v, dk, dv and the residual stream with its gradient, bf16): {floor / 2**10:.0f} KiB/token"
    )
    print(format_table(rows, COLUMNS))
    left_out = one_count(records)
    if left_out:
        named = ", ".join(
            f"{policy} ({'a line at ' + ', '.join(map(str, layers)) + ' blocks' if layers else 'no line'})"
            for policy, layers in left_out.items()
        )
        print(f"\nLeft out, without a line (two lengths) at two block counts: {named}")
    print(
        "\nbinds in: the phase whose line leaves the least room (step: records without phases); KiB/token: "
        "that phase's full model's device bytes per token at 32 blocks (of which per block: what each block "
        "leaves on the device); longest: in Ki tokens (1024); x 2**20: over 1,048,576 tokens; host and NVMe: "
        f"what actoff sent off the device at that length, host up to {HOST_BYTES / 1e9:.0f} GB (PyTorch's tools: "
        "not counted). Note [a projection from the proxy] in benchmarks/projection.py says how it scales."
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"shrink": args.shrink, "preset": args.preset, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
