"""A hand-written T5 encoder-decoder (Raffel et al. 2020; v1.0 by default, v1.1's gated GELU as an option).

Module tree::

    T5
      encoder          T5Encoder:
        embed          Embedding(V, h): the token embedding ("shared" in T5), owner of the weight
        rel_bias       RelativePositionBias (bidirectional): Embedding(buckets, heads)
        blocks[i]      T5EncoderBlock (pre-norm):
          attn_norm    RMSNorm(h)
          attn         T5Attention: q, k, v (h -> heads*d_kv), o (heads*d_kv -> h)
          mlp_norm     RMSNorm(h)
          mlp          T5MLP: wi (h -> ffn), ReLU, wo (ffn -> h); or wi_0, wi_1, wo (gated GELU)
        final_norm     RMSNorm(h)
      decoder          T5Decoder:
        embed          Embedding(V, h); its weight is encoder.embed.weight
        rel_bias       RelativePositionBias (causal buckets)
        blocks[i]      T5DecoderBlock (pre-norm): self_attn_norm, self_attn, cross_norm,
                       cross_attn (q from the decoder, k and v from the encoder output), mlp_norm, mlp
        final_norm     RMSNorm(h)
      head             Linear(h -> V, bias=False); weight is encoder.embed.weight when tied

Each stack looks its tokens up through its own ``embed`` module (one weight, as
Hugging Face's ``encoder.embed_tokens`` / ``decoder.embed_tokens``), not through
one module called twice: capture names a layer by its module path, and two
layers both called ``shared`` could not be told apart by a plan.

No Linear has a bias; RMSNorm is :class:`autopar.models.llama.RMSNorm` (T5's
"T5LayerNorm": no mean subtraction, no bias). Attention is T5's: unscaled
``q k^T`` plus the position bias, softmax, dropout, ``@ v`` (the 1/sqrt(d_kv) is
folded into the initialisation of ``q``), written out so that capture sees the
attention core and the learned bias gets its gradient.

Relative position bias. Hugging Face computes it in the first block of each stack
and passes it on to the others. Here each stack computes it once, in its own
``rel_bias`` module *before* the blocks, and every block takes it as an input:
the parameters are the same (one ``buckets x heads`` table per stack), and all the
blocks of a stack stay identical, so capture finds 12 + 12 repeated layers rather
than 11 + 11 and two odd first blocks. The decoder's causal mask is folded into
its bias there too. The price is a value that every block reads: the bias
(1, heads, s, s), independent of the batch, like the encoder output that every
decoder block's cross-attention reads.

Head: with tied embeddings (v1.0) the decoder output is scaled by ``h**-0.5``
before the head, as in T5; untied (v1.1) it is not.

Parameter count (see :func:`t5_param_count`), with ``a = heads * d_kv``: per
encoder block ``4 h a + F + 2h``, per decoder block ``8 h a + F + 3h`` where
``F = 2 h f`` (ReLU) or ``3 h f`` (gated GELU); per stack ``buckets * heads + h``;
``V h`` for the (shared) token embedding and ``V h`` more for an untied head. t5-base:
222,903,552.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_bool, check_choice, check_int, check_probability, construct, random_tokens
from .llama import RMSNorm
from ..errors import ConfigError

FEED_FORWARDS: tuple[str, ...] = ("relu", "gated-gelu")


@dataclass(frozen=True, kw_only=True)
class T5Config:
    """Shape and options of a :class:`T5`; validated on construction (ConfigError)."""

    vocab_size: int = 32128
    """Vocabulary size V (rows of the shared embedding, columns of the head)."""
    hidden: int
    """Model size h (T5's d_model)."""
    heads: int
    """Attention heads."""
    head_dim: int | None = None
    """Size of one head (T5's d_kv); None means hidden // heads."""
    ffn_hidden: int
    """Feed-forward inner size (T5's d_ff)."""
    layers: int
    """Encoder blocks."""
    decoder_layers: int | None = None
    """Decoder blocks; None means ``layers``."""
    seq_len: int = 512
    """Encoder sequence length of the example inputs (T5 pre-trains on 512 input tokens)."""
    decoder_seq_len: int = 128
    """Decoder sequence length of the example inputs. T5's span corruption turns 512 input
    tokens into about 114 targets (Raffel et al. 2020, sec. 3.1.4), padded to 128."""
    relative_buckets: int = 32
    """Buckets of the relative position bias (half per direction in the encoder)."""
    relative_max_distance: int = 128
    """Distance beyond which all relative positions share the last bucket."""
    feed_forward: str = "relu"
    """"relu": wi, ReLU, wo (T5 v1.0); "gated-gelu": gelu(wi_0) * wi_1, wo (T5 v1.1)."""
    tie_embeddings: bool = True
    """Share the head weight with the shared embedding (and scale the head's input by h**-0.5)."""
    dropout: float = 0.1
    """Dropout of the embeddings, attention probabilities, every residual branch and the final norms."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    def __post_init__(self) -> None:
        check_int("hidden", self.hidden)
        check_int("heads", self.heads)
        if self.head_dim is None:
            if self.hidden % self.heads != 0:
                raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: "
                                  f"choose heads that divide hidden, or set head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.decoder_layers is None:
            object.__setattr__(self, "decoder_layers", self.layers)
        for name in ("vocab_size", "hidden", "heads", "head_dim", "ffn_hidden", "layers", "decoder_layers",
                     "seq_len", "decoder_seq_len", "relative_buckets", "relative_max_distance"):
            check_int(name, getattr(self, name))
        if self.relative_buckets < 4:
            raise ConfigError(f"relative_buckets={self.relative_buckets} is out of range: it must be >= 4 "
                              f"(half per direction, half of those exact)")
        if self.relative_max_distance <= self.relative_buckets // 2:
            # The causal bias has buckets // 2 exact distances; log buckets need a larger maximum.
            raise ConfigError(f"relative_max_distance={self.relative_max_distance} is out of range: it must "
                              f"exceed relative_buckets // 2 = {self.relative_buckets // 2}")
        check_choice("feed_forward", self.feed_forward, FEED_FORWARDS)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_probability("dropout", self.dropout)
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or self.norm_eps <= 0:
            raise ConfigError(f"norm_eps={self.norm_eps!r} must be a positive number")


def t5_param_count(cfg: T5Config) -> int:
    """Exact number of distinct parameters of ``T5(cfg)`` (a tied head counts once)."""
    h, a = cfg.hidden, cfg.heads * cfg.head_dim
    ffn = (2 if cfg.feed_forward == "relu" else 3) * h * cfg.ffn_hidden
    encoder = cfg.layers * (4 * h * a + ffn + 2 * h)
    decoder = cfg.decoder_layers * (8 * h * a + ffn + 3 * h)
    stacks = 2 * (cfg.relative_buckets * cfg.heads + h)
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return encoder + decoder + stacks + cfg.vocab_size * h + head


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position ``key - query`` (int64, same shape).

    Half the buckets are exact distances, the other half grow logarithmically up to
    ``max_distance``; bidirectional splits them between the two directions, causal
    keeps only keys at or before the query.
    """
    offset = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        offset = (relative > 0).to(torch.long) * buckets
        distance = relative.abs()
    else:
        distance = -torch.clamp(relative, max=0)
    exact = buckets // 2
    is_small = distance < exact
    # clamp(min=1) only guards log(0) at the small distances that torch.where discards.
    large = exact + (torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
                     * (buckets - exact)).to(torch.long)
    large = torch.clamp(large, max=buckets - 1)
    return offset + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """The (1, heads, s_q, s_k) additive attention bias from bucketed relative positions."""

    def __init__(self, cfg: T5Config, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.buckets, self.max_distance = cfg.relative_buckets, cfg.relative_max_distance
        self.embedding = nn.Embedding(cfg.relative_buckets, cfg.heads)

    def forward(self, s_q: int, s_k: int, device: torch.device) -> torch.Tensor:
        relative = (torch.arange(s_k, device=device)[None, :] - torch.arange(s_q, device=device)[:, None])
        bucket = relative_position_bucket(relative, self.bidirectional, self.buckets, self.max_distance)
        return self.embedding(bucket).permute(2, 0, 1).unsqueeze(0)


class T5Attention(nn.Module):
    """Multi-head attention without scaling: softmax(q k^T + bias) v; cross-attention when given ``memory``."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        inner = cfg.heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, inner, bias=False)
        self.k = nn.Linear(cfg.hidden, inner, bias=False)
        self.v = nn.Linear(cfg.hidden, inner, bias=False)
        self.o = nn.Linear(inner, cfg.hidden, bias=False)
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        source = x if memory is None else memory
        b, s_q, _ = x.shape
        s_k = source.shape[1]
        q = self.q(x).view(b, s_q, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(source).view(b, s_k, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(source).view(b, s_k, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1))
        if bias is not None:
            scores = scores + bias
        probs = self.attn_dropout(torch.softmax(scores.float(), dim=-1).type_as(scores))
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s_q, self.heads * self.head_dim)
        return self.o(out)


class T5MLP(nn.Module):
    """wo(dropout(relu(wi(x)))) (v1.0), or wo(dropout(gelu(wi_0(x)) * wi_1(x))) (v1.1)."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.gated = cfg.feed_forward == "gated-gelu"
        if self.gated:
            self.wi_0 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
            self.wi_1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        else:
            self.wi = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.wo = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            inner = F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x)
        else:
            inner = F.relu(self.wi(x))
        return self.wo(self.dropout(inner))


class T5EncoderBlock(nn.Module):
    """x + drop(attn(norm(x), bias)), then x + drop(mlp(norm(x)))."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = T5Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = T5MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), bias))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class T5DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention over ``memory`` (the encoder output), MLP; all pre-norm."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.self_attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.self_attn = T5Attention(cfg)
        self.cross_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.cross_attn = T5Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = T5MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.self_attn_norm(x), bias))
        x = x + self.dropout(self.cross_attn(self.cross_norm(x), memory=memory))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class T5Encoder(nn.Module):
    """Token embedding and dropout, the blocks (sharing one bidirectional bias), final norm, dropout."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.rel_bias = RelativePositionBias(cfg, bidirectional=True)
        self.blocks = nn.ModuleList(T5EncoderBlock(cfg) for _ in range(cfg.layers))
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        s = x.shape[1]
        bias = self.rel_bias(s, s, x.device).to(x.dtype)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, bias)
        return self.dropout(self.final_norm(x))


