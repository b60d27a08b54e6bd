"""A hand-written BERT encoder with its masked-language-model head (post-LN, as in Devlin et al. 2019).

Module tree::

    BERT
      embed            BERTEmbedding: word (Embedding V x h), position (Embedding p x h),
                       token_type (Embedding 2 x h), norm (LayerNorm h), dropout
      layers[i]        BERTBlock (post-LN):
        attn           BERTAttention: query, key, value (Linear h -> h), attn_dropout, out (Linear h -> h)
        attn_norm      LayerNorm(h), applied to x + dropout(attn(x))
        mlp            BERTMLP: fc1 (Linear h -> ffn), act (GELU, erf), fc2 (Linear ffn -> h)
        mlp_norm       LayerNorm(h), applied to x + dropout(mlp(x))
      mlm              MLMHead: dense (Linear h -> h), act (GELU), norm (LayerNorm h),
                       decoder (Linear h -> V with bias); decoder.weight is embed.word.weight

Attention is bidirectional and unmasked (every example is a full sequence, so no
padding mask), one fused ``F.scaled_dot_product_attention``. There is no pooler or
next-sentence head: the model is BERT pre-trained on the masked-LM objective only
(Hugging Face's ``BertForMaskedLM``), so bert-base has 109,514,298 parameters
(the "110M" of the paper counts the pooler, 590,592 more, and no MLM transform).

Parameter count (see :func:`bert_param_count`): per layer ``4(h^2 + h)`` (attention)
``+ 2 h f + f + h`` (MLP) ``+ 4h`` (two LayerNorms); embeddings ``(V + p + 2) h + 2h``;
MLM head ``h^2 + h + 2h + V`` (the decoder weight is tied, its bias is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import INPUT_SEED, normal_init, check_int, check_probability, construct, random_tokens
from ..errors import ConfigError

INIT_STD = 0.02
"""Standard deviation of the normal init of every Linear and Embedding weight (BERT's initializer_range)."""
IGNORE_INDEX = -100
"""Label of positions that are not predicted (F.cross_entropy's default ignore_index)."""


@dataclass(frozen=True, kw_only=True)
class BERTConfig:
    """Shape and options of a :class:`BERT`; validated on construction (ConfigError)."""

    vocab_size: int = 30522
    """Vocabulary size V (rows of the word embedding, columns of the MLM decoder)."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    layers: int
    """Number of encoder blocks."""
    ffn_hidden: int | None = None
    """MLP inner size f; None means 4 * hidden (resolved on construction)."""
    seq_len: int = 512
    """Sequence length of the example inputs; at most ``max_positions``."""
    max_positions: int | None = None
    """Rows of the position embedding (512 for BERT); None means ``seq_len``."""
    type_vocab_size: int = 2
    """Rows of the token-type (segment) embedding."""
    dropout: float = 0.1
    """Dropout probability of the embeddings, attention probabilities and both residual branches."""
    norm_eps: float = 1e-12
    """Epsilon of every LayerNorm (BERT's layer_norm_eps)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.max_positions is None:
            object.__setattr__(self, "max_positions", self.seq_len)
        for name in ("vocab_size", "hidden", "heads", "layers", "ffn_hidden", "seq_len", "max_positions",
                     "type_vocab_size"):
            check_int(name, getattr(self, name))
        if self.hidden % self.heads != 0:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: "
                              f"choose heads that divide hidden")
        if self.seq_len > self.max_positions:
            raise ConfigError(f"seq_len={self.seq_len} is out of range: the position embedding has "
                              f"max_positions={self.max_positions} rows; shorten seq_len or raise max_positions")
        check_probability("dropout", self.dropout)
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or self.norm_eps <= 0:
            raise ConfigError(f"norm_eps={self.norm_eps!r} must be a positive number")

    @property
    def head_dim(self) -> int:
        """Size of one head, hidden // heads."""
        return self.hidden // self.heads


def bert_param_count(cfg: BERTConfig) -> int:
    """Exact number of distinct parameters of ``BERT(cfg)`` (the tied decoder weight counts once)."""
    h, f = cfg.hidden, cfg.ffn_hidden
    per_layer = 4 * (h * h + h) + 2 * h * f + f + h + 4 * h
    embed = (cfg.vocab_size + cfg.max_positions + cfg.type_vocab_size) * h + 2 * h
    head = h * h + h + 2 * h + cfg.vocab_size
    return cfg.layers * per_layer + embed + head


class BERTEmbedding(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm and dropout (all token types are 0)."""

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        types = torch.zeros_like(positions)
        x = self.word(input_ids) + self.position(positions) + self.token_type(types)
        return self.dropout(self.norm(x))


class BERTAttention(nn.Module):
    """Bidirectional multi-head self-attention with separate q, k, v projections (biased)."""

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim, self.p = cfg.heads, cfg.head_dim, cfg.dropout
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        return self.out(out.transpose(1, 2).reshape(b, s, h))


class BERTMLP(nn.Module):
    """fc1, GELU (exact, erf form, as BERT), fc2."""

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class BERTBlock(nn.Module):
    """Post-LN encoder block: x = attn_norm(x + drop(attn(x))), then mlp_norm(x + drop(mlp(x)))."""

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.attn = BERTAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = BERTMLP(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.dropout(self.attn(x)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class MLMHead(nn.Module):
    """Transform (dense, GELU, LayerNorm) then the decoder to vocabulary logits (weight tied by BERT)."""

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(x))))


class BERT(nn.Module):
    """BERT encoder with the MLM head; ``forward(input_ids, labels=None)``.

    Returns logits (b, s, V) without labels, else the mean cross-entropy over the
    positions whose label is not :data:`IGNORE_INDEX` (-100).
    """

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = BERTEmbedding(cfg)
        self.layers = nn.ModuleList(BERTBlock(cfg) for _ in range(cfg.layers))
        self.mlm = MLMHead(cfg)
        self.apply(self._init_weights)
        self.mlm.decoder.weight = self.embed.word.weight

    def _init_weights(self, module: nn.Module) -> None:
        normal_init(module, INIT_STD)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.mlm(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX)


def mlm_labels(input_ids: torch.Tensor, fraction: float) -> torch.Tensor:
    """Labels predicting ``input_ids`` at ``ceil(fraction * s)`` positions per row, -100 elsewhere.

    Every row gets the same number of predicted positions (drawn from a fixed seed), so
    the mean loss of a batch equals the mean of the losses of equal-sized slices of it:
    data-parallel shards average to the single-process loss. Shape only on "meta".
    """
    if input_ids.device.type == "meta":
        return torch.empty_like(input_ids)
    b, s = input_ids.shape
    count = max(1, math.ceil(fraction * s - 1e-9))  # 1e-9: 0.15 * 20 must give 3, not 4
    gen = torch.Generator().manual_seed(INPUT_SEED + 2)
    keep = torch.zeros(b, s, dtype=torch.bool)
    for row in range(b):
        keep[row, torch.randperm(s, generator=gen)[:count]] = True
    labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long)
    labels[keep] = input_ids.cpu()[keep]
    return labels.to(input_ids.device)


def build_bert(cfg: BERTConfig, batch_size: int = 1, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32,
               mask_fraction: float = 0.15) -> tuple[BERT, dict[str, torch.Tensor]]:
    """A :class:`BERT` on ``device`` in ``dtype`` and example inputs ``{input_ids, labels}``.

    Both are int64 of shape (batch_size, cfg.seq_len) from a fixed seed (shape only on
    "meta"). ``labels`` predict the input token at a ``mask_fraction`` of the positions
    (BERT masks 15%; 1.0 predicts every position) and are -100 elsewhere; the inputs are
    not replaced by a [MASK] token, which changes no shape or cost. ``model(**inputs)``
    is the training loss.
    """
    if isinstance(mask_fraction, bool) or not isinstance(mask_fraction, (int, float)) \
            or not 0.0 < mask_fraction <= 1.0:
        raise ConfigError(f"mask_fraction={mask_fraction!r} is out of range: it must be in (0, 1]")
    model = construct(lambda: BERT(cfg), device, dtype)
    input_ids = random_tokens(batch_size, cfg.seq_len, cfg.vocab_size, device)
    return model, {"input_ids": input_ids, "labels": mlm_labels(input_ids, mask_fraction)}
