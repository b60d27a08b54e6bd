"""Hugging Face transformers (v5) models built from configs with random weights; nothing is downloaded.

Each builder returns ``(model, inputs)`` with ``inputs`` a dict of keyword tensors
(``input_ids``, ``labels``, and ``attention_mask`` for BERT) such that
``model(**inputs).loss`` is the training loss. The causal models shift ``labels``
inside (their loss covers the first s - 1 positions); BERT's example labels are a
target at every position (no -100 masking), so every token counts.

transformers is an optional extra (``pip install autopar[dev]``): it is imported
inside the builders, and a missing install raises ConfigError. KV caches are off
(``use_cache=False``): training does not use them and they are no exportable output.

The mixture-of-experts builders (Mixtral, Qwen2-MoE, Qwen3-MoE) take
``experts_implementation``: transformers' name of the experts dispatch, passed to the
config (``PretrainedConfig(experts_implementation=...)``, the same keyword
``from_pretrained`` takes; ``model.set_experts_implementation`` switches a built model).
"grouped_mm" (transformers' default) sorts the T*k assignments by expert and runs one
grouped GEMM; "batched_mm" gathers each assignment's expert weights and runs a batched
matrix-vector product; "eager" loops over the experts hit, which torch.export cannot
trace (capture then exports it as "grouped_mm": autopar/capture/moe.py). Their router
aux loss is off (``output_router_logits=False``, the config default).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

from ._common import check_choice, check_int, check_probability, construct, random_tokens
from ..errors import ConfigError

AttnImplementation = Literal["sdpa", "eager"]
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager")
ExpertsImplementation = Literal["grouped_mm", "batched_mm", "eager"]
EXPERTS_IMPLEMENTATIONS: tuple[str, ...] = ("grouped_mm", "batched_mm", "eager")

GPT2_DROPOUT_FIELDS: tuple[str, ...] = ("resid_pdrop", "embd_pdrop", "attn_pdrop",
                                        "summary_first_dropout")
LLAMA_DROPOUT_FIELDS: tuple[str, ...] = ("attention_dropout",)
MOE_DROPOUT_FIELDS: tuple[str, ...] = ("attention_dropout",)
GPT_NEOX_DROPOUT_FIELDS: tuple[str, ...] = ("attention_dropout", "hidden_dropout")
BERT_DROPOUT_FIELDS: tuple[str, ...] = ("hidden_dropout_prob", "attention_probs_dropout_prob",
                                        "classifier_dropout")


def _transformers() -> ModuleType:
    """Import transformers offline, or raise ConfigError saying how to install it."""
    # These builders only instantiate configs; make sure nothing tries the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("the Hugging Face model builders need transformers: "
                          "pip install transformers (or pip install autopar[dev])") from exc
    return transformers


def _common_kwargs(dropout: float | None, fields: tuple[str, ...], attn_implementation: str,
                   vocab: int) -> dict[str, Any]:
    """Config keywords every builder passes: attention kernel, no cache, token ids in range, dropout."""
    check_choice("attn_implementation", attn_implementation, ATTN_IMPLEMENTATIONS)
    check_int("vocab", vocab, 2)
    kwargs: dict[str, Any] = dict(attn_implementation=attn_implementation, use_cache=False,
                                  bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    if dropout is not None:
        check_probability("dropout", dropout)
        kwargs.update({name: float(dropout) for name in fields})
    return kwargs


def _check_sizes(**sizes: int) -> None:
    """Every size is a positive int, and ``heads`` divides ``hidden`` (``kv_heads`` divides ``heads``)."""
    for name, value in sizes.items():
        check_int(name, value)
    if sizes["hidden"] % sizes["heads"] != 0:
        raise ConfigError(f"hidden={sizes['hidden']} is not divisible by heads={sizes['heads']}: "
                          f"choose heads that divide hidden")
    if "kv_heads" in sizes and sizes["heads"] % sizes["kv_heads"] != 0:
        raise ConfigError(f"heads={sizes['heads']} is not divisible by "
                          f"kv_heads={sizes['kv_heads']}: choose kv_heads that divide heads")


def _token_inputs(batch_size: int, seq_len: int, vocab: int,
                  device: torch.device | str) -> dict[str, torch.Tensor]:
    """Example ``input_ids`` and ``labels`` (int64, batch_size x seq_len, fixed seed)."""
    return {
        "input_ids": random_tokens(batch_size, seq_len, vocab, device),
        "labels": random_tokens(batch_size, seq_len, vocab, device, offset=1),
    }


def build_hf_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256,
                  seq_len: int = 32, batch_size: int = 2, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32, dropout: float | None = None,
                  attn_implementation: AttnImplementation = "sdpa",
                  ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``GPT2LMHeadModel`` (tied embeddings, n_positions = seq_len) and ``{input_ids, labels}``.

    ``dropout`` None keeps the config defaults (0.1); a float sets every dropout field.
    """
    tf = _transformers()
    _check_sizes(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len)
    config = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                           n_positions=seq_len, tie_word_embeddings=True,
                           **_common_kwargs(dropout, GPT2_DROPOUT_FIELDS, attn_implementation,
                                            vocab))
    model = construct(lambda: tf.GPT2LMHeadModel(config), device, dtype)
    # The class name matches no entry of transformers' loss table; say which loss it is.
    model.loss_type = "ForCausalLM"
    return model.train(), _token_inputs(batch_size, seq_len, vocab, device)


