"""Mixture-of-experts layers run as one expert-parallel call: each rank holds ``E / ep`` experts.

When ``ep > 1`` (or ``cp > 1``: the experts then see this rank's tokens of each sequence) the
nodes of each captured MoE region (:class:`autopar.capture.opgraph.MoERegion`, the experts
module of one layer) are not run one by one: the region's output is computed by
:func:`.expert_parallel.expert_parallel_moe` from the region's three inputs (tokens ``[T, h]``,
top-k ids and weights ``[T, k]``) and this rank's expert shards, and its other nodes are skipped.
That computes the region's maths (``out_t = sum_j w_tj D_e (act(G_e x_t) * U_e x_t)``). A region
whose implementation drops assignments beyond a capacity of ``C`` slots per expert
(``MoERegion.capacity``, at the micro-batch's ``T`` tokens) drops the same ones: each rank marks
what its own forward would keep (choice-major priority, :func:`.expert_parallel.capacity_kept`)
before dispatching, which is what the model computes on that rank's micro-batch without expert
parallelism. Under context parallelism a rank holds only part of each sequence, and which
assignments a capacity keeps depends on all of them: that combination is refused.

Placement. The ep ranks of a group are ``ep`` consecutive data-parallel ranks with the same
pipeline, context and tensor coordinates (``ep_rank = dp_rank mod ep``; mesh.py's ep group, its
edp group the ranks holding the same experts); rank ``q`` holds experts
``[q E/ep, (q+1) E/ep)`` of every region (:func:`.expert_parallel.shard_experts`). Expert weights
are plain tensors, also under tensor parallelism: each tensor-parallel rank runs the dispatch
with its ep peers of the same tp rank, on the region's inputs made whole (the lowering's
conversions to ``R``, codegen/lower.py), and hands on a replicated output.

Gradients (expert_parallel.py derives them): an expert weight is summed over its expert
replicas, the ``dp * cp / ep`` ranks holding the same experts, and divided by ``dp * cp`` like
the dense weights. Under FSDP2 (ZeRO-2/3) each region's weights live in an :class:`ExpertsModule`
sharded over the expert-replica mesh with that divide factor, as torchtitan wraps its experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .expert_parallel import expert_parallel_moe

if TYPE_CHECKING:
    from ..capture.opgraph import MoERegion


class ExpertsModule(nn.Module):
    """One region's local experts: ``forward(tokens, ids, weights) -> [T, h]`` over the ep group."""

    def __init__(self, region: MoERegion, gate_up: nn.Parameter, down: nn.Parameter, group: Any,
                 timeout: float) -> None:
        super().__init__()
        self.region = region
        self.gate_up = gate_up
        self.down = down
        self.group = group
        self.timeout = timeout

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        r = self.region
        return expert_parallel_moe(hidden, top_k_index, top_k_weights, self.gate_up, self.down,
                                   num_experts=r.num_experts, activation=r.activation, group=self.group,
                                   timeout=self.timeout, capacity=getattr(r, "capacity", None))

    def named_model_parameters(self) -> dict[str, nn.Parameter]:
        return {self.region.gate_up: self.gate_up, self.region.down: self.down}
