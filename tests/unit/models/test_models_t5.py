"""The hand-written T5: numerics on CPU and against Hugging Face, causality, capture, size, planning."""

from __future__ import annotations

import math
import os

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.errors import ConfigError
from autopar.models import build
from autopar.models.t5 import T5, T5Config, build_t5, relative_position_bucket, shift_right, t5_param_count

TINY = dict(hidden=64, heads=4, ffn_hidden=128, layers=2, vocab_size=512, seq_len=32, decoder_seq_len=16)


@pytest.mark.parametrize("feed_forward", ["relu", "gated-gelu"])
def test_forward_backward_cpu(feed_forward: str) -> None:
    torch.manual_seed(0)
    model, inputs = build_t5(T5Config(**TINY, feed_forward=feed_forward), batch_size=2)
    loss = model(**inputs)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model(inputs["input_ids"], inputs["decoder_input_ids"]).shape == (2, 16, 512)


def test_inputs() -> None:
    model, inputs = build_t5(T5Config(**TINY), batch_size=3)
    assert inputs["input_ids"].shape == (3, 32) and inputs["labels"].shape == (3, 16)
    assert torch.equal(inputs["decoder_input_ids"], shift_right(inputs["labels"]))
    assert (inputs["decoder_input_ids"][:, 0] == 0).all()
    assert model.head.weight is model.encoder.embed.weight is model.decoder.embed.weight
    untied, _ = build_t5(T5Config(**TINY, tie_embeddings=False), device="meta")
    assert untied.head.weight is not untied.encoder.embed.weight
    assert untied.decoder.embed.weight is untied.encoder.embed.weight


def test_decoder_is_causal_and_encoder_is_not() -> None:
    torch.manual_seed(0)
    model = T5(T5Config(**TINY)).eval()
    ids, dec = torch.randint(0, 512, (1, 32)), torch.randint(0, 512, (1, 16))
    out = model(ids, dec)
    later = dec.clone()
    later[:, 8:] = (later[:, 8:] + 1) % 512
    torch.testing.assert_close(model(ids, later)[:, :8], out[:, :8])
    last_input = ids.clone()
    last_input[:, 31] = (last_input[:, 31] + 1) % 512
    assert not torch.allclose(model(last_input, dec)[:, 0], out[:, 0])   # every decoder position sees it


def test_relative_position_buckets() -> None:
    relative = torch.arange(-200, 201)                                  # key position - query position
    both = dict(zip(relative.tolist(), relative_position_bucket(relative, True, 32, 128).tolist()))
    causal = dict(zip(relative.tolist(), relative_position_bucket(relative, False, 32, 128).tolist()))
    # Bidirectional: 16 buckets per direction, the first 8 exact; keys after the query take 16..31.
    assert [both[r] for r in (0, -1, -7, 1, 7)] == [0, 1, 7, 17, 23]
    assert max(both[r] for r in range(-200, 1)) == 15 and max(both.values()) == 31
    # Causal: all 32 buckets for the past, the first 16 exact; the future is bucket 0 (masked anyway).
    assert [causal[r] for r in (0, -1, -15, 5)] == [0, 1, 15, 0]
    assert causal[-16] == 16 and causal[-200] == 31 and max(causal.values()) == 31
    past = [causal[-d] for d in range(201)]
    assert past == sorted(past)                                         # non-decreasing with distance


