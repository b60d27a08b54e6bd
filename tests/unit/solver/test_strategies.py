"""solver/strategies.py: the contracted-dim split of a product of two activations follows the op's own
convention (DeepSeek-V4's and Inkling's attention multiply by weights cast or sliced in the forward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture import capture
from autopar.ops import base_name
from autopar.plan.placement import Partial, Shard
from autopar.solver.strategies import OpContext, node_strategies


class Products(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16))   # [out, in], as nn.Linear keeps it
        self.m = nn.Parameter(torch.randn(16, 12))   # [in, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.linear(x, self.w * 2.0)       # linear(x, w) = x @ w.T: w's last dim is contracted
        b = torch.matmul(x, self.m * 2.0)   # matmul(x, m): m's next-to-last dim is contracted
        return a.sum() + b.sum()


def test_contract_splits_each_operand_along_the_dim_the_op_contracts():
    graph = capture(Products(), (torch.randn(4, 8, 16),))
    ctx = OpContext(graph)
    seen = {}
    for node in graph.nodes:
        if base_name(node.target) not in ("linear", "matmul") or node.params:
            continue
        for strategy in node_strategies(ctx, node, 2):
            if strategy.name == "contract":
                seen[base_name(node.target)] = tuple(s.dim if isinstance(s, Shard) else None for s in strategy.inputs)
    assert seen == {"linear": (2, 1), "matmul": (2, 0)}, seen


class BiasLast(nn.Module):
    """GPT-NeoX-Japanese's last layer: a bias added after its residual, ``bias.expand_as(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y + self.bias.expand_as(y)


def test_a_view_of_a_parameter_lists_it_and_splits_only_where_it_broadcasts():
    """Every strategy names every parameter its op reads (the plan records them, and a rank's program checks the
    count: a view's strategies named none, and GPT-NeoX-Japanese at tp=2 refused its own plan). The bias, whole,
    fills the batch and sequence dims of its broadcast but not the hidden dim it has: no split there."""
    graph = capture(BiasLast(), (torch.randn(4, 8, 16),))
    ctx = OpContext(graph)
    (view,) = [n for n in graph.nodes if base_name(n.target) == "expand_as"]
    strategies = node_strategies(ctx, view, 2)
    assert all(s.params == (("bias", None),) for s in strategies), strategies
    assert {s.output.dim for s in strategies if isinstance(s.output, Shard)} == {0, 1}
    assert not any(isinstance(s.output, Partial) for s in strategies)
