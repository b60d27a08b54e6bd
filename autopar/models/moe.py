"""A Mixtral-style mixture-of-experts decoder: :mod:`.llama` blocks whose MLP is a routed set of SwiGLU experts.

Module tree::

    Mixtral
      embed            Embedding(V, h)
      layers[i]        MixtralBlock (pre-norm):
        attn_norm      RMSNorm(h)                       (from .llama)
        attn           LlamaAttention (GQA + RoPE)      (from .llama)
        mlp_norm       RMSNorm(h)
        moe            MoE:
          router       Linear(h -> E, bias=False)
          experts      Experts: gate_up_proj (E, 2 ffn, h), down_proj (E, h, ffn), one SwiGLU per expert
      norm             RMSNorm(h)
      head             Linear(h -> V, bias=False)

Routing (as Mixtral, Jiang et al. 2024): softmax of the router logits in float32,
the top-k experts of each token, their weights renormalised to sum to 1.

Experts interface and layout: those of Hugging Face transformers v5 (``MixtralExperts``),
so that capture and expert parallelism treat both alike (capture/moe.py)::

    experts(hidden [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]
    out_t = sum_j w_tj * D_e (silu(G_e x_t) * (U_e x_t)),   e = top_k_index[t, j]

with ``gate_up_proj[e]`` = [G_e; U_e] (the ffn gate rows, then the ffn up rows) and
``down_proj[e]`` = D_e, so HF weights load unchanged.

Static-shape dispatch (inside ``Experts.forward``). ``torch.export`` needs shapes that do
not depend on the routing, so every expert gets a buffer of ``C`` token slots:

1. The T tokens' k choices become ``k*T`` assignments, ordered choice-major (all
   first choices, then all second choices), so that first choices win slots first
   when an expert overflows (GShard / Switch priority).
2. ``onehot`` (k*T, E) marks each assignment's expert; its cumulative sum down the
   assignments gives each one its position within its expert.
3. Assignments at a position >= C are dropped (they contribute nothing; the
   residual carries the token), the others go to slot ``expert * C + position`` of
   an (E*C, h) buffer, filled by ``index_put`` (accumulate: dropped ones add zeros).
4. The experts run as batched matmuls on (E, C, h):
   ``gate, up = x gate_up^T``, then ``(silu(gate) * up) down^T``.
5. Each assignment reads its slot back, is scaled by its routing weight, and the
   k assignments of a token are summed.

``C = ceil(capacity_factor * T * k / E)``; ``capacity_factor=None`` drops nothing
(``C = T``, as no expert can receive a token twice), which is Mixtral's exact
maths but computes E*T slots, E/k times the routed FLOPs. With ``capacity_factor=1.0``
the experts compute exactly the ``T*k`` routed slots (the registry's Mixtral entries use
1.0). Either way capture counts the
routed FLOPs only (``T*k`` rows per expert GEMM; capture/moe.py), which is what the
active parameters cost.
T is the tokens of one forward call (one micro-batch on one rank), so with a
capacity the tokens dropped depend on how the batch is split, as in any
capacity-based MoE; only ``capacity_factor=None`` computes the same loss for any
split (data, pipeline micro-batches) as one process does.

No auxiliary load-balancing loss: Mixtral's (router_aux_loss_coef 0.02) only
regularises routing, costs a few elementwise ops, and would need the blocks to
return a second value through every pipeline stage.

Parameter count: see :func:`mixtral_param_count` (46,702,792,704 for Mixtral 8x7B,
12,879,925,248 active per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_int
from .llama import INIT_STD, Llama, LlamaAttention, LlamaConfig, RMSNorm, build_decoder
from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class MixtralConfig(LlamaConfig):
    """A :class:`LlamaConfig` whose ``ffn_hidden`` is each expert's SwiGLU size, plus the routing."""

    num_experts: int = 8
    """Experts E per layer."""
    top_k: int = 2
    """Experts each token is routed to; at most ``num_experts``."""
    capacity_factor: float | None = None
    """Slots per expert as a multiple of the balanced load ``T*k/E``; None drops nothing (C = T)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_experts", self.num_experts)
        check_int("top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k={self.top_k} is out of range: it must be <= num_experts={self.num_experts}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ConfigError(f"capacity_factor={cf!r} is out of range: it must be a number > 0, or None "
                              f"to drop no tokens")

    def capacity(self, tokens: int) -> int:
        """Slots per expert C for ``tokens`` tokens (at most ``tokens``: more could never fill)."""
        if self.capacity_factor is None:
            return tokens
        return min(tokens, max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)))


def mixtral_param_count(cfg: MixtralConfig, *, active: bool = False) -> int:
    """Exact number of distinct parameters of ``Mixtral(cfg)``; with ``active`` only those
    one token uses (its ``top_k`` experts instead of all of them)."""
    h, d = cfg.hidden, cfg.head_dim
    attn = 2 * h * h + 2 * h * cfg.kv_heads * d
    per_expert = 2 * cfg.ffn_hidden * h + h * cfg.ffn_hidden   # gate_up_proj (2 ffn, h) + down_proj (h, ffn)
    experts = (cfg.top_k if active else cfg.num_experts) * per_expert
    per_layer = attn + experts + h * cfg.num_experts + 2 * h
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return cfg.layers * per_layer + cfg.vocab_size * h + h + head


class Experts(nn.Module):
    """E SwiGLU experts in Hugging Face's layout (``gate_up_proj`` (E, 2 ffn, h), gate rows first,
    ``down_proj`` (E, h, ffn)) with the static-shape dispatch of the module docstring:
    ``forward(hidden (T, h), top_k_index (T, k), top_k_weights (T, k)) -> (T, h)``."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.config = cfg
        e, h, f = cfg.num_experts, cfg.hidden, cfg.ffn_hidden
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(w, mean=0.0, std=INIT_STD)

    def expert_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on its slots: (E, C, h) -> (E, C, h)."""
        gate, up = torch.bmm(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, h = hidden.shape
        e, k = self.config.num_experts, top_k_index.shape[-1]
        cap = self.config.capacity(tokens)
        expert_of = top_k_index.t().reshape(-1)                            # (k*T,) choice-major
        weight_of = top_k_weights.t().reshape(-1)
        onehot = (expert_of.unsqueeze(-1) == torch.arange(e, device=hidden.device)).to(torch.long)
        position = (torch.cumsum(onehot, dim=0) * onehot).sum(dim=-1) - 1  # place within its expert
        kept = position < cap
        slot = expert_of * cap + torch.clamp(position, max=cap - 1)
        values = hidden.repeat(k, 1) * kept.unsqueeze(-1).to(hidden.dtype)  # (k*T, h); dropped -> 0
        buffer = torch.zeros(e * cap, h, dtype=hidden.dtype, device=hidden.device)
        buffer = buffer.index_put((slot,), values, accumulate=True)
        out = self.expert_mlp(buffer.view(e, cap, h)).reshape(e * cap, h)
        scale = (weight_of * kept.to(weight_of.dtype)).unsqueeze(-1)
        return (out[slot] * scale).view(k, tokens, h).sum(dim=0)


class MoE(nn.Module):
    """Router plus experts; (b, s, h) -> (b, s, h)."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.config = cfg
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (weights in x's dtype, expert ids), both (T, k), for the flat tokens x (T, h)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.config.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        weights, experts = self.route(flat)
        return self.experts(flat, experts, weights).view(b, s, h)


def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same layer assignment by assignment (a Python loop): the test oracle of the dispatch.

    Walks the first choices of all tokens, then the second ones, and so on, counting
    each expert's assignments; one beyond the expert's capacity is dropped.
    """
    b, s, h = x.shape
    flat = x.reshape(b * s, h)
    weights, experts = moe.route(flat)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    cap = moe.config.capacity(flat.shape[0])
    load = [0] * moe.config.num_experts
    rows = [torch.zeros_like(flat[t]) for t in range(flat.shape[0])]
    for j in range(moe.config.top_k):
        for t in range(flat.shape[0]):
            i = int(experts[t, j])
            load[i] += 1
            if load[i] <= cap:
                gate, up = (gate_up[i] @ flat[t]).chunk(2)
                rows[t] = rows[t] + weights[t, j] * (down[i] @ (F.silu(gate) * up))
    return torch.stack(rows).view(b, s, h)


class MixtralBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + moe(mlp_norm(x))."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.mlp_norm(x))


class Mixtral(Llama):
    """Mixtral-style MoE decoder: :class:`autopar.models.llama.Llama` with :class:`MixtralBlock` layers;
    ``forward(input_ids, labels=None)`` the same."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__(cfg, MixtralBlock)


def build_mixtral(cfg: MixtralConfig, batch_size: int = 1, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[Mixtral, dict[str, torch.Tensor]]:
    """A :class:`Mixtral` on ``device`` in ``dtype`` and example inputs ``{input_ids, labels}``.

    Both are int64 of shape (batch_size, cfg.seq_len) from a fixed seed (shape only on
    "meta"). ``model(**inputs)`` is the training loss.
    """
    return build_decoder(Mixtral, cfg, batch_size, device, dtype)
