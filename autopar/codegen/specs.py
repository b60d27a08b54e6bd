"""The plan's per-op tensor-parallel placements, expanded to every node of the graph this rank exported.

``Plan.sharding`` lists, per layer group, each op of the group's *solved* layers by its structural
identity (plan/sharding.py :class:`~autopar.plan.sharding.OpId`); the other layers of a group repeat
the first one, and take the placement of the op of the same identity in it. This rank's export of
the model gives its ops the same identities (capture/structure.py ``op_ids``), so node_specs maps
the plan onto it exactly: an op the plan lists that the graph lacks, or the reverse, is a
PlanMismatchError naming it. A volatile op (a ``contiguous``, an ``expand``, dropout:
plan/sharding.py) takes the plan's record when the plan's export had it too, else gets no spec here
and the lowering carries its input's placement through it. Placements: Replicate, Shard(d), Partial
(autopar.plan.placement). codegen/lower.py turns them into what each rank runs.

Sequence parallelism (Korthikanti et al. 2022) is applied on top of the plan's layout: every
replicated, batch-dependent 3-D activation (``[batch, seq, hidden]``: the residual stream,
norms, dropouts) whose sequence dim divides by ``t`` is split along dim 1 instead, and reads
its replicated-region inputs split the same way. The lowering then turns each all-reduce at the
region's edge into a reduce-scatter and each entry into a column-parallel matmul into an
all-gather, which is Megatron's SP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from ..capture.opgraph import OpGraph
from ..cost_model.tensor_parallel import splits_along_sequence
from ..errors import PlanMismatchError
from ..plan.placement import Placement, Replicate, Shard
from ..plan.sharding import OpId, OpSharding, ShardingGroup

_REPLAN = "re-plan with autopar.plan on this model"


@dataclass(frozen=True)
class OpSpec:
    """The plan's sharding of one op: output placement and the placement it reads each producer in."""

    strategy: str
    output: Placement
    inputs: Mapping[str, Placement]      # producer name -> placement required
    params: Mapping[str, int | None] = dataclasses.field(default_factory=dict)  # fqn -> split dim the op reads


def node_specs(plan_sharding: Sequence[ShardingGroup], graph: OpGraph
               ) -> tuple[dict[str, OpSpec], dict[str, int | None]]:
    """(spec of every non-volatile op by node name, split dim of every parameter) of ``graph``, the model as
    this rank exported it, from the plan's groups: each op is found by its identity (module docstring)."""
    specs: dict[str, OpSpec] = {}
    params: dict[str, int | None] = {}
    layer_by_name = {layer.name: layer for layer in graph.layers}
    for group in plan_sharding:
        missing = [name for name in group.layers if name not in layer_by_name]
        if missing:
            raise PlanMismatchError(f"the plan's sharding names layer {missing[0]}, which the model here does not "
                                    f"have: {_REPLAN}")
        first = group.layers[0]
        planned = {op.id: op for op in group.ops}
        for name in group.layers[group.solved:]:
            copied = ((op.id.in_layer(name), op) for op in group.ops if op.id.layer == first)
            planned.update({op_id: op for op_id, op in copied if op_id is not None})
        here = {graph.op_ids[i]: graph.nodes[i] for name in group.layers for i in layer_by_name[name].nodes
                if graph.op_ids[i] is not None}
        _same_ops({i: op for i, op in planned.items() if not i.volatile}, {i: n for i, n in here.items()
                                                                           if not i.volatile})
        for op_id, op in planned.items():
            node = here.get(op_id)
            if node is None:   # a volatile op this export does not have
                continue
            if len(op.inputs) != len(node.inputs) or len(op.params) != len(node.params):
                raise PlanMismatchError(f"op {op_id} reads {len(node.inputs)} activations and {len(node.params)} "
                                        f"parameters here but {len(op.inputs)} and {len(op.params)} in the plan: "
                                        f"{_REPLAN}")
            mine = {p: d for p, (_, d) in zip(node.params, op.params)}
            specs[node.name] = OpSpec(op.strategy, op.output, dict(zip(node.inputs, op.inputs)), mine)
            for fqn, d in mine.items():
                params.setdefault(fqn, d)
    return specs, params


def _same_ops(planned: Mapping[OpId, OpSharding], here: Mapping[OpId, Any]) -> None:
    """PlanMismatchError naming the first op only one of the plan and this graph has."""
    gone = sorted(set(planned) - set(here), key=str)
    if gone:
        raise PlanMismatchError(f"the plan shards op {gone[0]}, which the model exported here does not have "
                                f"({len(gone)} such ops): {_REPLAN}")
    new = sorted(set(here) - set(planned), key=str)
    if new:
        raise PlanMismatchError(f"op {new[0]} of the model exported here is not in the plan's sharding "
                                f"({len(new)} such ops): {_REPLAN}")


def sequence_parallel(specs: Mapping[str, OpSpec], graph: OpGraph, tp: int) -> dict[str, OpSpec]:
    """The specs with the replicated 3-D activations split along the sequence (see the docstring)."""
    sp = set()
    for node in graph.nodes:
        spec = specs.get(node.name)
        if spec is not None and spec.output == Replicate() and splits_along_sequence(node, tp):  # the cost model's rule
            sp.add(node.name)
    out = dict(specs)
    for name in sp:
        spec, shape = specs[name], graph.node(name).outputs[0].shape
        # An input of the same [batch, seq, hidden] shape is read split too: a partial one (a
        # row-parallel output) is then reduce-scattered rather than all-reduced.
        inputs = {k: (Shard(1) if v == Replicate() and k in graph.node_index
                      and graph.node(k).outputs[0].shape == shape else v) for k, v in spec.inputs.items()}
        out[name] = replace(spec, output=Shard(1), inputs=inputs)
    return out


def plan_specs(plan: Any, graph: OpGraph) -> tuple[dict[str, OpSpec], dict[str, int | None]]:
    """The plan's tensor-parallel specs on ``graph`` (sequence parallelism's where the plan has it) and
    each parameter's split dim: what the in-process runtime and a standalone program lower. Empty at
    ``tp == 1``."""
    cfg = plan.config
    if cfg.tp == 1:
        return {}, {}
    if plan.schema_version < 3:
        raise PlanMismatchError(f"the plan is of schema {plan.schema_version}, whose sharding names the nodes of "
                                "the export it was made from, which this rank's export need not repeat: make it "
                                "again with autopar.plan or autopar.estimate (schema 3 names each op by its place "
                                "in the model)")
    if not plan.sharding:
        raise PlanMismatchError("the plan has tp > 1 but no per-op sharding (a plan file written by an autopar "
                                "before estimates had one, or edited): make it again with autopar.plan or "
                                "autopar.estimate")
    specs, dims = node_specs(plan.sharding, graph)
    return (sequence_parallel(specs, graph, cfg.tp) if cfg.sequence_parallel else specs), dims
