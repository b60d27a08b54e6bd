"""ResNet (He et al. 2016, v1.5: stride on the 3x3 conv) written here, no torchvision needed.

Module tree::

    ResNet
      stem             Sequential: conv (7x7/2), bn, relu, maxpool (3x3/2)   ["imagenet" stem]
                       Sequential: conv (3x3/1), bn, relu                   ["cifar" stem]
      layer1..layerN   Sequential of BasicBlock or Bottleneck (N = len(depths), at most 4);
                       layer k has width * 2**(k-1) channels (times 4 for Bottleneck output),
                       stride 2 in its first block for k > 1
      pool             AdaptiveAvgPool2d(1)
      fc               Linear(channels -> num_classes)

Blocks: ``conv1/bn1, conv2/bn2[, conv3/bn3]`` and ``downsample`` (1x1 conv + bn, or
None). ``forward(images)`` returns logits (b, num_classes); no loss.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import nn

from ._common import check_choice, check_int, construct, random_floats
from ..errors import ConfigError

Stem = Literal["imagenet", "cifar"]
RESNET_NAMES: tuple[str, ...] = ("small", "resnet18", "resnet50")


def _conv_bn(cin: int, cout: int, kernel: int, stride: int) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
    return conv, nn.BatchNorm2d(cout)


def _downsample(cin: int, cout: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(*_conv_bn(cin, cout, 1, stride))


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual; output channels = planes."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, planes, 3, stride)
        self.conv2, self.bn2 = _conv_bn(planes, planes, 3, 1)
        self.relu = nn.ReLU()
        self.downsample = _downsample(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4, with a residual."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, planes, 1, 1)
        self.conv2, self.bn2 = _conv_bn(planes, planes, 3, stride)
        self.conv3, self.bn3 = _conv_bn(planes, planes * 4, 1, 1)
        self.relu = nn.ReLU()
        self.downsample = _downsample(cin, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """Stem, ``len(depths)`` stages of residual blocks, global average pool, fc."""

    def __init__(self, depths: Sequence[int], block: type[BasicBlock] | type[Bottleneck],
                 width: int = 64, num_classes: int = 1000, stem: Stem = "imagenet") -> None:
        super().__init__()
        if not 1 <= len(depths) <= 4:
            raise ConfigError(f"depths={list(depths)} must have 1 to 4 stages")
        for i, depth in enumerate(depths):
            check_int(f"depths[{i}]", depth)
        check_int("width", width)
        check_int("num_classes", num_classes)
        check_choice("stem", stem, ("imagenet", "cifar"))
        if stem == "imagenet":
            conv, bn = _conv_bn(3, width, 7, 2)
            self.stem = nn.Sequential(conv, bn, nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        else:
            conv, bn = _conv_bn(3, width, 3, 1)
            self.stem = nn.Sequential(conv, bn, nn.ReLU())
        channels = width
        self.num_stages = len(depths)
        for k, depth in enumerate(depths, start=1):
            planes = width * 2 ** (k - 1)
            blocks = []
            for i in range(depth):
                blocks.append(block(channels, planes, 2 if (k > 1 and i == 0) else 1))
                channels = planes * block.expansion
            self.add_module(f"layer{k}", nn.Sequential(*blocks))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for k in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{k}")(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet(depths: Sequence[int], block: type[BasicBlock] | type[Bottleneck], width: int = 64,
           num_classes: int = 1000, stem: Stem = "imagenet") -> ResNet:
    """A ResNet with ``depths[k]`` blocks in stage k+1."""
    return ResNet(depths, block, width=width, num_classes=num_classes, stem=stem)


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18 (11.7M parameters), for 224x224 images."""
    return resnet([2, 2, 2, 2], BasicBlock, num_classes=num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 v1.5 (25.6M parameters), for 224x224 images."""
    return resnet([3, 4, 6, 3], Bottleneck, num_classes=num_classes)


def small_resnet(num_classes: int = 10) -> ResNet:
    """A tiny ResNet for tests: width 8, two stages of one BasicBlock, CIFAR stem, 32x32 images."""
    return resnet([1, 1], BasicBlock, width=8, num_classes=num_classes, stem="cifar")


def build_resnet(name: str = "small", batch_size: int = 8, image_size: int | None = None,
                 device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[ResNet, tuple[torch.Tensor]]:
    """A ResNet by name ("small", "resnet18", "resnet50") and example inputs ``(images,)``.

    ``images`` has shape (batch_size, 3, image_size, image_size); image_size defaults to
    32 for "small" and 224 otherwise. The model returns logits: pass a loss_fn to autopar.
    """
    check_choice("name", name, RESNET_NAMES)
    factory = {"small": small_resnet, "resnet18": resnet18, "resnet50": resnet50}[name]
    size = image_size if image_size is not None else (32 if name == "small" else 224)
    check_int("image_size", size)
    model = construct(factory, device, dtype)
    return model, (random_floats((batch_size, 3, size, size), device, dtype),)
