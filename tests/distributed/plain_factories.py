"""A model and batch factory that import only torch and transformers, and an import hook that refuses
autopar (test_standalone.py and bench/cuda_check.py run a compiled program where autopar cannot be
imported)."""

from __future__ import annotations

import torch

VOCAB, SEQ = 256, 16


def llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def llama_batch(step: int, global_batch: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)}


def llama4():
    """Four blocks: one for each of ZB-V's chunks at pp=2."""
    return llama(layers=4)


def llama_on_meta():
    with torch.device("meta"):
        return llama()


REFUSE_AUTOPAR = '''import sys


class _RefuseAutopar:
    def find_spec(self, name, path=None, target=None):
        if name == "autopar" or name.startswith("autopar."):
            raise ImportError("autopar cannot be imported here (a compiled program runs with torch alone)")
        return None


sys.meta_path.insert(0, _RefuseAutopar())
'''
"""A sitecustomize.py that refuses ``import autopar`` in every process started with its folder on
PYTHONPATH (test_standalone.py, bench/cuda_check.py)."""


def mixtral():
    """A tiny Hugging Face Mixtral (4 experts, top 2), for what a standalone folder refuses."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                           num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


class Tagger(torch.nn.Module):
    """A per-token regressor (plain torch): ``forward(x)`` returns predictions and no loss; its loss
    (tagger_loss) reads the batch's ``targets`` and ``mask``, keys forward does not take."""

    def __init__(self, width: int = 16, hidden: int = 32, depth: int = 2, tags: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(width), torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
            for _ in range(depth))
        self.head = torch.nn.Linear(width, tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def tagger():
    return Tagger()


def tagger_batch(step: int, global_batch: int) -> dict:
    g = torch.Generator().manual_seed(200 + step)
    return {"x": torch.randn(global_batch, SEQ, 16, generator=g), "targets": torch.randn(global_batch, SEQ, 4, generator=g),
            "mask": torch.rand(global_batch, SEQ, generator=g) > 0.25}


def tagger_loss(out: torch.Tensor, inputs: dict) -> torch.Tensor:
    """Each sample's squared error over the tokens its mask keeps, averaged over the samples (so the mean of
    equal micro-batches' losses is the whole batch's)."""
    mask = inputs["mask"].float()
    per_sample = ((out - inputs["targets"]).pow(2).mean(-1) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sample.mean()
