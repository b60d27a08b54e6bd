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
two structures differ. :func:`op_ids` gives each op its structural identity
(:class:`~autopar.plan.sharding.OpId`, the rule and its argument in plan/sharding.py), which the plan's
per-op sharding is keyed by: a rank's export of the same model maps onto it exactly.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

from .. import ops
from ..ops import base_name, is_inplace
from ..plan.sharding import OpId
from ..plan.structure import Anchor, ModelStructure, relative_name
from .opgraph import GraphInput, Layer, OpKind, OpNode, TensorMeta

__all__ = ["ANCHOR_KINDS", "is_anchor", "is_volatile", "op_ids", "plumbing", "structure_of"]

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


def is_volatile(node: OpNode, plumbing: Collection[str] = ()) -> bool:
    """Whether ``node`` may be in one export of a model and not in another (plan/sharding.py): a layout copy
    or broadcast (ops.VOLATILE), dropout, a state update (an in-place op that reads no activation and no
    parameter and so writes a buffer, which modules make in train mode only: BatchNorm's batch count), or
    index and mask plumbing (``plumbing``: :func:`plumbing` of its graph; T5's decoder inputs shifted from its
    labels, a padding mask, a mixture of experts' token counts), whose ops torch.export traces differently at a
    batch of 1 or on another device, and which carries no decision a plan prices (anchors all make
    floating-point values from floating-point data)."""
    update = is_inplace(node.target) and not node.inputs and not node.params
    return (node.kind is OpKind.DROPOUT or base_name(node.target) in ops.VOLATILE or update
            or node.name in plumbing or _integral(node))


def plumbing(nodes: Sequence[OpNode], inputs: Sequence[GraphInput]) -> frozenset[str]:
    """The ops computing only from integers and booleans: those making no floating-point tensor, and those
    reading no parameter whose every activation input is an integer or boolean graph input or such an op's
    value, whatever dtype they make (not an anchor). A cast of index tensors to float is plumbing still:
    Hugging Face's mixture of experts counts tokens per expert with ``histc`` over the sorted expert ids cast
    to float on a CPU and to int elsewhere, so the planning export on the meta device makes integers where a
    rank's CPU export makes floats (one model, two dtypes: neither computes from the activations)."""
    data = {i.name for i in inputs if i.meta.is_float}   # the values computed from floating-point data
    out: set[str] = set()
    for node in nodes:
        if _integral(node) or (node.inputs and not is_anchor(node) and not any(i in data for i in node.inputs)):
            out.add(node.name)
        else:
            data.add(node.name)
    return frozenset(out)


def _integral(node: OpNode) -> bool:
    """An op making only integer or boolean tensors."""
    return bool(node.outputs) and not any(t.is_float for t in node.outputs)


def op_ids(nodes: Sequence[OpNode], layers: Sequence[Layer], inputs: Sequence[GraphInput]) -> tuple[OpId | None, ...]:
    """Per node, its structural identity (the rule and its argument: plan/sharding.py): layer, module relative
    to it, aten op and occurrence among the layer's non-volatile ops of that module and op; a volatile op is
    named by the op it reads (OpId.source: a graph input by its name, or nothing)."""
    out: list[OpId | None] = [None] * len(nodes)
    named: dict[str, OpId] = {}
    indices = plumbing(nodes, inputs)
    for layer in layers:
        seen: dict[tuple, int] = {}
        for i in layer.nodes:
            node = nodes[i]
            module, op = relative_name(node.module_path, layer.name), base_name(node.target)
            reads = named.get(node.inputs[0]) if node.inputs else None
            if is_volatile(node, indices):
                if reads is None:
                    reads = OpId.source(node.inputs[0] if node.inputs else None)
                key: tuple = (module, op, reads)
            else:
                key, reads = (module, op), None
            seen[key] = seen.get(key, -1) + 1
            out[i] = named[node.name] = OpId(layer.name, module, op, seen[key], reads)
    return tuple(out)


def _anchor_of(node: OpNode, layer: str, params: Mapping[str, TensorMeta]) -> Anchor:
    return Anchor(kind=node.kind.value, op=base_name(node.target),
                  module=relative_name(node.module_path, layer),
                  params=tuple((relative_name(p, layer), tuple(params[p].shape)) for p in node.params if p in params))
