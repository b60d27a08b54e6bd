"""Random small models for the fuzz test (test_fuzz.py): seed -> (model, example batch, loss_fn).

A seed draws a :class:`ModelSpec` (plain data, printable) with ``random.Random(seed)``; the model is
built from the spec by ordinary nn.Module classes (no generated source), its weights drawn after
``torch.manual_seed(seed)``, so a seed always gives the same model, batches and loss.

What varies:

- front end: a dense (batch, features) input, a dense (batch, seq, features) input, or a token
  embedding of (batch, seq) integer ids (optionally with a learned position table);
- 1-6 blocks in an ``nn.ModuleList`` (so capture finds them as layers), all of one spec or each its
  own: a single Linear, an MLP (Linear -> activation -> Linear), two parallel branches summed or
  concatenated and projected back, or (sequence models) a Linear mixing the sequence positions or
  one head of unfused attention (optionally causal, its mask a buffer); an optional learned scale;
  each with an optional pre-LayerNorm, an optional residual connection, biases or none, in-place
  activations or not;
- sequence models: a learned token prepended to the sequence (sometimes), and a head over every
  position, over their mean, or over the sequence flattened into features;
- widths 4..48 (seven of them), often odd primes so that a tensor-parallel split of 2 does not divide them;
- activations relu / gelu / tanh / silu;
- tied parameters: a token model's head sharing the embedding's weight, a Linear applied both
  before and after the blocks, or one block module standing at two places of the ModuleList;
- the loss: mse against 0.5 (dense), cross-entropy against labels (token models), computed by a
  ``loss_fn(output, inputs)`` or (some token models) by the model itself from a ``labels`` input.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# Few distinct widths, odd primes among them so that a tensor-parallel split of 2 does not divide them.
# Few, because DTensor's sharding propagation (most of a tiny tensor-parallel step) and torch.export
# cache their work by shape: with 7 widths most shapes recur across the 200 models (a tensor-parallel
# model's first step costs 2.5x less the second time its shapes are seen).
WIDTHS = (4, 5, 8, 13, 16, 31, 48)
ACTIVATIONS = ("relu", "gelu", "tanh", "silu")
BLOCK_KINDS = ("linear", "mlp", "branch", "mix", "attn")   # the last two need a sequence
GLOBAL_BATCH = 4


@dataclass(frozen=True)
class BlockSpec:
    kind: str            # "linear" | "mlp" | "branch" | "mix" (a Linear over the sequence positions) | "attn"
    hidden: int          # the MLP's / first branch's inner width
    hidden2: int         # the second branch's inner width (0: the second branch is one Linear)
    act: str
    bias: bool
    norm: bool           # pre-LayerNorm
    residual: bool
    merge: str           # branch: "sum" | "concat"
    scale: bool          # the body's output times a learned per-feature scale (an elementwise parameter)
    causal: bool         # attn: a causal mask (a boolean buffer)
    persistent: bool     # attn: the mask buffer is in the state dict
    inplace: bool        # relu / silu modules with inplace=True

    def describe(self) -> str:
        flags = [f for f, on in (("norm", self.norm), ("res", self.residual), ("nobias", not self.bias),
                                 (self.merge, self.kind == "branch"), ("scale", self.scale),
                                 ("causal", self.kind == "attn" and self.causal),
                                 ("inplace", self.inplace and self.act in ("relu", "silu"))) if on]
        hidden = f"{self.hidden}/{self.hidden2}" if self.kind == "branch" else f"{self.hidden}"
        return f"{self.kind}(h={hidden},{','.join([self.act] + flags)})"


@dataclass(frozen=True)
class ModelSpec:
    seed: int
    front: str           # "dense" (batch, features) | "dense_seq" (batch, seq, features) | "tokens" (batch, seq) ids
    in_features: int     # dense inputs' features, or the vocabulary size of a token model
    seq: int             # sequence length (0 for "dense")
    width: int
    blocks: tuple[BlockSpec, ...]
    shared_block: tuple[int, int] | None  # the ModuleList holds one module at both indices
    shared_linear: bool  # a Linear(width, width) applied before and after the blocks
    tie_head: bool       # tokens: the output head is the embedding's weight
    pos_embed: bool      # tokens: a learned (seq, width) position table
    final_norm: bool
    out_features: int    # dense outputs (token models output the vocabulary)
    loss_in_model: bool  # tokens: forward(input_ids, labels) returns the loss itself
    pool: str            # dense_seq: the head reads every position ("none"), their mean ("mean"), or the
                         # sequence flattened into features ("flatten")
    cls_token: bool      # sequence models: a learned position prepended to the sequence (dropped before a
                         # token model's head)

    def describe(self) -> str:
        blocks = ", ".join(b.describe() for b in self.blocks)
        extras = [k for k in ("shared_linear", "tie_head", "pos_embed", "final_norm", "loss_in_model", "cls_token")
                  if getattr(self, k)]
        if self.pool != "none":
            extras.append(f"pool={self.pool}")
        if self.shared_block:
            extras.append(f"shared_block={self.shared_block}")
        return (f"seed {self.seed}: {self.front} in={self.in_features} seq={self.seq} width={self.width} "
                f"out={self.out_features} [{blocks}] {' '.join(extras)}")


def _regressions() -> dict[int, ModelSpec]:
    """Models that found a bug under an earlier version of this generator, kept as they were, under
    seed numbers past the random ones (test_fuzz.py runs them with the configuration that failed)."""
    def block(**kw) -> BlockSpec:
        return BlockSpec(**{**dict(kind="mlp", hidden=13, hidden2=0, act="tanh", bias=False, norm=False,
                                   residual=True, merge="sum", scale=False, causal=False, persistent=False,
                                   inplace=False), **kw})

    def model(seed: int, **kw) -> ModelSpec:
        return ModelSpec(**{**dict(seed=seed, front="tokens", in_features=16, seq=3, width=4, blocks=(block(),) * 4,
                                   shared_block=None, shared_linear=False, tie_head=True, pos_embed=False,
                                   final_norm=False, out_features=1, loss_in_model=False, pool="none",
                                   cls_token=False), **kw})

    # the embedding split by vocabulary (width 4 < vocabulary 16), read by block 0 and its residual
    return {10_000: model(10_000)}


REGRESSIONS = _regressions()


def draw_spec(seed: int) -> ModelSpec:
    """The spec of seed ``seed``."""
    if seed in REGRESSIONS:
        return REGRESSIONS[seed]
    r = random.Random(seed)
    front = r.choices(("dense", "dense_seq", "tokens"), weights=(5, 2, 3))[0]
    width = r.choice(WIDTHS)
    seq = 0 if front == "dense" else r.choice((3, 4, 8))
    in_features = r.choice((5, 13, 16, 31)) if front == "tokens" else r.choice(WIDTHS)
    depth = r.choices(range(1, 7), weights=(3, 3, 3, 2, 2, 1))[0]   # 1-6 blocks, 3 on average

    def block() -> BlockSpec:
        kinds = BLOCK_KINDS if seq else BLOCK_KINDS[:3]
        kind = r.choices(kinds, weights=(3, 4, 3, 1, 2)[:len(kinds)])[0]
        merge = r.choice(("sum", "concat"))
        return BlockSpec(kind=kind, hidden=r.choice(WIDTHS), hidden2=r.choice((0,) + WIDTHS), act=r.choice(ACTIVATIONS),
                         bias=r.random() < 0.75, norm=r.random() < 0.35, residual=r.random() < 0.5, merge=merge,
                         scale=r.random() < 0.15, causal=r.random() < 0.5, persistent=r.random() < 0.5,
                         inplace=r.random() < 0.2)

    if r.random() < 0.5:
        blocks = (block(),) * depth   # identical blocks: one layer signature repeated
    else:
        blocks = tuple(block() for _ in range(depth))
    shared_block = None
    if depth >= 3 and r.random() < 0.12:
        i, j = sorted(r.sample(range(depth), 2))
        shared_block = (i, j)
    tokens = front == "tokens"
    return ModelSpec(seed=seed, front=front, in_features=in_features, seq=seq, width=width, blocks=blocks,
                     shared_block=shared_block, shared_linear=r.random() < 0.12,
                     tie_head=tokens and r.random() < 0.4, pos_embed=tokens and r.random() < 0.5,
                     final_norm=r.random() < 0.3, out_features=r.choice((1, 4, 13)),
                     loss_in_model=tokens and r.random() < 0.3,
                     pool=r.choice(("none", "none", "mean", "flatten")) if front == "dense_seq" else "none",
                     cls_token=bool(seq) and r.random() < 0.2)


def activation(name: str, inplace: bool = False) -> nn.Module:
    if name in ("relu", "silu"):
        return {"relu": nn.ReLU, "silu": nn.SiLU}[name](inplace=inplace)
    return {"gelu": nn.GELU, "tanh": nn.Tanh}[name]()


class Block(nn.Module):
    """One block: [LayerNorm] -> body -> [+ input]."""

    def __init__(self, spec: BlockSpec, width: int, seq: int) -> None:
        super().__init__()
        self.kind, self.residual, self.merge = spec.kind, spec.residual, spec.merge
        self.norm = nn.LayerNorm(width) if spec.norm else nn.Identity()
        self.act = activation(spec.act, spec.inplace)
        if spec.kind == "linear":
            self.fc = nn.Linear(width, width, bias=spec.bias)
        elif spec.kind == "mlp":
            self.up = nn.Linear(width, spec.hidden, bias=spec.bias)
            self.down = nn.Linear(spec.hidden, width, bias=spec.bias)
        elif spec.kind == "branch":
            self.a_up = nn.Linear(width, spec.hidden, bias=spec.bias)
            self.a_down = nn.Linear(spec.hidden, width, bias=spec.bias)
            if spec.hidden2:
                self.b_up = nn.Linear(width, spec.hidden2, bias=spec.bias)
                self.b_down = nn.Linear(spec.hidden2, width, bias=spec.bias)
            else:
                self.b_up, self.b_down = nn.Linear(width, width, bias=spec.bias), nn.Identity()
            if spec.merge == "concat":
                self.proj = nn.Linear(2 * width, width, bias=spec.bias)
        elif spec.kind == "mix":
            self.mix = nn.Linear(seq, seq, bias=spec.bias)
        elif spec.kind == "attn":
            self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=spec.bias) for _ in range(4))
            self.causal = spec.causal
            if spec.causal:
                self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(),
                                     persistent=spec.persistent)
        else:
            raise ValueError(spec.kind)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(width)) if spec.scale else None

    def body(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mixed(x)
        return y * self.scale if self.scale is not None else y

    def mixed(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "linear":
            return self.act(self.fc(x))
        if self.kind == "mlp":
            return self.down(self.act(self.up(x)))
        if self.kind == "mix":
            return self.act(self.mix(x.transpose(-1, -2)).transpose(-1, -2))
        if self.kind == "attn":   # one head, unfused: what selective recomputation finds as an attention core
            q, k, v = self.q(x), self.k(x), self.v(x)
            scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
            if self.causal:
                scores = scores.masked_fill(~self.mask, float("-inf"))
            return self.o(torch.softmax(scores, dim=-1) @ v)
        a = self.a_down(self.act(self.a_up(x)))
        b = self.b_down(self.act(self.b_up(x)))
        if self.merge == "sum":
            return a + b
        return self.proj(torch.cat([a, b], dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(self.norm(x))
        return x + y if self.residual else y


class RandomModel(nn.Module):
    """front end -> [shared] -> blocks -> [shared] -> [LayerNorm] -> head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        w = spec.width
        if spec.front == "tokens":
            self.embed = nn.Embedding(spec.in_features, w)
            self.pos = nn.Parameter(torch.randn(spec.seq, w) * 0.1) if spec.pos_embed else None
        else:
            self.proj_in = nn.Linear(spec.in_features, w)
        self.cls = nn.Parameter(torch.randn(1, 1, w) * 0.1) if spec.cls_token else None
        seq = spec.seq + spec.cls_token
        self.shared = nn.Linear(w, w) if spec.shared_linear else None
        blocks = [Block(b, w, seq) for b in spec.blocks]
        if spec.shared_block:
            i, j = spec.shared_block
            blocks[j] = blocks[i]
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = nn.LayerNorm(w) if spec.final_norm else nn.Identity()
        out = spec.in_features if spec.front == "tokens" else spec.out_features
        self.head = nn.Linear(w * seq if spec.pool == "flatten" else w, out, bias=not spec.tie_head)
        if spec.tie_head:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.spec.front == "tokens":
            h = self.embed(x)
            if self.pos is not None:
                h = h + self.pos
        else:
            h = torch.tanh(self.proj_in(x))
        if self.cls is not None:
            h = torch.cat([self.cls.expand(h.shape[0], 1, -1), h], dim=1)
        if self.shared is not None:
            h = self.shared(h)
        for block in self.blocks:
            h = block(h)
        if self.shared is not None:
            h = self.shared(h)
        h = self.final_norm(h)
        if self.spec.front == "tokens" and self.cls is not None:
            h = h[:, 1:]
        if self.spec.pool == "mean":
            h = h.mean(dim=1)
        elif self.spec.pool == "flatten":
            h = h.flatten(1)
        out = self.head(h)
        if self.spec.loss_in_model:
            return F.cross_entropy(out.flatten(0, 1), labels.flatten())
        return out


