"""The policies the benchmark compares, their variants, and applying one to a model.

A policy is a baseline without actoff (``none``, ``torch_checkpoint``, ``torch_save_on_cpu``) or one of
actoff's (``keep``, ``cpu``, ``nvme``, ``tokenwise:CPU:NVME``, ``recompute``, ``auto``), with
suffixes: the variants of `VARIANTS` and ``+verify``.
"""

from __future__ import annotations

import contextlib
import os

# none: no actoff, autograd keeps every activation; keep: actoff's hooks, nothing moved.
BASELINES = ("none", "torch_checkpoint", "torch_save_on_cpu", "torch_checkpoint_cpu", "hf_checkpoint_offload")
ACTOFF_POLICIES = ("keep", "cpu", "nvme", "tokenwise", "recompute", "checkpoint", "chunked", "auto")
# tokenwise:CPU:NVME gives the token fractions (the rest is recomputed).
# --find-max-seq on a CPU: the baselines and actoff's policies, each plain and with tiling and
# the chunked loss. Of the token-wise family, recompute (block inputs and attention outputs in
# host memory, the rest rebuilt in backward) needs the least device memory: its device arena
# holds one block's rebuilt activations where cpu's holds two blocks' fetched ones.
MAXSEQ_CPU_POLICIES = tuple(
    f"{name}{variant}"
    for variant in ("", "+tile+loss")
    for name in (
        "keep",
        "torch_checkpoint",
        "torch_save_on_cpu",
        "torch_checkpoint_cpu",
        "cpu",
        "recompute",
        "auto",
    )
)
# ... and recompute+tile+loss with ACTOFF_PLANNER=off, to weigh what the device arena costs.
MAXSEQ_CPU_POLICIES += ("recompute+tile+loss+noplan",)
DEFAULT_POLICIES = ("none", "keep", "torch_checkpoint", "torch_save_on_cpu", "torch_checkpoint_cpu", "cpu", "nvme", "tokenwise:0.5:0",
                    "tokenwise:0.25:0.25", "recompute", "auto")  # fmt: skip

#: Variants a policy may carry as suffixes: ``+tile`` runs each block's MLP and the final norm chunk
#: by chunk (`actoff.tile_`, TILE_TOKENS positions at a time), ``+loss`` computes the head and the loss
#: over chunks of LOSS_TOKENS rows (`actoff.chunked_cross_entropy`), e.g. ``cpu+tile+loss``;
#: ``+noplan`` runs an actoff policy with ``ACTOFF_PLANNER=off``: no device arena, actoff's
#: backward buffers allocated per request and freed after their last use (and the host arena
#: bump-allocated), to weigh what the arena costs in device memory. On CUDA, ``+expandable`` runs
#: the worker with PyTorch's ``expandable_segments:True`` and ``+replay`` under actoff's replay
#: allocator (``ACTOFF_ALLOCATOR=replay``): with ``+noplan`` and the plain policy, four ways to
#: allocate the device's memory, compared by fragmentation and longest sequence.
VARIANTS = ("tile", "loss", "noplan", "expandable", "replay")
#: The worker's environment under each allocator variant (set before CUDA starts).
ALLOCATOR_VARIANTS = {
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "replay": {"ACTOFF_ALLOCATOR": "replay"},
}
TILE_TOKENS = 4096
LOSS_TOKENS = 4096


def split_variants(policy: str) -> tuple[str, frozenset[str]]:
    """``"cpu+tile+loss"`` -> ``("cpu", {"tile", "loss"})``; other suffixes (``+verify``) stay.

    >>> split_variants("torch_checkpoint+loss")
    ('torch_checkpoint', frozenset({'loss'}))
    """
    name, *suffixes = policy.split("+")
    extras = frozenset(s for s in suffixes if s in VARIANTS)
    return "+".join([name, *(s for s in suffixes if s not in VARIANTS)]), extras