def build_hf_llama(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                   ffn_hidden: int = 128, vocab: int = 256, seq_len: int = 32, batch_size: int = 2,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   dropout: float | None = None, attn_implementation: AttnImplementation = "sdpa",
                   ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``LlamaForCausalLM`` with grouped-query attention (kv_heads < heads) and ``{input_ids, labels}``.

    ``dropout`` None keeps the config default (attention_dropout = 0.0); a float sets it.
    """
    tf = _transformers()
    _check_sizes(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                 ffn_hidden=ffn_hidden, seq_len=seq_len)
    config = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, intermediate_size=ffn_hidden,
                            vocab_size=vocab, max_position_embeddings=seq_len,
                            tie_word_embeddings=False,
                            **_common_kwargs(dropout, LLAMA_DROPOUT_FIELDS, attn_implementation,
                                            vocab))
    model = construct(lambda: tf.LlamaForCausalLM(config), device, dtype)
    return model.train(), _token_inputs(batch_size, seq_len, vocab, device)


def build_hf_gpt_neox(layers: int = 2, hidden: int = 64, heads: int = 4, ffn_hidden: int | None = None,
                      vocab: int = 256, seq_len: int = 32, batch_size: int = 2,
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                      dropout: float | None = None, attn_implementation: AttnImplementation = "sdpa",
                      ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``GPTNeoXForCausalLM`` (parallel attention + MLP residual, partial rotary embeddings, untied head;
    ``ffn_hidden`` defaults to 4 x hidden) and ``{input_ids, labels}``.

    ``dropout`` None keeps the config defaults (0.0); a float sets both dropout fields.
    """
    tf = _transformers()
    ffn_hidden = 4 * hidden if ffn_hidden is None else ffn_hidden
    _check_sizes(layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden, seq_len=seq_len)
    config = tf.GPTNeoXConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                              intermediate_size=ffn_hidden, vocab_size=vocab, max_position_embeddings=seq_len,
                              tie_word_embeddings=False,
                              **_common_kwargs(dropout, GPT_NEOX_DROPOUT_FIELDS, attn_implementation, vocab))
    model = construct(lambda: tf.GPTNeoXForCausalLM(config), device, dtype)
    return model.train(), _token_inputs(batch_size, seq_len, vocab, device)


def build_hf_bert(layers: int = 2, hidden: int = 64, heads: int = 4, ffn_hidden: int = 256,
                  vocab: int = 256, seq_len: int = 32, batch_size: int = 2,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  dropout: float | None = None, attn_implementation: AttnImplementation = "sdpa",
                  ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``BertForMaskedLM`` and ``{input_ids, attention_mask (all ones), labels}``.

    ``dropout`` None keeps the config defaults (0.1); a float sets every dropout field.
    """
    tf = _transformers()
    _check_sizes(layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden, seq_len=seq_len)
    config = tf.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           intermediate_size=ffn_hidden, vocab_size=vocab,
                           max_position_embeddings=seq_len,
                           **_common_kwargs(dropout, BERT_DROPOUT_FIELDS, attn_implementation,
                                            vocab))
    model = construct(lambda: tf.BertForMaskedLM(config), device, dtype)
    inputs = _token_inputs(batch_size, seq_len, vocab, device)
    inputs = {"input_ids": inputs["input_ids"],
              "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long, device=device),
              "labels": inputs["labels"]}
    return model.train(), inputs


def _moe_sizes(layers: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, num_experts: int,
               top_k: int, seq_len: int, experts_implementation: str) -> None:
    """The sizes of a MoE decoder are positive, heads divide, ``top_k <= num_experts``, a known dispatch."""
    _check_sizes(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn_hidden,
                 num_experts=num_experts, top_k=top_k, seq_len=seq_len)
    if top_k > num_experts:
        raise ConfigError(f"top_k={top_k} is out of range: it must be <= num_experts={num_experts}")
    check_choice("experts_implementation", experts_implementation, EXPERTS_IMPLEMENTATIONS)


def build_hf_mixtral(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     ffn_hidden: int = 128, num_experts: int = 4, top_k: int = 2, vocab: int = 256,
                     seq_len: int = 32, batch_size: int = 2, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32, dropout: float | None = None,
                     attn_implementation: AttnImplementation = "sdpa",
                     experts_implementation: ExpertsImplementation = "grouped_mm",
                     ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``MixtralForCausalLM``: GQA decoder whose MLPs are ``num_experts`` SwiGLU experts of size
    ``ffn_hidden``, ``top_k`` per token (renormalised softmax weights), and ``{input_ids, labels}``.

    ``dropout`` None keeps the config default (attention_dropout = 0.0); a float sets it.
    """
    tf = _transformers()
    _moe_sizes(layers, hidden, heads, kv_heads, ffn_hidden, num_experts, top_k, seq_len, experts_implementation)
    config = tf.MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, intermediate_size=ffn_hidden,
                              num_local_experts=num_experts, num_experts_per_tok=top_k, vocab_size=vocab,
                              max_position_embeddings=seq_len, tie_word_embeddings=False,
                              experts_implementation=experts_implementation,
                              **_common_kwargs(dropout, MOE_DROPOUT_FIELDS, attn_implementation, vocab))
    model = construct(lambda: tf.MixtralForCausalLM(config), device, dtype)
    return model.train(), _token_inputs(batch_size, seq_len, vocab, device)


