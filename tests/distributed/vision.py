"""Image classifiers with a class token, position embeddings and a classifier head, as users bring them.

The class token (a parameter ``[1, 1, hidden]``) is expanded over the batch and concatenated before
the patch embeddings, a position embedding ``[1, tokens, hidden]`` is added to the result, and the
head reads the class token's row after the last norm. With micro-batches of one sample the expand
and the broadcast are no-ops in the backward, so the class token's gradient is a view of the one
the position embedding takes, and a tensor-parallel runtime that lets two parameters keep one
gradient's memory accumulates later micro-batches into it twice (issue 48, driver/chunk.py
local_shard). Every model here has 4 heads, so tensor parallelism can split them 2 and 4 ways.

Builders take ``device`` (``"meta"`` to plan, ``"cpu"`` to run); the same seed gives the same
weights on every rank. Each model is in ``eval()`` (the issue's flow; dropout is 0 anyway).
"""

from __future__ import annotations

import copy
import os
from typing import Callable

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

IMAGE, PATCH, CHANNELS, CLASSES = 32, 8, 3, 10
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def _tf():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def vit() -> nn.Module:
    """The issue's model: Hugging Face ViT, classifier on the class token."""
    tf = _tf()
    return tf.ViTForImageClassification(tf.ViTConfig(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS,
                                                     num_labels=CLASSES, **SIZES))


def deit() -> nn.Module:
    """DeiT: a class token and a distillation token before the patches (the classifier reads the first)."""
    tf = _tf()
    return tf.DeiTForImageClassification(tf.DeiTConfig(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS,
                                                       num_labels=CLASSES, **SIZES))


def beit() -> nn.Module:
    """BEiT with absolute position embeddings and the class token pooled (its defaults use neither)."""
    tf = _tf()
    return tf.BeitForImageClassification(tf.BeitConfig(
        image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, num_labels=CLASSES,
        use_absolute_position_embeddings=True, use_mean_pooling=False, **SIZES))


def vit_msn() -> nn.Module:
    """ViT-MSN: ViT's embeddings, its own head."""
    tf = _tf()
    return tf.ViTMSNForImageClassification(tf.ViTMSNConfig(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS,
                                                           num_labels=CLASSES, **SIZES))


class TinyViT(nn.Module):
    """A hand-written ViT laid out as timm's: a patch-embedding module (a strided convolution), the class
    token and position embedding on the model, pre-norm blocks with fused attention, the head on the
    class token; ``forward`` returns the loss."""

    def __init__(self, hidden: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(hidden)
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, hidden) * 0.02)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(self.norm(x)[:, 0]), labels)


class _PatchEmbed(nn.Module):
    """timm's PatchEmbed with its norm: a strided convolution, the patches as tokens, a layer norm."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(CHANNELS, hidden, PATCH, stride=PATCH)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (t(y).view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


def tiny_vit() -> nn.Module:
    return TinyViT()


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "vit": vit, "deit": deit, "beit": beit, "vit-msn": vit_msn, "tiny-vit": tiny_vit}

_BUILT: dict[tuple[str, str], nn.Module] = {}


def build(name: str, device: str = "cpu") -> nn.Module:
    """The model in ``eval()``, seeded (a deep copy of one built once per process)."""
    key = (name, device)
    if key not in _BUILT:
        torch.manual_seed(0)
        with torch.device(device):
            _BUILT[key] = BUILDERS[name]().eval()
    return copy.deepcopy(_BUILT[key])


def batches(n: int, global_batch: int, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``global_batch`` images and labels (fixed seed)."""
    g = torch.Generator().manual_seed(1)
    return [{"pixel_values": torch.randn(global_batch, CHANNELS, IMAGE, IMAGE, generator=g).to(device),
             "labels": torch.randint(0, CLASSES, (global_batch,), generator=g).to(device)} for _ in range(n)]


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss
