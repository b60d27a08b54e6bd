"""A model and batch factory that import only torch and transformers (test_standalone.py runs a compiled
program where autopar cannot be imported)."""

from __future__ import annotations

import torch

VOCAB, SEQ = 256, 16


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def llama_batch(step: int, global_batch: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)}


def llama_on_meta():
    with torch.device("meta"):
        return llama()
