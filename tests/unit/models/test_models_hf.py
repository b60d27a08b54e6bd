"""Hugging Face builders: random-weight models from configs, training loss, export on meta."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download

import pytest
import torch

from autopar.errors import ConfigError
from autopar.models.hf import build_hf_bert, build_hf_gpt2, build_hf_llama

pytest.importorskip("transformers", reason="transformers is the optional dev extra")

BUILDERS = [build_hf_gpt2, build_hf_llama, build_hf_bert]


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda f: f.__name__)
def test_training_loss_cpu(builder) -> None:
    torch.manual_seed(0)
    model, inputs = builder()
    assert model.training
    assert inputs["input_ids"].shape == (2, 32)
    loss = model(**inputs).loss
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("builder", BUILDERS, ids=lambda f: f.__name__)
def test_export_train_mode_on_meta(builder, attn: str) -> None:
    model, inputs = builder(device="meta", attn_implementation=attn)
    assert model.config._attn_implementation == attn
    program = torch.export.export(model.train(), (), inputs, strict=False)
    loss = [n for n in program.graph.nodes if n.op == "output"][0].args[0][0]
    assert loss.meta["val"].shape == ()


def test_dropout_override() -> None:
    def dropouts(config) -> dict:
        return {k: v for k, v in config.to_dict().items()
                if ("drop" in k) and isinstance(v, (int, float))}

    for builder in BUILDERS:
        model, _ = builder(device="meta", dropout=0.0)
        assert dropouts(model.config) and set(dropouts(model.config).values()) == {0.0}, builder
    default, _ = build_hf_gpt2(device="meta")
    assert default.config.resid_pdrop == 0.1  # None keeps the config defaults


def test_model_specifics() -> None:
    gpt2, _ = build_hf_gpt2(device="meta", dtype=torch.bfloat16)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert gpt2.lm_head.weight.dtype == torch.bfloat16
    llama, _ = build_hf_llama(device="meta", heads=8, kv_heads=2)
    assert llama.config.num_key_value_heads == 2 < llama.config.num_attention_heads
    bert, inputs = build_hf_bert(device="meta", batch_size=3)
    assert set(inputs) == {"input_ids", "attention_mask", "labels"}
    assert inputs["attention_mask"].shape == (3, 32)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        build_hf_gpt2(attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError):
        build_hf_llama(heads=4, kv_heads=3)
    with pytest.raises(ConfigError):
        build_hf_bert(hidden=66, heads=4)
    with pytest.raises(ConfigError):
        build_hf_gpt2(dropout=1.5)


def test_missing_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ConfigError, match="pip install transformers"):
        build_hf_gpt2()
