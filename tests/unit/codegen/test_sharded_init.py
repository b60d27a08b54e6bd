"""Sharded initialisation's values (runtime/sharded_init.py): a meta model's tensors, one module at a
time, by the model's own init, seeded per module; the same values whoever asks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar import ConfigError
from autopar.models import GPTConfig, build_gpt
from autopar.models.hf import build_hf_gpt2, build_hf_llama
from autopar.runtime.sharded_init import Materializer, has_meta, module_seed

def _meta_gpt(layers: int = 2) -> nn.Module:
    return build_gpt(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=layers, seq_len=8), device="meta")[0]


def test_init_weights_materialises_every_tensor_keeps_ties_and_follows_the_models_init() -> None:
    model = autopar.init_weights(_meta_gpt(), seed=3)
    assert not has_meta(model)
    params = dict(model.named_parameters())
    assert all(not torch.isnan(p).any() for p in params.values())
    assert model.head.weight is model.embed.tok.weight          # tied: one tensor
    # the model's own init: Normal(0, 0.02) weights, zero biases, LayerNorm (1, 0)
    assert abs(model.blocks[0].mlp.fc1.weight.std().item() - 0.02) < 0.004
    assert all(torch.all(m.bias == 0) for m in model.modules() if isinstance(m, nn.Linear) and m.bias is not None)
    assert all(torch.all(m.weight == 1) for m in model.modules() if isinstance(m, nn.LayerNorm))


def test_values_depend_on_the_seed_and_module_name_only() -> None:
    a = Materializer(_meta_gpt(layers=2), seed=0)
    b = Materializer(_meta_gpt(layers=4), seed=0)   # another model around the same modules
    name = "blocks.1.attn.qkv.weight"
    assert torch.equal(a.tensor(name), b.tensor(name))
    b.tensor("embed.tok.weight")                    # asking for others in between changes nothing
    assert torch.equal(a.tensor(name), b.tensor(name))
    assert torch.equal(a.tensor("head.weight"), a.tensor("embed.tok.weight"))   # a tie's alias
    assert not torch.equal(a.tensor(name), Materializer(_meta_gpt(), seed=1).tensor(name))
    assert module_seed(0, "blocks.1") != module_seed(0, "blocks.10") != module_seed(1, "blocks.1")
    before = torch.random.get_rng_state()
    a.tensor("blocks.0.ln1.weight")
    assert torch.equal(before, torch.random.get_rng_state())   # the caller's generator is left alone


def test_hugging_face_init_and_buffers_match_a_model_built_on_the_cpu() -> None:
    meta, _ = build_hf_llama(layers=2, hidden=32, heads=4, vocab=64, seq_len=8, device="meta")
    real, _ = build_hf_llama(layers=2, hidden=32, heads=4, vocab=64, seq_len=8)
    autopar.init_weights(meta, seed=0)
    for name, buf in real.named_buffers():          # rotary frequencies: computed, not drawn
        assert torch.equal(dict(meta.named_buffers())[name], buf), name
    std = real.config.initializer_range
    assert abs(meta.model.layers[0].mlp.up_proj.weight.std().item() - std) < 0.3 * std
    assert torch.all(meta.model.norm.weight == 1)
    # GPT-2's block re-initialises its c_proj with a depth-scaled std: the ancestors' init runs too
    gpt2, _ = build_hf_gpt2(layers=2, hidden=64, heads=4, vocab=64, seq_len=8, device="meta")
    autopar.init_weights(gpt2, seed=0)
    scaled = gpt2.config.initializer_range / (2 * gpt2.config.n_layer) ** 0.5
    c_proj = gpt2.transformer.h[0].attn.c_proj.weight
    assert abs(c_proj.std().item() - scaled) < 0.3 * scaled


class _Raw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))   # no reset_parameters, no _init_weights covers it

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_tensor_no_init_sets_is_named_with_the_fix() -> None:
    with torch.device("meta"):
        model = _Raw()
    mat = Materializer(model)
    assert mat.tensor("lin.weight").shape == (4, 4)
    with pytest.raises(ConfigError, match=r"scale \(_Raw\).*reset_parameters.*_init_weights"):
        mat.tensor("scale")
    done = autopar.init_weights(model, init=lambda m: nn.init.ones_(m.scale) if isinstance(m, _Raw) else None)
    assert torch.all(done.scale == 1)
    with pytest.raises(ConfigError, match="init_seed must be an int"):
        Materializer(model, seed=1.5)
