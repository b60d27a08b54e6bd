"""Operand dtypes a real kernel requires to agree (capture/dtypes.py): on the meta device a linear, matmul
or bias-free conv of a bfloat16 or int64 input with float32 weights exports without a word and fails on
every real device; capture refuses it naming the example input. Mixed precision real kernels run is not
refused, and an input the model casts itself before its weights is a note."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import CaptureError
from autopar.capture import capture


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device="meta")


def on_meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


class Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, feats):
        return self.fc(feats).sum()


class Matmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8, 4))

    def forward(self, x):
        return (x @ self.w).sum()


class Patches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 4, 4, bias=False)

    def forward(self, pixel_values):
        return self.proj(pixel_values).float().sum()


class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4).to(torch.bfloat16)

    def forward(self, x):
        return self.b(self.a(x)).sum()


@pytest.mark.parametrize("model, inputs, message", [
    (Features, {"feats": meta(2, 8, dtype=torch.bfloat16)},
     "feats is bfloat16 but Features computes in float32: linear in fc takes bfloat16 and float32 operands, which "
     "no real kernel accepts (the meta device, where the model was traced, does not check). Hint: pass feats as "
     "float32, or cast the model to bfloat16 (model.to(torch.bfloat16))"),
    (Features, (meta(2, 8, dtype=torch.int64),),
     "example_inputs[0] is int64 but Features computes in float32: linear in fc takes int64 and float32 operands"),
    (Matmul, {"x": meta(2, 8, dtype=torch.bfloat16)}, "x is bfloat16 but Matmul computes in float32: matmul of "),
    (Patches, {"pixel_values": meta(2, 3, 16, 16, dtype=torch.bfloat16)},
     "pixel_values is bfloat16 but Patches computes in float32: conv2d in proj takes bfloat16 and float32"),
    (TwoDtypes, (meta(2, 8),), "TwoDtypes's parameters mix float32 (a.weight) and bfloat16 (b.weight): linear in "
                               "b takes float32 and bfloat16 operands"),
], ids=["bf16-linear", "int64-linear", "bf16-matmul", "bf16-conv", "mixed-parameters"])
def test_operands_a_real_kernel_refuses(model, inputs, message):
    with pytest.raises(CaptureError) as err:
        capture(on_meta(model), inputs)
    assert str(err.value).startswith(message), str(err.value)


class Accepted(nn.Module):
    """What real kernels run with mixed dtypes: integer ids into an embedding, a bool and an int mask
    promoted into float scores, a float32 buffer times integer positions (rotary), attention with a
    bool mask, a bfloat16 input inside an autocast region, a layer norm of bfloat16 with float32 weights."""

    def __init__(self, autocast: bool = True) -> None:
        super().__init__()
        self.autocast = autocast
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("inv_freq", torch.ones(1, 4))

    def forward(self, input_ids, mask, positions, extra):
        h = self.emb(input_ids)                                                   # int64 ids
        angles = positions[:, :, None].float() @ self.inv_freq                    # rotary: against a buffer
        h = h + torch.cat([angles.sin(), angles.cos()], -1)
        q = h[:, None]
        h = h + F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None, None, :]).squeeze(1)
        h = h + (~mask)[..., None] * -1.0 + mask.long()[..., None]               # bool and int masks
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            h = h + self.fc(extra).float()                                        # bf16 input, autocast
        return self.norm(h.bfloat16()).float().sum()


def test_mixed_precision_real_kernels_run_is_captured():
    """Captured as it is, with no note; without the autocast region, its linear is refused."""
    inputs = {"input_ids": meta(2, 5, dtype=torch.int64), "mask": meta(2, 5, dtype=torch.bool),
              "positions": meta(2, 5, dtype=torch.int64), "extra": meta(2, 5, 8, dtype=torch.bfloat16)}
    graph = capture(on_meta(Accepted), inputs)
    assert not [w for w in graph.warnings if "computes in" in w], graph.warnings
    with pytest.raises(CaptureError, match="^extra is bfloat16 but Accepted computes in float32: linear in fc "):
        capture(on_meta(Accepted, False), inputs)


def test_a_model_cast_to_bfloat16_takes_bfloat16_inputs():
    feats = {"feats": meta(2, 8, dtype=torch.bfloat16)}
    graph = capture(on_meta(Features).to(torch.bfloat16), feats)
    assert not [w for w in graph.warnings if "computes in" in w]
    with pytest.raises(CaptureError, match="^feats is bfloat16 but Features computes in float32"):
        capture(on_meta(Features), feats)


class Casting(nn.Module):
    """Casts its input to its weights' dtype, as Hugging Face's ViT does with pixel_values."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 4, 4)

    def forward(self, pixel_values):
        return self.proj(pixel_values.to(self.proj.weight.dtype)).sum()


def test_an_input_the_model_casts_is_a_note():
    int_note = ("pixel_values is int64 but Casting computes in float32: it casts pixel_values for the conv2d in "
                "proj, and the plan is priced so; pass pixel_values as float32 if that is what training feeds it")
    graph = capture(on_meta(Casting), {"pixel_values": meta(2, 3, 16, 16, dtype=torch.int64)})
    assert int_note in graph.warnings
    graph = capture(on_meta(Casting), {"pixel_values": meta(2, 3, 16, 16, dtype=torch.bfloat16)})
    assert [w for w in graph.warnings if "computes in" in w] == [
        "pixel_values is bfloat16 but Casting computes in float32: it casts pixel_values for the conv2d in proj, "
        "and the plan is priced so; pass pixel_values as float32 if that is what training feeds it, or cast the "
        "model to bfloat16 to train in bfloat16"]
    graph = capture(on_meta(Casting), {"pixel_values": meta(2, 3, 16, 16)})
    assert not [w for w in graph.warnings if "computes in" in w]


def test_hf_vit_with_int64_pixel_values_says_so():
    """The issue's case: ViT casts pixel_values itself (so real devices run it), and the plan's notes say the
    int64 values are cast to float32."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, intermediate_size=128, num_labels=10)
    model = on_meta(transformers.ViTForImageClassification, config)
    inputs = {"pixel_values": meta(2, 3, 32, 32, dtype=torch.int64), "labels": meta(2, dtype=torch.int64)}
    notes = [w for w in capture(model, inputs).warnings if "computes in" in w]
    assert len(notes) == 1 and notes[0].startswith(
        "pixel_values is int64 but ViTForImageClassification computes in float32: it casts pixel_values for the "
        "conv2d in vit.embeddings.patch_embeddings.projection"), notes