def is_actoff_policy(policy: str) -> bool:
    """Whether ``policy`` places activations with actoff (``cpu+tile+loss`` yes, ``torch_checkpoint+loss`` no)."""
    return split_variants(policy)[0].split(":")[0].split("+")[0] in ACTOFF_POLICIES


def check_policies(text: str) -> list[str]:
    """The policies of ``--policies``, or SystemExit naming the one that is not known."""
    policies = [p.strip().lower() for p in text.split(",") if p.strip()]
    for policy in policies:
        base, *suffixes = policy.split("+")
        unknown = [s for s in suffixes if s not in (*VARIANTS, "verify")]
        if unknown:
            raise SystemExit(
                f"policy {policy!r}: unknown suffix +{unknown[0]}; known: +tile, +loss, +noplan, "
                "+expandable, +replay, +verify"
            )
        name, *fractions = base.split(":")
        needs_actoff = {"noplan": "turns off actoff's planner", "replay": "plans by actoff's scopes"}
        for variant, what in needs_actoff.items():
            if variant in suffixes and name not in ACTOFF_POLICIES:
                raise SystemExit(f"policy {policy!r}: +{variant} {what}; {name} does not use actoff")
        if name not in BASELINES + ACTOFF_POLICIES or (fractions and name != "tokenwise"):
            raise SystemExit(
                f"unknown policy {policy!r}: choose from {', '.join(BASELINES + ACTOFF_POLICIES)}"
                " (each may end in +tile, +loss, +noplan, +expandable, +replay, +verify)"
            )
        try:
            [float(f) for f in fractions]
        except ValueError:
            raise SystemExit(
                f"policy {policy!r}: write tokenwise:CPU_FRACTION:NVME_FRACTION, e.g. tokenwise:0.5:0"
            ) from None
    return policies


def model_config(spec: dict):
    """The reference model's shape for a worker's spec: the preset's, with the spec's layers,
    and under ``shrink`` K its widths (hidden, MLP, vocabulary) divided by K, heads kept: the
    preset's shape at a size a CPU trains.

    >>> config = model_config({"model": "8b", "layers": 2, "shrink": 32})
    >>> config.hidden_size, config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    (128, 32, 8, 448, 4008)
    """
    import dataclasses

    from actoff.reference import ModelConfig

    config = ModelConfig.preset(spec["model"], num_layers=spec["layers"])
    shrink = spec.get("shrink")
    if not shrink:
        return config
    hidden = config.hidden_size // shrink
    if hidden < 2 * config.num_heads or hidden % (2 * config.num_heads):
        raise SystemExit(
            f"--shrink {shrink}: hidden size {config.hidden_size} / {shrink} leaves no even head size for "
            f"{config.num_heads} heads; give a divisor of {config.hidden_size // (2 * config.num_heads)}"
        )
    return dataclasses.replace(
        config,
        hidden_size=hidden,
        intermediate_size=config.intermediate_size // shrink,
        vocab_size=max(config.vocab_size // shrink, 2),
    )


def build_model(config, device, dtype):
    """The reference model with its parameters made on ``device`` in ``dtype``: no CPU copy
    first (a 7B-shaped model built on the CPU in float32 took about 15 s per process)."""
    import torch

    from actoff.reference import Transformer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the rotary tables are computed in float32 regardless
    try:
        with torch.device(device):
            return Transformer(config)
    finally:
        torch.set_default_dtype(previous)


def apply_policy(model, policy: str, nvme_dir: str | None, planner_off: bool = False):
    """Returns a context manager to run each step under (for torch_save_on_cpu). ``planner_off``: an
    actoff policy with ``ACTOFF_PLANNER=off`` (the ``+noplan`` variant)."""
    import torch

    if policy == "none":
        return contextlib.nullcontext
    if policy in ("torch_checkpoint", "torch_checkpoint_cpu"):
        _checkpoint_blocks(model, offload_input=policy == "torch_checkpoint_cpu")
        return contextlib.nullcontext
    if policy == "hf_checkpoint_offload":
        _hf_checkpoint_offload(model)
        return contextlib.nullcontext
    if policy == "torch_save_on_cpu":
        return lambda: save_on_host(pinned=torch.cuda.is_available())
    _offload(model, policy, nvme_dir, planner_off)
    return contextlib.nullcontext


def _checkpoint_blocks(model, *, offload_input: bool = False) -> None:
    """Every block of ``model`` under PyTorch's activation checkpointing: non-reentrant, or
    with ``offload_input`` the offloaded checkpoint that Unsloth and ALST ship: reentrant
    checkpointing (which saves the block's inputs with ``save_for_backward``) under
    ``save_on_cpu(pin_memory=True)``, so only the inputs are stored, on the host. Hugging Face's
    ``activation_checkpointing_enable(offload=True)`` is this with a non-reentrant checkpoint; it
    is a method of Hugging Face models and this is the reference model, so it has no policy here
    (tests/test_huggingface.py runs it with actoff)."""
    import torch
    import torch.utils.checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, cos, sin):
            if not offload_input:
                return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)
            with save_on_host(pinned=True):
                return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=True)

    model.layers = torch.nn.ModuleList(Checkpointed(b) for b in model.layers)