class T5Decoder(nn.Module):
    """As :class:`T5Encoder` with a causal bias (the mask folded in) and cross-attention over ``memory``."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)  # tied to the encoder's by T5
        self.rel_bias = RelativePositionBias(cfg, bidirectional=False)
        self.blocks = nn.ModuleList(T5DecoderBlock(cfg) for _ in range(cfg.decoder_layers))
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        s = x.shape[1]
        bias = self.rel_bias(s, s, x.device).to(x.dtype)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(diagonal=1)
        bias = bias.masked_fill(future, torch.finfo(bias.dtype).min)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, bias, memory)
        return self.dropout(self.final_norm(x))


class T5(nn.Module):
    """T5 encoder-decoder; ``forward(input_ids, decoder_input_ids, labels=None)``.

    Returns logits (b, s_dec, V) without labels, else the mean cross-entropy over the
    decoder positions whose label is not -100. ``decoder_input_ids`` are the labels
    shifted right by the caller (as Hugging Face does when given labels only).
    """

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = T5Encoder(cfg)
        self.decoder = T5Decoder(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.decoder.embed.weight = self.encoder.embed.weight
        if cfg.tie_embeddings:
            self.head.weight = self.encoder.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        """Mesh TensorFlow's (and Hugging Face's) T5 init of one module: unit embeddings, fan-in scaled
        projections (a method taking one module, Hugging Face's convention, which parallelize runs on a
        meta model's modules).

        ``q`` is scaled by ``(h * d_kv)**-0.5``, which is where T5 puts attention's 1/sqrt(d_kv).
        """
        cfg, h = self.config, self.config.hidden
        if module is self.encoder.embed or module is self.head:
            nn.init.normal_(module.weight, std=1.0)
        elif isinstance(module, T5Attention):
            nn.init.normal_(module.q.weight, std=(h * cfg.head_dim) ** -0.5)
            nn.init.normal_(module.k.weight, std=h ** -0.5)
            nn.init.normal_(module.v.weight, std=h ** -0.5)
            nn.init.normal_(module.o.weight, std=(cfg.heads * cfg.head_dim) ** -0.5)
        elif isinstance(module, T5MLP):
            for name in ("wi", "wi_0", "wi_1"):
                if hasattr(module, name):
                    nn.init.normal_(getattr(module, name).weight, std=h ** -0.5)
            nn.init.normal_(module.wo.weight, std=cfg.ffn_hidden ** -0.5)
        elif isinstance(module, RelativePositionBias):
            nn.init.normal_(module.embedding.weight, std=h ** -0.5)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        memory = self.encoder(input_ids)
        x = self.decoder(decoder_input_ids, memory)
        if self.config.tie_embeddings:
            x = x * self.config.hidden ** -0.5
        logits = self.head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def shift_right(labels: torch.Tensor, start_token: int = 0) -> torch.Tensor:
    """Decoder inputs from labels: ``start_token`` then labels[:, :-1] (T5's decoder_start_token_id is 0)."""
    start = torch.full_like(labels[:, :1], start_token)
    return torch.cat((start, labels[:, :-1]), dim=1)


def build_t5(cfg: T5Config, batch_size: int = 1, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> tuple[T5, dict[str, torch.Tensor]]:
    """A :class:`T5` on ``device`` in ``dtype`` and inputs ``{input_ids, decoder_input_ids, labels}``.

    ``input_ids`` is (batch_size, cfg.seq_len); ``labels`` (batch_size, cfg.decoder_seq_len)
    and ``decoder_input_ids`` the labels shifted right; int64 from fixed seeds (shape only
    on "meta"). ``model(**inputs)`` is the training loss.
    """
    model = construct(lambda: T5(cfg), device, dtype)
    labels = random_tokens(batch_size, cfg.decoder_seq_len, cfg.vocab_size, device, offset=1)
    return model, {
        "input_ids": random_tokens(batch_size, cfg.seq_len, cfg.vocab_size, device),
        "decoder_input_ids": shift_right(labels),
        "labels": labels,
    }