@pytest.mark.parametrize("feed_forward", ["relu", "gated-gelu"])
def test_matches_hugging_face_t5(feed_forward: str) -> None:
    tf = pytest.importorskip("transformers", reason="transformers is the optional dev extra")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    tied = feed_forward == "relu"                                       # v1.0 tied, v1.1 untied
    cfg = T5Config(**{**TINY, "decoder_layers": 3}, head_dim=8, relative_buckets=8, relative_max_distance=20,
                   feed_forward=feed_forward, tie_embeddings=tied)
    ours, inputs = build_t5(cfg, batch_size=2)
    hf = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=512, d_model=64, d_kv=8, d_ff=128, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, feed_forward_proj=feed_forward,
        tie_word_embeddings=tied))
    sd = hf.state_dict()
    names = {"encoder.embed.weight": "shared.weight", "encoder.final_norm.weight": "encoder.final_layer_norm.weight",
             "decoder.final_norm.weight": "decoder.final_layer_norm.weight"}
    for stack in ("encoder", "decoder"):
        hf_bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"  # HF: in block 0
        names[f"{stack}.rel_bias.embedding.weight"] = hf_bias
    if not tied:
        names["head.weight"] = "lm_head.weight"
    mlp = ("wi",) if tied else ("wi_0", "wi_1")
    for stack, blocks, attns in (("encoder", 2, (("attn", "0.SelfAttention", "attn_norm"),)),
                                 ("decoder", 3, (("self_attn", "0.SelfAttention", "self_attn_norm"),
                                                 ("cross_attn", "1.EncDecAttention", "cross_norm")))):
        for i in range(blocks):
            ours_p, hf_p = f"{stack}.blocks.{i}.", f"{stack}.block.{i}.layer."
            for attn, hf_attn, norm in attns:
                names.update({f"{ours_p}{attn}.{x}.weight": f"{hf_p}{hf_attn}.{x}.weight" for x in "qkvo"})
                names[f"{ours_p}{norm}.weight"] = f"{hf_p}{hf_attn[0]}.layer_norm.weight"
            ff = len(attns)                                              # index of the feed-forward sub-layer
            names[f"{ours_p}mlp_norm.weight"] = f"{hf_p}{ff}.layer_norm.weight"
            names.update({f"{ours_p}mlp.{w}.weight": f"{hf_p}{ff}.DenseReluDense.{w}.weight" for w in (*mlp, "wo")})
    result = ours.load_state_dict({k: sd[v] for k, v in names.items()}, strict=False)
    tied_keys = ["decoder.embed.weight"] + (["head.weight"] if tied else [])  # loaded through encoder.embed
    assert result.missing_keys == tied_keys and not result.unexpected_keys
    ours.eval(), hf.eval()
    # float32, same maths in a different order (observed max logit difference 1.3e-5 with the untied
    # head's unit-variance weights, whose logits reach ~+-50); 1e-4 relative covers it.
    torch.testing.assert_close(ours(inputs["input_ids"], inputs["decoder_input_ids"]),
                               hf(input_ids=inputs["input_ids"], decoder_input_ids=inputs["decoder_input_ids"]).logits,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours(**inputs), hf(**inputs).loss, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [{}, {"decoder_layers": 3}, {"head_dim": 8}, {"feed_forward": "gated-gelu"},
                                       {"tie_embeddings": False, "relative_buckets": 16}])
def test_param_count_is_exact(overrides: dict) -> None:
    cfg = T5Config(**{**TINY, **overrides})
    model, _ = build_t5(cfg, device="meta", dtype=torch.bfloat16)
    assert t5_param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_t5_base_size_on_meta() -> None:
    model, inputs = build("t5-base", batch_size=2)
    count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert inputs["input_ids"].shape == (2, 512) and inputs["decoder_input_ids"].shape == (2, 128)
    # Hugging Face's T5ForConditionalGeneration("t5-base") has 222,903,552 (the paper: "220M").
    assert count == 222_903_552
    _, short = build("t5-base", seq_len=256)
    assert short["input_ids"].shape == (1, 256) and short["labels"].shape == (1, 128)


def test_capture_finds_repeated_layers() -> None:
    model, inputs = build("t5-tiny", batch_size=2)
    graph = capture(model, inputs)
    blocks = [layer for layer in graph.layers if layer.is_block]
    assert [layer.name for layer in blocks] == ["encoder.blocks.0", "encoder.blocks.1",
                                                "decoder.blocks.0", "decoder.blocks.1"]
    encoder_sig, decoder_sig = blocks[0].signature, blocks[2].signature
    assert encoder_sig != decoder_sig
    assert [layer.signature for layer in blocks] == [encoder_sig] * 2 + [decoder_sig] * 2
    # A plan names its stages' layers: two layers of one name (one module called twice) could not be split.
    assert len({layer.name for layer in graph.layers}) == len(graph.layers)
    assert not graph.warnings


def test_estimate_tiny() -> None:
    """Pipelined from batch-2 example inputs (tensor parallelism on this model, each layout the ILP's:
    tests/unit/solver/test_one_pricing_path.py)."""
    model, inputs = build("t5-tiny", batch_size=2)
    plan = autopar.estimate(model, autopar.Cluster.from_spec("1x8xA100-80GB"), inputs,
                            autopar.ParallelConfig(dp=4, pp=2), global_batch_size=16)
    assert plan.step_time > 0 and math.isfinite(plan.step_time) and plan.peak_memory > 0


@pytest.mark.parametrize("bad", [{"hidden": 66}, {"layers": 0}, {"decoder_layers": 0}, {"feed_forward": "gelu"},
                                 {"relative_buckets": 2}, {"relative_max_distance": 8}, {"dropout": -0.1},
                                 {"tie_embeddings": 1}])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ConfigError):
        T5Config(**{**TINY, **bad})
