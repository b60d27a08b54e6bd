"""What a plan relies on of a model: comparable across devices, batch sizes and train/eval mode.

A plan is made from one export of the model, often on the meta device, from batch-1 example
inputs, in train mode; every rank exports the model again on its own device, at the plan's
micro-batch size, in the mode the model is in. Both are the same model, yet not the same graph:
torch.export specialises a batch of 1 (Hugging Face's mask code takes another branch there, and
ops that do nothing at that size vanish), a meta kernel reports other strides than a CPU kernel
(a ``contiguous`` appears or goes), dropout is gone in eval mode and batch norm is another aten
op. The plan relies on none of that. It relies on:

- the layers, by name and in order: pipeline stages are cut between them, and the per-op
  sharding is given per layer;
- in each layer, its *anchor* ops in order: those that read parameters, and the matmuls,
  attention, convolutions, embeddings, norms and losses (the ops whose split the plan decides and
  whose costs it prices), each with its kind and the names and shapes of the parameters it reads;
- so the parameters' names and shapes (not their dtype: the plan's precision is its own field).

:class:`ModelStructure` records exactly that (each distinct layer body once, parameters named
relative to their layer, ``*.self_attn.q_proj.weight``); its :attr:`~ModelStructure.fingerprint`
is what plans carry, and :func:`first_difference` names the first layer, op or parameter where
two structures differ. :func:`align` pairs the ops of two exports of one model (the plan's and a
rank's) by the op each node calls, for what the plan says per op.
"""

from __future__ import annotations

import difflib
import re
from typing import Mapping, Sequence

from ..ops import base_name
from ..plan.structure import LAYER, Anchor, ModelStructure, ShardUnits, first_difference, relative_name
from .opgraph import Layer, OpGraph, OpKind, OpNode, TensorMeta

__all__ = ["ANCHOR_KINDS", "LAYER", "Anchor", "ModelStructure", "ShardUnits", "align", "align_ops",
           "first_difference", "is_anchor", "op_of", "structure_of"]

# Kinds of op a plan decides a split for, or prices as more than moving bytes, even without parameters.
ANCHOR_KINDS = frozenset({OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV, OpKind.EMBEDDING, OpKind.NORM,
                          OpKind.LOSS})


def is_anchor(node: OpNode) -> bool:
    """Whether ``node`` is one of the ops the plan relies on (module docstring)."""
    return bool(node.params) or node.kind in ANCHOR_KINDS


def structure_of(nodes: Sequence[OpNode], layers: Sequence[Layer], params: Mapping[str, TensorMeta]
                 ) -> ModelStructure:
    """The structure of a captured graph (its nodes with layers assigned, its layers, its parameters)."""
    bodies: dict[tuple[Anchor, ...], int] = {}
    out = []
    for layer in layers:
        body = tuple(_anchor_of(nodes[i], layer.name, params) for i in layer.nodes if is_anchor(nodes[i]))
        out.append((layer.name, bodies.setdefault(body, len(bodies))))
    return ModelStructure(tuple(out), tuple(bodies))


def op_of(node_name: str) -> str:
    """The op a graph node calls, from its name: torch.fx names the nodes calling ``aten.linear``
    ``linear``, ``linear_1``, ``linear_2``... (a plan's sharding keeps only node names)."""
    return _NUMBERED.sub("", node_name)


_NUMBERED = re.compile(r"_\d+$")


def align_ops(planned: Sequence[str], running: Sequence[str]) -> dict[int, int]:
    """Position in ``planned`` -> position in ``running`` of the same op, for two node-name sequences of
    one stretch of the model exported twice: the longest runs of the same ops in the same order
    (difflib), so an op only one export has (a ``contiguous``, an ``expand`` a batch of 1 drops, a
    dropout gone in eval mode) is left unpaired and everything around it still pairs."""
    matcher = difflib.SequenceMatcher(None, [op_of(n) for n in planned], [op_of(n) for n in running],
                                      autojunk=False)
    return {block.a + k: block.b + k for block in matcher.get_matching_blocks() for k in range(block.size)}


def align(planned: OpGraph, running: OpGraph) -> dict[str, str]:
    """Node of ``planned`` -> the same op in ``running`` (two exports of one model), layer by layer
    (layers are matched by name; :func:`first_difference` says why when they do not match), and
    each graph input to itself."""
    by_name = {layer.name: layer for layer in running.layers}
    out: dict[str, str] = {}
    for layer in planned.layers:
        other = by_name.get(layer.name)
        if other is None:
            continue
        a = [planned.nodes[i].name for i in layer.nodes]
        b = [running.nodes[i].name for i in other.nodes]
        out.update({a[i]: b[j] for i, j in align_ops(a, b).items()})
    for gi in planned.inputs:
        out[gi.name] = gi.name
    return out


def _anchor_of(node: OpNode, layer: str, params: Mapping[str, TensorMeta]) -> Anchor:
    return Anchor(kind=node.kind.value, op=base_name(node.target),
                  module=relative_name(node.module_path, layer),
                  params=tuple((relative_name(p, layer), tuple(params[p].shape)) for p in node.params if p in params))
