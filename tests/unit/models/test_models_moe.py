"""The Mixtral-style MoE: static dispatch vs a per-token loop, numerics, export, capture, size, planning."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.errors import ConfigError
from autopar.models import build
from autopar.models.moe import Experts, Mixtral, MixtralConfig, MoE, build_mixtral, mixtral_param_count, moe_reference
from autopar.models.registry import REGISTRY

TINY = dict(hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=48, vocab_size=128, seq_len=16,
            num_experts=4, top_k=2)


def _moe(capacity_factor: float | None, seed: int = 0) -> tuple[MoE, torch.Tensor]:
    """A float64 MoE layer and an input (2, 16, 32) that needs a gradient."""
    torch.manual_seed(seed)
    moe = MoE(MixtralConfig(**TINY, capacity_factor=capacity_factor)).double()
    return moe, torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)


def _grads(moe: MoE, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)  # a non-uniform upstream grad
    return list(torch.autograd.grad((out * weight).sum(), [x, *moe.parameters()]))


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0])
def test_static_dispatch_matches_per_token_loop(capacity_factor: float | None) -> None:
    moe, x = _moe(capacity_factor)
    out, ref = moe(x), moe_reference(moe, x)
    # float64, same products summed in a different order: agreement to ~1e-15 relative;
    # assert_close's float64 defaults (rtol 1e-7, atol 1e-7) leave a wide margin.
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(moe, x, out), _grads(moe, x, ref)):
        torch.testing.assert_close(got, want)


def test_capacity_drops_assignments() -> None:
    moe, x = _moe(capacity_factor=0.5)
    tokens, cfg = 32, moe.config
    assert cfg.capacity(tokens) == 8                      # ceil(0.5 * 32 * 2 / 4)
    _, experts = moe.route(x.reshape(tokens, 32))
    load = torch.bincount(experts.reshape(-1), minlength=4)
    assert load.max() > 8, "the seed must overflow some expert for this test to mean anything"
    no_drop = MoE(replace(cfg, capacity_factor=None)).double()
    no_drop.load_state_dict(moe.state_dict())
    assert not torch.allclose(moe(x), no_drop(x))


def test_capacity() -> None:
    cfg = MixtralConfig(**TINY, capacity_factor=1.25)
    assert cfg.capacity(32) == math.ceil(1.25 * 32 * 2 / 4)
    assert MixtralConfig(**TINY, capacity_factor=100.0).capacity(32) == 32   # never more than T
    assert MixtralConfig(**TINY).capacity(32) == 32                          # None: no dropping


def test_routing_weights_are_renormalised() -> None:
    moe, x = _moe(None)
    weights, experts = moe.route(x.reshape(-1, 32))
    torch.testing.assert_close(weights.sum(-1), torch.ones(32, dtype=torch.float64))
    assert experts.shape == (32, 2) and (experts[:, 0] != experts[:, 1]).all()


def test_forward_backward_cpu() -> None:
    torch.manual_seed(0)
    model, inputs = build_mixtral(MixtralConfig(**TINY, capacity_factor=1.0), batch_size=2)
    loss = model(**inputs)
    # Weights ~ N(0, 0.02): near-uniform logits, loss about ln V (observed within 0.05).
    assert abs(loss.item() - math.log(128)) < 0.3
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model(inputs["input_ids"]).shape == (2, 16, 128)


def test_module_paths() -> None:
    model = Mixtral(MixtralConfig(**TINY))
    modules = dict(model.named_modules())
    assert {"layers.0.attn", "layers.0.moe.router", "layers.0.moe.experts", "layers.1.moe.experts"} <= set(modules)
    experts = modules["layers.0.moe.experts"]
    # Hugging Face v5's layout: gate_up (E, 2 ffn, h), gate rows first; down (E, h, ffn).
    assert experts.gate_up_proj.shape == (4, 96, 32) and experts.down_proj.shape == (4, 32, 48)
    assert {n for n, _ in experts.named_parameters()} == {"gate_up_proj", "down_proj"}
    assert modules["layers.0.moe.router"].weight.shape == (4, 32)


def test_export_on_fake_tensors_matches_eager() -> None:
    """Exporting real CPU weights traces with fake tensors; the program must compute the same loss."""
    torch.manual_seed(0)
    model, inputs = build_mixtral(MixtralConfig(**TINY, capacity_factor=1.0), batch_size=2)
    program = torch.export.export(model, (), inputs, strict=False)
    # The same ops in the same order: bit-identical up to float32 kernel nondeterminism (none on CPU).
    torch.testing.assert_close(program.module()(**inputs), model(**inputs), atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_graph():
    model, inputs = build("mixtral-tiny", batch_size=2)
    return model, inputs, capture(model, inputs)


def test_capture_finds_repeated_layers(tiny_graph) -> None:
    _, _, graph = tiny_graph
    blocks = [layer for layer in graph.layers if layer.is_block]
    assert [layer.name for layer in blocks] == ["layers.0", "layers.1"]
    assert len({layer.signature for layer in blocks}) == 1
    assert not graph.warnings
    assert len({layer.name for layer in graph.layers}) == len(graph.layers)   # a plan names layers


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_flops_count_routed_tokens_only(capacity_factor: float | None) -> None:
    """The expert matmuls count the T*k routed rows, whatever the dispatch computes (E*T slots
    without a capacity, E*C with one); capture/moe.py recounts them."""
    cfg = MixtralConfig(**TINY, capacity_factor=capacity_factor)
    model, inputs = build_mixtral(cfg, batch_size=2, device="meta")
    graph = capture(model, inputs)
    expert_nodes = [n for n in graph.nodes if n.module_path.endswith("moe.experts") and n.target == "aten.bmm.default"]
    assert len(expert_nodes) == 2 * cfg.layers                    # gate_up, then down, per layer
    tokens = inputs["input_ids"].numel()
    routed = 2.0 * tokens * cfg.top_k * 3 * cfg.hidden * cfg.ffn_hidden * cfg.layers
    assert sum(n.flops_fwd for n in expert_nodes) == routed
    assert [r.module for r in graph.moe] == ["layers.0.moe.experts", "layers.1.moe.experts"]


def test_estimate_tiny() -> None:
    """Pipelined from batch-2 example inputs (tensor parallelism on this model, each layout the ILP's:
    tests/unit/solver/test_one_pricing_path.py)."""
    model, inputs = build("mixtral-tiny", batch_size=2)
    plan = autopar.estimate(model, autopar.Cluster.from_spec("1x8xA100-80GB"), inputs,
                            autopar.ParallelConfig(dp=4, pp=2), global_batch_size=16)
    assert plan.step_time > 0 and math.isfinite(plan.step_time) and plan.peak_memory > 0


@pytest.mark.parametrize("overrides", [{}, {"kv_heads": 4}, {"tie_embeddings": True}, {"num_experts": 8, "top_k": 1}])
def test_param_count_is_exact(overrides: dict) -> None:
    cfg = MixtralConfig(**{**TINY, **overrides})
    model, _ = build_mixtral(cfg, device="meta", dtype=torch.bfloat16)
    assert mixtral_param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_mixtral_8x7b_size_on_meta() -> None:
    model, inputs = build("mixtral-8x7b")
    cfg = REGISTRY["mixtral-8x7b"].config
    count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters()) and inputs["input_ids"].shape == (1, 4096)
    # Mistral AI's published sizes, rounded: 46.7B total, 12.9B active per token.
    assert count == mixtral_param_count(cfg) and abs(count - 46.7e9) < 0.01 * 46.7e9
    assert abs(mixtral_param_count(cfg, active=True) - 12.9e9) < 0.01 * 12.9e9


def test_matches_hugging_face_mixtral() -> None:
    tf = pytest.importorskip("transformers", reason="transformers is the optional dev extra")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    cfg = MixtralConfig(**TINY, rope_theta=1e6)
    ours, inputs = build_mixtral(cfg, batch_size=2)
    hf = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5))
    sd = hf.state_dict()
    if "model.layers.0.mlp.experts.gate_up_proj" not in sd:
        pytest.skip("this transformers version stores Mixtral experts unfused; the mapping below is for v5")
    new = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "head.weight": sd["lm_head.weight"]}
    for i in range(2):
        p = f"model.layers.{i}."
        for x in "qkvo":
            new[f"layers.{i}.attn.{x}_proj.weight"] = sd[p + f"self_attn.{x}_proj.weight"]
        new[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        new[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        new[f"layers.{i}.moe.router.weight"] = sd[p + "mlp.gate.weight"]
        # The same layout: gate_up (E, 2 ffn, h) with the gate rows first, down (E, h, ffn).
        new[f"layers.{i}.moe.experts.gate_up_proj"] = sd[p + "mlp.experts.gate_up_proj"]
        new[f"layers.{i}.moe.experts.down_proj"] = sd[p + "mlp.experts.down_proj"]
    ours.load_state_dict(new)
    # float32, same maths in a different order (observed max difference 7e-8).
    torch.testing.assert_close(ours.eval()(inputs["input_ids"]), hf.eval()(input_ids=inputs["input_ids"]).logits,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_experts_match_hugging_face_experts(implementation: str) -> None:
    """Our Experts (no capacity) and HF's MixtralExperts compute the same on the same weights and routing."""
    tf = pytest.importorskip("transformers", reason="transformers is the optional dev extra")
    torch.manual_seed(0)
    cfg = MixtralConfig(**TINY)
    ours = Experts(cfg)
    hf_cfg = tf.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                              experts_implementation=implementation)
    hf_cfg._experts_implementation_internal = implementation   # as a PreTrainedModel would set it
    theirs = tf.models.mixtral.modeling_mixtral.MixtralExperts(hf_cfg)
    theirs.load_state_dict(ours.state_dict())
    hidden = torch.randn(32, 32)
    weights, index = torch.softmax(torch.randn(32, 4), -1).topk(2, dim=-1)
    # float32 (torch's grouped_mm has no float64 kernel): the same products summed in another
    # order differ by a few ulps (observed <= 5e-10 on outputs of ~2e-3); 1e-6 leaves a wide margin.
    torch.testing.assert_close(ours(hidden, index, weights), theirs(hidden, index, weights), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", [{"top_k": 5}, {"num_experts": 0}, {"capacity_factor": 0.0},
                                 {"capacity_factor": True}, {"capacity_factor": "1"}, {"kv_heads": 3}])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ConfigError):
        MixtralConfig(**{**TINY, **bad})
