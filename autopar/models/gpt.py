"""A hand-written Megatron-style GPT (pre-LN decoder, learned positions, fused QKV, tied head).

Module tree (what capture, the cost model and codegen see)::

    GPT
      embed            GPTEmbedding: tok (Embedding V x h), pos (Embedding s x h), dropout
      blocks[i]        Block (pre-LN):
        ln1            LayerNorm(h)
        attn           Attention: qkv (Linear h -> 3h), attn_dropout, proj (Linear h -> h), dropout
        ln2            LayerNorm(h)
        mlp            MLP: fc1 (Linear h -> ffn), act (GELU, tanh), fc2 (Linear ffn -> h), dropout
      final_norm       LayerNorm(h)
      head             Linear(h -> V, bias=False); weight is embed.tok.weight when tied

The ``qkv`` output is laid out per head as Megatron does ([heads, 3, head_dim]
along the output features), so a contiguous column split of ``qkv`` over
``tp`` ranks gives each rank whole heads with their own q, k and v.

Parameter count (see :func:`gpt_param_count`) with bias, ffn = 4h and tied
embeddings is ``l*(12h^2 + 13h) + (V + s)*h + 2h``. Megatron's formula
(Narayanan et al. 2021, eq. in sec. 5.1) ``12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h))``
equals ``l*(12h^2 + 13h) + (V + s)*h``: per layer it counts qkv 3h^2+3h, proj
h^2+h, fc1 4h^2+4h, fc2 4h^2+h and two LayerNorms 4h, plus both embeddings. It
leaves out the final LayerNorm, so this model has exactly ``2h`` parameters more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (normal_init, check_bool, check_choice, check_int, check_probability, construct,
                      random_tokens)
from ..errors import ConfigError

ATTENTION_KINDS: tuple[str, ...] = ("eager", "sdpa")
INIT_STD = 0.02
"""Standard deviation of the normal init of every Linear and Embedding weight (GPT-2 / Megatron)."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and options of a :class:`GPT`; validated on construction (ConfigError)."""

    vocab_size: int = 51200
    """Vocabulary size V (rows of the token embedding, columns of the head)."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a; must divide ``hidden``."""
    layers: int
    """Number of transformer blocks l."""
    seq_len: int = 2048
    """Maximum sequence length s (rows of the position embedding); also the example inputs' length."""
    ffn_hidden: int | None = None
    """MLP inner size; None means 4 * hidden (resolved on construction, so it is always an int after)."""
    dropout: float = 0.1
    """Dropout probability of the embeddings, attention probabilities and both residual branches."""
    attention: str = "eager"
    """"eager": explicit softmax(q k^T / sqrt(d)) v, Korthikanti et al.'s layout;
    "sdpa": F.scaled_dot_product_attention (one fused op)."""
    tie_embeddings: bool = True
    """Share the head weight with the token embedding."""
    bias: bool = True
    """Biases on every Linear except the head (LayerNorms always have theirs)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "heads", "layers", "seq_len"):
            check_int(name, getattr(self, name))
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        check_int("ffn_hidden", self.ffn_hidden)
        if self.hidden % self.heads != 0:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: "
                              f"choose heads that divide hidden")
        check_probability("dropout", self.dropout)
        check_choice("attention", self.attention, ATTENTION_KINDS)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("bias", self.bias)

    @property
    def head_dim(self) -> int:
        """Size of one head, hidden // heads."""
        return self.hidden // self.heads


def gpt_param_count(cfg: GPTConfig) -> int:
    """Exact number of distinct parameters of ``GPT(cfg)`` (a tied head counts once)."""
    h, f, b = cfg.hidden, cfg.ffn_hidden, int(cfg.bias)
    attn = 4 * h * h + b * 4 * h                      # qkv (h x 3h) + proj (h x h), biases 3h + h
    mlp = 2 * h * f + b * (f + h)                     # fc1 + fc2
    norms = 2 * (2 * h)                               # ln1, ln2: weight + bias
    embed = (cfg.vocab_size + cfg.seq_len) * h
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return cfg.layers * (attn + mlp + norms) + embed + 2 * h + head


class GPTEmbedding(nn.Module):
    """Token plus learned position embeddings, then dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.dropout(self.tok(input_ids) + self.pos(positions))


class Attention(nn.Module):
    """Causal multi-head self-attention with one fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim, self.kind = cfg.heads, cfg.head_dim, cfg.attention
        self.p = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        # (b, s, heads, 3, d) then (3, b, heads, s, d): per-head [q | k | v] as in Megatron.
        qkv = self.qkv(x).view(b, s, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.kind == "sdpa":
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        else:
            out = self._eager(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, h)
        return self.dropout(self.proj(out))

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Korthikanti et al. (2022) core: QK^T, scale, causal mask, softmax, dropout, @V."""
        s = q.shape[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(diagonal=1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        return torch.matmul(probs, v)


class MLP(nn.Module):
    """fc1, GELU (tanh approximation, as Megatron's fused bias-GELU), fc2, dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Megatron-style GPT; ``forward(input_ids, labels=None)``.

    Returns logits (b, s, V) without labels, else the mean cross-entropy over all
    b*s tokens. ``labels`` are already the targets of each position (no shift here).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = GPTEmbedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.tok.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, 0.02) weights and zero biases for Linear/Embedding; LayerNorm keeps (1, 0)."""
        normal_init(module, INIT_STD)


def build_gpt(cfg: GPTConfig, batch_size: int = 1, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[GPT, dict[str, torch.Tensor]]:
    """A :class:`GPT` on ``device`` in ``dtype`` and example inputs ``{input_ids, labels}``.

    Both inputs are int64 of shape (batch_size, cfg.seq_len), drawn from a fixed seed
    (shape only on "meta"). ``model(**inputs)`` is the training loss.
    """
    model = construct(lambda: GPT(cfg), device, dtype)
    inputs = {
        "input_ids": random_tokens(batch_size, cfg.seq_len, cfg.vocab_size, device),
        "labels": random_tokens(batch_size, cfg.seq_len, cfg.vocab_size, device, offset=1),
    }
    return model, inputs
