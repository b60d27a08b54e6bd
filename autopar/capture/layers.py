"""Group ops into layers, find repeated blocks, and mark unfused attention cores.

Layers. A node belongs to the outermost module in its ``nn_module_stack`` whose path
ends in an index (``blocks.3``, ``model.layers.17``, ``layer2.1``): that is a block.
Other nodes are keyed by their module path cut to the depth of the block container
(``transformer.wte``, ``lm_head``); a new non-block layer starts only where a node
of another module *with parameters* appears, so parameter-free glue (masks, position
ids, the loss) stays with its neighbour, except that a block never takes the ops of
another module. Layers are contiguous in graph order, which is what a pipeline cut
needs. Layers whose ops, shapes and parameter shapes agree share a ``signature``:
"96 identical decoder layers" is one signature counted 96 times.

Attention cores. Selective recomputation (Korthikanti et al.; Megatron-LM's
``--recompute-granularity selective``, which checkpoints its ``CoreAttention``) recomputes the
attention core and keeps its inputs (Q, K, V) and its output: written with explicit ops, everything
from the scores product ``Q K^T`` (a matmul of two activations) through what follows it in the layer
(scale, mask add, ``masked_fill`` or the causal mask's ``where``, softmax, casts, dropout) up to and
including the next product of two activations ``P V``; a fused attention op
(``scaled_dot_product_attention``) is a core by itself (Megatron with flash attention checkpoints it
the same way). Parameter-free ops between them that only the core reads (a causal mask built there)
join it, so that the core is one run of ops. The structure decides, not the model: any attention implementation that computes these
ops is recognised.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from typing import Mapping, Sequence

from .opgraph import Layer, OpKind, OpNode, TensorMeta

_INDEXED = re.compile(r"(^|\.)\d+$")


def _block_path(paths: Sequence[str]) -> str | None:
    for path in paths:
        if path and _INDEXED.search(path):
            return path
    return None


def _container_depth(stacks: Mapping[str, Sequence[str]]) -> int:
    """Depth (in path components) of the container holding the most block nodes; 1 if none."""
    counts: dict[str, int] = {}
    for paths in stacks.values():
        block = _block_path(paths)
        if block:
            container = block.rsplit(".", 1)[0] if "." in block else ""
            counts[container] = counts.get(container, 0) + 1
    if not counts:
        return 1
    container = max(counts, key=lambda c: (counts[c], c))
    return max(1, len(container.split(".")) + 1) if container else 1


def _key(paths: Sequence[str], depth: int) -> tuple[str, bool]:
    block = _block_path(paths)
    if block:
        return block, True
    inner = next((p for p in reversed(paths) if p), "")
    return ".".join(inner.split(".")[:depth]), False


def segment(nodes: Sequence[OpNode], stacks: Mapping[str, Sequence[str]]) -> list[tuple[str, bool, list[int]]]:
    """Contiguous (name, is_block, node indices) segments in graph order."""
    depth = _container_depth(stacks)
    segments: list[tuple[str, bool, list[int]]] = []
    pending: list[int] = []  # parameter-free nodes before any segment
    for i, node in enumerate(nodes):
        key, is_block = _key(stacks.get(node.name, []), depth)
        current = segments[-1] if segments else None
        if current is not None and key == current[0]:
            current[2].append(i)
        elif is_block or (node.params and key) or (key and current is not None and current[1]):
            # A repeated block holds only its own ops: parameter-free ops of the module after it
            # (the first half of an RMSNorm before its weight) would break the family's signature.
            segments.append((key, is_block, pending + [i]))
            pending = []
        elif current is not None:
            current[2].append(i)
        else:
            pending.append(i)
    if pending:
        segments.append(("(model)", False, pending))
    return segments


def _signature(nodes: Sequence[OpNode], params: Mapping[str, TensorMeta]) -> str:
    h = hashlib.sha1()
    for n in nodes:
        shapes = [o.shape for o in n.outputs]
        pshapes = [params[p].shape for p in n.params if p in params]
        h.update(f"{n.target}|{shapes}|{pshapes}|{n.kind.value};".encode())
    return h.hexdigest()[:12]


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with the second, third... occurrence of a name suffixed ``#2``, ``#3``...

    A module called at two places of the forward (one Linear applied before and after the blocks,
    one block module standing twice in a ModuleList) gives two segments of one module path; plans
    name their stages' layers, and the runtime finds them, by name, so names must be unique."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def build_layers(nodes: Sequence[OpNode], stacks: Mapping[str, Sequence[str]],
                 params: Mapping[str, TensorMeta]) -> tuple[tuple[OpNode, ...], tuple[Layer, ...]]:
    """Assign every node a layer; return (nodes with ``layer`` set, layers)."""
    segments = segment(nodes, stacks)
    owner = {}
    for li, (_, _, idx) in enumerate(segments):
        for i in idx:
            owner[nodes[i].name] = li
    signatures = [_signature([nodes[i] for i in idx], params) for _, _, idx in segments]
    family = {s: signatures.count(s) for s in signatures}
    names = unique_names([name for name, _, _ in segments])
    seen_params: set[str] = set()
    layers: list[Layer] = []
    for li, ((_, is_block, idx), name) in enumerate(zip(segments, names)):
        used = list(dict.fromkeys(p for i in idx for p in nodes[i].params))
        own = tuple(p for p in used if p not in seen_params)
        shared = tuple(p for p in used if p in seen_params)
        seen_params.update(own)
        outside = dict.fromkeys(src for i in idx for src in nodes[i].inputs if owner.get(src, -1) != li)
        layers.append(Layer(index=li, name=name, signature=signatures[li], nodes=tuple(idx), params=own,
                            shared_params=shared, param_numel=sum(params[p].numel for p in own if p in params),
                            inputs=tuple(outside), is_block=is_block and family[signatures[li]] > 1))
    core = attention_cores(nodes, owner)
    out = tuple(replace(n, layer=owner[n.name], attention_core=n.name in core) for n in nodes)
    return out, tuple(layers)


def weight_operands(nodes: Sequence[OpNode]) -> set[str]:
    """Nodes whose value is a parameter seen through views or gathers: a view or unknown op (index)
    reading a parameter, or a view of such a node."""
    found: set[str] = set()
    for n in nodes:
        if (n.params and n.kind in (OpKind.VIEW, OpKind.OTHER)) or (
                n.kind is OpKind.VIEW and n.inputs and n.inputs[0] in found):
            found.add(n.name)
    return found


def _is_activation_product(node: OpNode, weights: set[str]) -> bool:
    return (node.kind is OpKind.MATMUL and not node.params and len(node.inputs) >= 2
            and not any(i in weights for i in node.inputs))


def attention_cores(nodes: Sequence[OpNode], owner: Mapping[str, int]) -> set[str]:
    """Names of the nodes of attention cores (module docstring): each fused attention op, and each
    scores product with the ops after it up to and including the value product."""
    weights = weight_operands(nodes)
    consumers: dict[str, list[OpNode]] = {}
    for n in nodes:
        for src in n.inputs:
            consumers.setdefault(src, []).append(n)
    core: set[str] = {n.name for n in nodes if n.kind is OpKind.ATTENTION}
    closing: set[str] = set()
    for start in nodes:
        if not _is_activation_product(start, weights) or start.name in closing:
            continue
        region, frontier, ends = {start.name}, [start], set()
        while frontier:
            node = frontier.pop()
            for nxt in consumers.get(node.name, []):
                if nxt.name in region or owner.get(nxt.name) != owner.get(start.name):
                    continue
                if _is_activation_product(nxt, weights):
                    ends.add(nxt.name)
                    continue
                if nxt.params:
                    region = set()
                    frontier = []
                    break
                region.add(nxt.name)
                frontier.append(nxt)
        if ends and region:
            core |= _with_feeders(region | ends, nodes, consumers)
            closing |= ends
    return core


def _with_feeders(region: set[str], nodes: Sequence[OpNode], consumers: Mapping[str, list[OpNode]]) -> set[str]:
    """``region`` with the parameter-free ops inside its span of graph order that only it reads (a causal
    mask built between the scores and the softmax: ``ones``, ``triu``), so that the core is one run of
    ops, which the runtime recomputes as one checkpoint (codegen/layers.py) keeping only its inputs."""
    span = [i for i, n in enumerate(nodes) if n.name in region]
    out = set(region)
    for n in reversed(nodes[span[0]:span[-1] + 1]):
        users = consumers.get(n.name, [])
        if n.name not in out and not n.params and users and all(u.name in out for u in users):
            out.add(n.name)
    return out
