"""The hand-written Megatron-style GPT: numerics on CPU, export on meta, parameter count."""

from __future__ import annotations

import math

import pytest
import torch

from autopar.errors import ConfigError
from autopar.models.gpt import GPT, GPTConfig, build_gpt, gpt_param_count

TINY = dict(hidden=64, heads=4, layers=2, vocab_size=512, seq_len=32)


def _distinct_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_forward_backward_cpu(attention: str) -> None:
    torch.manual_seed(0)
    model, inputs = build_gpt(GPTConfig(**TINY, attention=attention), batch_size=2)
    loss = model(**inputs)
    assert loss.shape == ()
    # Weights ~ N(0, 0.02) give near-uniform logits, so the loss is about ln V; 0.3 covers
    # the spread of random logits at this size (observed within 0.05).
    assert abs(loss.item() - math.log(512)) < 0.3
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_logits_without_labels_and_tied_head() -> None:
    model, inputs = build_gpt(GPTConfig(**TINY), batch_size=3)
    assert model(inputs["input_ids"]).shape == (3, 32, 512)
    assert model.head.weight is model.embed.tok.weight
    untied, _ = build_gpt(GPTConfig(**TINY, tie_embeddings=False), device="meta")
    assert untied.head.weight is not untied.embed.tok.weight


def test_eager_matches_sdpa_and_is_causal() -> None:
    torch.manual_seed(0)
    eager = GPT(GPTConfig(**TINY, attention="eager", dropout=0.0)).eval()
    sdpa = GPT(GPTConfig(**TINY, attention="sdpa", dropout=0.0)).eval()
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 512, (2, 32))
    out = eager(ids)
    # Same float32 maths in a different order: differences are rounding, far below 1e-4.
    torch.testing.assert_close(sdpa(ids), out, atol=1e-4, rtol=1e-4)
    changed = ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 512
    torch.testing.assert_close(eager(changed)[:, :20], out[:, :20])


def test_dropout_is_active_in_train_mode_only() -> None:
    model, inputs = build_gpt(GPTConfig(**TINY, dropout=0.5), batch_size=2)
    model.eval()
    assert torch.equal(model(**inputs), model(**inputs))
    model.train()
    assert not torch.equal(model(**inputs), model(**inputs))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_export_train_mode_on_meta(attention: str) -> None:
    model, inputs = build_gpt(GPTConfig(**TINY, attention=attention), batch_size=2, device="meta")
    model.train()
    program = torch.export.export(model, (), inputs, strict=False)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "aten.dropout.default" in targets
    if attention == "eager":
        assert {"aten.softmax.int", "aten.masked_fill.Scalar", "aten.matmul.default"} <= targets
    else:
        assert "aten.scaled_dot_product_attention.default" in targets
    output = [n for n in program.graph.nodes if n.op == "output"][0].args[0][0]
    assert output.meta["val"].shape == ()


def test_dtype_and_meta_device() -> None:
    model, inputs = build_gpt(GPTConfig(**TINY), batch_size=4, device="meta", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.tok.weight
    assert inputs["input_ids"].shape == (4, 32) and inputs["input_ids"].dtype == torch.long


@pytest.mark.parametrize("overrides", [
    {}, {"ffn_hidden": 96}, {"tie_embeddings": False}, {"bias": False},
    {"bias": False, "tie_embeddings": False, "ffn_hidden": 200},
])
def test_param_count_is_exact(overrides: dict) -> None:
    cfg = GPTConfig(**{**TINY, **overrides})
    model, _ = build_gpt(cfg, device="meta")
    assert gpt_param_count(cfg) == _distinct_numel(model)


@pytest.mark.parametrize("l,h,a,V,s", [(2, 64, 4, 512, 32), (24, 2304, 24, 51200, 2048),
                                       (96, 12288, 96, 51200, 2048)])
def test_param_count_vs_megatron_formula(l: int, h: int, a: int, V: int, s: int) -> None:
    """Narayanan et al. 2021: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)).

    The formula omits the final LayerNorm; the model has exactly 2h parameters more.
    """
    cfg = GPTConfig(layers=l, hidden=h, heads=a, vocab_size=V, seq_len=s)
    formula_exact = 12 * l * h * h + 13 * l * h + (V + s) * h       # the formula, expanded
    formula_float = 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    # Float evaluation of the same polynomial: relative rounding error ~1e-15.
    assert math.isclose(formula_float, formula_exact, rel_tol=1e-12)
    assert gpt_param_count(cfg) == formula_exact + 2 * h


def test_ffn_default_and_head_dim() -> None:
    cfg = GPTConfig(hidden=96, heads=3, layers=1)
    assert cfg.ffn_hidden == 384 and cfg.head_dim == 32
    assert cfg == GPTConfig(hidden=96, heads=3, layers=1, ffn_hidden=384)


@pytest.mark.parametrize("bad", [
    {"hidden": 65}, {"attention": "flash"}, {"dropout": 1.0}, {"dropout": -0.1},
    {"layers": 0}, {"vocab_size": 2.5}, {"ffn_hidden": 0}, {"bias": 1},
])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ConfigError):
        GPTConfig(**{**TINY, **bad})
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        GPTConfig(**{**TINY, **bad})


def test_bad_dtype_and_batch() -> None:
    with pytest.raises(ConfigError):
        build_gpt(GPTConfig(**TINY), device="meta", dtype=torch.int32)
    with pytest.raises(ConfigError):
        build_gpt(GPTConfig(**TINY), batch_size=0, device="meta")
