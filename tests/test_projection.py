"""benchmarks/projection.py: the full model's bytes per token and longest length from the proxy's
records (Note [a projection from the proxy]), on records whose figures are known by construction."""

import json
import os
import subprocess
import sys

import pytest
from test_benchmarks import ROOT, _load_benchmark

from actoff.budget import cuda_budget

pytestmark = pytest.mark.plain_pass_only  # no device involved: one pass is enough

SHRINK = 32
APART, EACH, INTERCEPT = 3000.0, 250.0, 4 * 2**20  # proxy bytes per token, per block, constant
HOST_EACH = 96  # proxy bytes per token and block sent to host memory


def _records() -> list[dict]:
    """A policy's ok records at 2 and 4 blocks: three lengths on exact lines and a shorter one off
    them; a failure beside."""
    records = [{"system": {"preset": "8b"}}]
    for layers in (2, 4):
        for seq in (2048, 4096, 8192):
            peak = INTERCEPT + seq * (APART + layers * EACH)
            records.append(
                {"policy": "p", "status": "ok", "layers": layers, "seq": seq,
                 "activation_peak_bytes": peak, "act_cpu_bytes": HOST_EACH * seq * layers}
            )  # fmt: skip
        # A short length where a flat phase (the loss's chunks) binds, off the line: left out.
        records.append(
            {"policy": "p", "status": "ok", "layers": layers, "seq": 512,
             "activation_peak_bytes": 4 * INTERCEPT, "act_cpu_bytes": HOST_EACH * 512 * layers}
        )  # fmt: skip
    records.append({"policy": "p", "status": "oom", "layers": 4, "seq": 16384})
    return records


def test_the_full_models_bytes_per_token_and_longest_length():
    projection = _load_benchmark("projection")
    rows = projection.project([r for r in _records() if r.get("status") == "ok"], SHRINK)
    per_token = SHRINK * (APART + 32 * EACH)
    assert {(r["mode"], r["gpu"]) for r in rows} == {
        (m, g) for m in ("lora", "full") for g in projection.GPUS
    }
    for row in rows:
        assert row["kib_per_token"] * 2**10 == pytest.approx(per_token)
        assert row["kib_per_block"] * 2**10 == pytest.approx(SHRINK * EACH)
        # Llama-3.1-8B: 8,030,261,248 parameters in bf16, their bf16 gradients too under a full fine-tune.
        weights = 8_030_261_248 * 2 * (2 if row["mode"] == "full" else 1)
        room = cuda_budget(projection.GPUS[row["gpu"]]) - weights - INTERCEPT * SHRINK**2
        assert row["longest_k"] * 2**10 == int(room / per_token)
        host = SHRINK * 32 * HOST_EACH * int(room / per_token)
        assert row["host_gb"] * 1e9 == pytest.approx(min(host, projection.HOST_BYTES))
        assert row["nvme_gb"] * 1e9 == pytest.approx(max(0, host - projection.HOST_BYTES))
    lora = {r["gpu"]: r["longest_k"] for r in rows if r["mode"] == "lora"}
    full = {r["gpu"]: r["longest_k"] for r in rows if r["mode"] == "full"}
    assert all(full[gpu] < lora[gpu] for gpu in projection.GPUS)  # the gradients take room


def test_one_block_count_is_refused_with_what_is_missing():
    # No policy at two block counts: nothing to project, and the error says why (where some
    # policies have two, the others are left out: the tests below).
    projection = _load_benchmark("projection")
    records = [r for r in _records() if r.get("layers") == 2]
    with pytest.raises(ValueError, match="two block counts"):
        projection.project(records, SHRINK)
    with pytest.raises(ValueError, match="two lengths"):
        projection.fit([(4096, 1), (4096, 2)])


def test_the_command_reads_jsonl_files_and_writes_its_rows(tmp_path):
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    out = tmp_path / "rows.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "projection.py"), str(runs),
               "--shrink", str(SHRINK), "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "KiB/token" in done.stdout and "attention floor" in done.stdout
    assert len(json.loads(out.read_text())["rows"]) == 4


def test_a_policy_at_one_block_count_is_left_out_and_named(tmp_path):
    # The H200 run of 2026-12-04 ran torch_save_on_cpu at 2 blocks only; the projection raised
    # for every policy then, where it can still project those run at two counts.
    projection = _load_benchmark("projection")
    once = [{**r, "policy": "q"} for r in _records() if r.get("layers") == 2 and r.get("status") == "ok"]
    both = [r for r in _records() if r.get("status") == "ok"]
    rows = projection.project(both + once, SHRINK)
    assert {r["policy"] for r in rows} == {"p"} and len(rows) == 4
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in _records() + once))
    command = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "projection.py"),
        str(runs),
        "--shrink",
        str(SHRINK),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Left out, without a line (two lengths) at two block counts: q (a line at 2 blocks)" in done.stdout


