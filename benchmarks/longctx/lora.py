"""``--lora RANK``: the benchmark's model with its base frozen and trainable low-rank adapters
on every attention and MLP projection: peft's LoRA where peft is installed, else `LoRALinear`.

A frozen base changes what a step holds, not only what it computes: no gradient for a base
weight (half the static memory of bf16 training goes), and a product with a frozen weight
saves no input for a weight gradient, while each adapter saves its own. So the longest sequence with LoRA is
its own question, and a benchmark of it must train the adapters, not a copy of full training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LORA_TARGETS", "LoRALinear", "lora_", "trainable_bytes"]

#: The projections that get adapters (the reference model's names; fused or not).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update, as peft's LoRA computes it:
    ``base(x) + (x A^T) B^T * alpha / rank``. ``B`` starts at zero, so the adapted model
    begins as its base; ``A`` as peft initialises it.

    >>> layer = LoRALinear(nn.Linear(8, 6, bias=False), rank=2, alpha=4)
    >>> x = torch.randn(3, 8)
    >>> torch.equal(layer(x), layer.base(x)), layer.base.weight.requires_grad, layer.lora_A.requires_grad
    (True, False, True)
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        weight = base.weight
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, device=weight.device, dtype=weight.dtype)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, device=weight.device, dtype=weight.dtype)
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def lora_(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    *,
    use_peft: bool | None = None,
    input_grads: bool = False,
) -> str:
    """Freeze every parameter of ``model`` and add rank-``rank`` adapters (``alpha`` defaults
    to twice the rank) on the projections of `LORA_TARGETS`, in place; what made them
    (``"peft 0.x"`` or ``"actoff LoRALinear"``). ``use_peft``: None picks peft when installed.

    Note [input grads only where reentrant]: with ``input_grads`` the embedding's output is made
    to require grad, as Hugging Face's ``enable_input_require_grads`` does for LoRA: reentrant
    checkpointing (torch_checkpoint_cpu) passes no gradient into a block none of whose inputs
    requires one, and the first block's adapters would then never learn. Nothing else needs it,
    and it costs: the output becomes a leaf, which its gradient's accumulator holds on the device
    for the whole step (whatever saves it, offloaded or not), and whose gradient is made at the
    end of backward: two residual-stream tensors at full length (16 KB a token of
    Llama-3.1-8B), the first block's input that the offloading policies store off the device.

    >>> from actoff.reference import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig.preset("tiny"))
    >>> lora_(model, 4, use_peft=False)
    'actoff LoRALinear'
    >>> sorted({name.split(".")[-1] for name, p in model.named_parameters() if p.requires_grad})
    ['lora_A', 'lora_B']
    """
    if rank < 1:
        raise ValueError(f"--lora {rank}: the rank must be at least 1")
    alpha = 2.0 * rank if alpha is None else alpha
    model.requires_grad_(False)
    if use_peft is None:
        import importlib.util

        use_peft = importlib.util.find_spec("peft") is not None
    if use_peft:
        import peft

        present = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS
            }
        )
        config = peft.LoraConfig(
            r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=present, bias="none"
        )
        peft.inject_adapter_in_model(config, model)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_("lora_" in name)
        made = f"peft {peft.__version__}"
    else:
        targets = [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if isinstance(child, nn.Linear) and name in LORA_TARGETS
        ]
        for parent, name, child in targets:
            setattr(parent, name, LoRALinear(child, rank, alpha))
        made = "actoff LoRALinear"
    embed = getattr(model, "embed", None)
    if embed is not None and input_grads:
        embed.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    return made


def trainable_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s trainable parameters (their gradients take as many again)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
