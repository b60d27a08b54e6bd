"""Named models: ``build("llama3-8b", device="meta")`` for demos, tests and benchmarks.

The transformer entries use the hand-written :mod:`.gpt`, :mod:`.llama`,
:mod:`.bert`, :mod:`.t5` and :mod:`.moe` models (quick to build on "meta" and to
export; no transformers dependency). Vocabulary sizes are the
published ones, unpadded (50257 for GPT-2 is not divisible by any tensor-parallel
degree > 1; benchmarks that need padding define their own configs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..errors import ConfigError
from .bert import BERTConfig, build_bert
from .cnn import build_resnet
from .gpt import GPTConfig, build_gpt
from .llama import LlamaConfig, build_llama
from .mlp import build_mlp
from .moe import MixtralConfig, build_mixtral
from .t5 import T5Config, build_t5

Inputs = dict[str, torch.Tensor] | tuple[torch.Tensor, ...]
TransformerConfig = GPTConfig | LlamaConfig | MixtralConfig | BERTConfig | T5Config

_BUILDERS: Mapping[type, Callable[..., tuple[nn.Module, Inputs]]] = MappingProxyType({
    GPTConfig: build_gpt, LlamaConfig: build_llama, MixtralConfig: build_mixtral,
    BERTConfig: build_bert, T5Config: build_t5,
})
"""The builder of each transformer config type (exact type: MixtralConfig subclasses LlamaConfig)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One registry entry."""

    name: str
    """Registry name."""
    description: str
    """One line: what the model is and its size."""
    config: TransformerConfig | None = None
    """Transformer config (its seq_len is the default sequence length; T5's is the encoder's),
    or None for the others."""
    builder: Callable[..., tuple[nn.Module, Any]] | None = None
    """For non-transformer entries: ``builder(batch_size=, device=, dtype=)``."""


def _gpt(name: str, desc: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, description=desc, config=GPTConfig(**kw))


def _llama(name: str, desc: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, description=desc, config=LlamaConfig(**kw))


def _mixtral(name: str, desc: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, description=desc, config=MixtralConfig(**kw))


def _bert(name: str, desc: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, description=desc, config=BERTConfig(**kw))


def _t5(name: str, desc: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, description=desc, config=T5Config(**kw))


_SPECS: tuple[ModelSpec, ...] = (
    _gpt("gpt-tiny", "GPT, 2 layers, h=64, 4 heads, V=512, s=32 (tests)",
         layers=2, hidden=64, heads=4, vocab_size=512, seq_len=32),
    _gpt("gpt2-small", "GPT-2 small: l=12, h=768, 12 heads, V=50257, s=1024, tied head (124M)",
         layers=12, hidden=768, heads=12, vocab_size=50257, seq_len=1024),
    _gpt("gpt2-xl", "GPT-2 XL: l=48, h=1600, 25 heads, V=50257, s=1024, tied head (1.56B)",
         layers=48, hidden=1600, heads=25, vocab_size=50257, seq_len=1024),
    _gpt("gpt3-175b", "GPT-3: l=96, h=12288, 96 heads, V=51200, s=2048 (175B)",
         layers=96, hidden=12288, heads=96, vocab_size=51200, seq_len=2048),
    _llama("llama2-7b", "Llama 2 7B: l=32, h=4096, 32 heads (MHA), ffn 11008, V=32000, s=4096 (6.7B)",
           layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab_size=32000,
           seq_len=4096, rope_theta=10000.0),
    _llama("llama3-8b", "Llama 3 8B: l=32, h=4096, 32/8 kv heads, ffn 14336, V=128256, s=8192 (8.0B)",
           layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=128256,
           seq_len=8192),
    _llama("llama3-70b", "Llama 3 70B: l=80, h=8192, 64/8 kv heads, ffn 28672, V=128256, s=8192 (70.6B)",
           layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab_size=128256,
           seq_len=8192),
    _llama("llama3-405b", "Llama 3.1 405B: l=126, h=16384, 128/8 kv heads, ffn 53248, V=128256, s=8192",
           layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab_size=128256,
           seq_len=8192),
    _mixtral("mixtral-tiny", "Mixtral-style MoE, 2 layers, h=64, 4/2 kv heads, 4 experts top-2, "
             "capacity 1.0, V=512, s=32 (tests)",
             layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=512, seq_len=32,
             num_experts=4, top_k=2, capacity_factor=1.0),
    _mixtral("mixtral-8x7b", "Mixtral 8x7B: l=32, h=4096, 32/8 kv heads, 8 experts (ffn 14336) top-2, "
             "capacity 1.0, V=32000, s=4096 (46.7B, 12.9B active)",
             layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=32000,
             seq_len=4096, rope_theta=1e6, num_experts=8, top_k=2, capacity_factor=1.0),
    _mixtral("deepseek-v3-shaped", "DeepSeek-V3's shape as a Mixtral-style MoE: l=61, h=7168, 128 heads (MHA in "
             "place of MLA), 256 experts (ffn 2048) top-8, capacity 1.0, V=129280, s=4096; no shared expert or "
             "dense first layers (702B, 36B active)",
             layers=61, hidden=7168, heads=128, kv_heads=128, ffn_hidden=2048, vocab_size=129280, seq_len=4096,
             rope_theta=10000.0, num_experts=256, top_k=8, capacity_factor=1.0),
    _bert("bert-tiny", "BERT MLM, 2 layers, h=64, 4 heads, V=512, s=32 (tests)",
          layers=2, hidden=64, heads=4, vocab_size=512, seq_len=32),
    _bert("bert-base", "BERT-base MLM: l=12, h=768, 12 heads, ffn 3072, V=30522, s=512, tied decoder (110M)",
          layers=12, hidden=768, heads=12, ffn_hidden=3072, vocab_size=30522, seq_len=512, max_positions=512),
    _t5("t5-tiny", "T5 v1.0, 2+2 layers, h=64, 4 heads, ffn 128, V=512, s=32 encoder / 16 decoder (tests)",
        layers=2, hidden=64, heads=4, ffn_hidden=128, vocab_size=512, seq_len=32, decoder_seq_len=16),
    _t5("t5-base", "T5 v1.0 base: 12+12 layers, h=768, 12 heads x 64, ffn 3072 ReLU, V=32128, "
        "s=512 encoder / 128 decoder, tied head (223M)",
        layers=12, hidden=768, heads=12, head_dim=64, ffn_hidden=3072, vocab_size=32128, seq_len=512,
        decoder_seq_len=128),
    ModelSpec(name="resnet50",
              description="ResNet-50 v1.5, 224x224 images, 1000 classes (25.6M); returns logits",
              builder=lambda **kw: build_resnet("resnet50", **kw)),
    ModelSpec(name="mlp-small",
              description="MLP 32 -> 64 (x4 hidden blocks) -> 16 (19.8K); returns outputs",
              builder=build_mlp),
    ModelSpec(name="small-cnn",
              description="tiny ResNet: width 8, 2 BasicBlocks, 32x32 images, 10 classes (5.3K); logits",
              builder=lambda **kw: build_resnet("small", **kw)),
)

REGISTRY: Mapping[str, ModelSpec] = MappingProxyType({s.name: s for s in _SPECS})
"""Every built-in model by name (read-only)."""


def names() -> tuple[str, ...]:
    """The built-in model names, in registry order."""
    return tuple(REGISTRY)


def spec(name: str) -> ModelSpec:
    """The registry entry of ``name``; ConfigError listing the names if unknown."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(names())}") from None


def describe(name: str) -> str:
    """One line about ``name``: what it is and its size."""
    return f"{name}: {spec(name).description}"


def build(name: str, *, batch_size: int = 1, seq_len: int | None = None,
          device: torch.device | str = "meta",
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Inputs]:
    """Build the named model and its example inputs (batch on dim 0), on "meta" by default.

    ``seq_len`` overrides a transformer's sequence length (for GPT it also sizes the
    position embedding; for BERT it must stay within its 512 positions; for T5 it is the
    encoder's, the decoder keeps its own); it is an error for the models that take no sequence.
    """
    entry = spec(name)
    if entry.config is None:
        if seq_len is not None:
            raise ConfigError(f"model {name!r} takes no sequence: leave seq_len=None (got {seq_len})")
        return entry.builder(batch_size=batch_size, device=device, dtype=dtype)
    config = entry.config if seq_len is None else replace(entry.config, seq_len=seq_len)
    return _BUILDERS[type(config)](config, batch_size=batch_size, device=device, dtype=dtype)
