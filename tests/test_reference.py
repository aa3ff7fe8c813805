"""The reference model: shapes, presets, grouped KV heads and the fused-qkv variant."""

import pytest
import torch

from actoff.reference import ModelConfig, Transformer, rope_tables


def test_forward_shapes_and_loss():
    model = Transformer(ModelConfig.preset("tiny"))
    tokens = torch.randint(0, 256, (3, 20))
    assert model(tokens).shape == (3, 20, 256)
    loss = model.loss(tokens)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_fused_qkv_matches_separate_projections():
    torch.manual_seed(0)
    separate = Transformer(ModelConfig.preset("tiny"))
    fused = Transformer(ModelConfig.preset("tiny", fused_qkv=True))
    fused.load_state_dict(separate.state_dict(), strict=False)
    for a, b in zip(separate.layers, fused.layers, strict=True):
        with torch.no_grad():
            b.attn.qkv_proj.weight.copy_(
                torch.cat([a.attn.q_proj.weight, a.attn.k_proj.weight, a.attn.v_proj.weight])
            )
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(
        fused(tokens), separate(tokens), rtol=1e-5, atol=1e-5
    )  # same math, other GEMM shapes


def test_presets():
    assert ModelConfig.preset("7b").intermediate_size == 11008
    assert ModelConfig.preset("1b").num_kv_heads < ModelConfig.preset("1b").num_heads
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("13b")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)


def test_rope_tables_shape():
    cos, sin = rope_tables(10, 16)
    assert cos.shape == sin.shape == (10, 16)
    torch.testing.assert_close(cos[0], torch.ones(16))


def test_flops_per_token_grows_with_sequence():
    config = ModelConfig.preset("7b")
    assert config.flops_per_token(32768) > config.flops_per_token(4096) > 6 * 32 * config.block_params()
