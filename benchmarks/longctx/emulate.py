"""``--emulate-layers L``: a model of L blocks measured on the few built (``--layers N``): a
device ballast stands for the L - N blocks that are not built, and actoff's host budget is
scaled by N / L.

Note [emulated layers]: a training step's device memory is a static part (weights, and
gradients of what trains), a part held per block from its forward to its backward, and a
working set: one block's forward or backward, the loss, the copies in flight, actoff's
device arena for the block being differentiated. The working set does not grow with the
number of blocks, since an offloading policy moves a bounded window. The static part grows,
and so does the held part, by policy: for torch_checkpoint each block's input (B x S x H,
kept for its re-run), for actoff's policies what stays on the device (the keep tier:
tensors under ACTOFF_MIN_BYTES, blocks kept last, and tensors left there once the host
budget is full), for keep all a block saves; torch_save_on_cpu and torch_checkpoint_cpu hold
nothing per block on the device. So N real blocks and a ballast of (L - N) x (static + held
per block) hold what L blocks would. The static part per block is counted on a real block
(its weights, its trainable parameters' gradients); the held part is measured on the real
blocks in the warm-up step (`actoff.stats`, keep-tier bytes per block) or, for
torch_checkpoint, computed. The host side grows per block as well, and actoff's host budget
is one budget for all blocks: N blocks under N / L of it each get the share they would get
among L, and run out of it at the same length. Not emulated: the time of the missing blocks
(step times are N blocks'), which blocks run out of host budget first (the total is the
same), the allocator's fragmentation across L - N blocks' tensors (the ballast is one
tensor), and `none`, whose per-block bytes nothing counts (use keep).

`auto` decides what stays on the device from its budget, so it must see the share of the device
its N blocks would get among L, as the host budget is scaled: what is in use once the model and
the static ballast are there, plus N / L of the device's budget left over (`auto_budget`). Given
the whole device, auto keeps everything its N blocks save, and the ballast then charges L - N
blocks as much: the H200 run of 2026-11-28 (benchmarks/results/h200-2026-11-28) measured that
and not auto. The share is conservative: the working set (one block's backward, the loss) is
paid out of N / L of the room, where L blocks would share one.
"""

from __future__ import annotations

from .lora import trainable_bytes
from .policies import HEAD_AND_LOSS, is_actoff_policy, split_variants

__all__ = [
    "HELD_BY_POLICY",
    "Ballast",
    "auto_budget",
    "block_static_bytes",
    "check_emulation",
    "held_per_block",
    "scaled_budget",
]

#: How a policy's per-block held bytes are had: computed, measured by actoff, or none on the device.
HELD_BY_POLICY = {
    "torch_checkpoint": "block input",
    "torch_checkpoint_cpu": "nothing",
    "hf_checkpoint_offload": "nothing",  # its block inputs go to the host under save_on_cpu too
    "torch_save_on_cpu": "nothing",
}


def check_emulation(policies: list[str], real_layers: int, target_layers: int) -> None:
    """SystemExit when ``--emulate-layers`` cannot stand for the run: fewer target blocks than
    real ones, or a policy whose per-block bytes are not counted (``none``)."""
    if target_layers < real_layers:
        raise SystemExit(f"--emulate-layers {target_layers}: at least --layers ({real_layers})")
    for policy in policies:
        name = split_variants(policy)[0]
        if name not in HELD_BY_POLICY and not is_actoff_policy(policy):
            raise SystemExit(
                f"--emulate-layers: policy {policy!r} holds per block what nothing counts "
                "(Note [emulated layers]); run keep, whose per-block bytes actoff counts"
            )


def block_static_bytes(block) -> int:
    """What one block keeps on the device across steps: its parameters and buffers, and a
    gradient for each trainable parameter (under ``--lora``, the adapters' only)."""
    kept = sum(t.numel() * t.element_size() for t in (*block.parameters(), *block.buffers()))
    return kept + trainable_bytes(block)


