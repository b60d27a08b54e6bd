"""The named-model registry: every name builds on meta with the size its name says."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import ConfigError
from autopar.models import (bert_param_count, build, describe, gpt_param_count, mixtral_param_count, names,
                            t5_param_count)
from autopar.models.registry import REGISTRY

# Published sizes. The tolerance is 10% as these are rounded marketing numbers
# (GPT-3 "175B" is 174.6B with V=51200; GPT-2 XL "1.5B" is 1.56B).
EXPECTED = {
    "gpt-tiny": gpt_param_count(REGISTRY["gpt-tiny"].config),
    "gpt2-small": 124e6, "gpt2-xl": 1.5e9, "gpt3-175b": 175e9,
    "llama2-7b": 6.7e9, "llama3-8b": 8.0e9, "llama3-70b": 70.6e9, "llama3-405b": 405e9,
    "resnet50": 25.6e6, "mlp-small": 19_792, "small-cnn": 5_266,
    "bert-tiny": bert_param_count(REGISTRY["bert-tiny"].config), "bert-base": 110e6,
    "t5-tiny": t5_param_count(REGISTRY["t5-tiny"].config), "t5-base": 223e6,
    "mixtral-tiny": mixtral_param_count(REGISTRY["mixtral-tiny"].config), "mixtral-8x7b": 46.7e9,
    "deepseek-v3-shaped": 671e9,   # DeepSeek-V3's published total (MLA, a shared expert and 3 dense layers aside)
}


def test_names() -> None:
    assert set(names()) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builds_on_meta_with_expected_size(name: str) -> None:
    model, inputs = build(name, batch_size=2)
    params = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.float32 for p in params)
    count = sum(p.numel() for p in params)
    assert abs(count - EXPECTED[name]) <= 0.1 * EXPECTED[name], f"{name}: {count:,}"
    tensors = inputs.values() if isinstance(inputs, dict) else inputs
    assert all(t.is_meta and t.shape[0] == 2 for t in tensors)
    assert describe(name).startswith(name)


def test_seq_len_override() -> None:
    _, inputs = build("llama3-8b", seq_len=128)
    assert inputs["input_ids"].shape == (1, 128)
    model, inputs = build("gpt-tiny", seq_len=16, device="cpu")
    assert model.embed.pos.num_embeddings == 16
    assert model(**inputs).shape == ()


def test_registry_gpt_exports() -> None:
    model, inputs = build("gpt-tiny", batch_size=2, dtype=torch.bfloat16)
    torch.export.export(model.train(), (), inputs, strict=False)


def test_errors() -> None:
    with pytest.raises(ConfigError, match="llama3-8b"):
        build("gpt5")
    with pytest.raises(ConfigError):
        describe("gpt5")
    with pytest.raises(ConfigError, match="seq_len"):
        build("resnet50", seq_len=128)
