"""The Hugging Face models the planning benches pass as users pass them: transformers' own classes at
GPT-3 175B's shape (``GPT2LMHeadModel``, sequence 2048) and Llama-3 405B's (``LlamaForCausalLM``,
sequence 8192), built on the meta device in bf16 with SDPA attention, with a batch-1 example.
Used by bench/solver_scaling.py and bench/capture_repeat.py (in their child processes)."""

from __future__ import annotations

import os
from typing import Any

import torch

NAMES = ("gpt2", "llama")


def build(name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(model on meta, example inputs) for ``name`` in :data:`NAMES`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        if name == "gpt2":
            config = transformers.GPT2Config(n_embd=12288, n_layer=96, n_head=96, n_positions=2048,
                                             vocab_size=51200, use_cache=False, attn_implementation="sdpa")
            model, seq = transformers.GPT2LMHeadModel(config).to(torch.bfloat16), 2048
        elif name == "llama":
            config = transformers.LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                              num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                                              max_position_embeddings=8192, use_cache=False,
                                              attn_implementation="sdpa")
            model, seq = transformers.LlamaForCausalLM(config).to(torch.bfloat16), 8192
        else:
            raise ValueError(f"unknown HF shape {name!r}; known: {NAMES}")
        ids = torch.zeros(1, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}
