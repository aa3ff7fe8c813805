"""Reference Llama-style transformer (RMSNorm, RoPE, grouped-KV SDPA, SwiGLU) for tests and benchmarks.

Blocks take ``(x, cos, sin)`` with the rotary tables passed in, so a block never builds
position tables from ``arange`` itself (which token-wise recompute could not slice).
Shapes: ``x`` is ``(B, S, H)``; ``cos``/``sin`` are ``(S, head_dim)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "ModelConfig", "Transformer", "next_token_loss", "rope_tables"]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the reference model. `preset` gives tiny (CPU tests) to 7B-shaped.

    >>> ModelConfig.preset("7b").hidden_size
    4096
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 176
    num_layers: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    fused_qkv: bool = False  # one projection for q, k, v: their saved tensors share a storage

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def preset(name: str, **changes: object) -> ModelConfig:
        """``tiny`` (tests), ``small`` (CPU benchmark), ``1b``, ``7b`` and ``8b`` (GPU) shapes."""
        presets = {
            "tiny": ModelConfig(),
            "small": ModelConfig(vocab_size=1024, hidden_size=256, num_heads=8, num_kv_heads=4,
                                 intermediate_size=688, num_layers=4),
            "1b": ModelConfig(vocab_size=32000, hidden_size=2048, num_heads=32, num_kv_heads=4,
                              intermediate_size=5632, num_layers=22),
            "7b": ModelConfig(vocab_size=32000, hidden_size=4096, num_heads=32, num_kv_heads=32,
                              intermediate_size=11008, num_layers=32),
            # Llama-3.1-8B's shapes: grouped KV heads, a wider MLP, a 128K vocabulary.
            "8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_heads=32, num_kv_heads=8,
                              intermediate_size=14336, num_layers=32, rope_theta=500000.0),
        }  # fmt: skip
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}: expected one of {', '.join(presets)}")
        return dataclasses.replace(presets[name], **changes)  # type: ignore[arg-type]

    def block_params(self) -> int:
        """Parameters of one block."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return h * (h + 2 * kv) + h * h + 3 * h * self.intermediate_size + 2 * h

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), attention included."""
        dense = 2 * (self.num_layers * self.block_params() + self.vocab_size * self.hidden_size)
        attention = 2 * 2 * self.num_layers * seq_len * self.hidden_size / 2  # causal: half
        return 3 * (dense + attention)


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0, *, device=None, dtype=torch.float32):
    """``cos, sin`` of shape ``(seq_len, head_dim)`` for rotary embeddings."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        kv = config.num_kv_heads * d
        if config.fused_qkv:
            self.qkv_proj = nn.Linear(h, h + 2 * kv, bias=False)
        else:
            self.q_proj = nn.Linear(h, h, bias=False)
            self.k_proj = nn.Linear(h, kv, bias=False)
            self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, seq, _ = x.shape  # (B, S, H)
        kv = c.num_kv_heads * c.head_dim
        if c.fused_qkv:
            q, k, v = self.qkv_proj(x).split((c.hidden_size, kv, kv), dim=-1)  # views of one storage
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, seq, c.num_heads, c.head_dim).transpose(1, 2)  # (B, nH, S, D)
        k = k.view(batch, seq, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, nKV, S, D)
        v = v.view(batch, seq, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=c.num_kv_heads != c.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, c.hidden_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.post_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class Transformer(nn.Module):
    """Embedding, ``num_layers`` blocks, final norm and output head.

    >>> model = Transformer(ModelConfig.preset("tiny"))
    >>> model(torch.randint(0, 256, (2, 16))).shape
    torch.Size([2, 16, 256])
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 1.0 / math.sqrt(self.config.hidden_size)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)

    def blocks_output(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last block's output ``(B, S, H)``, before the final norm (for a loop that runs the
        norm, head and loss as one region, e.g. an offload scope of their own: `head_and_loss`)."""
        x = self.embed(tokens)  # (B, S, H)
        cos, sin = rope_tables(
            tokens.shape[1], self.config.head_dim, self.config.rope_theta, device=tokens.device, dtype=x.dtype
        )
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The normed last hidden states ``(B, S, H)``: what the head turns into logits (for a
        loss that never makes all the logits, e.g. `actoff.chunked_cross_entropy`)."""
        return self.norm(self.blocks_output(tokens))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(tokens))

    def head_and_loss(self, output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final norm, the head and the next-token loss over the blocks' ``output``: the
        logits and the loss.

        >>> model = Transformer(ModelConfig.preset("tiny"))
        >>> tokens = torch.randint(0, 256, (1, 9))
        >>> logits, loss = model.head_and_loss(model.blocks_output(tokens[:, :-1]), tokens[:, 1:])
        >>> bool(loss == model.loss(tokens)), tuple(logits.shape)
        (True, (1, 8, 256))
        """
        logits = self.head(self.norm(output))
        return logits, next_token_loss(logits, targets)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy on ``tokens`` ``(B, S)``."""
        return next_token_loss(self(tokens[:, :-1]), tokens[:, 1:])


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``logits`` ``(B, S, V)`` against ``targets`` ``(B, S)``, in float32.

    >>> round(next_token_loss(torch.zeros(1, 2, 4), torch.tensor([[0, 3]])).item(), 6)  # uniform: log 4
    1.386294
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