def build_hf_qwen2_moe(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                       ffn_hidden: int = 96, shared_ffn_hidden: int = 128, num_experts: int = 4, top_k: int = 2,
                       vocab: int = 256, seq_len: int = 32, batch_size: int = 2,
                       device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       dropout: float | None = None, attn_implementation: AttnImplementation = "sdpa",
                       experts_implementation: ExpertsImplementation = "grouped_mm",
                       ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``Qwen2MoeForCausalLM``: every layer's MLP is ``num_experts`` SwiGLU experts of size ``ffn_hidden``
    (``moe_intermediate_size``), ``top_k`` per token (weights not renormalised, the config default),
    plus a sigmoid-gated shared expert of size ``shared_ffn_hidden``; and ``{input_ids, labels}``.

    ``dropout`` None keeps the config default (attention_dropout = 0.0); a float sets it.
    """
    tf = _transformers()
    _moe_sizes(layers, hidden, heads, kv_heads, ffn_hidden, num_experts, top_k, seq_len, experts_implementation)
    check_int("shared_ffn_hidden", shared_ffn_hidden)
    config = tf.Qwen2MoeConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, moe_intermediate_size=ffn_hidden,
                               shared_expert_intermediate_size=shared_ffn_hidden, intermediate_size=shared_ffn_hidden,
                               num_experts=num_experts, num_experts_per_tok=top_k, vocab_size=vocab,
                               max_position_embeddings=seq_len, tie_word_embeddings=False,
                               experts_implementation=experts_implementation,
                               **_common_kwargs(dropout, MOE_DROPOUT_FIELDS, attn_implementation, vocab))
    model = construct(lambda: tf.Qwen2MoeForCausalLM(config), device, dtype)
    return model.train(), _token_inputs(batch_size, seq_len, vocab, device)


def build_hf_qwen3_moe(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                       ffn_hidden: int = 96, num_experts: int = 4, top_k: int = 2, vocab: int = 256,
                       seq_len: int = 32, batch_size: int = 2, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, dropout: float | None = None,
                       attn_implementation: AttnImplementation = "sdpa",
                       experts_implementation: ExpertsImplementation = "grouped_mm",
                       ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``Qwen3MoeForCausalLM`` (q/k norms, head_dim = hidden / heads): every layer's MLP is
    ``num_experts`` SwiGLU experts of size ``ffn_hidden``, ``top_k`` per token, no shared expert;
    and ``{input_ids, labels}``.

    ``dropout`` None keeps the config default (attention_dropout = 0.0); a float sets it.
    """
    tf = _transformers()
    if not hasattr(tf, "Qwen3MoeForCausalLM"):
        raise ConfigError(f"transformers {tf.__version__} has no Qwen3-MoE: pip install 'transformers>=4.51'")
    _moe_sizes(layers, hidden, heads, kv_heads, ffn_hidden, num_experts, top_k, seq_len, experts_implementation)
    config = tf.Qwen3MoeConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=hidden // heads,
                               moe_intermediate_size=ffn_hidden, intermediate_size=ffn_hidden,
                               num_experts=num_experts, num_experts_per_tok=top_k, vocab_size=vocab,
                               max_position_embeddings=seq_len, tie_word_embeddings=False,
                               experts_implementation=experts_implementation,
                               **_common_kwargs(dropout, MOE_DROPOUT_FIELDS, attn_implementation, vocab))
    model = construct(lambda: tf.Qwen3MoeForCausalLM(config), device, dtype)
    return model.train(), _token_inputs(batch_size, seq_len, vocab, device)
