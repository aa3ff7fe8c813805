"""One policy in a fresh process: `run_one` starts ``long_context.py --worker SPEC``, whose
`worker` builds the model once and measures every sequence length of the spec in turn, a JSON
record per length on stdout; the first failure skips the longer lengths, and a crash, a time
out or an out of memory outside a step takes only that process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from .ddp import join_process_group
from .measure import measure
from .policies import ALLOCATOR_VARIANTS, TILE_TOKENS, apply_policy, build_model, model_config, split_variants

#: The entry point the worker processes run (``--worker SPEC``).
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "long_context.py")


def worker(spec: dict):
    """Yield one record per sequence length of ``spec["seqs"]`` (or ``spec["seq"]``), in order.

    The model is built once; after a failure the longer lengths are skipped (they would fail
    too, and the failed step may have left state behind).
    """
    import torch

    cuda = torch.cuda.is_available()
    if spec.get("tunnel"):
        from .tunnel import TUNNEL_THREADS

        torch.set_num_threads(TUNNEL_THREADS)  # as the tunnel's scale was measured
    ddp = spec.get("ddp")  # {rank, world, address, port} when launched by torchrun
    if ddp is not None:
        join_process_group(ddp, cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = model_config(spec)
    if cuda and spec.get("memory_snapshot"):
        from .snapshot import start_history

        start_history()  # before the model: every live block then carries its stack
    # (Note [a capped device on a CPU]) With ACTOFF_SIM_DEVICE_MEMORY the whole worker, model
    # included, runs on the simulated device's memory, which raises out of memory past the cap.
    if cuda and spec.get("budget_bytes"):  # Note [a budget sweep]: the budget is a hard cap too
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["budget_bytes"] / total), device)
    with _capped_device_memory(cuda) as memory:
        torch.manual_seed(0)
        model, net, step_context, adapters, ballast = _prepare(spec, config, device, cuda, memory)
        hang_after = int(os.environ.get("_ACTOFF_BENCH_HANG_AFTER", "0"))  # tests: a worker that hangs
        failed = None
        for made, seq in enumerate(spec.get("seqs") or [spec["seq"]]):
            if hang_after and made >= hang_after:
                time.sleep(3600)
            record = {
                **{key: spec[key] for key in ("policy", "batch", "model", "layers", "dtype")},
                "seq": seq,
            }
            if "budget_bytes" in spec:  # Note [a budget sweep]
                record["budget_bytes"] = spec["budget_bytes"]
            if ddp is not None:
                record["rank"] = ddp["rank"]
            if adapters:
                record["lora"] = {"rank": spec["lora"], "made_by": adapters}
            if failed is not None:
                record.update(status="skipped", error=f"a shorter length failed ({failed})")
            else:
                record.update(measure(spec, seq, model, net, step_context, config, device, memory, ballast))
                if record["status"] != "ok":
                    failed = f"seq {seq}: {record['status']}"
                    if cuda:
                        torch.cuda.empty_cache()
            yield record


def _prepare(spec: dict, config, device, cuda: bool, memory):
    """The model under the spec's policy and variants: the model, what steps it (DDP's wrapper
    under torchrun, else the model), the context manager each step runs under, under
    ``--lora`` what made the adapters (else None), and under ``--emulate-layers`` the `Ballast`
    (else None). ``memory``: the capped simulated device's count, if any."""
    import torch

    model = build_model(config, device, getattr(torch, spec["dtype"]))
    made = None
    if spec.get("lora"):  # first: the policy's wrappers and tiles then hold the adapted layers
        from .lora import lora_

        # Note [input grads only where reentrant] in lora.py
        made = lora_(
            model, spec["lora"], input_grads=split_variants(spec["policy"])[0] == "torch_checkpoint_cpu"
        )
    ballast = None
    if spec.get("emulate_layers"):  # Note [emulated layers]: before the policy, which reads auto's budget
        from .emulate import Ballast

        ballast = Ballast(model, config, device, spec["emulate_layers"])
        if split_variants(spec["policy"])[0] == "auto":
            _scale_auto_budget(spec, ballast, device, cuda, memory)
    policy, extras = split_variants(spec["policy"])
    if "tile" in extras:
        import actoff
        from actoff.reference import MLP

        tokens = spec.get("tile_tokens") or TILE_TOKENS
        actoff.tile_(model, module_cls=MLP, max_tokens=tokens)
        # The final norm too: token-local, outside the blocks, and in float32 at full length its
        # backward bound a block-chunked backward on the 8B proxy (3.7 against 2.9 KB per token).
        actoff.tile_(model, filter_fn=lambda module, name: name == "norm", max_tokens=tokens)
    step_context = apply_policy(model, policy, spec.get("nvme_dir"), planner_off="noplan" in extras)
    net = torch.nn.parallel.DistributedDataParallel(model) if spec.get("ddp") is not None else model
    return model, net, step_context, made, ballast


