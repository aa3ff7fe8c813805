"""I/O bandwidth of the NVMe tier's engines against raw baselines on the same file system.

Every method writes then reads the same amount in 4 MiB requests; writes include fsync and
the page cache is dropped (fadvise DONTNEED) before each read, so all methods hit the disk.
On CUDA it also times pinned device-to-host and host-to-device copies, and with GPUDirect
Storage active kvikio's reads and writes of device memory. ``-sealed`` methods seal every
request (Note [sealed records]: a CRC32C computed in the engine's workers).

    python benchmarks/io_bandwidth.py --size 1GiB --dir /mnt/nvme --json io.json

``--checksum-steps N`` answers what the seals cost a training step instead: the reference model
under ``nvme`` with ``ACTOFF_NVME_CHECKSUM`` on and off, in alternating rounds of N timed steps
each, and the ratio of the median step times (target: at most 1.02x).

    python benchmarks/io_bandwidth.py --checksum-steps 10 --rounds 6 --json checksum.json
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time

# This checkout's actoff (and _common) before any installed copy: a benchmark measures the
# code it sits next to, also when the package is installed elsewhere or not at all.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
from _common import JsonLines, format_table, median, print_header, system_header, write_json

import actoff

CHUNK = 4 * 2**20
ALIGNMENT = 4096  # O_DIRECT's: actoff's host arena and engines align to 4 KiB


def aligned_buffer(nbytes: int, misalign: int = 0) -> torch.Tensor:
    raw = torch.empty(nbytes + 2 * ALIGNMENT, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    start = (-raw.data_ptr()) % ALIGNMENT + misalign
    return raw[start : start + nbytes]


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def engine_method(make, misalign: int = 0, sealed: bool = False):
    seals: dict[int, int] = {}  # offset -> the seal its write computed, for the read

    def run(path: str, data: torch.Tensor, op: str) -> None:
        engine = make(path)
        buffer = data if misalign == 0 else aligned_buffer(data.numel(), misalign)
        if misalign and op == "write":
            buffer.copy_(data)
        engine.reserve(data.numel())
        futures = []
        for offset in range(0, data.numel(), CHUNK):
            part = buffer[offset : offset + CHUNK]
            if not sealed:
                call = engine.pwrite if op == "write" else engine.pread
                futures.append((offset, call(part, part.numel(), offset)))
            elif op == "write":
                futures.append((offset, engine.pwrite(part, part.numel(), offset, offset + 1)))
            else:
                futures.append((offset, engine.pread(part, part.numel(), offset, offset + 1, seals[offset])))
        for offset, future in futures:
            future.wait()
            if sealed and op == "write":
                seals[offset] = future.checksum()
        if op == "write":
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        engine.close()

    return run


def kvikio_device_method():
    """kvikio with GDS active, from and into device memory (the NVMe tier's direct path,
    Note [direct device I/O]). A read ends with one device-to-host copy of what was read, for
    the check against the data written (about 2% of the time at 50 GB/s against a few GB/s)."""
    buffers: dict[str, torch.Tensor] = {}

    def run(path: str, data: torch.Tensor, op: str) -> None:
        if op not in buffers:
            buffers[op] = data.to("cuda") if op == "write" else torch.empty_like(data, device="cuda")
            torch.cuda.synchronize()
        device = buffers[op]
        engine = actoff.open_io_engine(path, "kvikio", 4)
        engine.reserve(data.numel())
        call = engine.pwrite_device if op == "write" else engine.pread_device
        futures = [
            call(device[offset : offset + CHUNK], min(CHUNK, data.numel() - offset), offset, None)
            for offset in range(0, data.numel(), CHUNK)
        ]
        for future in futures:
            future.wait()
        if op == "write":
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        else:
            data.copy_(device)
        engine.close()

    return run


def raw_numpy(path: str, data: torch.Tensor, op: str) -> None:
    array = data.numpy()
    if op == "write":
        with open(path, "r+b") as handle:
            array.tofile(handle)
            handle.flush()
            os.fsync(handle.fileno())
    else:
        with open(path, "rb") as handle:
            handle.readinto(memoryview(array))


def raw_os(path: str, data: torch.Tensor, op: str) -> None:
    view = memoryview(data.numpy())
    fd = os.open(path, os.O_RDWR)
    try:
        for offset in range(0, data.numel(), CHUNK):
            part = view[offset : offset + CHUNK]
            if op == "write":
                os.pwrite(fd, part, offset)
            else:
                os.preadv(fd, [part], offset)
        if op == "write":
            os.fsync(fd)
    finally:
        os.close(fd)


def checksum_cost(args: argparse.Namespace, directory: str, out: JsonLines) -> list[dict]:
    """Step time of the reference model under ``nvme`` with seals on and off, in alternating
    rounds (the order flips each round); the ratio is the median over rounds of the ratio of
    the two settings' median step times in that round, so drift on a shared machine falls on
    both sides of each ratio. Also the CPU time of a step (every thread of the process, the
    I/O workers included): the work the seals add, which other programs' load does not change."""
    from actoff.reference import Block, ModelConfig, Transformer

    generator = torch.Generator().manual_seed(0)
    vocab = ModelConfig.preset(args.preset).vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
    wall: dict[bool, list[float]] = {True: [], False: []}  # median step ms, per round
    cpu: dict[bool, list[float]] = {True: [], False: []}  # CPU ms per step, per round
    for round_index in range(-1, args.rounds):  # round -1: the process warms up, not counted
        for checksum in (True, False) if round_index % 2 == 0 else (False, True):
            torch.manual_seed(0)
            model = Transformer(ModelConfig.preset(args.preset))
            actoff.offload_(
                model, block_cls=Block, policy="nvme", nvme_dir=directory, min_bytes=0, nvme_checksum=checksum
            )
            times, cpu_start = [], 0.0
            for step in range(args.checksum_steps + 2):  # two warm-up steps: the file grows, plans
                if step == 2:
                    cpu_start = time.process_time()
                start = time.perf_counter()
                model.loss(tokens).backward()
                model.zero_grad(set_to_none=True)
                if step >= 2:
                    times.append(time.perf_counter() - start)
            offloaded = actoff.stats().total_bytes_offloaded  # waits for the step's copies
            cpu_ms = (time.process_time() - cpu_start) / args.checksum_steps * 1e3
            actoff.reset()
            if round_index < 0:
                continue
            wall[checksum].append(median(times) * 1e3)
            cpu[checksum].append(cpu_ms)
            record = {"method": "nvme-step", "round": round_index, "checksum": checksum,
                      "median_ms": wall[checksum][-1], "cpu_ms": cpu_ms,
                      "steps_ms": [t * 1e3 for t in times], "offloaded_bytes": offloaded}  # fmt: skip
            out.write(record)
            print(
                f"   round {round_index} checksum={int(checksum)}: {wall[checksum][-1]:.0f} ms, "
                f"{cpu_ms:.0f} ms of CPU",
                file=sys.stderr,
            )
    ratios = sorted(on / off for on, off in zip(wall[True], wall[False], strict=True))
    cpu_ratios = sorted(on / off for on, off in zip(cpu[True], cpu[False], strict=True))
    records = [
        {
            "method": "nvme-step",
            "checksum": checksum,
            "rounds": len(wall[checksum]),
            "median_ms": median(wall[checksum]),
            "min_ms": min(wall[checksum]),
            "max_ms": max(wall[checksum]),
            "cpu_ms": median(cpu[checksum]),
        }
        for checksum in (True, False)
    ]
    records.append(
        {
            "method": "nvme-step-ratio",
            "ratio": median(ratios),
            "min": ratios[0],
            "max": ratios[-1],
            "cpu_ratio": median(cpu_ratios),
            "cpu_min": cpu_ratios[0],
            "cpu_max": cpu_ratios[-1],
            "offloaded_bytes": offloaded,
        }
    )
    out.write(records[-1])
    return records


