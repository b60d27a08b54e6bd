r"""Mixture-of-experts regions: find each experts call in a captured graph, and count only its routed work.

What an experts module computes. For ``T`` tokens ``x_t`` (rows of ``hidden`` [T, h]), each
routed to ``k`` of ``E`` experts (ids ``top_k_index`` [T, k], weights ``w`` [T, k]), with the
stacked weights ``gate_up`` [E, 2f, h] (the f gate rows, then the f up rows) and ``down``
[E, h, f]::

    out_t = sum_j w_tj * down[e] (act(G_e x_t) * (U_e x_t)),     e = top_k_index[t, j]

This is the interface of Hugging Face transformers v5's experts (``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``: ``experts(hidden_states, top_k_index,
top_k_weights)``) and of :class:`autopar.models.moe.Experts`.

Recognition (:func:`find_regions`), by structure, not by class name, so a user's own module
of the same shape is found too. A module ``M`` (a path of the nodes' ``nn_module_stack``) is
an experts module when:

1. Parameters: among the 3-D parameters its nodes read and whose names lie under ``M``,
   exactly one pair has shapes ``[E, 2f, h]`` (gate_up) and ``[E, h, f]`` (down), ``E >= 2``.
2. Inputs: the values its nodes read from outside ``M`` are exactly three: a floating
   ``[T, h]`` (the tokens), an integer ``[T, k]`` (the top-k ids) and a floating ``[T, k]``
   (the top-k weights), ``1 <= k <= E``; the tokens are the one that flows into the gate_up
   product (this decides when ``k == h``).
3. Output: a floating ``[T, h]`` node of ``M`` read outside ``M`` (the last one in graph order).
4. Products: ``M`` holds at least one matrix product reading gate_up and one reading down,
   directly or through views and gathers (``W.transpose(1, 2)``, ``W[expert_ids]``).

The enclosing MoE block (router, shared expert) fails rule 2 (it takes ``[b, s, h]`` and
makes the ids itself), so only the experts call is a region. The router is the ``[E, h]``
(or ``[h, E]``) parameter nearest upstream of the ids, when there is one; the activation is
named (a Hugging Face ``hidden_act`` name: ``silu``, ``gelu``, ``gelu_pytorch_tanh``, ``relu``, ...)
only when what runs between the two products is exactly ``act(gate) * up``; ``""`` otherwise.

Routed FLOPs (:func:`count_routed_flops`). Implementations compute more than the routed work:
``batched_mm`` gathers a weight copy per assignment, a capacity-free static dispatch runs
every expert on ``E*T`` slots, a capacity-based one on ``E*C``. The region's nodes are
recounted so that its forward totals the routed work, ``T*k`` rows per expert GEMM (fewer,
``R = min(T k, what the gate_up products computed / (4 f h))``, when a capacity below the
load drops rows; ``T k`` stands for ``R`` below)::

    gate_up products  2 T k (2f) h      (shared over them in proportion to what each computed)
    down products     2 T k f h
    activation        T k f             (one FLOP per element, capture's element-wise convention)
    act(gate) * up    T k f
    everything else   0                 (dispatch, sort, gather, combine: the implementation's
                                         book-keeping, priced by its bytes)

Backward: each product ``(a + b)`` times its forward, ``a`` = 1 when its weight is trained,
``b`` = 1 when its activation input needs a gradient (2x for any trained MoE layer);
element-wise ops twice their forward when they need a gradient. Bytes are left as
measured: the implementation does move them.

Capture with Hugging Face's ``experts_implementation="eager"`` (a Python loop over the
experts hit, ``nonzero`` and ``torch.where``: data-dependent shapes torch.export cannot
trace) runs with ``"grouped_mm"`` instead (:func:`static_experts`), the same maths on the
same weights, and the graph says so in a warning.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..ops import base_name
from .opgraph import FLOAT_DTYPES, Gemm, GraphInput, MoERegion, OpKind, OpNode, TensorMeta

# Hugging Face's experts implementations with static shapes, in order of preference: grouped_mm
# computes only the routed rows, as the eager loop does.
STATIC_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
# aten op -> Hugging Face hidden_act name (gelu is resolved by its `approximate` argument).
_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh",
                "mish": "mish", "elu": "elu", "leaky_relu": "leaky_relu", "softplus": "softplus",
                "relu6": "relu6", "hardswish": "hardswish"}
# ops that only move or re-type the gate and up halves (a view-kind op needs no listing)
_GATE_PLUMBING = frozenset({"_to_copy", "to", "clone", "contiguous", "split", "split_with_sizes", "chunk",
                            "getitem", "slice", "narrow", "unbind", "index_select", "gather"})
_PARAMETRISED = frozenset({"elu", "leaky_relu", "softplus"})   # named only at their default parameters
_WEIGHT_PATH_KINDS = (OpKind.VIEW, OpKind.OTHER, OpKind.ELEMENTWISE)
_INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8"})


# ----------------------------------------------------------------------------------------------
# Hugging Face "eager" experts: captured with a static implementation


def eager_experts(model: nn.Module) -> list[tuple[str, Any]]:
    """``(path, config)`` of the Hugging Face experts modules of ``model`` set to ``"eager"``.

    An experts module is one transformers' ``@use_experts_implementation`` decorated: its
    instances carry ``_is_expert_parallel`` and its class ``_apply_gate``; it dispatches on
    ``config._experts_implementation`` at every call.
    """
    found = []
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if (hasattr(module, "_is_expert_parallel") and callable(getattr(module, "_apply_gate", None))
                and getattr(config, "_experts_implementation", None) == "eager"):
            found.append((path, config))
    return found


def static_implementation() -> str | None:
    """The first of :data:`STATIC_IMPLEMENTATIONS` this transformers registers, None if none."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return next((name for name in STATIC_IMPLEMENTATIONS if name in ALL_EXPERTS_FUNCTIONS), None)


