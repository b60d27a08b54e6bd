"""A plain multi-layer perceptron: the smallest model for planner and runtime tests.

Module tree::

    MLP
      proj_in          Linear(in_features -> hidden), then act (ReLU)
      layers[i]        MLPBlock: fc (Linear hidden -> hidden), act (ReLU); ``depth`` of them
      proj_out         Linear(hidden -> out_features)

The model returns its outputs (batch, out_features) and computes no loss:
callers pass a ``loss_fn(output, inputs)`` to autopar, as DESIGN.md says.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_int, construct, random_floats


class MLPBlock(nn.Module):
    """One repeated layer: ReLU(Linear(hidden -> hidden))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """proj_in + ReLU, ``depth`` identical hidden blocks, proj_out (depth + 2 Linear layers)."""

    def __init__(self, in_features: int, hidden: int, out_features: int, depth: int) -> None:
        super().__init__()
        for name, value, low in (("in_features", in_features, 1), ("hidden", hidden, 1),
                                 ("out_features", out_features, 1), ("depth", depth, 0)):
            check_int(name, value, low)
        self.proj_in = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.layers = nn.ModuleList(MLPBlock(hidden) for _ in range(depth))
        self.proj_out = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.proj_in(x))
        for layer in self.layers:
            x = layer(x)
        return self.proj_out(x)


def build_mlp(batch_size: int = 8, in_features: int = 32, hidden: int = 64, out_features: int = 16,
              depth: int = 4, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[MLP, tuple[torch.Tensor]]:
    """An :class:`MLP` and example inputs ``(x,)`` with x of shape (batch_size, in_features).

    The model returns outputs, not a loss: pass a loss_fn to autopar.
    """
    model = construct(lambda: MLP(in_features, hidden, out_features, depth), device, dtype)
    return model, (random_floats((batch_size, in_features), device, dtype),)
