"""The residual MLP two benches run (bench/runtime_overhead.py at hidden 512, bench/host_overhead.py's
second program at hidden 32): blocks of LayerNorm, Linear h -> 4h, GELU, Linear 4h -> h with a residual
add, on [batch, seq, h] inputs; the loss is the mean of squares of the output."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(hidden: int, blocks: int) -> ResidualMLP:
    """The model, the same weights in every process (seeded)."""
    torch.manual_seed(0)
    return ResidualMLP(hidden, blocks)


def loss_fn(out: torch.Tensor, inputs) -> torch.Tensor:
    return out.pow(2).mean()
