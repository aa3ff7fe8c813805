"""Shared benchmark helpers: the system header, timing (warm-up, median), a progress bar."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

import actoff

T = TypeVar("T")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        )
        return (rev.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def io_backend_name(directory: str | None) -> str:
    """What the NVMe tier would use in ``directory``: engine and GDS or compat state."""
    if directory is None:
        return "n/a (no NVMe directory)"
    from actoff._io import open_engine

    path = os.path.join(directory, f".actoff-bench-probe-{os.getpid()}")
    try:
        engine = open_engine(path, os.environ.get("ACTOFF_IO_BACKEND", "auto").lower())
        name = engine.name
        engine.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return name


def system_header(nvme_dir: str | None = None) -> dict:
    """Facts every benchmark prints first, so results can be compared honestly."""
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "actoff": actoff.__version__,
        "git": git_revision(),
        "extension": "built" if actoff.HAS_EXTENSION else "not built (pure Python)",
        "io_backend": io_backend_name(nvme_dir),
        "kvikio": "installed" if actoff.kvikio_available() else "not installed",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def print_header(title: str, header: dict) -> None:
    print(f"== {title}")
    for key, value in header.items():
        print(f"   {key:<11} {value}")
    print()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_it(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 3) -> list[float]:
    """Seconds per call of ``fn`` after ``warmup`` calls (CUDA synchronised around each)."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def progress(items: Iterable[T], total: int, describe: Callable[[T], str]) -> Iterator[T]:
    """A progress bar on stderr (redrawn in place on a terminal, a line per item otherwise)."""
    tty = sys.stderr.isatty()
    start = time.perf_counter()
    for done, item in enumerate(items):
        filled = int(24 * done / max(total, 1))
        line = f"[{'#' * filled}{'.' * (24 - filled)}] {done}/{total} {describe(item)}  ({time.perf_counter() - start:.0f}s)"
        print(("\r" + line.ljust(100)) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
        yield item
    line = f"[{'#' * 24}] {total}/{total} done in {time.perf_counter() - start:.0f}s"
    print(("\r" + line.ljust(100)) if tty else line, file=sys.stderr, flush=True)


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Rows as an aligned text table; ``columns`` are (key, title) pairs."""
    cells = [[title for _, title in columns]]
    for row in rows:
        cells.append([_cell(row.get(key)) for key, _ in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_json(path: str, header: dict, records: list[dict]) -> None:
    """``{"system": header, "records": records}`` to ``path``, and say so."""
    with open(path, "w") as handle:
        json.dump({"system": header, "records": records}, handle, indent=2)
    print(f"records written to {path}")