@contextlib.contextmanager
def static_experts(model: nn.Module) -> Iterator[str | None]:
    """Within the block, Hugging Face experts set to ``"eager"`` run a static implementation.

    Yields the implementation used (None when nothing was switched). The configs are set back
    on exit, exception or not. Only the experts dispatch reads the value: attention and the
    rest of the model are unchanged.
    """
    found = eager_experts(model)
    name = static_implementation() if found else None
    if name is None:
        yield None
        return
    configs = list({id(c): c for _, c in found}.values())
    saved = [c._experts_implementation_internal for c in configs]
    try:
        for c in configs:
            c._experts_implementation_internal = name
        yield name
    finally:
        for c, value in zip(configs, saved):
            c._experts_implementation_internal = value


def eager_warning(model: nn.Module) -> str | None:
    """The graph warning for experts captured with another implementation than the model's own."""
    found = eager_experts(model)
    name = static_implementation() if found else None   # no transformers import for other models
    if name is None:
        return None
    paths = ", ".join(p for p, _ in found[:2]) + (f" and {len(found) - 2} more" if len(found) > 2 else "")
    return (f"experts {paths}: experts_implementation='eager' loops over the experts hit (data-dependent shapes "
            f"torch.export cannot capture), so they were captured with '{name}', the same maths on the same "
            f"weights; build the model with experts_implementation='{name}' to capture what it runs")


# ----------------------------------------------------------------------------------------------
# Recognition


class _Graph:
    """Look-ups over the captured nodes: values' metadata, consumers, members of each module."""

    def __init__(self, nodes: Sequence[OpNode], inputs: Sequence[GraphInput],
                 stacks: Mapping[str, Sequence[str]]) -> None:
        self.nodes = nodes
        self.index = {n.name: i for i, n in enumerate(nodes)}
        self.meta: dict[str, TensorMeta] = {g.name: g.meta for g in inputs}
        self.meta.update({n.name: n.outputs[0] for n in nodes if n.outputs})
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for src in n.inputs:
                self.consumers.setdefault(src, []).append(i)
        self.members: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for path in dict.fromkeys(stacks.get(n.name, ())):
                if path:
                    self.members.setdefault(path, []).append(i)

    def node(self, name: str) -> OpNode | None:
        i = self.index.get(name)
        return None if i is None else self.nodes[i]