def seal_throughput(out: JsonLines) -> list[dict]:
    """GB/s of the host checksums the engines use, on 64 MiB in one thread."""
    from actoff.tiers.nvme import seals

    data = torch.randint(0, 256, (64 * 2**20,), dtype=torch.uint8).numpy()
    records = []
    methods = [("zlib.crc32 (Python engine)", seals.zlib_crc)]
    if actoff.HAS_EXTENSION:
        from actoff import _C

        fastest, *others = _C.crc32c_methods()
        methods[:0] = [(f"crc32c {fastest} (C++ engine, kvikio)", seals.fast_crc)] + [
            (f"crc32c {name}", functools.partial(_C.crc32c, method=name)) for name in others
        ]
    for name, crc in methods:
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            crc(data, 0)
            seconds.append(time.perf_counter() - start)
        records.append({"method": name, "gbps": data.nbytes / median(seconds) / 1e9})
        out.write(records[-1])
    return records


def build_parser() -> argparse.ArgumentParser:
    """The command line (also what benchmarks/gpu_session.sh's commands are checked against)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="256MiB", help="bytes per method and direction")
    parser.add_argument("--dir", help="directory on the disk to test (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,4,8", help="engine thread counts")
    parser.add_argument("--json", help="write all records to this path at the end")
    parser.add_argument("--jsonl", help="append each record to this path as it is made (JSON lines)")
    parser.add_argument(
        "--checksum-steps",
        type=int,
        default=0,
        help="instead: time this many steps per round with seals on and off",
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds of --checksum-steps (alternating)")
    parser.add_argument("--preset", default="small", help="reference model preset for --checksum-steps")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length for --checksum-steps")
    parser.add_argument("--batch", type=int, default=2, help="batch for --checksum-steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    size = actoff.parse_size(args.size, what="--size") // CHUNK * CHUNK or CHUNK
    directory = args.dir or tempfile.mkdtemp(prefix="actoff-io-")
    os.makedirs(directory, exist_ok=True)
    header = system_header(directory)
    header.update(size=f"{size / 2**20:.0f} MiB in {CHUNK // 2**20} MiB requests", directory=directory)
    if args.checksum_steps:
        header.update(
            size=f"{args.preset} model, batch {args.batch}, seq {args.seq}, {args.rounds} rounds "
            f"of {args.checksum_steps} steps per setting"
        )
    print_header("actoff I/O bandwidth", header)
    out = JsonLines(args.jsonl, header)  # the header line first, then each record as it is made
    try:
        if args.checksum_steps:
            records = _seals(args, directory, out)
        else:
            records = _bandwidths(args, size, directory, out)
    finally:
        out.close()
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        write_json(args.json, header, records)
    return 0


def _seals(args: argparse.Namespace, directory: str, out: JsonLines) -> list[dict]:
    """--checksum-steps: the CRC32C methods' throughput and the seals' cost on a training step."""
    throughput = seal_throughput(out)
    steps = checksum_cost(args, directory, out)
    print(format_table(throughput, [("method", "checksum"), ("gbps", "GB/s")]))
    columns = [
        ("checksum", "ACTOFF_NVME_CHECKSUM"),
        ("rounds", "rounds"),
        ("median_ms", "median step ms"),
        ("min_ms", "min"),
        ("max_ms", "max"),
        ("cpu_ms", "CPU ms per step"),
    ]
    print(format_table(steps[:2], columns))
    ratio = steps[2]
    print(
        f"\nnvme step time with seals / without: {ratio['ratio']:.3f}x, median of {args.rounds} "
        f"rounds (from {ratio['min']:.3f} to {ratio['max']:.3f}; {ratio['offloaded_bytes'] / 2**20:.0f} MiB "
        f"written and read per step): {'meets' if ratio['ratio'] <= 1.02 else 'misses'} the 1.02x target"
    )
    print(
        f"CPU time per step (every thread) with seals / without: {ratio['cpu_ratio']:.3f}x "
        f"(from {ratio['cpu_min']:.3f} to {ratio['cpu_max']:.3f}): the work the seals add"
    )
    return [*throughput, *steps]


def _methods(directory: str, threads: str) -> dict:
    """Every way of writing and reading a file this machine has, by name."""
    methods = {}
    if actoff.HAS_EXTENSION:
        for count in (int(t) for t in threads.split(",")):
            methods[f"engine-cpp-t{count}-direct"] = engine_method(
                lambda p, t=count: actoff.open_io_engine(p, "cpp", t)
            )
        methods["engine-cpp-t4-direct-sealed"] = engine_method(
            lambda p: actoff.open_io_engine(p, "cpp", 4), sealed=True
        )
        methods["engine-cpp-t4-buffered"] = engine_method(
            lambda p: actoff.open_io_engine(p, "cpp", 4, direct=False), misalign=64
        )
    methods["engine-python-t4"] = engine_method(lambda p: actoff.open_io_engine(p, "python", 4))
    kvikio_ok, kvikio_name = actoff.check_kvikio(directory)
    if kvikio_ok:  # its name says whether GDS or compat mode runs (host buffers: POSIX either way)
        mode = "gds" if "GDS" in kvikio_name else "compat"
        methods[f"kvikio-t4-{mode}"] = engine_method(lambda p: actoff.open_io_engine(p, "kvikio", 4))
        if mode == "gds" and torch.cuda.is_available():
            methods["kvikio-t4-gds-device"] = kvikio_device_method()
    methods["raw-numpy"] = raw_numpy
    methods["raw-os-pwrite"] = raw_os
    return methods


def _bandwidths(args: argparse.Namespace, size: int, directory: str, out: JsonLines) -> list[dict]:
    """Each method's write and read bandwidth (median of --repeats), the engine against raw I/O."""
    data = aligned_buffer(size)
    data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    back = aligned_buffer(size)
    records = []
    path = os.path.join(directory, "bandwidth.bin")
    try:
        for name, method in _methods(directory, args.threads).items():
            for op in ("write", "read"):
                seconds = []
                for _ in range(args.repeats):
                    if op == "write":
                        with open(path, "wb") as handle:
                            handle.truncate(size)
                    drop_cache(path)
                    start = time.perf_counter()
                    method(path, data if op == "write" else back, op)
                    seconds.append(time.perf_counter() - start)
                if op == "read" and not np.array_equal(back.numpy(), data.numpy()):
                    raise SystemExit(f"{name}: data read back differs from data written")
                seconds_median = median(seconds)
                records.append(
                    {"method": name, "op": op, "gbps": size / seconds_median / 1e9, "seconds": seconds_median}
                )
                out.write(records[-1])
                print(f"   {name:<26} {op:<5} {records[-1]['gbps']:.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    records += _cuda_copies(size, args.repeats, out)
    print(format_table(records, [("method", "method"), ("op", "op"), ("gbps", "GB/s")]))
    print()
    for op in ("write", "read"):
        engine = max((r["gbps"] for r in records if r["op"] == op and "engine" in r["method"]), default=0.0)
        raw = max(
            (r["gbps"] for r in records if r["op"] == op and r["method"].startswith("raw")), default=0.0
        )
        ratio = engine / raw if raw else float("nan")
        verdict = "meets" if ratio >= 0.9 else "misses"
        print(
            f"{op:<5}: best engine {engine:.2f} GB/s, best raw {raw:.2f} GB/s, ratio {ratio:.2f} ({verdict} the 0.9x target)"
        )
    return records


def _cuda_copies(size: int, repeats: int, out: JsonLines) -> list[dict]:
    """Pinned host <-> device copy bandwidth, where there is a GPU."""
    if not torch.cuda.is_available():
        return []
    records = []
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = aligned_buffer(size)
    for op, fn in (
        ("d2h", lambda: pinned.copy_(device, non_blocking=True)),
        ("h2d", lambda: device.copy_(pinned, non_blocking=True)),
    ):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        gbps = size * repeats / (time.perf_counter() - start) / 1e9
        records.append({"method": "cuda-pinned", "op": op, "gbps": gbps})
        out.write(records[-1])
    return records


if __name__ == "__main__":
    sys.exit(main())
