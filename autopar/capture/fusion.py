r"""What a fused or compiled program keeps for backward: a minimum cut of each layer's forward values.

Eager autograd keeps, for every op, the tensors its backward formula reads (``OpNode.saved``,
rules.py): the float32 copy an RMSNorm makes of its input, the normalised output, SiLU's input and
output, the product SwiGLU feeds its down projection, each intermediate of a tanh-GELU written as
element-wise ops. Fused kernels keep less: a value that cheap element-wise ops compute from other
kept values is recomputed inside the fused backward kernel instead of stored.

- Hand-written fused kernels (``Precision(kernels="fused")``: Megatron-LM's, Apex's, Transformer
  Engine's) fuse chains of element-wise ops, and each such kernel keeps its inputs: Megatron's
  bias-GeLU keeps the GeLU's input (``GeLUFunction`` recomputes the tanh in backward), its SwiGLU the
  concatenated input, a fused RMSNorm its input and the per-row statistics. The ops around them are
  their own kernels and keep what autograd keeps: a matrix product its inputs (the GeLU's output
  that the second MLP product reads, the normalised input of the QKV product), a LayerNorm its input,
  a softmax its output, a dropout its mask; Megatron's cross entropy its fp32 probabilities.
  Korthikanti et al.'s activation counts are this program's.
- A compiled program (``"compiled"``) recomputes across those boundaries too, which is what
  torch.compile's AOTAutograd partitioner (``min_cut_rematerialization_partition``) decides, and what
  Transformer Engine's newer fused kernels do by hand (a fused RMSNorm keeps its input and the
  per-row statistics, and the product after it recomputes its normalised input).

The cut (AOTAutograd's formulation, on the OpGraph, one layer at a time). ``B`` is what eager
autograd saves in the layer (the roots of its ops' ``saved``: what backward reads). A value is
*recomputable* when an op of a recomputable kind produces it: compiled, an element-wise, view,
creation, norm or dropout op (a norm from its input and its kept row statistics, dropout from its
input and its kept mask; those op-internal extras stay kept as they are); fused, an element-wise,
view or creation op whose value no op of another kind saves (that op's autograd keeps it as it is).
The outputs of GEMMs, attention, reductions, softmax, embeddings, losses and unknown ops, and the
values entering the layer, are computed once in forward. Flow network::

    source -> v_in            (infinite)  v not recomputable, or entering the layer
    v_in   -> v_out           (bytes of v)
    u_out  -> v_in            (infinite)  u an input of recomputable v
    v_out  -> sink            (infinite)  v in B

A finite cut separates what forward computes from what backward needs; the values whose
``v_in -> v_out`` edge it cuts are the ones kept, and a minimum cut keeps the fewest bytes
(each value at its own dtype, so an fp32 copy costs twice the bf16 value it was cast from).
Every op then saves, instead of its eager roots, the kept values its eager roots are recomputed
from (the op-internal extras unchanged), so the memory model (memory.py) and the fusion rule of
the compute model (compute.py) read the fused or compiled program as they read the eager one.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from .. import ops
from .opgraph import OpGraph, OpKind, OpNode, SavedTensor

RECOMPUTABLE = {"compiled": frozenset((OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.CREATION, OpKind.NORM, OpKind.DROPOUT)),
                "fused": frozenset((OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.CREATION))}
SAVES = {"eager": "autograd", "fused": "fused", "compiled": "compiled"}   # Precision.kernels -> OpGraph.saves
_SOURCE, _SINK = "source", "sink"


def for_kernels(graph: OpGraph, kernels: str) -> OpGraph:
    """``graph`` as a program running ``kernels`` (``Precision.kernels``) keeps it for backward: the graph
    itself for eager kernels (autograd's saves), and for ``"fused"`` and ``"compiled"`` each op's ``saved``
    replaced by what that program keeps (:func:`kernel_saves`), computed once per graph
    (``OpGraph.derived``)."""
    saves = SAVES[kernels]
    if saves == graph.saves:
        return graph
    if graph.saves != "autograd":
        raise ValueError(f"a graph of {graph.saves} saves has no {kernels!r} form: capture the model again")
    out = graph.derived.get(saves)
    if out is None:
        out = graph.derived[saves] = kernel_saves(graph, saves)
    return out


def kernel_saves(graph: OpGraph, saves: str) -> OpGraph:
    """``graph`` with each op's ``saved`` as a ``saves`` ("fused" | "compiled") program keeps it (module
    docstring). The cut is solved once per layer signature: a repeated block's is its first one's with
    the names of its own values (:func:`_renamed`), or solved anew where they do not correspond."""
    saved: dict[str, tuple[SavedTensor, ...]] = {}
    solved: dict[str, tuple[list[OpNode], dict[str, tuple[SavedTensor, ...]]]] = {}
    for layer in graph.layers:
        nodes = [graph.nodes[i] for i in layer.nodes]
        first = solved.get(layer.signature)
        out = _renamed(graph, *first, nodes) if first is not None else None
        if out is None:
            out = _layer(graph, nodes, saves)
            solved.setdefault(layer.signature, (nodes, out))
        saved.update(out)
    return replace(graph, saves=saves, nodes=tuple(replace(n, saved=saved[n.name]) if n.name in saved else n
                                                   for n in graph.nodes))


def _renamed(graph: OpGraph, first: list[OpNode], cut: dict[str, tuple[SavedTensor, ...]],
             nodes: list[OpNode]) -> dict[str, tuple[SavedTensor, ...]] | None:
    """``cut`` (the saves of the layer of ``first``'s ops) as the layer of ``nodes`` (same signature)
    keeps it: each name replaced by the one in the same place of ``nodes`` (the op, its inputs, its
    saves), when every name has one counterpart and the values weigh alike; None otherwise."""
    if len(first) != len(nodes):
        return None
    names: dict[str, str] = {}
    pairs = [(a.name, b.name) for a, b in zip(first, nodes)]
    for a, b in zip(first, nodes):
        if len(a.inputs) != len(b.inputs) or len(a.saved) != len(b.saved):
            return None
        pairs += zip(a.inputs, b.inputs)
        pairs += ((x.root.split(":")[0], y.root.split(":")[0]) for x, y in zip(a.saved, b.saved))
    for x, y in pairs:
        if names.setdefault(x, y) != y:
            return None
    for x, y in names.items():
        vx, vy = _value(graph, x), _value(graph, y)
        if (vx.numel, vx.dtype, vx.batch_dependent) != (vy.numel, vy.dtype, vy.batch_dependent) or \
                names.get(vx.root) != vy.root:
            return None
    out = {}
    for a, b in zip(first, nodes):
        if a.name in cut:
            kept = []
            for st in cut[a.name]:
                base, colon, what = st.root.partition(":")
                if base not in names:
                    return None
                kept.append(replace(st, root=names[base] + colon + what))
            out[b.name] = tuple(kept)
    return out


def _extra(st: SavedTensor) -> bool:
    """An op-internal tensor (statistics, masks, log-sum-exp): kept as eager keeps it."""
    return ":" in st.root


def _layer(graph: OpGraph, nodes: list[OpNode], saves: str) -> dict[str, tuple[SavedTensor, ...]]:
    """The saves of one layer's ops (``nodes``, in graph order: every input precedes its consumer)."""
    inside = {n.name: n for n in nodes}
    kinds = RECOMPUTABLE[saves]
    needed = {st.root for n in nodes for st in n.saved if not _extra(st)}
    if not needed:
        return {}
    # fused: a value an op outside the fused chains saves is kept as that op's autograd keeps it
    held = set() if saves == "compiled" else {st.root for n in nodes if n.kind not in kinds
                                              for st in n.saved if not _extra(st)}
    flow = nx.DiGraph()
    values: dict[str, SavedTensor] = {}

    def add(name: str) -> None:
        values[name] = _value(graph, name)
        flow.add_edge(f"{name}/in", f"{name}/out", capacity=values[name].nbytes())

    def recomputable(name: str) -> bool:
        return name in inside and inside[name].kind in kinds and name not in held

    for n in nodes:                            # graph order: an input is added before its consumer
        for src in n.inputs:
            if src not in values:              # a value entering the layer
                add(src)
                flow.add_edge(_SOURCE, f"{src}/in")
        add(n.name)
        if recomputable(n.name):
            for src in n.inputs:
                flow.add_edge(f"{src}/out", f"{n.name}/in")
        else:
            flow.add_edge(_SOURCE, f"{n.name}/in")
    for root in sorted(needed):
        if root not in values:                 # kept by an op here, made before the layer's inputs
            add(root)
            flow.add_edge(_SOURCE, f"{root}/in")
        flow.add_edge(f"{root}/out", _SINK)
    _, (computed, _) = nx.minimum_cut(flow, _SOURCE, _SINK)
    kept = {v for v in values if f"{v}/in" in computed and f"{v}/out" not in computed}

    reads: dict[str, frozenset[str]] = {}     # value -> the kept values it is recomputed from
    for name in values:
        if name not in inside:
            reads[name] = frozenset((name,))
    for n in nodes:                            # graph order: its inputs' entries are there already
        if n.name in kept or not recomputable(n.name):
            reads[n.name] = frozenset((n.name,))
        else:
            reads[n.name] = frozenset().union(*(reads[src] for src in n.inputs))

    out = {}
    for n in nodes:
        roots = sorted(frozenset().union(*(reads[st.root] for st in n.saved if not _extra(st))))
        out[n.name] = tuple(values[r] for r in roots) + tuple(_extra_kept(n, st, saves) for st in n.saved if _extra(st))
    return out


def _extra_kept(node: OpNode, st: SavedTensor, saves: str) -> SavedTensor:
    """An op-internal tensor as ``saves`` keeps it: as eager does, but for the probabilities of a softmax
    cross entropy, which Megatron-LM's (fused) keeps in fp32 (megatron/core/tensor_parallel/
    cross_entropy.py: the normalised exponentials of its fp32 copy of the scores)."""
    if saves == "fused" and st.root.endswith(":log_probs") and \
            ops.is_cross_entropy(node.target):
        return replace(st, dtype="float32")
    return st


def _value(graph: OpGraph, name: str) -> SavedTensor:
    """``name`` (a node or a graph input) as a saved tensor: its storage root, size and dtype."""
    if name in graph.node_index:
        node = graph.node(name)
        while node.kind is OpKind.VIEW and node.inputs and node.inputs[0] in graph.node_index:
            node = graph.node(node.inputs[0])       # a view is kept as the storage it views
        meta = node.outputs[0]
        return SavedTensor(node.name, meta.numel, meta.dtype, node.batch_dependent)
    gi = next(g for g in graph.inputs if g.name == name)
    return SavedTensor(name, gi.meta.numel, gi.meta.dtype, gi.batch_dependent)

