"""The plan's per-op tensor-parallel specs, expanded to every node, as DTensor placements.

``Plan.sharding`` lists, per layer group, each op of the group's *solved* layers (its
strategy, input specs, output spec and parameter split dims); the other layers of a group
repeat the first one op for op (solver/sharding_layout.py), so their specs are taken by
node position. Specs: ``R`` replicated, ``S(d)`` split along dim ``d``, ``P`` partial sums,
``C`` a batch-independent constant every rank computes whole (a replicated DTensor here).

Sequence parallelism (Korthikanti et al. 2022) is applied on top of the plan's layout: every
replicated, batch-dependent 3-D activation (``[batch, seq, hidden]``: the residual stream,
norms, dropouts) whose sequence dim divides by ``t`` is split along dim 1 instead, and reads
its replicated-region inputs split the same way. DTensor then turns each all-reduce at the
region's edge into a reduce-scatter and each entry into a column-parallel matmul into an
all-gather, which is Megatron's SP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from torch.distributed.tensor import Placement, Replicate, Shard

from ..capture.opgraph import OpGraph
from ..cost_model.tensor_parallel import splits_along_sequence
from ..errors import PlanMismatchError

R, P, C = "R", "P", "C"


@dataclass(frozen=True)
class OpSpec:
    """The plan's sharding of one op: output spec and the spec it reads each producer in."""

    strategy: str
    output: str
    inputs: Mapping[str, str]      # producer name -> spec required


def split_dim(spec: str) -> int | None:
    return int(spec[2:-1]) if spec.startswith("S(") else None


def placement(spec: str, ndim: int) -> Placement | None:
    """The DTensor placement of a spec (``None`` for ``P`` and ``C``: nothing to enforce)."""
    d = split_dim(spec)
    if d is not None:
        return Shard(d % ndim if ndim else 0)
    return Replicate() if spec == R else None


def node_specs(plan_sharding, graph: OpGraph) -> tuple[dict[str, OpSpec], dict[str, int | None]]:
    """(spec of every op by node name, split dim of every parameter) from the plan's groups."""
    specs: dict[str, OpSpec] = {}
    params: dict[str, int | None] = {}
    layer_by_name = {layer.name: layer for layer in graph.layers}
    for group in plan_sharding:
        ops = list(group["ops"])
        layers = [layer_by_name.get(name) for name in group["layers"]]
        if any(layer is None for layer in layers):
            raise PlanMismatchError(f"the plan's sharding names layers the model does not have "
                                    f"({group['layers'][:3]}...): re-plan with autopar.plan on this model")
        solved = group.get("solved", 1 if len(layers) > 1 and sum(len(x.nodes) for x in layers) != len(ops)
                           else len(layers))
        solved_nodes = [graph.nodes[i] for layer in layers[:solved] for i in layer.nodes]
        if len(solved_nodes) != len(ops) or any(n.name != op["node"] for n, op in zip(solved_nodes, ops)):
            raise PlanMismatchError("the plan's per-op sharding does not match the model's ops: the model "
                                    "changed since planning; re-plan")
        for node, op in zip(solved_nodes, ops):
            _add(specs, params, node, op, node)
        first = [graph.nodes[i] for i in layers[0].nodes]
        for layer in layers[solved:]:
            nodes = [graph.nodes[i] for i in layer.nodes]
            if len(nodes) != len(first):
                raise PlanMismatchError(f"layer {layer.name} does not repeat {layers[0].name} op for op, yet the "
                                        "plan copies its sharding: re-plan")
            for node, ref in zip(nodes, first):
                _add(specs, params, node, ops[solved_nodes.index(ref)], ref)
    return specs, params


def _add(specs: dict, params: dict, node, op: Mapping, ref) -> None:
    inputs = op.get("inputs") or [R] * len(ref.inputs)
    specs[node.name] = OpSpec(op["strategy"], op["output"], dict(zip(node.inputs, inputs)))
    for mine, theirs in zip(node.params, ref.params):
        params.setdefault(mine, op["params"].get(theirs))


def sequence_parallel(specs: Mapping[str, OpSpec], graph: OpGraph, tp: int) -> dict[str, OpSpec]:
    """The specs with the replicated 3-D activations split along the sequence (see the docstring)."""
    sp = set()
    for node in graph.nodes:
        spec = specs.get(node.name)
        if spec is not None and spec.output == R and splits_along_sequence(node, tp):  # the cost model's rule
            sp.add(node.name)
    out = dict(specs)
    for name in sp:
        spec, shape = specs[name], graph.node(name).outputs[0].shape
        # An input of the same [batch, seq, hidden] shape is read split too: a partial one (a
        # row-parallel output) is then reduce-scattered rather than all-reduced.
        inputs = {k: ("S(1)" if v == R and k in graph.node_index and graph.node(k).outputs[0].shape == shape
                      else v) for k, v in spec.inputs.items()}
        out[name] = replace(spec, output="S(1)", inputs=inputs)
    return out


def align(planned: OpGraph, running: OpGraph) -> dict[str, str]:
    """Node of the plan's graph -> the same op in the graph exported at the micro-batch size.

    torch.export specialises a batch of 1: it drops ops that do nothing at that size (an
    ``expand`` to the same shape, a ``contiguous``), so the two graphs can differ by such ops.
    Layers are matched by name and their ops by the longest common subsequence of targets
    (difflib); the ops only one graph has get no spec and DTensor propagates through them.
    """
    import difflib
    by_name = {layer.name: layer for layer in running.layers}
    out: dict[str, str] = {}
    for layer in planned.layers:
        other = by_name.get(layer.name)
        if other is None:
            raise PlanMismatchError(f"layer {layer.name} of the plan is not in the model exported at the micro-batch "
                                    "size: re-plan with example inputs of the micro-batch size")
        a = [planned.nodes[i] for i in layer.nodes]
        b = [running.nodes[i] for i in other.nodes]
        matcher = difflib.SequenceMatcher(None, [n.target for n in a], [n.target for n in b], autojunk=False)
        for block in matcher.get_matching_blocks():
            for k in range(block.size):
                out[a[block.a + k].name] = b[block.b + k].name
    for gi in planned.inputs:
        out[gi.name] = gi.name
    return out


def translate(specs: Mapping[str, OpSpec], names: Mapping[str, str]) -> dict[str, OpSpec]:
    """The specs re-keyed by ``names`` (see :func:`align`); ops without a match are dropped."""
    return {names[k]: replace(v, inputs={names[i]: s for i, s in v.inputs.items() if i in names})
            for k, v in specs.items() if k in names}
