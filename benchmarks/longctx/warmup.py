"""The warm-up steps of a benchmark worker, and under ``auto`` the steps it takes to settle on a
plan (Note [auto decides on a warm step])."""

from __future__ import annotations

import actoff

from .policies import split_variants

__all__ = ["AUTO_SETTLE_STEPS", "warm_up"]


#: Most steps auto gets after its reset to settle (Note [auto decides on a warm step]): two
#: measuring, a first plan, a probe, the plan after it, its calibration and a replan are seven;
#: a trial against the runner-up (Note [a plan tried against its runner-up]) adds up to four.
AUTO_SETTLE_STEPS = 16


def warm_up(spec: dict, step, extra: dict) -> None:
    """The warm-up steps. Under ``auto`` (Note [auto decides on a warm step]) the decision made
    after the first of them is dropped and made again from warm steps, which run until its plan
    holds (`AUTO_SETTLE_STEPS` at most; the record says how many it took, or that it did not)."""
    for _ in range(spec["warmup"]):
        step()
    if spec["warmup"] and split_variants(spec["policy"])[0] == "auto":
        actoff.reset()  # forgets the decision, the plans and the probes: all made again
        settled = None
        for taken in range(1, AUTO_SETTLE_STEPS + 1):
            step()
            stats = actoff.stats()
            if stats.plan_holds or (taken >= 2 and stats.plan == "none"):  # no budget: it keeps
                settled = taken
                break
        step()  # the arenas laid out under the plan that holds
        extra.update(auto_decided_warm=True, auto_settle_steps=settled)


# Note [auto decides on a warm step]: auto times a block's forward in its first step and sizes
# what it stores from that time. A process's first step on a GPU also pays for the CUDA
# context, cuBLAS handles and kernel selection, so a decision made there stores more than the
# link can hide. The benchmark judges the decision a trained model lives with: the one made
# after a warm step, and the plan it settles on. Settling takes steps (two measuring, a first
# plan, a probe where it offloads, the plan after it, its calibration: Note [measuring at the
# floor] in actoff.runtime.auto), and a timed step among them times a measuring step instead of
# the plan (the main run's auto<=128MiB once timed 1280, 572 and 451 ms: two settling steps and
# the plan). So the warm-up runs until the plan holds (`actoff.Stats.plan_holds`).