def mse_loss(out: torch.Tensor, inputs: Any) -> torch.Tensor:
    return F.mse_loss(out, torch.full_like(out, 0.5))


def token_loss(out: torch.Tensor, inputs: Any) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), inputs["labels"].flatten())


def build(seed: int) -> tuple[RandomModel, ModelSpec]:
    """The model of ``seed`` (weights after torch.manual_seed(seed)), and its spec."""
    spec = draw_spec(seed)
    torch.manual_seed(seed)
    return RandomModel(spec), spec


def loss_fn_of(spec: ModelSpec) -> Callable[[Any, Any], torch.Tensor] | None:
    if spec.front != "tokens":
        return mse_loss
    return None if spec.loss_in_model else token_loss


def batches(spec: ModelSpec, n: int, global_batch: int = GLOBAL_BATCH) -> list[Any]:
    """``n`` global batches for the model of ``spec`` (a tuple for dense models, a dict for token models)."""
    g = torch.Generator().manual_seed(10_000 + spec.seed)
    out: list[Any] = []
    for _ in range(n):
        if spec.front == "dense":
            out.append((torch.randn(global_batch, spec.in_features, generator=g),))
        elif spec.front == "dense_seq":
            out.append((torch.randn(global_batch, spec.seq, spec.in_features, generator=g),))
        else:
            ids = torch.randint(0, spec.in_features, (global_batch, spec.seq), generator=g)
            labels = torch.randint(0, spec.in_features, (global_batch, spec.seq), generator=g)
            out.append({"x": ids, "labels": labels})
    return out