def find_regions(nodes: Sequence[OpNode], inputs: Sequence[GraphInput], stacks: Mapping[str, Sequence[str]],
                 params: Mapping[str, TensorMeta], program: torch.export.ExportedProgram | None = None
                 ) -> tuple[MoERegion, ...]:
    """Every experts call of the graph (the rules of the module docstring), in graph order.

    ``nodes`` have their layers assigned; ``stacks`` are the cleaned module paths of each node,
    outermost first; ``program`` (optional) tells gelu's approximation apart.
    """
    g = _Graph(nodes, inputs, stacks)
    fx = {n.name: n for n in program.graph.nodes} if program is not None else {}
    found: list[MoERegion] = []
    for path in sorted(g.members, key=lambda p: g.members[p][0]):
        region = _region(g, path, params, fx)
        if region is not None:
            found.append(region)
    # A module nested in a found one (or holding it) is the same call: keep the outermost.
    kept = [r for r in found if not any(o is not r and r.module.startswith(o.module + ".") for o in found)]
    return tuple(sorted(kept, key=lambda r: g.index[r.output]))


def _weight_pair(paths: Sequence[str], params: Mapping[str, TensorMeta]) -> tuple[str, str] | None:
    """The one (gate_up [E, 2f, h], down [E, h, f]) pair among ``paths``, else None."""
    cubes = [p for p in paths if p in params and len(params[p].shape) == 3]
    pairs = []
    for a in cubes:
        e, two_f, h = params[a].shape
        for b in cubes:
            if b != a and e >= 2 and two_f % 2 == 0 and params[b].shape == (e, h, two_f // 2) and h > 0:
                pairs.append((a, b))
    return pairs[0] if len(pairs) == 1 else None


def _derived(g: _Graph, members: Sequence[int], param: str) -> set[str]:
    """Nodes of the module whose value is ``param`` seen through views, gathers and casts."""
    out: set[str] = set()
    for i in members:
        n = g.nodes[i]
        if n.kind in _WEIGHT_PATH_KINDS and (param in n.params or any(s in out for s in n.inputs)):
            out.add(n.name)
    return out


def _products(g: _Graph, members: Sequence[int], param: str) -> list[str]:
    weights = _derived(g, members, param)
    return [g.nodes[i].name for i in members if g.nodes[i].kind is OpKind.MATMUL
            and (param in g.nodes[i].params or any(s in weights for s in g.nodes[i].inputs))]


def _anatomy(g: _Graph, members: Sequence[int], gate_up: str, down: str) -> tuple[list[str], list[str], set[str]]:
    """(gate_up products, down products, the nodes between them) of a module's members."""
    names = {g.nodes[i].name for i in members}
    up, dn = _products(g, members, gate_up), _products(g, members, down)
    interior = (_reach(g, up, names, forward=True) & _reach(g, dn, names, forward=False)) - set(up) - set(dn)
    return up, dn, interior


def _reach(g: _Graph, start: Sequence[str], inside: set[str], forward: bool) -> set[str]:
    """Nodes of ``inside`` reachable from ``start`` along consumers (forward) or inputs (backward)."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        nxt = ([g.nodes[i].name for i in g.consumers.get(name, ())] if forward
               else list(g.node(name).inputs if g.node(name) else ()))
        for m in nxt:
            if m in inside and m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _region(g: _Graph, path: str, params: Mapping[str, TensorMeta], fx: Mapping[str, Any]) -> MoERegion | None:
    members = g.members[path]
    names = {g.nodes[i].name for i in members}
    read = dict.fromkeys(p for i in members for p in g.nodes[i].params if p.startswith(path + "."))
    pair = _weight_pair(list(read), params)
    if pair is None:
        return None
    gate_up, down = pair
    e, two_f, h = params[gate_up].shape
    f = two_f // 2
    outside = list(dict.fromkeys(s for i in members for s in g.nodes[i].inputs if s not in names))
    roles = _roles(g, outside, h, e)
    if roles is None:
        return None
    up_products, down_products, interior = _anatomy(g, members, gate_up, down)
    if not up_products or not down_products:
        return None
    hidden, index, weight = roles
    if len(hidden) > 1:  # k == h: the tokens are what reaches the gate_up product
        hidden = [v for v in hidden if set(up_products) & _reach(g, [v], names, forward=True)]
        weight = [v for v in weight if v not in hidden]
    if len(hidden) != 1 or len(weight) != 1:
        return None
    tokens, top_k = g.meta[index].shape
    output = _output(g, members, names, tokens, h)
    if output is None:
        return None
    return MoERegion(
        layer=g.node(output).layer, module=path, nodes=tuple(g.nodes[i].name for i in members),
        hidden_input=hidden[0], index_input=index, weight_input=weight[0], output=output,
        gate_up=gate_up, down=down, activation=_activation(g, members, interior, fx), num_experts=e,
        top_k=top_k, tokens=tokens, hidden=h, ffn=f, router=_router(g, index, e, h, params),
        capacity=_capacity(g, up_products, e, tokens))


def _capacity(g: _Graph, products: Sequence[str], e: int, tokens: int) -> int | None:
    """Slots per expert of a capacity dispatch: its gate_up product is a batch of ``E`` GEMMs of ``C``
    rows each; ``C < T`` drops what overflows (``C = T`` cannot: no expert gets a token twice)."""
    for name in products:
        gemm = g.node(name).gemm
        if gemm is not None and gemm.batch == e and gemm.m < tokens:
            return gemm.m
    return None


def _roles(g: _Graph, values: Sequence[str], h: int, e: int) -> tuple[list[str], str, list[str]] | None:
    """(token candidates, ids, weight candidates) of the three outside values, else None."""
    if len(values) != 3 or any(v not in g.meta for v in values):
        return None
    metas = {v: g.meta[v] for v in values}
    ids = [v for v, m in metas.items() if m.dtype in _INT_DTYPES and len(m.shape) == 2]
    floats = [v for v, m in metas.items() if m.dtype in FLOAT_DTYPES and len(m.shape) == 2]
    if len(ids) != 1 or len(floats) != 2:
        return None
    tokens, k = metas[ids[0]].shape
    if not 1 <= k <= e:
        return None
    hidden = [v for v in floats if metas[v].shape == (tokens, h)]
    weight = [v for v in floats if metas[v].shape == (tokens, k)]
    if not hidden or not weight or set(hidden) | set(weight) != set(floats):
        return None
    return hidden, ids[0], ([v for v in weight if v not in hidden] or weight)


def _output(g: _Graph, members: Sequence[int], names: set[str], tokens: int, h: int) -> str | None:
    """The last floating [T, h] node of the module that a node outside it reads."""
    out = None
    for i in members:
        n = g.nodes[i]
        if (n.outputs and n.outputs[0].shape == (tokens, h) and n.outputs[0].is_float
                and any(g.nodes[c].name not in names for c in g.consumers.get(n.name, ()))):
            out = n.name
    return out


def _activation(g: _Graph, members: Sequence[int], interior: set[str], fx: Mapping[str, Any]) -> str:
    """The Hugging Face name of the activation when what runs between the two products is exactly
    ``act(gate) * up``: one activation op, one product with ``up``, and otherwise only views, splits
    and dtype casts. "" for anything else (a softcapped or clamped gate, a slope other than the
    default): no name would be true, and expert parallelism, which recomputes the experts from the
    name, is then not offered."""
    acts, muls, other = [], 0, False
    for i in members:
        n = g.nodes[i]
        if n.name not in interior:
            continue
        base = base_name(n.target)
        if base in _ACTIVATIONS:
            acts.append(n)
        elif base == "mul":
            muls += 1
        elif n.kind is not OpKind.VIEW and base not in _GATE_PLUMBING:
            other = True
    if len(acts) != 1 or muls != 1 or other:
        return ""
    n = acts[0]
    base, node = base_name(n.target), fx.get(n.name)
    if base == "gelu" and node is not None and node.kwargs.get("approximate", "none") == "tanh":
        return "gelu_pytorch_tanh"
    if base in _PARAMETRISED and (node is None or len(node.args) > 1 or node.kwargs):
        return ""   # a slope / alpha / beta other than the default: not a plain hidden_act name
    return _ACTIVATIONS[base]


def _router(g: _Graph, index: str, e: int, h: int, params: Mapping[str, TensorMeta]) -> str | None:
    """The [E, h] (or [h, E]) parameter nearest upstream of the ids, within their layer."""
    start = g.node(index)
    if start is None:
        return None
    frontier, seen = [start], {start.name}
    while frontier:
        nxt = []
        for n in frontier:
            for p in n.params:
                if p in params and params[p].shape in ((e, h), (h, e)):
                    return p
            for s in n.inputs:
                m = g.node(s)
                if m is not None and s not in seen and m.layer == start.layer:
                    seen.add(s)
                    nxt.append(m)
        frontier = nxt
    return None


# ----------------------------------------------------------------------------------------------
# Routed FLOPs


def count_routed_flops(nodes: Sequence[OpNode], regions: Sequence[MoERegion],
                       params: Mapping[str, TensorMeta]) -> tuple[OpNode, ...]:
    """``nodes`` with each region's FLOPs replaced by its routed work (module docstring)."""
    out = list(nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    for r in regions:
        flops = _region_flops(nodes, index, r, params)
        for name, (fwd, bwd) in flops.items():
            i = index[name]
            out[i] = replace(out[i], flops_fwd=fwd, flops_bwd=bwd, attention_core=False,
                             gemm=_routed_gemm(out[i], r, fwd) if out[i].gemm is not None else None)
    return tuple(out)


def _routed_gemm(node: OpNode, r: MoERegion, fwd: float) -> Gemm | None:
    """The GEMM shape of a region's product as the routed work: ``E`` experts each multiplying its
    share of the ``T k`` rows (``m``, which grows with the tokens), whatever the implementation
    computed (a capacity buffer, one matrix-vector product per row); None for a product of nothing."""
    if fwd <= 0:
        return None
    g = node.gemm
    n, k = (g.n, g.k) if g is not None else (r.hidden, r.hidden)
    rows = fwd / (2.0 * n * k)          # rows this product multiplies, over all experts
    return Gemm(batch=r.num_experts, m=max(1, round(rows / r.num_experts)), n=n, k=k, scaled="m")


def _region_flops(nodes: Sequence[OpNode], index: Mapping[str, int], r: MoERegion,
                  params: Mapping[str, TensorMeta]) -> dict[str, tuple[float, float]]:
    g = _Graph([nodes[index[n]] for n in r.nodes], (), {})
    up, down, interior = _anatomy(g, range(len(r.nodes)), r.gate_up, r.down)
    acts = [n for n in r.nodes if n in interior and base_name(g.node(n).target) in _ACTIVATIONS]
    after_act = _reach(g, acts, interior, forward=True)
    gating = [n for n in r.nodes if n in after_act and base_name(g.node(n).target) == "mul"]

    hidden = nodes[index[r.hidden_input]] if r.hidden_input in index else None
    x_grad = bool(hidden is not None and hidden.requires_grad)
    up_w, down_w = r.gate_up in params, r.down in params   # OpGraph.params holds the trained ones
    rows = float(r.tokens * r.top_k)
    computed = sum(g.node(n).flops_fwd for n in up) / (2.0 * 2 * r.ffn * r.hidden)
    if computed > 0:
        rows = min(rows, computed)   # a capacity below the load drops rows: they are not computed
    flops: dict[str, tuple[float, float]] = {n: (0.0, 0.0) for n in r.nodes}
    _share(g, flops, up, 2.0 * rows * 2 * r.ffn * r.hidden, up_w + x_grad)
    _share(g, flops, down, 2.0 * rows * r.ffn * r.hidden, down_w + (x_grad or up_w))
    for group in (acts, gating):
        needs = [g.node(n).requires_grad for n in group]
        _share(g, flops, group, rows * r.ffn, None, needs)
    return flops


def _share(g: _Graph, flops: dict[str, tuple[float, float]], group: Sequence[str], total: float,
           grad_factor: int | None, needs: Sequence[bool] = ()) -> None:
    """Split ``total`` forward FLOPs over ``group`` in proportion to what each computed (equally when
    none was counted); backward ``grad_factor`` times that, or twice it where ``needs`` says so."""
    if not group:
        return
    counted = [g.node(n).flops_fwd for n in group]
    weights = counted if sum(counted) > 0 else [1.0] * len(group)
    for j, n in enumerate(group):
        fwd = total * weights[j] / sum(weights)
        bwd = fwd * grad_factor if grad_factor is not None else (2.0 * fwd if needs[j] else 0.0)
        flops[n] = (fwd, bwd)
