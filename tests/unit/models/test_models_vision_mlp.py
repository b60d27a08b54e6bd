"""The MLP and the ResNets: numerics on CPU, export on meta, module names, parameter counts."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import ConfigError
from autopar.models.cnn import build_resnet, resnet18, resnet50, small_resnet
from autopar.models.mlp import MLP, build_mlp


def test_mlp_forward_backward_cpu() -> None:
    model, (x,) = build_mlp(batch_size=8, in_features=32, hidden=64, out_features=16, depth=4)
    out = model(x)
    assert out.shape == (8, 16)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert len(model.layers) == 4
    assert {n for n, _ in model.named_children()} == {"proj_in", "act", "layers", "proj_out"}


def test_mlp_export_on_meta() -> None:
    model, args = build_mlp(device="meta", dtype=torch.bfloat16)
    program = torch.export.export(model.train(), args, strict=False)
    out = [n for n in program.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta["val"].shape == (8, 16) and out.meta["val"].dtype == torch.bfloat16


def test_mlp_validation() -> None:
    with pytest.raises(ConfigError):
        MLP(32, 0, 16, 2)
    with pytest.raises(ConfigError):
        MLP(32, 64, 16, -1)


def test_small_resnet_forward_backward_cpu() -> None:
    model, (images,) = build_resnet("small", batch_size=4)
    assert images.shape == (4, 3, 32, 32)
    logits = model(images)
    assert logits.shape == (4, 10)
    torch.nn.functional.cross_entropy(logits, torch.arange(4)).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert [n for n, _ in model.named_children()] == ["stem", "layer1", "layer2", "pool", "fc"]


def test_small_resnet_export_train_mode_on_meta() -> None:
    model, args = build_resnet("small", batch_size=4, device="meta")
    program = torch.export.export(model.train(), args, strict=False)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any("batch_norm" in t for t in targets) and "aten.conv2d.default" in targets


def test_resnet_param_counts_match_torchvision() -> None:
    # torchvision.models.resnet18 / resnet50 have 11,689,512 and 25,557,032 parameters.
    with torch.device("meta"):
        assert sum(p.numel() for p in resnet18().parameters()) == 11_689_512
        assert sum(p.numel() for p in resnet50().parameters()) == 25_557_032
        r50 = resnet50()
    assert [n for n, _ in r50.named_children()] == ["stem", "layer1", "layer2", "layer3", "layer4",
                                                    "pool", "fc"]
    assert [len(getattr(r50, f"layer{k}")) for k in range(1, 5)] == [3, 4, 6, 3]


def test_resnet50_builds_on_meta_with_image_size() -> None:
    model, (images,) = build_resnet("resnet50", batch_size=2, image_size=128, device="meta",
                                    dtype=torch.bfloat16)
    assert images.shape == (2, 3, 128, 128) and images.is_meta
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert small_resnet().fc.out_features == 10


def test_build_resnet_unknown_name() -> None:
    with pytest.raises(ConfigError, match="resnet50"):
        build_resnet("resnet101")
