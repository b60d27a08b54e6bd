"""The hand-written Llama-style decoder: numerics on CPU, export on meta, parameter count."""

from __future__ import annotations

import math

import pytest
import torch

from autopar.errors import ConfigError
from autopar.models.llama import Llama, LlamaConfig, build_llama, llama_param_count, rotary

TINY = dict(hidden=64, heads=4, kv_heads=2, layers=2, ffn_hidden=128, vocab_size=512, seq_len=32)


def test_forward_backward_cpu() -> None:
    torch.manual_seed(0)
    model, inputs = build_llama(LlamaConfig(**TINY), batch_size=2)
    loss = model(**inputs)
    # Weights ~ N(0, 0.02): near-uniform logits, loss about ln V (observed within 0.05).
    assert abs(loss.item() - math.log(512)) < 0.3
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model(inputs["input_ids"]).shape == (2, 32, 512)


def test_module_names() -> None:
    model = Llama(LlamaConfig(**TINY))
    names = {name for name, _ in model.named_modules()}
    assert {"embed", "layers.0.attn_norm", "layers.0.attn.q_proj", "layers.0.attn.k_proj",
            "layers.0.attn.v_proj", "layers.0.attn.o_proj", "layers.1.mlp.gate_proj",
            "layers.1.mlp.up_proj", "layers.1.mlp.down_proj", "norm", "head"} <= names
    assert model.layers[0].attn.k_proj.weight.shape == (2 * 16, 64)  # kv_heads * head_dim
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_causal() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY)).eval()
    ids = torch.randint(0, 512, (2, 32))
    changed = ids.clone()
    changed[:, 16:] = (changed[:, 16:] + 1) % 512
    torch.testing.assert_close(model(changed)[:, :16], model(ids)[:, :16])


def test_rotary_scores_depend_on_relative_position_only() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16).expand(1, 1, 8, 16), torch.randn(1, 1, 1, 16).expand(1, 1, 8, 16)
    scores = (rotary(q, 10000.0) @ rotary(k, 10000.0).transpose(-2, -1))[0, 0]
    for offset in (0, 2, 5):
        diagonal = torch.diagonal(scores, -offset)  # scores[i + offset, i]
        # Same offset -> same score, up to float32 rounding of the angles.
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), atol=1e-4, rtol=1e-4)


def test_export_train_mode_on_meta() -> None:
    model, inputs = build_llama(LlamaConfig(**TINY), batch_size=2, device="meta")
    program = torch.export.export(model.train(), (), inputs, strict=False)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert {"aten.scaled_dot_product_attention.default", "aten.silu.default"} <= targets


@pytest.mark.parametrize("overrides", [{}, {"kv_heads": 4}, {"kv_heads": 1}, {"tie_embeddings": True}])
def test_param_count_is_exact(overrides: dict) -> None:
    cfg = LlamaConfig(**{**TINY, **overrides})
    model, _ = build_llama(cfg, device="meta", dtype=torch.bfloat16)
    assert llama_param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_kv_heads_default_to_heads() -> None:
    assert LlamaConfig(**{**TINY, "kv_heads": None}).kv_heads == 4


@pytest.mark.parametrize("bad", [{"kv_heads": 3}, {"hidden": 66}, {"heads": 64}, {"rope_theta": 0.0},
                                 {"layers": 0}, {"tie_embeddings": "no"}])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ConfigError):
        LlamaConfig(**{**TINY, **bad})
