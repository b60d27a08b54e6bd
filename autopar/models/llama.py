"""A hand-written Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases).

Module tree::

    Llama
      embed            Embedding(V, h)
      layers[i]        LlamaBlock (pre-norm):
        attn_norm      RMSNorm(h)
        attn           LlamaAttention: q_proj (h -> heads*d), k_proj, v_proj (h -> kv_heads*d),
                       o_proj (h -> h)
        mlp_norm       RMSNorm(h)
        mlp            SwiGLU: gate_proj, up_proj (h -> ffn), down_proj (ffn -> h)
      norm             RMSNorm(h)
      head             Linear(h -> V, bias=False); weight is embed.weight when tied

Rotary embeddings are computed inside ``forward`` from the positions (no buffers),
so a model built on "meta" has nothing to materialise but its parameters.
Grouped-query attention runs in F.scaled_dot_product_attention (``enable_gqa``): keys and values
keep their ``kv_heads`` heads, never repeated to all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._common import normal_init, check_bool, check_int, construct, random_tokens
from ..errors import ConfigError

INIT_STD = 0.02
"""Standard deviation of the normal init of every Linear and Embedding weight."""


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and options of a :class:`Llama`; validated on construction (ConfigError)."""

    vocab_size: int = 128256
    """Vocabulary size V."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Query heads; must divide ``hidden``."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide ``heads``. None means ``heads`` (MHA)."""
    layers: int
    """Number of decoder blocks."""
    ffn_hidden: int
    """SwiGLU inner size (gate_proj / up_proj output features)."""
    seq_len: int = 8192
    """Sequence length of the example inputs (RoPE needs no table, so any length runs)."""
    tie_embeddings: bool = False
    """Share the head weight with the token embedding."""
    rope_theta: float = 500000.0
    """RoPE base frequency (500000 for Llama 3, 10000 for Llama 2)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        for name in ("vocab_size", "hidden", "heads", "kv_heads", "layers", "ffn_hidden", "seq_len"):
            check_int(name, getattr(self, name))
        if self.hidden % self.heads != 0:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: "
                              f"choose heads that divide hidden")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head size hidden/heads={self.head_dim} is odd; rotary embeddings "
                              f"need an even head size: change hidden or heads")
        if self.heads % self.kv_heads != 0:
            raise ConfigError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}: "
                              f"choose kv_heads that divide heads")
        check_bool("tie_embeddings", self.tie_embeddings)
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive number")

    @property
    def head_dim(self) -> int:
        """Size of one head, hidden // heads."""
        return self.hidden // self.heads


def llama_param_count(cfg: LlamaConfig) -> int:
    """Exact number of distinct parameters of ``Llama(cfg)`` (a tied head counts once)."""
    h, d = cfg.hidden, cfg.head_dim
    attn = 2 * h * h + 2 * h * cfg.kv_heads * d       # q_proj, o_proj; k_proj, v_proj
    mlp = 3 * h * cfg.ffn_hidden
    per_layer = attn + mlp + 2 * h                     # two RMSNorm weights
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return cfg.layers * per_layer + cfg.vocab_size * h + h + head


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x (b, heads, s, d) by position-dependent angles."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with rotary embeddings on q and k."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads < self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder; ``forward(input_ids, labels=None)``.

    Returns logits (b, s, V) without labels, else the mean cross-entropy over all
    b*s tokens. ``labels`` are already the targets of each position (no shift here).
    """

    def __init__(self, cfg: LlamaConfig, block: Callable[[LlamaConfig], nn.Module] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList((block or LlamaBlock)(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, 0.02) Linear and Embedding weights (Llama's Linears have no biases)."""
        normal_init(module, INIT_STD)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_llama(cfg: LlamaConfig, batch_size: int = 1, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[Llama, dict[str, torch.Tensor]]:
    """A :class:`Llama` on ``device`` in ``dtype`` and example inputs ``{input_ids, labels}``.

    Both inputs are int64 of shape (batch_size, cfg.seq_len), drawn from a fixed seed
    (shape only on "meta"). ``model(**inputs)`` is the training loss.
    """
    return build_decoder(Llama, cfg, batch_size, device, dtype)


def build_decoder(model_cls: Callable[[LlamaConfig], Llama], cfg: LlamaConfig, batch_size: int,
                  device: torch.device | str, dtype: torch.dtype) -> tuple[Llama, dict[str, torch.Tensor]]:
    """``model_cls(cfg)`` (a Llama or a subclass) on ``device`` in ``dtype``, and its token inputs."""
    model = construct(lambda: model_cls(cfg), device, dtype)
    inputs = {
        "input_ids": random_tokens(batch_size, cfg.seq_len, cfg.vocab_size, device),
        "labels": random_tokens(batch_size, cfg.seq_len, cfg.vocab_size, device, offset=1),
    }
    return model, inputs
