"""Smoke tests of the benchmarks: every policy at a tiny size; JSON fields and a real PNG.

The figures are never asserted as timings (these machines are noisy).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from _helpers import free_port

import actoff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_long_context_smoke(tmp_path):
    out_json, out_png = tmp_path / "lc.json", tmp_path / "lc.png"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "long_context.py"), "--preset", "cpu",
               "--seq", "64", "--layers", "1", "--steps", "1", "--warmup", "0",
               "--json", str(out_json), "--plot", str(out_png)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "device" in done.stdout and "io_backend" in done.stdout  # system header
    data = json.loads(out_json.read_text())
    assert data["system"]["actoff"] == actoff.__version__
    policies = {r["policy"] for r in data["records"]}
    assert policies == {"keep", "checkpoint", "save_on_cpu", "cpu", "nvme", "tokenwise:0.5:0",
                        "tokenwise:0.25:0.25", "recompute", "auto"}  # fmt: skip
    for record in data["records"]:
        assert record["status"] == "ok"
        for key in ("seq", "step_ms", "tokens_per_s", "act_cpu_bytes", "act_nvme_bytes", "peak_allocated_bytes",
                    "fragmentation_bytes", "copy_gbps", "hidden_share", "rss_peak_bytes", "timeline"):  # fmt: skip
            assert key in record, key
    by_policy = {r["policy"]: r for r in data["records"]}
    assert by_policy["cpu"]["act_cpu_bytes"] > 0 and by_policy["nvme"]["act_nvme_bytes"] > 0
    assert by_policy["recompute"]["act_recompute_bytes"] > 0 and by_policy["recompute"]["recompute_share"] > 0
    assert by_policy["tokenwise:0.25:0.25"]["act_nvme_bytes"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_context_rejects_unknown_policies():
    for policy, message in (
        ("turbo", "unknown policy 'turbo'"),
        ("tokenwise:half", "tokenwise:CPU_FRACTION"),
    ):
        command = [sys.executable, os.path.join(ROOT, "benchmarks", "long_context.py"), "--policies", policy]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and message in done.stderr


def test_io_bandwidth_smoke(tmp_path):
    out_json = tmp_path / "io.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "io_bandwidth.py"), "--size", "8MiB",
               "--repeats", "1", "--threads", "1", "--dir", str(tmp_path / "io"), "--json", str(out_json)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = json.loads(out_json.read_text())["records"]
    assert {r["op"] for r in records} == {"write", "read"}
    assert any("engine" in r["method"] for r in records) and any(
        r["method"].startswith("raw") for r in records
    )
    assert all(r["gbps"] > 0 for r in records)
    assert "target" in done.stdout


def test_long_context_prints_the_cost_of_verify():
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "long_context.py"), "--seq", "64", "--layers", "1",
               "--steps", "1", "--warmup", "1", "--policies", "recompute,recompute+verify"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ACTOFF_VERIFY cost for recompute at seq 64:" in done.stdout


def test_planner_benchmark_smoke(tmp_path):
    out_json = tmp_path / "planner.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "planner.py"), "--seq", "64", "--layers", "2",
               "--random", "1", "--time-limit", "1", "--json", str(out_json)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = json.loads(out_json.read_text())["records"]
    assert {r["method"] for r in records if r["arena"] == "host"} == {"greedy", "flat MIP", "bi-level"}
    assert {r["method"] for r in records if r["arena"] == "device"} == {
        "greedy",
        "bi-level",
        "MEMO 2 buffers",
    }
    assert all(r["ratio"] >= 1.0 for r in records if r["ratio"] is not None)  # never below the lower bound
    assert "bi-level on model traces" in done.stdout and "device arena: worst size/bound" in done.stdout


@pytest.mark.parametrize("launcher", ["torchrun", "env"])
def test_long_context_under_torchrun_reports_per_rank_and_total(tmp_path, launcher):
    """Under torchrun (its agent hosts the store) and under a bare env:// launch (rank 0 hosts it).

    The env launch uses a port near the top of the range: jobs meet in the launch's one store,
    never on a port derived from it (an earlier MASTER_PORT + 10000 overflowed there).
    """
    out_json = tmp_path / "ddp.json"
    args = [os.path.join(ROOT, "benchmarks", "long_context.py"), "--seq", "64", "--layers", "1", "--steps", "1",
            "--warmup", "0", "--policies", "keep,cpu", "--timeout", "120", "--json", str(out_json)]  # fmt: skip
    if launcher == "torchrun":
        torchrun = shutil.which("torchrun")
        if torchrun is None:
            pytest.skip("torchrun is not on PATH")
        done = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), *args],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    else:
        port = next(p for p in range(65535, 60000, -1) if free_port(p))
        env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        ranks = [subprocess.Popen([sys.executable, *args],
                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in (0, 1)]  # fmt: skip
        for rank in ranks:
            out, err = rank.communicate(timeout=300)
            assert rank.returncode == 0, out + err[-3000:]
    records = json.loads(out_json.read_text())["records"]
    assert {(r["rank"], r["policy"]) for r in records} == {
        (rank, policy) for rank in (0, 1, "total") for policy in ("keep", "cpu")
    }
    totals = {r["policy"]: r for r in records if r["rank"] == "total"}
    per_rank = [r for r in records if r["rank"] != "total" and r["policy"] == "cpu"]
    assert abs(totals["cpu"]["tokens_per_s"] - sum(r["tokens_per_s"] for r in per_rank)) < 1e-6
