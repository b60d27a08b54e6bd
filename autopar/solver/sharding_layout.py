"""Layer groups of the sharding ILP, solved groups, and a solution turned into a TPLayout.

Groups (see sharding.py): the non-block layers together, and one group per block signature,
solved on its first layer and copied to every other layer of the signature whose ops match
position by position (target, dims map, output shape, which inputs come from inside the layer,
which outputs leave it, parameter shapes); a layer that does not match is solved on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..capture.opgraph import Layer, OpGraph, OpNode
from ..cost_model.tensor_parallel import TPComm, TPLayout, Work, sequence_split_nodes
from ..errors import AutoparError
from .sharding_problem import GroupProblem, Realised, layout_state, realise, splits_work
from ..plan.placement import Placement, Replicate
from .strategies import Comm, Strategy


@dataclass(frozen=True)
class LayerGroup:
    """Layers solved together: ``solved`` in one ILP, each of ``copies`` takes the solution by position."""

    key: str
    solved: tuple[int, ...]
    copies: tuple[tuple[int, Mapping[str, str], Mapping[str, str]], ...]  # (layer, node map, param map)


def consumers_of(graph: OpGraph) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            out.setdefault(name, []).append(node.name)
    return out


def layer_groups(graph: OpGraph, consumers: Mapping[str, list[str]]) -> list[LayerGroup]:
    """Non-block layers together; each block signature solved on its first layer and copied
    (``consumers``: :func:`consumers_of` the graph)."""
    groups: list[LayerGroup] = []
    rest = tuple(layer.index for layer in graph.layers if not layer.is_block)
    if rest:
        groups.append(LayerGroup("non-block", rest, ()))
    firsts: dict[str, Layer] = {}
    copies: dict[str, list] = {}
    for layer in graph.layers:
        if not layer.is_block:
            continue
        first = firsts.setdefault(layer.signature, layer)
        if first is layer:
            copies[layer.signature] = []
            continue
        maps = _match(graph, first, layer, consumers)
        if maps is None:
            groups.append(LayerGroup(f"layer {layer.name}", (layer.index,), ()))
        else:
            copies[layer.signature].append((layer.index,) + maps)
    for sig, first in firsts.items():
        groups.append(LayerGroup(f"signature {sig}", (first.index,), tuple(copies[sig])))
    return sorted(groups, key=lambda g: g.solved[0])


def _match(graph: OpGraph, a: Layer, b: Layer, consumers: Mapping[str, list[str]]
           ) -> tuple[dict[str, str], dict[str, str]] | None:
    """Node and parameter maps from layer ``a`` to ``b`` when they match op for op, else None."""
    if len(a.nodes) != len(b.nodes):
        return None
    na, nb = [graph.nodes[i] for i in a.nodes], [graph.nodes[i] for i in b.nodes]
    pa = {n.name: k for k, n in enumerate(na)}
    pb = {n.name: k for k, n in enumerate(nb)}
    nodes, params = {}, {}
    for x, y in zip(na, nb):
        if (x.target, x.dims, x.outputs[0].shape, len(x.inputs), len(x.params)) != \
                (y.target, y.dims, y.outputs[0].shape, len(y.inputs), len(y.params)):
            return None
        for i, j in zip(x.inputs, y.inputs):
            if pa.get(i, -1) != pb.get(j, -1):
                return None
        if _readers(consumers, x.name, pa) != _readers(consumers, y.name, pb):
            return None
        for p, q in zip(x.params, y.params):
            if graph.params[p].shape != graph.params[q].shape:
                return None
            params[p] = q
        nodes[x.name] = y.name
    return nodes, params


def _readers(consumers: Mapping[str, list[str]], name: str, pos: Mapping[str, int]) -> tuple:
    """(positions of the readers inside the layer, whether any reads it outside or none reads it at all)."""
    readers = consumers.get(name, [])
    return tuple(sorted({pos[r] for r in readers if r in pos})), not readers or any(r not in pos for r in readers)


@dataclass
class GroupSolution:
    """One solved layer group: its ILP data, the chosen strategies and the boundary spec it assumed."""

    group: LayerGroup
    problem: GroupProblem
    result: Realised
    boundary: Placement = Replicate()
    stats: Mapping[str, Any] = field(default_factory=dict)   # ILP size and seconds


def evaluate_layout(solution: GroupSolution, layout: TPLayout) -> Realised:
    """Another layout (Megatron's rules, say) priced by the same group ILP: each op takes the strategy
    with the layout's state and split parameters, the cheapest given its producers' choices."""
    gp = solution.problem
    choice: list[int] = []
    into: dict[int, list] = {}
    for e in gp.edges:
        into.setdefault(e.v, []).append(e)
    for k, node in enumerate(gp.nodes):
        split = bool(node.params) and node.params[0] in layout.split_params   # the weight (not its bias)
        state = layout.state.get(node.name, Work.WHOLE)
        best, best_cost = None, 0.0
        for j, s in enumerate(gp.strategies[k]):
            mine = bool(node.params) and node.params[0] in s.split_params
            if (mine != split or (layout_state(node, s) == Work.SPLIT) != (state == Work.SPLIT)  # WHOLE, CONST alike
                    or splits_work(s) != (node.name in layout.split_work)):
                continue
            keys = [(gp.strategies[e.u][choice[e.u]].output, s.inputs[e.i]) for e in into.get(k, [])]
            if any(key not in e.costs for key, e in zip(keys, into.get(k, []))):
                continue
            cost = gp.time[k][j] + gp.step[k][j] + sum(e.costs[key] for key, e in zip(keys, into.get(k, [])))
            if best is None or cost < best_cost:
                best, best_cost = j, cost
        if best is None:
            raise AutoparError(f"no strategy of {node.name} reproduces the layout's state {state.name} with its "
                               f"weight {'split' if split else 'whole'}")
        choice.append(best)
    return realise(gp, choice)


def totals(solutions: Sequence[GroupSolution]) -> tuple[float, float]:
    """(time + exposed step seconds per sample, memory bytes) over every layer the groups cover."""
    time = sum((s.result.time + s.result.step) * (1 + len(s.group.copies)) for s in solutions)
    memory = sum(s.result.memory * (1 + len(s.group.copies)) for s in solutions)
    return time, memory


def assemble(graph: OpGraph, tp: int, solutions: Sequence[GroupSolution]) -> TPLayout:
    """The TPLayout of solved groups: states, split parameters, collectives per layer, GEMM split dims."""
    state: dict[str, Work] = {gi.name: Work.WHOLE for gi in graph.inputs}
    split: set[str] = set()
    replicated: list[str] = []
    whole: list[str] = []
    comms: dict[int, list[TPComm]] = {}
    gemm: dict[str, str] = {}
    names: dict[str, str] = {}
    split_work: set[str] = set()
    for sol in solutions:
        maps = [({}, {})] + [(nm, pm) for _, nm, pm in sol.group.copies]
        chosen = [sol.problem.strategies[k][j] for k, j in enumerate(sol.result.choice)]
        weights: dict[int, tuple[str, bool] | None] = {}   # by op: its weight and whether a split of it divides
        for nmap, pmap in maps:
            for k, node in enumerate(sol.problem.nodes):
                s = chosen[k]
                name = nmap.get(node.name, node.name)
                target = graph.node(name)
                state[name] = layout_state(target, s)
                names[name] = s.name
                if splits_work(s):
                    split_work.add(name)
                if s.gemm and target.gemm is not None:
                    gemm[name] = s.gemm
                split.update(pmap.get(p, p) for p, d in s.params if d is not None)
                if node.params and target.kind.value in ("matmul", "conv", "embedding", "view"):
                    if k not in weights:
                        weights[k] = _weight(graph, node, sol.problem.strategies[k])
                    if weights[k] is not None:
                        weight, splittable = weights[k]
                        # no split of it divides by tp, or the ILP keeps it whole (replicating the op is cheaper)
                        (whole if splittable else replicated).append(pmap.get(weight, weight))
            for owner, c in sol.result.comms:
                name = nmap.get(owner, owner)
                layer = graph.node(name).layer
                comms.setdefault(layer, []).append(_tp_comm(name, c))
    replicated = [p for p in dict.fromkeys(replicated) if p not in split]
    whole = [p for p in dict.fromkeys(whole) if p not in split and p not in replicated]
    return TPLayout(tp, state, frozenset(split), {k: tuple(v) for k, v in sorted(comms.items())},
                    tuple(replicated), gemm, names, sequence_split_nodes(graph, state, tp), tuple(whole),
                    frozenset(split_work))


def _weight(graph: OpGraph, node: OpNode, strategies: Sequence[Strategy]) -> tuple[str, bool] | None:
    """The op's weight (its parameter of most dims) and whether any of its strategies splits it; None
    when that is not a matrix (a bias, a norm's scale)."""
    weight = max(node.params, key=lambda p: len(graph.params[p].shape) if p in graph.params else 0)
    if weight not in graph.params or len(graph.params[weight].shape) < 2:
        return None
    return weight, any(d is not None for o in strategies for p, d in o.params if p == weight)


def _tp_comm(name: str, c: Comm | tuple[str, int]) -> TPComm:
    if isinstance(c, Comm):
        return TPComm(name, c.kind, c.phase, c.numel, c.batch_dependent)
    return TPComm(name, "all_reduce", "step", c[1], False)
