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

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..capture.opgraph import MoERegion
from ..errors import ConfigError
from .expert_parallel import ACTIVATIONS, expert_parallel_moe


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


def check_regions(regions: Sequence[MoERegion], nodes: Mapping[str, Any], layer_of: Mapping[str, int],
                  param_of: Mapping[str, str], ep: int, cp: int, ignored: frozenset[str] = frozenset()) -> None:
    """Refuse regions the expert-parallel call cannot stand in for (ConfigError naming the region);
    ``ignored``: nodes never run (metadata asserts), whatever they read."""
    for r in regions:
        where = f"MoE region {r.module} (output {r.output})"
        if getattr(r, "capacity", None) is not None and cp > 1:
            raise ConfigError(f"{where} drops assignments beyond a capacity of {r.capacity} slots per expert, which "
                              "depends on every token of the sequence, while context parallelism gives a rank part of "
                              "it: build the model without a capacity (capacity_factor=None) or re-plan with cp=1")
        if r.activation not in ACTIVATIONS:
            raise ConfigError(f"{where} uses activation {r.activation!r}, which expert parallelism does not know "
                              f"(it knows {sorted(ACTIVATIONS)}): re-plan with ep=1, cp=1")
        if r.num_experts % ep:
            raise ConfigError(f"{where} has {r.num_experts} experts, which ep={ep} does not divide: re-plan with an "
                              "ep dividing the expert count")
        inside = set(r.nodes)
        for name in r.nodes:
            if name == r.output or name not in nodes:
                continue
            outside = [u.name for u in nodes[name].users if u.name not in inside and u.name not in ignored]
            if outside:
                raise ConfigError(f"{where}: node {outside[0]} outside the region reads its inner value {name}, "
                                  "so the region cannot run as one expert-parallel call: re-plan with ep=1, cp=1")
        layers = {layer_of.get(name) for name in r.nodes if name in layer_of}
        if len(layers) > 1:
            raise ConfigError(f"{where} spans layers {sorted(layers)}: re-plan with ep=1, cp=1")
        for p in (r.gate_up, r.down):
            readers = [n.name for n in nodes.values() if n.op == "call_function" and n.name not in inside
                       and any(param_of.get(a.name) == p for a in n.all_input_nodes)]
            if readers:
                raise ConfigError(f"{where}: node {readers[0]} outside the region reads expert weight {p}: re-plan "
                                  "with ep=1, cp=1")


def skipped_nodes(regions: Sequence[MoERegion]) -> frozenset[str]:
    """Nodes not run: every node of a region but its output."""
    return frozenset(name for r in regions for name in r.nodes if name != r.output)
