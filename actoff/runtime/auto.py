"""The auto policy's decision after its first step: token fractions per block (MEMO's closed form)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from actoff.policy import AutoDecision, auto_fractions, budget_share
from actoff.tiers.tokenwise.run import TokenwiseRun

from .distributed import local_world_size

if TYPE_CHECKING:
    from .runtime import Runtime
    from .step import Step

__all__ = ["decide_auto", "forward_ms"]


def forward_ms(tokenwise: TokenwiseRun) -> float:
    """Measured forward time of a block (the auto policy's T_layer), in milliseconds.

    The one place where the auto decision consumes a measured time: tests replace it to make
    the decision independent of the machine's load.
    """
    watch = tokenwise.forward_watch
    watch.synchronize()
    return watch.elapsed_ms()


def decide_auto(runtime: Runtime, step: Step) -> None:
    """The auto policy, after its first step: MEMO's closed form per block. Decisions of the
    first step are replaced by rank 0's with Note [one agreement]; a block that first runs
    later is decided by its own rank (a broadcast then could wait on ranks that never see
    that block)."""
    for run in step.runs:
        tokenwise = run.tokenwise
        if tokenwise is None or tokenwise.auto_sample is None or run.name in runtime.auto_decisions:
            continue
        config = run.config
        bandwidth = config.host_bandwidth
        if bandwidth is None:
            if run.device not in runtime.bandwidths:
                # Ranks on one host copy at the same time: each gets its share of the link.
                runtime.bandwidths[run.device] = run.backend.host_bandwidth() / local_world_size()
            bandwidth = runtime.bandwidths[run.device]
        input_bytes, attention_bytes, other_bytes = tokenwise.auto_sample
        decision: AutoDecision = auto_fractions(
            bandwidth_bytes_per_s=bandwidth,
            t_layer_s=forward_ms(tokenwise) / 1e3,
            input_bytes=input_bytes,
            attention_bytes=attention_bytes,
            other_bytes=other_bytes,
            num_layers=len(step.runs),
            host_budget=budget_share(config.host_budget, local_world_size()),
            nvme_available=config.nvme_dir is not None,
        )
        runtime.auto_decisions[run.name] = decision
