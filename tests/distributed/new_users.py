"""Models as a new user brings them: Hugging Face architectures built from tiny configs, a small
U-Net with batch norm and skip connections, and a per-token regressor whose loss reads targets and a
mask that its forward does not take; their batches; and a single-process reference that
accumulates gradients over the plan's micro-batches.

Every builder takes ``device`` (``"meta"`` to plan, ``"cpu"`` to run, as README and ``autopar
codegen`` do) and ``dropout``; the same seed gives the same weights on every rank.
"""

from __future__ import annotations

import copy

import os
from typing import Any, Callable

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, CLASSES, IMAGE, TAGS = 64, 8, 3, 16, 4


def _tf():
    import transformers
    return transformers


def llama(dropout: float):
    tf = _tf()
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, use_cache=False, attention_dropout=dropout))


def qwen2(dropout: float):
    tf = _tf()
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, use_cache=False, attention_dropout=dropout))


def gpt2(dropout: float):
    tf = _tf()
    model = tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
    model.loss_type = "ForCausalLM"   # GPT2LMHeadModel's class name is not in transformers' loss table
    return model


def bert(dropout: float):
    tf = _tf()
    return tf.BertForSequenceClassification(tf.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=64, num_labels=CLASSES, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout))


def t5(dropout: float):
    tf = _tf()
    return tf.T5ForConditionalGeneration(tf.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
        dropout_rate=dropout, use_cache=False, decoder_start_token_id=0, pad_token_id=0))


def vit(dropout: float):
    tf = _tf()
    return tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=IMAGE,
        patch_size=4, num_channels=3, num_labels=CLASSES, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout))


class UNet(nn.Module):
    """Two levels: conv-BN-ReLU blocks, max-pool down, transposed conv up, the skip concatenated. The
    convolutions before a batch norm have no bias, as usual: the norm cancels it (its gradient is
    exactly zero, so the computed one is rounding noise that AdamW would scale up to lr-sized steps)."""

    def __init__(self, channels: int = 8, dropout: float = 0.0) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.down1, self.down2 = block(3, channels), block(channels, 2 * channels)
        self.pool = nn.MaxPool2d(2)
        self.middle = block(2 * channels, 2 * channels)
        self.drop = nn.Dropout2d(dropout)
        self.up = nn.ConvTranspose2d(2 * channels, channels, 2, stride=2)
        self.up1 = block(2 * channels, channels)
        self.out = nn.Conv2d(channels, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down1(x)
        low = self.drop(self.middle(self.down2(self.pool(skip))))
        return self.out(self.up1(torch.cat([self.up(low), skip], dim=1)))


def unet(dropout: float):
    return UNet(dropout=dropout)


def unet_loss(out: torch.Tensor, inputs: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


class Tagger(nn.Module):
    """A custom per-token regressor: ``forward(x)`` returns predictions (batch, sequence, TAGS) and no
    loss; its loss (tagger_loss) reads the batch's ``targets`` and ``mask``, keys forward does not take."""

    def __init__(self, width: int = 16, hidden: int = 32, depth: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(),
                                                  nn.Linear(hidden, width), nn.Dropout(dropout))
                                    for _ in range(depth))
        self.head = nn.Linear(width, TAGS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def tagger(dropout: float):
    return Tagger(dropout=dropout)


def tagger_loss(out: torch.Tensor, inputs: Any) -> torch.Tensor:
    """Mean squared error over the tokens the mask keeps."""
    mask = inputs["mask"].float()
    return ((out.float() - inputs["targets"]).pow(2).mean(-1) * mask).sum() / mask.sum().clamp(min=1.0)


BUILDERS: dict[str, Callable[[float], nn.Module]] = {
    "llama": llama, "qwen2": qwen2, "gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit, "unet": unet,
    "tagger": tagger}
LOSS_FNS = {"unet": unet_loss, "tagger": tagger_loss}


_BUILT: dict[tuple[str, str, float], nn.Module] = {}


def build(name: str, device: str = "cpu", dropout: float = 0.0) -> nn.Module:
    """The model, seeded: the same weights on every rank (on ``"meta"``: no weights at all). A deep copy
    of one built once per process: building (Hugging Face's init) costs more than the tiny run."""
    key = (name, device, dropout)
    if key not in _BUILT:
        torch.manual_seed(0)
        with torch.device(device):
            _BUILT[key] = BUILDERS[name](dropout)
    torch.manual_seed(0)
    return copy.deepcopy(_BUILT[key])


def batches(name: str, n: int, global_batch: int, device: str = "cpu") -> list[Any]:
    """``n`` global batches of ``global_batch`` samples (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    out: list[Any] = []
    for _ in range(n):
        if name == "unet":
            out.append((torch.randn(global_batch, 3, IMAGE, IMAGE, generator=g),))
        elif name == "tagger":
            out.append({"x": torch.randn(global_batch, SEQ, 16, generator=g),
                        "targets": torch.randn(global_batch, SEQ, TAGS, generator=g),
                        "mask": torch.rand(global_batch, SEQ, generator=g) > 0.25})
        elif name == "vit":
            out.append({"pixel_values": torch.randn(global_batch, 3, IMAGE, IMAGE, generator=g),
                        "labels": torch.randint(0, CLASSES, (global_batch,), generator=g)})
        else:
            ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
            labels = (torch.randint(0, CLASSES, (global_batch,), generator=g) if name == "bert"
                      else torch.randint(0, VOCAB, (global_batch, SEQ), generator=g))
            out.append({"input_ids": ids, "labels": labels})
    return [to(b, device) for b in out]


def to(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(v.to(device) for v in batch)


def rows(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, dict):
        return {k: v[start:stop] for k, v in batch.items()}
    return tuple(v[start:stop] for v in batch)


def loss_of(model: nn.Module, name: str, batch: Any) -> torch.Tensor:
    from autopar.capture.export import LossWrapper, normalize_inputs
    args, kwargs = normalize_inputs(batch)
    return LossWrapper(model, LOSS_FNS.get(name), batch)(*args, **kwargs)