def _hf_checkpoint_offload(model) -> None:
    """Every block as Hugging Face's ``activation_checkpointing_enable(offload=True)`` wraps a
    decoder layer (transformers 5.x, ``PreTrainedModel._activation_checkpointing_enable``): a
    non-reentrant ``checkpoint`` called inside ``save_on_cpu(pin_memory=True)``. The same two calls,
    applied to the reference model's blocks (the method is Hugging Face models' own); refused where
    the installed transformers has no such method, so the row always names what it stands for."""
    import torch
    import torch.utils.checkpoint

    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = None
    if PreTrainedModel is None or not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        raise SystemExit(
            "hf_checkpoint_offload: the installed transformers has no activation_checkpointing_enable "
            "(transformers 5.x has it; pip install -U transformers)"
        )

    class Offloaded(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, cos, sin):
            with save_on_host(pinned=True):
                return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)

    model.layers = torch.nn.ModuleList(Offloaded(b) for b in model.layers)


def _offload(model, policy: str, nvme_dir: str | None, planner_off: bool) -> None:
    """``model``'s blocks under one of actoff's policies (``tokenwise:CPU:NVME``, ``+verify``), and under
    ``auto`` its head and loss too (Note [auto plans the head and loss too])."""
    import actoff
    from actoff.reference import Block

    # actoff policies read the rest of their settings from ACTOFF_* (e.g. ACTOFF_KEEP_LAST).
    policy, verify = policy.removesuffix("+verify"), policy.endswith("+verify")
    name, *fractions = policy.split(":")
    overrides: dict[str, object] = {"policy": name, "verify": verify or actoff.Config.from_env().verify}
    if fractions:
        overrides["cpu_fraction"] = float(fractions[0])
        overrides["nvme_fraction"] = float(fractions[1]) if len(fractions) > 1 else 0.0
    if nvme_dir and os.environ.get("ACTOFF_NVME_DIR") is None:
        overrides["nvme_dir"] = nvme_dir
    if planner_off:
        overrides["planner"] = "off"
    config = actoff.Config.from_env(**overrides)
    actoff.offload_(model, block_cls=Block, config=config)
    if name == "auto":  # Note [auto plans the head and loss too]
        model.scoped_head_and_loss = actoff.offload(model.head_and_loss, config=config, name=HEAD_AND_LOSS)


#: The scope's name under ``auto`` (Note [auto plans the head and loss too]).
HEAD_AND_LOSS = "head+loss"