def _capped_device_memory(cuda: bool):
    """Note [a capped device on a CPU]: the simulated device's memory model, capped at
    ``ACTOFF_SIM_DEVICE_MEMORY``, when that is set on a CPU (``--sim-memory`` sets it for the
    workers); else nothing. Entered before the model is built, so weights and gradients count
    as a GPU's would; actoff's host buffers and torch_save_on_cpu's copies do not. A run past the cap
    is out of memory, as on a GPU of that size. Kernels' internal scratch is not seen (the
    count is of the storages operators return), nor an optimizer's state (the steps have none).
    """
    import actoff
    from actoff.testing import device_memory

    if cuda or actoff.get_config().sim_device_memory is None:
        return contextlib.nullcontext()
    return device_memory()


def run_one(spec: dict, timeout_s: float, on_record=None) -> list[dict]:
    """Run one policy over ``spec["seqs"]`` (or one ``spec["seq"]``) in a fresh process.

    Records are passed to ``on_record`` as the worker prints them; lengths the worker never
    reported (it timed out, crashed or ran out of memory outside a step) get a record saying so.
    """
    command = [sys.executable, SCRIPT, "--worker", json.dumps(spec)]
    records: list[dict] = []
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=_worker_env(spec)
        )
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            for line in process.stdout:
                if line.startswith("{"):
                    records.append(json.loads(line))
                    if on_record is not None:
                        on_record(records[-1])
            returncode = process.wait()
        finally:
            timed_out = not timer.is_alive() and process.returncode not in (0, None)
            timer.cancel()
            if process.poll() is None:
                process.kill()
                process.wait()
        stderr.seek(0)
        err = stderr.read()
    for record in _unreported(spec, len(records), timed_out, timeout_s, returncode, err):
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def _scale_auto_budget(spec: dict, ballast, device, cuda: bool, memory) -> None:
    """Under ``--emulate-layers``, auto plans its blocks' share of the device (Note [emulated
    layers]): the spec's budget, else the device's default, scaled by `auto_budget`."""
    import torch

    import actoff
    from actoff.budget import cuda_budget

    from .emulate import auto_budget

    if cuda:
        whole = spec.get("budget_bytes") or cuda_budget(torch.cuda.get_device_properties(device).total_memory)
        in_use = torch.cuda.memory_allocated(device)
    else:
        whole = spec.get("budget_bytes") or actoff.get_config().sim_device_memory
        in_use = memory.live if memory is not None else 0
    if whole is None:
        return  # a plain CPU device: auto has no budget to scale
    ballast.auto_budget_bytes = auto_budget(
        whole, in_use, ballast.target_layers - ballast.missing, ballast.target_layers
    )
    os.environ["ACTOFF_GPU_BUDGET"] = f"{ballast.auto_budget_bytes}B"  # this worker's alone


def _worker_env(spec: dict) -> dict | None:
    """The worker's environment: the parent's, with what the allocator variants and a capped
    simulated device set (None: the parent's as it is)."""
    extra = {
        key: value
        for variant in split_variants(spec["policy"])[1]
        for key, value in ALLOCATOR_VARIANTS.get(variant, {}).items()
    }
    if spec.get("sim_memory"):  # Note [a capped device on a CPU]
        extra.update(ACTOFF_SIM_DEVICE="1", ACTOFF_SIM_DEVICE_MEMORY=f"{spec['sim_memory']}B")
    elif spec.get("budget_bytes") and spec["policy"].startswith("auto"):  # Note [a budget sweep]: on CUDA
        extra.update(ACTOFF_GPU_BUDGET=f"{spec['budget_bytes']}B")
    if spec.get("host_budget"):  # scaled under --emulate-layers (Note [emulated layers])
        extra["ACTOFF_HOST_BUDGET"] = f"{spec['host_budget']}B"
    return {**os.environ, **extra} if extra else None


def _unreported(spec: dict, reported: int, timed_out: bool, timeout_s: float, returncode: int, err: str):
    """A record for each length the worker did not report, saying why (from its exit and stderr)."""
    base = {key: value for key, value in spec.items() if key not in ("seqs", "ddp")}
    for seq in (spec.get("seqs") or [spec["seq"]])[reported:]:
        if timed_out:
            failure = {"status": "timeout", "error": f"over {timeout_s:.0f} s"}
        else:
            tail = (err.strip().splitlines() or ["no output"])[-1]
            status = "oom" if "out of memory" in err.lower() else "crash"
            failure = {"status": status, "error": f"exit {returncode}: {tail}"}
        yield {**base, "seq": seq, **failure}
