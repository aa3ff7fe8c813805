"""Several policies stepped in turn in one worker on the wind tunnel, round after round (ABAB...):
the step times that ``--calibrate`` compares, each policy's ratio to ``none`` taken within a round.

Note [rounds in one process]: a policy timed in a process of its own runs minutes apart from
the others, and on a shared machine what other processes do then moves its ratio to ``none``
by more than the tunnel's error (``cpu`` went from 2.11x to 2.78x under one busy core). Here
every policy is built in one process on one set of weights, warmed up, then stepped once per
round, in an order rotated each round, so that a burst of load falls on all of them alike; a
round's ratios are taken within it, and the table gives their median and spread. Steps are
timed by the tunnel's `tunnel.UnstolenClock`, which the simulated device's link runs on too
(Note [the device's clock] in actoff.device.sim.link), so time other processes take from the
training thread counts in neither compute nor copies.
"""

from __future__ import annotations

import copy

#: Rounds of the calibration: every policy stepped once per round.
ROUNDS = 7


def rounds_worker(spec: dict):
    """Yield, per length of ``spec["seqs"]``, one record of ``spec["policies"]`` stepped in
    ``spec["rounds"]`` rounds on the tunnel (Note [rounds in one process]): per policy the step
    times (``step_ms``, on the unstolen clock), their wall times and the time other processes
    took (``wall_ms``, ``stolen_ms``), the link's busy time (``link_ms``, both directions), and
    the activation peak of one more step on the simulated device (memory, not time)."""
    import torch

    from .measure import Step, Timeline, simulated_memory_step
    from .policies import apply_policy, build_model, model_config
    from .tunnel import TUNNEL_THREADS, UnstolenClock

    torch.set_num_threads(TUNNEL_THREADS)  # as the tunnel's scale was measured
    config = model_config(spec)
    torch.manual_seed(0)
    plain = build_model(config, torch.device("cpu"), getattr(torch, spec["dtype"]))
    models = {}
    for policy in spec["policies"]:
        # none and torch_save_on_cpu run the plain model; the others change theirs: a copy each
        model = plain if policy in ("none", "torch_save_on_cpu") else copy.deepcopy(plain)
        models[policy] = (model, apply_policy(model, policy, spec.get("nvme_dir")))
    clock = UnstolenClock()
    for seq in spec["seqs"]:
        generator = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, config.vocab_size, (spec["batch"], seq + 1), generator=generator)
        steps = {
            policy: Step(
                {**spec, "policy": policy}, model, model, tokens, context, False, None, Timeline(False)
            )
            for policy, (model, context) in models.items()
        }
        try:
            record = _rounds(spec, seq, steps, clock)
            for policy, step in steps.items():  # outside the tunnel: a device that counts
                memory = simulated_memory_step(step, step.model, tokens, step.timeline)
                record["activation_peak_bytes"][policy] = memory["activation_peak_bytes"]
        except Exception as error:  # the parent reports it; the next length may still run
            record = {"status": "error", "error": f"{type(error).__name__}: {error}"}
        yield {"policy": "rounds", "seq": seq, **record}


def _rounds(spec: dict, seq: int, steps: dict, clock) -> dict:
    """The warm-up, then the rounds, on the tunnel's simulated device for ``seq``."""
    import time

    from .tunnel import tunnel_device

    names = list(steps)
    fields = ("step_ms", "wall_ms", "stolen_ms", "link_ms")
    out: dict[str, dict[str, list[float]]] = {key: {name: [] for name in names} for key in fields}
    with tunnel_device(spec, seq, clock=clock) as device:
        if device is None:
            raise SystemExit("the rounds run on the wind tunnel: the spec has no link for this length")
        for name in names:
            for _ in range(max(1, spec.get("warmup", 1))):
                steps[name]()
        for index in range(spec["rounds"]):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                busy = sum(link.busy_s for link in device.links.values())
                stolen, wall, start = clock.stolen_s(), time.perf_counter(), clock()
                steps[name]()
                out["step_ms"][name].append((clock() - start) * 1e3)
                out["wall_ms"][name].append((time.perf_counter() - wall) * 1e3)
                out["stolen_ms"][name].append((clock.stolen_s() - stolen) * 1e3)
                out["link_ms"][name].append((sum(link.busy_s for link in device.links.values()) - busy) * 1e3)
    return {"status": "ok", "rounds": spec["rounds"], **out, "activation_peak_bytes": {}}