# Note [auto plans the head and loss too]: under ``auto`` the final norm, the head and the
# (unchunked) loss run as one more scope (`Transformer.head_and_loss`), which auto places as it
# places a block. Outside every scope their saves (the norm's input and normed output, its
# intermediate, the log-probabilities: 7 of 44.6 MiB at the main run's 1024 tokens) stayed on the
# device through the loss's backward, where ``torch_save_on_cpu``, whose context holds the whole
# step, moves them; so the main run's floor budget, ``torch_save_on_cpu``'s peak, sat under auto's
# least peak and auto ran out of memory there (tests/test_benchmarks.py, 256 tokens). This is what
# a user at the edge of memory does (README, "Other ways in"). Not for the explicit policies, which
# keep the blocks-only scoping they are compared by (a uniform ``checkpoint`` would run the head
# twice; ``cpu`` would gain the same room: so at the floor auto has a scope they lack), nor under
# DDP (the wrapper runs the model whole), nor under the chunked loss (``+loss``: never all the
# logits). Its phases move: the norm's forward falls in ``loss`` and its backward in ``loss
# backward``. The scoped callable is the model's attribute, bound to it: set after any copy of the
# model (rounds.py copies before `apply_policy`). Under ``--emulate-layers`` the ballast's blocks
# leave it out (`Ballast.hold`).


def save_on_host(*, pinned: bool):
    """PyTorch's ``save_on_cpu(pin_memory=pinned)``; on a simulated device its equivalent
    (Note [save_on_cpu on the simulated device])."""
    import torch

    import actoff.testing

    device = actoff.testing.active_device()
    if device is None:
        return torch.autograd.graph.save_on_cpu(pin_memory=pinned and torch.cuda.is_available())
    return _save_on_simulated_host(device)


def _save_on_simulated_host(device):
    """Note [save_on_cpu on the simulated device]: on a CPU ``torch.autograd.graph.save_on_cpu``
    keeps each saved tensor as it is (``tensor.cpu()`` of a CPU tensor is the tensor), so on the
    simulated device it would cost what ``keep`` costs. This is what it does on a GPU: pack
    copies every saved tensor, parameters' views included, into host memory (allocated outside
    the device's count, as pinned memory is) and unpack copies it back into a new device
    tensor, both synchronously: under a link model each copy blocks for its time on the link.
    Pinned or not, it runs at the device's ``pageable_rate`` of the link (the synchronous
    copy's): the wind tunnel sets that to the share PyTorch's tool reached on the target, which
    copied into pinned buffers (``Gpu.save_on_cpu_share``, fitted: Note [fitting the tunnel])."""
    import torch
    from torch.utils._mode_utils import no_dispatch

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        with no_dispatch():  # host memory: not the device's
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout)
            host.copy_(tensor)
        device.transfer(host.numel() * host.element_size(), "device-to-host", pageable=True)
        return host

    def unpack(host: torch.Tensor) -> torch.Tensor:
        device.transfer(host.numel() * host.element_size(), "host-to-device", pageable=True)
        return host.clone()  # a device allocation, as ``.to(device)`` is

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def shrunk_chunks(base: dict, shrink: int) -> tuple[int, int]:
    """The tile and loss chunks (tokens) of a model whose widths are divided by ``shrink``: the
    full model's divided too, at least 64. A proxy's lengths are the full model's scaled down (on a
    device scaled down with it); with its chunks / K too, a length / K is cut into as many chunks
    as the full model's length, so the MLP and loss chunks weigh in the peak as they would there
    (issue 39: with 4096-token chunks at 1024 tokens nothing was chunked, and the loss's backward
    bound the proxy).

    >>> shrunk_chunks({"tile_tokens": None, "loss_tokens": None}, 32)
    (128, 128)
    """
    tile = base.get("tile_tokens") or TILE_TOKENS
    loss = base.get("loss_tokens") or LOSS_TOKENS
    return max(64, tile // shrink), max(64, loss // shrink)