def held_per_block(
    policy: str, seq: int, batch: int, hidden: int, dtype_bytes: int, keep_bytes_per_block: float | None
) -> int:
    """Bytes ``policy`` holds on the device per block from its forward to its backward
    (Note [emulated layers]); ``keep_bytes_per_block``: actoff's keep-tier bytes per block,
    measured in the warm-up step.

    >>> held_per_block("torch_checkpoint+tile+loss", 1024, 1, 4096, 2, None)  # the input, B x S x H
    8388608
    >>> held_per_block("cpu+tile+loss", 1024, 1, 4096, 2, 12345.0), held_per_block("torch_save_on_cpu", 1024, 1, 4096, 2, None)
    (12345, 0)
    """
    how = HELD_BY_POLICY.get(split_variants(policy)[0])
    if how == "block input":
        return batch * seq * hidden * dtype_bytes
    if how == "nothing":
        return 0
    return int(keep_bytes_per_block or 0)


def scaled_budget(total_bytes: int, real_layers: int, target_layers: int) -> int:
    """The host budget N blocks get in place of L blocks' ``total_bytes``.

    >>> scaled_budget(64 * 2**30, 4, 32) / 2**30
    8.0
    """
    return total_bytes * real_layers // target_layers


def auto_budget(device_budget: int, in_use: int, real_layers: int, target_layers: int) -> int:
    """``auto``'s device budget for ``real_layers`` blocks standing for ``target_layers``: the
    bytes in use with the model and the static ballast there, and the blocks' share of the rest
    (Note [emulated layers]).

    >>> auto_budget(100 * 2**30, 36 * 2**30, 4, 32) / 2**30  # 64 GiB left; 4 of 32 blocks get 8
    44.0
    """
    if device_budget <= in_use:
        return device_budget  # nothing left: auto plans its floor and says it is over
    return in_use + (device_budget - in_use) * real_layers // target_layers


class Ballast:
    """The device bytes of the blocks not built (Note [emulated layers]): their static part,
    allocated with the model and kept, and per length the part they would hold through the
    step, allocated after the warm-up (which measures it) and freed after the length."""

    def __init__(self, model, config, device, target_layers: int) -> None:
        import torch

        real_layers = len(model.layers)
        self.device, self.hidden, self.target_layers = device, config.hidden_size, target_layers
        self.missing = target_layers - real_layers
        self.static_bytes = self.missing * block_static_bytes(model.layers[0])
        self._static = torch.empty(self.static_bytes, dtype=torch.uint8, device=device)
        self._held = None
        self.auto_budget_bytes: int | None = None  # set for auto (Note [emulated layers])
        self.total_bytes = (
            self.static_bytes
        )  # the ballast now: its static part, and the held part while a length runs

    def hold(self, spec: dict, seq: int, stats) -> dict:
        """Allocate what the missing blocks hold at ``seq`` under the spec's policy (actoff's
        keep-tier bytes per block from ``stats``, the warm-up's); the record's fields."""
        import torch

        keep_per_block = None
        blocks = [b for name, b in stats.blocks.items() if name != HEAD_AND_LOSS]  # blocks only
        if blocks:
            keep_per_block = sum(b.bytes_per_tier["keep"] for b in blocks) / len(blocks)
        dtype_bytes = torch.empty(0, dtype=getattr(torch, spec["dtype"])).element_size()
        per_block = held_per_block(
            spec["policy"], seq, spec["batch"], self.hidden, dtype_bytes, keep_per_block
        )
        self.total_bytes = self.static_bytes + self.missing * per_block
        self._held = torch.empty(self.missing * per_block, dtype=torch.uint8, device=self.device)
        return {
            "emulated_layers": self.target_layers,
            "ballast_static_bytes": self.static_bytes,
            "ballast_held_bytes": self.missing * per_block,
            "held_per_block_bytes": per_block,
            **({"emulated_auto_budget_bytes": self.auto_budget_bytes} if self.auto_budget_bytes else {}),
        }

    def release_held(self) -> None:
        self._held = None
        self.total_bytes = self.static_bytes
