"""Two revisions of actoff on one benchmark command, interleaved: did a change move step time?

Each round runs ``benchmarks/long_context.py`` with the same arguments in one checkout, then in
the other (ABAB...; each run a fresh process, in that checkout's own package), and reads the step
time of every policy and length from its JSON. The table gives, per policy and length, the median
of the rounds' ratios (second revision over first) with their spread: a difference inside the
spread is noise, whatever its sign.

    git worktree add /tmp/base <revision>          # then build it: pip's build, or copy the .so files
    python benchmarks/revisions.py /tmp/base . --rounds 6 -- --policies keep,cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import format_table, print_header, system_header, write_json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("first", help="checkout of the first revision (the base)")
    parser.add_argument("second", help="checkout of the second revision (the change)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each running both revisions once")
    parser.add_argument("--json", help="write the rounds and the ratios to this path")
    return parser


def _revision(tree: str) -> str:
    done = subprocess.run(
        ["git", "-C", tree, "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def _run(tree: str, arguments: list[str]) -> dict[tuple[str, int], float]:
    """One benchmark run in ``tree``: step time (ms) per (policy, length) that ran."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "run.json")
        command = [
            sys.executable,
            os.path.join(tree, "benchmarks", "long_context.py"),
            *arguments,
            "--json",
            out,
        ]
        environment = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        done = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{tree}: the benchmark failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        with open(out) as handle:
            records = json.load(handle)["records"]
    return {(r["policy"], r["seq"]): r["step_ms"] for r in records if r.get("status") == "ok"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, arguments = build_parser().parse_args(argv[:split]), argv[split + 1 :]
    revisions = {tree: _revision(tree) for tree in (args.first, args.second)}
    header = system_header(None)
    header.update(first=revisions[args.first], second=revisions[args.second], rounds=str(args.rounds))
    header.update(command="long_context.py " + " ".join(arguments))
    print_header("actoff: two revisions, interleaved", header)
    rounds = []
    for index in range(args.rounds):
        first, second = _run(args.first, arguments), _run(args.second, arguments)
        rounds.append({"first": first, "second": second})
        print(f"   round {index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for key in sorted(rounds[0]["first"]):
        ratios = [
            r["second"][key] / r["first"][key] for r in rounds if key in r["second"] and key in r["first"]
        ]
        firsts = [r["first"][key] for r in rounds]
        seconds = [r["second"][key] for r in rounds if key in r["second"]]
        row = {"policy": key[0], "seq": key[1], "first_ms": statistics.median(firsts)}
        row.update(second_ms=statistics.median(seconds), ratio=statistics.median(ratios))
        rows.append({**row, "low": min(ratios), "high": max(ratios)})
    columns = [("policy", "policy"), ("seq", "seq"), ("first_ms", "first ms"), ("second_ms", "second ms"),
               ("ratio", "second / first"), ("low", "min"), ("high", "max")]  # fmt: skip
    print(format_table(rows, columns))
    for row in rows:
        inside = row["low"] <= 1.0 <= row["high"]
        verdict = "within the spread" if inside else ("slower" if row["low"] > 1.0 else "faster")
        print(
            f"   {row['policy']} at {row['seq']}: {row['ratio']:.3f}x ({row['low']:.3f} to {row['high']:.3f}): {verdict}"
        )
    if args.json:
        serialised = [{side: {f"{p}@{s}": v for (p, s), v in r[side].items()} for side in r} for r in rounds]
        write_json(args.json, header, rows, rounds=serialised)
    return 0


if __name__ == "__main__":
    sys.exit(main())
