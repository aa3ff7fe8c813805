"""The interleaved rounds as one table: ``python table.py DIR`` (records ``{new,old}-ROUND.json``)."""

import glob
import json
import statistics
import sys

rows: dict[tuple[str, str], list[dict]] = {}
for name in sorted(glob.glob(sys.argv[1] + "/*-[0-9].json")):
    head = name.split("/")[-1].split("-")[0]
    with open(name) as handle:
        records = json.load(handle)["records"]
    for record in records:
        key = record["policy"] if record["policy"] != "auto" else record["label"]
        rows.setdefault((key, head), []).append(record)
print(
    f"{'policy':22} {'head':4} {'status':10} {'step ms (each round)':28} {'median':>7} {'peak MiB (most)':>15}  plans"
)
for (key, head), mine in sorted(rows.items()):
    ok = [r for r in mine if r["status"] == "ok"]
    times = [round(r["step_ms"]) for r in ok]
    failed = [r["status"] for r in mine if r["status"] != "ok"]
    status = f"{len(failed)}/{len(mine)} {failed[0]}" if failed else "ok"
    median = statistics.median(times) if times else float("nan")
    peak = max((r["peak_allocated_bytes"] for r in ok), default=0) / 2**20
    plans = sorted({(r.get("auto_plan") or "").split(";")[0] for r in ok} - {""})
    print(f"{key:22} {head:4} {status:10} {times!s:28} {median:7.0f} {peak:15.2f}  {'; '.join(plans)}")
