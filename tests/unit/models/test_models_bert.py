"""The hand-written BERT (MLM): numerics on CPU and against Hugging Face, capture, size, planning."""

from __future__ import annotations

import math
import os

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.errors import ConfigError
from autopar.models import build
from autopar.models.bert import BERT, BERTConfig, bert_param_count, build_bert

TINY = dict(hidden=64, heads=4, layers=2, vocab_size=512, seq_len=32)


def test_forward_backward_cpu() -> None:
    torch.manual_seed(0)
    model, inputs = build_bert(BERTConfig(**TINY), batch_size=2)
    loss = model(**inputs)
    # Weights ~ N(0, 0.02) and a LayerNorm before the decoder: logits of std ~0.02*sqrt(64) = 0.16,
    # so the loss is ln V plus a few hundredths (observed 6.31 vs ln 512 = 6.24).
    assert abs(loss.item() - math.log(512)) < 0.3
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model(inputs["input_ids"]).shape == (2, 32, 512)
    assert model.mlm.decoder.weight is model.embed.word.weight


def test_mlm_labels() -> None:
    _, inputs = build_bert(BERTConfig(**TINY), batch_size=3)
    ids, labels = inputs["input_ids"], inputs["labels"]
    kept = labels != -100
    assert (kept.sum(1) == math.ceil(0.15 * 32)).all()          # the same count in every row
    assert torch.equal(labels[kept], ids[kept])
    _, full = build_bert(BERTConfig(**TINY), batch_size=2, mask_fraction=1.0)
    assert torch.equal(full["labels"], full["input_ids"])
    _, meta = build_bert(BERTConfig(**TINY), batch_size=2, device="meta")
    assert meta["labels"].is_meta and meta["labels"].shape == (2, 32)
    for bad in (0.0, 1.5, True):
        with pytest.raises(ConfigError, match="mask_fraction"):
            build_bert(BERTConfig(**TINY), device="meta", mask_fraction=bad)


def test_bidirectional() -> None:
    torch.manual_seed(0)
    model = BERT(BERTConfig(**TINY)).eval()
    ids = torch.randint(0, 512, (1, 32))
    changed = ids.clone()
    changed[:, 31] = (changed[:, 31] + 1) % 512
    assert not torch.allclose(model(changed)[:, 0], model(ids)[:, 0])   # position 0 sees the last token


def test_matches_hugging_face_bert() -> None:
    tf = pytest.importorskip("transformers", reason="transformers is the optional dev extra")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    ours, inputs = build_bert(BERTConfig(**TINY, max_positions=512), batch_size=2)
    hf = tf.BertForMaskedLM(tf.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=256))
    sd = hf.state_dict()
    names = {"embed.word": "bert.embeddings.word_embeddings", "embed.position": "bert.embeddings.position_embeddings",
             "embed.token_type": "bert.embeddings.token_type_embeddings", "embed.norm": "bert.embeddings.LayerNorm",
             "mlm.dense": "cls.predictions.transform.dense", "mlm.norm": "cls.predictions.transform.LayerNorm"}
    for i in range(2):
        hf_layer = f"bert.encoder.layer.{i}."
        names.update({f"layers.{i}.{ours_name}": hf_layer + hf_name for ours_name, hf_name in [
            ("attn.query", "attention.self.query"), ("attn.key", "attention.self.key"),
            ("attn.value", "attention.self.value"), ("attn.out", "attention.output.dense"),
            ("attn_norm", "attention.output.LayerNorm"), ("mlp.fc1", "intermediate.dense"),
            ("mlp.fc2", "output.dense"), ("mlp_norm", "output.LayerNorm")]})
    state = {f"{o}.{w}": sd[f"{h}.{w}"] for o, h in names.items() for w in ("weight", "bias") if f"{h}.{w}" in sd}
    state["mlm.decoder.bias"] = sd["cls.predictions.bias"]
    missing = ours.load_state_dict(state, strict=False).missing_keys
    assert missing == ["mlm.decoder.weight"]                      # tied to embed.word.weight, loaded there
    ours.eval(), hf.eval()
    # float32, same maths (observed identical losses); 1e-5 covers kernel ordering differences.
    torch.testing.assert_close(ours(inputs["input_ids"]), hf(input_ids=inputs["input_ids"]).logits,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(**inputs), hf(**inputs).loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [{}, {"ffn_hidden": 96}, {"max_positions": 512}, {"type_vocab_size": 1}])
def test_param_count_is_exact(overrides: dict) -> None:
    cfg = BERTConfig(**{**TINY, **overrides})
    model, _ = build_bert(cfg, device="meta", dtype=torch.bfloat16)
    assert bert_param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_bert_base_size_on_meta() -> None:
    model, inputs = build("bert-base", batch_size=2)
    count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters()) and inputs["input_ids"].shape == (2, 512)
    # Hugging Face's BertForMaskedLM("bert-base-uncased") has 109,514,298; the paper says 110M.
    assert count == 109_514_298 and abs(count - 110e6) < 0.01 * 110e6


def test_capture_finds_repeated_layers() -> None:
    model, inputs = build("bert-tiny", batch_size=2)
    graph = capture(model, inputs)
    blocks = [layer for layer in graph.layers if layer.is_block]
    assert [layer.name for layer in blocks] == ["layers.0", "layers.1"]
    assert len({layer.signature for layer in blocks}) == 1
    assert "aten.scaled_dot_product_attention.default" in {n.target for n in graph.nodes}
    assert len({layer.name for layer in graph.layers}) == len(graph.layers)   # a plan names layers


def test_estimate_tiny() -> None:
    """Pipelined from batch-2 example inputs (tensor parallelism on this model, each layout the ILP's:
    tests/unit/solver/test_one_pricing_path.py)."""
    model, inputs = build("bert-tiny", batch_size=2)
    plan = autopar.estimate(model, autopar.Cluster.from_spec("1x8xA100-80GB"), inputs,
                            autopar.ParallelConfig(dp=4, pp=2), global_batch_size=16)
    assert plan.step_time > 0 and math.isfinite(plan.step_time) and plan.peak_memory > 0


@pytest.mark.parametrize("bad", [{"hidden": 66}, {"layers": 0}, {"dropout": 1.0}, {"seq_len": 64, "max_positions": 32},
                                 {"norm_eps": 0.0}, {"vocab_size": 2.5}])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ConfigError):
        BERTConfig(**{**TINY, **bad})
