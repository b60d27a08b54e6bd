"""The plan's per-op tensor-parallel specs, expanded to every node of the graph this rank exported.

``Plan.sharding`` lists, per layer group, each op of the group's *solved* layers (its
strategy, input specs, output spec and parameter split dims); the other layers of a group
repeat the first one op for op (solver/sharding_layout.py), so their specs are taken by
node position; the ops are paired with those of the graph this rank exported (node_specs).
Specs are placements (autopar/plan/placement.py): ``R`` replicated, ``S(d)`` split along dim ``d``,
``P`` partial sums (a plan's ``"C"``, what a batch-independent constant op reads and makes, is ``R``:
every rank computes it whole). codegen/lower.py turns them into what each rank runs.

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
from typing import Any, Mapping

from ..capture.opgraph import OpGraph
from ..capture.structure import align_ops
from ..cost_model.tensor_parallel import splits_along_sequence
from ..errors import PlanMismatchError
from ..plan.placement import Placement, Replicate, Shard, placement_from_json



@dataclass(frozen=True)
class OpSpec:
    """The plan's sharding of one op: output spec and the spec it reads each producer in."""

    strategy: str
    output: Placement
    inputs: Mapping[str, Placement]   # producer name -> spec required
    params: Mapping[str, int | None] = dataclasses.field(default_factory=dict)  # fqn -> split dim the op reads


def node_specs(plan_sharding, graph: OpGraph) -> tuple[dict[str, OpSpec], dict[str, int | None]]:
    """(spec of every op by node name, split dim of every parameter) of ``graph``, the model as this rank
    exported it, from the plan's groups; each op's spec names the split dim it reads each parameter in.

    The plan names the ops of the graph it was made from, which need not be this one op for op
    (another device, example batch or mode: capture/structure.py): a group's solved ops are paired
    with this graph's ops of the same layers by :func:`~autopar.capture.structure.align_ops`; an op
    left unpaired gets no spec and runs whole. The group's other layers repeat its
    first layer op for op here too, and take its specs by position."""
    specs: dict[str, OpSpec] = {}
    params: dict[str, int | None] = {}
    layer_by_name = {layer.name: layer for layer in graph.layers}
    for group in plan_sharding:
        ops = list(group["ops"])
        missing = [name for name in group["layers"] if name not in layer_by_name]
        if missing:
            raise PlanMismatchError(f"the plan's sharding names layer {missing[0]}, which the model here does not "
                                    "have: re-plan with autopar.plan on this model")
        layers = [layer_by_name[name] for name in group["layers"]]
        solved = group.get("solved", len(layers))
        nodes = [graph.nodes[i] for layer in layers[:solved] for i in layer.nodes]
        chosen: dict[str, tuple[Mapping, tuple[str, ...]]] = {}   # node -> (plan op, the op's parameter names)
        for k, j in align_ops([op["node"] for op in ops], [n.name for n in nodes]).items():
            chosen[nodes[j].name] = (ops[k], nodes[j].params)
        first = [graph.nodes[i] for i in layers[0].nodes]
        for layer in layers[solved:]:
            copy = [graph.nodes[i] for i in layer.nodes]
            if len(copy) != len(first):
                raise PlanMismatchError(f"layer {layer.name} does not repeat {layers[0].name} op for op here, yet the "
                                        "plan copies its sharding: re-plan with autopar.plan on this model")
            for node, ref in zip(copy, first):
                if ref.name in chosen:
                    chosen[node.name] = (chosen[ref.name][0], ref.params)
        for name, (op, names) in chosen.items():
            node = graph.node(name)
            inputs = [placement_from_json(x, f"{op['node']}'s input") for x in op.get("inputs") or []] or \
                [Replicate()] * len(node.inputs)
            mine = {p: op["params"].get(theirs) for p, theirs in zip(node.params, names)}
            if len(inputs) == len(node.inputs):    # else the op reads other values here: it runs whole
                specs[name] = OpSpec(op["strategy"], placement_from_json(op["output"], f"{op['node']}'s output"),
                                     dict(zip(node.inputs, inputs)), mine)
            for fqn, d in mine.items():
                params.setdefault(fqn, d)
    return specs, params


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
    if not plan.sharding:
        raise PlanMismatchError("the plan has tp > 1 but no per-op sharding (a plan file written by an autopar "
                                "before estimates had one, or edited): make it again with autopar.plan or "
                                "autopar.estimate")
    specs, dims = node_specs(plan.sharding, graph)
    return (sequence_parallel(specs, graph, cfg.tp) if cfg.sequence_parallel else specs), dims
