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
        memory = torch.cuda.get_device_properties(0).total_memory
        return f"{torch.cuda.get_device_name()} ({memory / 2**30:.0f} GiB)"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def io_backend_name(directory: str | None) -> str:
    """What the NVMe tier would use in ``directory``: engine and GDS or compat state."""
    if directory is None:
        return "n/a (no NVMe directory)"
    path = os.path.join(directory, f".actoff-bench-probe-{os.getpid()}")
    try:
        engine = actoff.open_io_engine(path, os.environ.get("ACTOFF_IO_BACKEND", "auto").lower())
        name = engine.name
        engine.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return name


def _version_of(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def file_system(directory: str) -> str:
    """``"ext4 on /mnt/nvme (/dev/nvme0n1p1)"``: the mount that holds ``directory``."""
    path = os.path.realpath(directory)
    best = None
    try:
        with open("/proc/mounts") as handle:
            for line in handle:
                device, mount, fs_type = line.split()[:3]
                mount = mount.replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best[1])):
                    best = (device, mount, fs_type)
    except OSError:
        pass
    if best is None:
        done = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
        return done.stdout.strip() or "unknown"
    device, mount, fs_type = best
    return f"{fs_type} on {mount} ({device})"


def o_direct_works(directory: str) -> str:
    """Whether a 4 KiB O_DIRECT write and read work in ``directory``: ``yes`` or ``no (why)``."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return "no (no O_DIRECT on this platform)"
    path = os.path.join(directory, f".actoff-odirect-{os.getpid()}")
    buffer = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    buffer.write(b"a" * 4096)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buffer, 0)
            os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
        return "yes"
    except OSError as error:
        return f"no ({error.strerror})"
    finally:
        if os.path.exists(path):
            os.unlink(path)


def host_memory() -> str:
    """The host budget in force (ACTOFF_HOST_BUDGET) against the machine's RAM."""
    try:
        with open("/proc/meminfo") as handle:
            total_kib = next(int(line.split()[1]) for line in handle if line.startswith("MemTotal:"))
        ram = f"{total_kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        ram = "RAM unknown"
    return f"ACTOFF_HOST_BUDGET={os.environ.get('ACTOFF_HOST_BUDGET', 'unset')} of {ram}"


def system_header(nvme_dir: str | None = None) -> dict:
    """Facts every benchmark prints first, so results can be compared honestly: the device, the
    versions, where the NVMe directory lives (file system, O_DIRECT) and which I/O engine runs
    there (kvikio in GDS or compat mode, or the POSIX engine)."""
    header = {
        "device": device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "actoff": actoff.__version__,
        "git": git_revision(),
        "extension": "built" if actoff.HAS_EXTENSION else "not built (pure Python)",
        "triton": _version_of("triton"),
        "host": host_memory(),
    }
    if nvme_dir is not None:
        header.update(nvme_dir=nvme_dir, file_system=file_system(nvme_dir), o_direct=o_direct_works(nvme_dir))
    header["io_backend"] = io_backend_name(nvme_dir)
    if nvme_dir is not None:
        ok, kvikio_state = actoff.check_kvikio(nvme_dir)
        header["kvikio"] = kvikio_state if ok else f"not used: {kvikio_state}"
    else:
        header["kvikio"] = "installed" if actoff.kvikio_available() else "not installed"
    header.update(python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M"))
    return header


def print_header(title: str, header: dict) -> None:
    print(f"== {title}")
    for key, value in header.items():
        print(f"   {key:<11} {value}", flush=True)
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
    """``items`` with a tqdm progress bar on stderr, naming the item in progress; without tqdm
    (``pip install tqdm``, in the ``bench`` extra) the items pass through with no bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    with tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True) as bar:
        for item in items:
            bar.set_postfix_str(describe(item))
            yield item
            bar.update(1)


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


def write_json(path: str, header: dict, records: list[dict], **extra: object) -> None:
    """``{"system": header, "records": records, **extra}`` to ``path``, and say so."""
    with open(path, "w") as handle:
        json.dump({"system": header, "records": records, **extra}, handle, indent=2)
    print(f"records written to {path}")


class JsonLines:
    """Records appended to a file as they are made, one JSON object a line, flushed and synced
    each time: a benchmark killed half-way leaves every record it finished."""

    def __init__(self, path: str | None, header: dict) -> None:
        self.path = path
        self._handle = open(path, "a") if path else None  # noqa: SIM115 (held for the run)
        self.write({"system": header})

    def write(self, record: dict) -> None:
        if self._handle is None:
            return
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


if __name__ == "__main__":  # python3 benchmarks/_common.py --header DIR: the system header alone
    import argparse

    parser = argparse.ArgumentParser(description="Print the benchmarks' system header.")
    parser.add_argument("--header", metavar="NVME_DIR", help="the NVMe directory to describe")
    args = parser.parse_args()
    if args.header:
        os.makedirs(args.header, exist_ok=True)
    print_header("system", system_header(args.header))
