"""Every Hugging Face decoder-only architecture is a target: capture + estimate on tiny random configs.

use_cache is left at its default (True), as users pass models: the capture keeps only the loss.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
tf = pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.solver import price  # noqa: E402
from autopar.solver import solve  # noqa: E402
from autopar.config import Precision  # noqa: E402
from autopar.solver.sharding_solver import ShardingSolver  # noqa: E402
from suite import ALL_CASES  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=64)
ARCHS = {
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "Mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    # four layers: Gemma2 alternates sliding-window and global attention, so with two of each both
    # kinds are repeated blocks, as in the real model (two different layers would be one ILP group)
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "num_hidden_layers": 4}),
    "OPT": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "Falcon": ("FalconConfig", "FalconForCausalLM", {}),
}


# The suite runs four of them (learned positions, parallel attention and MLP, fused QKV, GQA with
# biases); make bench all eight (AUTOPAR_ALL_CASES=1: Gemma2's two block kinds alone take 30 s,
# most of it in the sharding ILPs of a layer whose layouts all tie to a few bytes).
SUITE = ("Falcon", "GPTNeoX", "OPT", "Qwen2")


@pytest.mark.parametrize("arch", sorted(ARCHS) if ALL_CASES else SUITE)
def test_decoder_captures_with_cache_on(arch: str) -> None:
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(tf, config_cls)(**{**COMMON, **extra})
    assert config.use_cache  # as users pass them
    with torch.device("meta"):
        model = getattr(tf, model_cls)(config)
    ids = torch.randint(0, 256, (2, 16)).to("meta")
    graph = capture(model, {"input_ids": ids, "labels": ids})
    assert graph.param_numel == sum(p.numel() for p in model.parameters())
    assert len(graph.layers) >= 3  # embedding, the two decoder layers (one each, or one family), head
    assert graph.flops_fwd > 0 and graph.flops_bwd > 0
    # one ShardingSolver for the three (its layouts are cached per tp and variant)
    cluster = autopar.Cluster.from_spec("1x4xA100-80GB")
    sharding = ShardingSolver(graph, cluster, Precision.for_device(cluster.device.name))
    plan = price(graph, cluster, autopar.ParallelConfig(tp=2, dp=2), 8, sharding=sharding)
    assert plan.step_time > 0 and plan.fits
    # the solver (sharding ILP included) plans every family, free and with tensor parallelism pinned
    for fixed in (None, {"tp": 2, "pp": 2}):
        best, stats = solve(graph, cluster, 8, fixed=fixed, sharding=sharding)
        assert best.fits and best.config.devices == 4 and best.optimal and stats.ilp_stopped_early == 0
        if fixed:
            assert (best.config.tp, best.config.pp) == (2, 2) and best.sharding