def test_a_block_count_cut_after_one_length_leaves_its_policy_out():
    # gpu_session.sh's projection stage runs two lengths per policy in one process: a policy
    # stopped at its time limit after the first length at 4 blocks has no line there.
    projection = _load_benchmark("projection")
    ok = [r for r in _records() if r.get("status") == "ok"]
    cut = [{**r, "policy": "q"} for r in ok if r["layers"] == 2 or r["seq"] == 2048]
    assert projection.one_count(ok + cut) == {"q": [2]}
    rows = projection.project(ok + cut, SHRINK)
    assert {r["policy"] for r in rows} == {"p"}


def test_the_projections_docstring_examples_run():
    import doctest

    result = doctest.testmod(_load_benchmark("projection"), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, f"{result.failed} of {result.attempted} failed"


def test_each_phase_is_projected_and_the_one_that_binds_names_the_row():
    # The 8B proxy of 2026-12-04 bound in the loss's backward at 4k and 8k tokens while its
    # forward's line was steeper: fitted whole, the step's peak gave the loss's line. Here the
    # loss is flat and binds at the proxy's lengths, the forward steeper and binds at the full
    # model's: the row says the forward's, its length the forward's room over its bytes.
    projection = _load_benchmark("projection")
    static, flat, loss_slope, forward_slope = 3 * 2**20, 20 * 2**20, 500.0, 1800.0
    records = []
    for layers in (2, 4):
        for seq in (4096, 8192):
            forward = seq * (forward_slope + layers * 8)
            loss = flat + seq * (loss_slope + layers * 8)
            phases = [["forward", 0, static + forward], ["loss backward", 0, static + loss]]
            records.append(
                {"policy": "p", "status": "ok", "layers": layers, "seq": seq, "static_bytes": static,
                 "activation_peak_bytes": max(forward, loss), "act_cpu_bytes": 0, "phases": phases}
            )  # fmt: skip
    assert all(
        r["activation_peak_bytes"] == r["phases"][1][2] - static for r in records
    )  # the loss binds here
    rows = projection.project(records, SHRINK)
    for row in rows:
        assert row["binds"] == "forward"
        per_token = SHRINK * (forward_slope + 32 * 8)
        assert row["kib_per_token"] * 2**10 == pytest.approx(per_token)
        weights = 8_030_261_248 * 2 * (2 if row["mode"] == "full" else 1)
        room = cuda_budget(projection.GPUS[row["gpu"]]) - weights
        assert row["longest_k"] * 2**10 == int(room / per_token)
        loss_reach = (room - flat * SHRINK**2) / (SHRINK * (loss_slope + 32 * 8))
        assert row["phases_k"]["loss backward"] * 2**10 == pytest.approx(loss_reach)
        assert row["longest_k"] * 2**10 < loss_reach


def test_records_whose_phases_differ_are_fitted_by_the_steps_peak():
    # A review found the per-phase fit crashing (min of nothing) where some records had phases and
    # others none (CUDA's, an uncapped simulated device's): their step's peak is one line.
    projection = _load_benchmark("projection")
    records = [r for r in _records() if r.get("status") == "ok"]
    records[0] = {
        **records[0],
        "static_bytes": 0,
        "phases": [["forward", 0, records[0]["activation_peak_bytes"]]],
    }
    rows = projection.project(records, SHRINK)
    assert {r["binds"] for r in rows} == {"step"}
    assert rows[0]["kib_per_token"] * 2**10 == pytest.approx(SHRINK * (APART + 32 * EACH))


def test_a_line_that_does_not_grow_sets_no_bound():
    # A review found int(inf) raising where no phase's line grows: the row says UNBOUNDED.
    projection = _load_benchmark("projection")
    flat = [{**r, "activation_peak_bytes": INTERCEPT} for r in _records() if r.get("status") == "ok"]
    rows = projection.project(flat, SHRINK)
    assert all(r["longest_k"] * 2**10 == projection.UNBOUNDED for r in rows)


def test_the_head_and_loss_scopes_host_bytes_count_once_not_per_block():
    """Under auto the benchmark runs the head and loss as one more scope (Note [auto plans the
    head and loss too]); its host bytes are in the record's total but belong to the model once:
    scaled as a block's, 2 blocks to 32 would count them 16 times."""
    projection = _load_benchmark("projection")
    head = 50  # proxy bytes per token the head and loss scope sent to the host
    records = [r for r in _records() if r.get("status") == "ok"]
    for record in records:
        record["act_cpu_bytes"] += head * record["seq"]
        record["head_and_loss_cpu_bytes"] = head * record["seq"]
    for row in projection.project(records, SHRINK):
        host = SHRINK * (32 * HOST_EACH + head) * int(row["longest_k"] * 2**10)
        assert row["host_gb"] * 1e9 == pytest.approx(min(host, projection.HOST_BYTES))
        assert row["nvme_gb"] * 1e9 == pytest.approx(max(0, host - projection.HOST_BYTES))
