"""The data of one layer group's sharding ILP: strategies, their costs, and resharding costs on edges.

Every number here is priced exactly as the cost model prices the TPLayout built from a
solution (layer_cost.py), so the ILP's time for a layer is the cost model's time for it:

- compute: ``ComputeModel.op_time(node, 1 / B, compute_shard, split_dim, fused)`` with the
  shard and GEMM split dim the layout will state (``B`` the captured batch: one sample); an op
  that reads a ``Shard`` input and all-reduces its own ``R`` output (:func:`splits_work`: the
  vocabulary-parallel cross entropy, a reduction over a split dim) computes ``1 / t`` of its work;
- a forward collective of ``n`` elements costs ``T(n * a * s)`` in forward, plus the same
  again in backward for all-gather, reduce-scatter and all-to-all (their transposes);
  a backward one costs ``T`` in backward (``a`` activation bytes, ``s = 1 / B`` when the
  tensor scales with the batch);
- a step all-reduce of ``n`` parameter elements is exposed by
  ``max(0, T_ar(n * g) / B - bwd_v)``: the gradient all-reduce runs once per step of the
  captured batch's ``B`` samples and overlaps that op's backward over them (the data-parallel
  bucket model), and each sample is charged its share. It is reported apart from the time,
  as the cost model charges it apart (Estimator.dp_exposed);
- memory: parameter states ``n (w + g + K) / t`` when split, saved activations (bytes of one
  sample) divided by ``t`` when the storage root's layout state is ``S`` or the op splits its work.

Resharding a tensor from spec ``a`` (producer) to ``b`` (consumer): same spec free;
``R -> S(d)`` a backward all-gather of the gradient (if it has one); ``S(d) -> R`` all-gather;
``S(d) -> S(e)`` all-to-all; ``P -> R`` all-reduce; ``P -> S(d)`` reduce-scatter; anything else to
``P`` impossible. A constant (a batch-independent value every rank makes whole: ``OpContext.is_const``,
a ``const`` strategy's output) goes to anything but ``P`` for free, and a ``const`` strategy reads
anything for free (it makes its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..capture.opgraph import OpGraph, OpNode
from ..cluster import Cluster
from ..config import Precision
from ..cost_model.comm import SELF_TRANSPOSED, Collective, GroupPlacement, collective_time
from ..cost_model.compute import ComputeModel
from ..cost_model.layer_cost import compute_shard, split_dim
from ..cost_model.memory import saved_owner
from ..cost_model.tensor_parallel import TPLayout, Work
from ..plan.placement import Placement, Shard
from .strategies import Comm, OpContext, P, R, Strategy, node_strategies


def reshard_comms(src: Placement, dst: Placement, numel: int, batch_dependent: bool, grad: bool,
                  src_const: bool = False, dst_const: bool = False) -> tuple[Comm, ...] | None:
    """Collectives that turn spec ``src`` into ``dst`` (None: impossible); ``src_const``: the value is a
    constant, ``dst_const``: a ``const`` strategy reads it (see the module docstring)."""
    if src == dst or dst_const:
        return ()
    if dst == P:
        return None
    if src_const:
        return ()
    if src == R:  # slicing is free; the gradient must be gathered back whole
        return (Comm("all_gather", "bwd", numel, batch_dependent),) if grad else ()
    if src == P:
        kind = "all_reduce" if dst == R else "reduce_scatter"
    else:
        kind = "all_gather" if dst == R else "all_to_all"
    return (Comm(kind, "fwd", numel, batch_dependent),)


@dataclass
class Pricing:
    """Seconds of compute and collectives for one graph, cluster, precision and tensor-parallel degree."""

    graph: OpGraph
    cluster: Cluster
    precision: Precision
    tp: int
    group: GroupPlacement
    fused: frozenset[str]
    model: ComputeModel = field(init=False)
    owner: Mapping[str, int] = field(init=False)    # memory.saved_owner of the graph

    def __post_init__(self) -> None:
        # Priced per sample (``scale``): a GEMM of one sample is a tile or two, where tile and wave
        # quantization would rank strategies by the padding of a product no rank computes at the
        # micro-batches a plan runs; the ILP ranks them with the smooth efficiency, and the step time
        # (layer_cost at the plan's micro-batch) prices the waves of the layout it picks.
        self.model = ComputeModel.of(self.graph, self.cluster.device, self.precision, waves=False)
        self.owner = saved_owner(self.graph)

    @property
    def scale(self) -> float:
        return 1.0 / self.graph.batch_size

    def comm(self, c: Comm) -> float:
        """Seconds one micro-batch spends on ``c`` (forward and backward), as layer_cost prices it."""
        nbytes = c.numel * self.precision.activation_bytes * (self.scale if c.batch_dependent else 1.0)
        t = collective_time(c.kind, nbytes, self.group, self.cluster)
        return 2 * t if (c.phase == "fwd" and c.kind in SELF_TRANSPOSED) else t

    def step(self, numel: int, bwd: float) -> float:
        """Exposed seconds per sample of a once-per-step gradient all-reduce of ``numel`` elements."""
        if not numel:
            return 0.0
        t = collective_time(Collective.ALL_REDUCE, numel * self.precision.grad_bytes, self.group, self.cluster)
        return max(0.0, t / self.graph.batch_size - bwd)

    def compute(self, node: OpNode, s: Strategy) -> tuple[float, float]:
        """(forward, backward) seconds of ``node`` under ``s``, through the cost model's own functions."""
        stub = TPLayout(self.tp, {node.name: layout_state(node, s)}, s.split_params, {}, (),
                        {node.name: s.gemm} if s.gemm else {},
                        split_work=frozenset({node.name}) if splits_work(s) else frozenset())
        t = self.model.op_time(node, self.scale, compute_shard(node, stub, False), split_dim(node, stub), self.fused)
        return t.fwd, t.bwd

    @property
    def param_bytes(self) -> int:
        p = self.precision
        return p.weight_bytes + p.grad_bytes + p.optimizer_bytes


def layout_state(node: OpNode, s: Strategy) -> Work:
    """The TPLayout state of a node's output: SPLIT when each rank computes 1/t of it (a partial output
    without a split weight included, so that the cost model divides its compute), else WHOLE (CONST when
    the node does not depend on the batch)."""
    if isinstance(s.output, Shard) or (s.output == P and not (node.params and node.params[0] in s.split_params)):
        return Work.SPLIT
    return Work.CONST if not node.batch_dependent else Work.WHOLE


def splits_work(s: Strategy) -> bool:
    """Whether each rank computes the op from ``1/t`` of its inputs while its output stays whole: a ``Shard``
    input, an ``R`` output its own all-reduce joins (the vocabulary-parallel cross entropy, a loss split by
    rows, a reduction over a split dim): ``TPLayout.split_work``."""
    return s.output == R and any(isinstance(p, Shard) for p in s.inputs)


@dataclass(frozen=True)
class Boundary:
    """The spec of tensors that cross between layer groups: ``R``, or ``S(0)`` (split along dim 0, the
    batch: data parallelism between groups) for batch-dependent tensors whose dim 0 may split ``t``
    ways (strategies.OpContext.splittable).
    Graph inputs and constants are always ``R`` (every rank has the batch; slicing it is free)."""

    spec: Placement = R

    def of(self, ctx: OpContext, name: str, tp: int) -> Placement:
        if ctx.is_const(name) or self.spec == R or name not in ctx.graph.node_index:
            return R
        node = ctx.graph.node(name)
        split = isinstance(self.spec, Shard) and ctx.splittable(name, self.spec.dim, tp)
        return self.spec if node.batch_dependent and split else R


@dataclass(frozen=True)
class Edge:
    """An activation flowing from group op ``u`` into input ``i`` of group op ``v`` (positions)."""

    u: int
    v: int
    i: int
    comms: Mapping[tuple[Placement, Placement], tuple[Comm, ...]]   # (producer spec, required spec) -> collectives
    costs: Mapping[tuple[Placement, Placement], float]


@dataclass
class GroupProblem:
    """Everything the ILP of one layer group needs; positions index ``nodes``."""

    nodes: list[OpNode]
    strategies: list[list[Strategy]]
    time: list[list[float]]            # seconds per micro-batch: compute, own and boundary collectives
    step: list[list[float]]            # exposed step all-reduce seconds
    memory: list[list[float]]          # bytes
    comms: list[list[tuple[Comm, ...]]]  # own and boundary collectives (for the layout)
    edges: list[Edge]
    partial: dict[str, list[tuple[int, int]]]   # producer -> (op, strategy) leaving its gradient partial
    partial_comm: dict[str, Comm]
    partial_cost: dict[str, float]
    shared: dict[str, list[tuple[int, int, int | None]]]  # parameter read by several ops -> (op, strategy, dim)
    shared_bytes: dict[str, float]     # full state bytes of a shared parameter
    const_memory: float                # bytes no choice changes (saved tensors rooted outside the group)
    tp: int


def build_problem(ctx: OpContext, pricing: Pricing, nodes: Sequence[OpNode], consumers: Mapping[str, list[str]],
                  decided: Mapping[str, int | None], boundary: Boundary = Boundary()) -> GroupProblem:
    """Strategies and costs for the ops ``nodes`` (one layer group, graph order).

    ``consumers``: node -> nodes reading it (graph-wide); ``decided``: parameters whose split dim an
    earlier group fixed (their memory was charged there); ``boundary``: the spec of the tensors that
    enter or leave the group."""
    graph, tp = pricing.graph, pricing.tp
    pos = {n.name: k for k, n in enumerate(nodes)}
    strategies = [_allowed(ctx, n, tp, pos, consumers, decided, boundary) for n in nodes]
    for k, node in enumerate(nodes):  # a P input needs a producer in the group that can make one
        kept = [s for s in strategies[k] if all(
            spec != P or (name in pos and any(o.output == P for o in strategies[pos[name]]))
            for name, spec in zip(node.inputs, s.inputs))]
        strategies[k] = kept or strategies[k][:1]
    readers: dict[str, int] = {}
    for node in nodes:
        for p in dict.fromkeys(node.params):
            if p not in decided:
                readers[p] = readers.get(p, 0) + 1
    owner = pricing.owner
    layers = {n.layer for n in nodes}
    roots: dict[str, float] = {}
    for node in nodes:
        for st in node.saved:
            if owner.get(st.root) in layers and st.root not in roots:
                roots[st.root] = st.nbytes(pricing.precision.activation_bytes, graph.float_dtype) * (
                    pricing.scale if st.batch_dependent else 1.0)
    by_node: dict[str, float] = {}
    const_memory = 0.0
    for root, nbytes in roots.items():
        name = root.split(":")[0]
        if name in pos:
            by_node[name] = by_node.get(name, 0.0) + nbytes
        else:
            outside = name in ctx.graph.node_index or any(gi.name == name for gi in ctx.graph.inputs)
            split = outside and isinstance(boundary.of(ctx, name, tp), Shard)
            const_memory += nbytes / (tp if split else 1)
    prob = GroupProblem(list(nodes), strategies, [], [], [], [], [], {}, {}, {}, {}, {}, const_memory, tp)
    for k, node in enumerate(nodes):
        _price_node(ctx, pricing, prob, k, node, pos, by_node.get(node.name, 0.0), readers,
                    _leave_spec(ctx, node.name, pos, consumers, boundary, tp), boundary)
    for k, node in enumerate(nodes):
        for i, name in enumerate(node.inputs):
            if name in pos and not ctx.is_const(name):
                prob.edges.append(_edge(ctx, pricing, prob, pos[name], k, i, name))
    return prob


def _allowed(ctx: OpContext, node: OpNode, tp: int, pos: Mapping[str, int], consumers: Mapping[str, list[str]],
             decided: Mapping[str, int | None], boundary: Boundary) -> list[Strategy]:
    """Strategies that respect the boundary (an output read outside the group has the boundary spec, or is
    P and reduced to it on the way out) and the parameters earlier groups decided."""
    options = node_strategies(ctx, node, tp)
    leave = _leave_spec(ctx, node.name, pos, consumers, boundary, tp)
    if leave is not None:
        whole = next(s for s in options if s.output == R)
        options = [s for s in options if s.output in (leave, P) or s.const]
        if not any(s.output == leave or s.const for s in options):
            # nothing leaves in the boundary spec itself (e.g. a mask expanded over the batch from a
            # batch-1 capture, whose dims map has no batch dim to split): leave whole, which every
            # boundary spec is reachable from (a split is a local slice); P alone needs a P producer
            options.append(whole)
    options = [s for s in options if all(decided.get(p, d) == d for p, d in s.params)]
    external = [i for i, name in enumerate(node.inputs) if name not in pos]
    options = [s for s in options if all(s.inputs[i] != P for i in external)]
    return options or [node_strategies(ctx, node, 1)[0]]  # (the boundary spec is always reachable from R)


def _leave_spec(ctx: OpContext, name: str, pos: Mapping[str, int], consumers: Mapping[str, list[str]],
                boundary: Boundary, tp: int) -> Placement | None:
    """The spec a group op's output must leave the group in (R for the graph's output), or None when
    only the group reads it."""
    readers = consumers.get(name, [])
    if not readers:
        return R
    return boundary.of(ctx, name, tp) if any(r not in pos for r in readers) else None


def _price_node(ctx: OpContext, pricing: Pricing, prob: GroupProblem, k: int, node: OpNode, pos: Mapping[str, int],
                saved_bytes: float, readers: Mapping[str, int], leave: Placement | None, boundary: Boundary) -> None:
    times, steps, mems, comms = [], [], [], []
    for j, s in enumerate(prob.strategies[k]):
        fwd, bwd = pricing.compute(node, s)
        own = list(s.comms)
        if leave is not None and s.output == P:
            own += reshard_comms(P, leave, node.outputs[0].numel, node.batch_dependent, node.requires_grad) or ()
        for i, name in enumerate(node.inputs):
            if name not in pos:  # enters the group in the boundary spec
                meta = ctx.meta(name)
                bd = name not in ctx.graph.node_index or ctx.graph.node(name).batch_dependent
                own += reshard_comms(boundary.of(ctx, name, pricing.tp), s.inputs[i], meta.numel, bd,
                                     ctx.requires_grad(name), ctx.is_const(name), s.const) or ()
        t = fwd + bwd + sum(pricing.comm(c) for c in own)
        mem = saved_bytes / (pricing.tp if layout_state(node, s) == Work.SPLIT or splits_work(s) else 1)
        for p, d in s.params:
            if readers.get(p, 0) == 1:
                mem += ctx.param_meta[p].numel * pricing.param_bytes / (pricing.tp if d is not None else 1)
            elif readers.get(p, 0) > 1:
                prob.shared.setdefault(p, []).append((k, j, d))
                prob.shared_bytes[p] = ctx.param_meta[p].numel * pricing.param_bytes
        for i in s.partial:
            name = node.inputs[i]
            prob.partial.setdefault(name, []).append((k, j))
            if name not in prob.partial_comm:
                meta = ctx.meta(name)
                bd = name not in ctx.graph.node_index or ctx.graph.node(name).batch_dependent
                prob.partial_comm[name] = Comm("all_reduce", "bwd", meta.numel, bd)
                prob.partial_cost[name] = pricing.comm(prob.partial_comm[name])
        times.append(t)
        steps.append(pricing.step(s.step, bwd))
        mems.append(mem)
        comms.append(tuple(own))
    prob.time.append(times)
    prob.step.append(steps)
    prob.memory.append(mems)
    prob.comms.append(comms)


def _edge(ctx: OpContext, pricing: Pricing, prob: GroupProblem, u: int, v: int, i: int, name: str) -> Edge:
    meta = ctx.meta(name)
    producer = prob.nodes[u]
    outs: dict[Placement, bool] = {}    # spec -> whether a const strategy makes it (all or none of an op's are)
    needs: dict[Placement, bool] = {}
    for s in prob.strategies[u]:
        outs.setdefault(s.output, s.const)
    for s in prob.strategies[v]:
        needs.setdefault(s.inputs[i], s.const)
    comms, costs = {}, {}
    for o, o_const in outs.items():
        for r, r_const in needs.items():
            c = reshard_comms(o, r, meta.numel, producer.batch_dependent, producer.requires_grad, o_const, r_const)
            if c is not None:
                comms[(o, r)] = c
                costs[(o, r)] = sum(pricing.comm(x) for x in c)
    return Edge(u, v, i, comms, costs)


@dataclass(frozen=True)
class Realised:
    """A solution's exact totals and the collectives it implies (node -> comms, in graph order)."""

    choice: tuple[int, ...]
    time: float          # seconds per micro-batch (what the cost model's layer times add up to)
    step: float          # exposed step all-reduce seconds per sample (charged apart)
    memory: float        # bytes
    comms: tuple[tuple[str, Comm | tuple[str, int]], ...]  # (node, Comm) or (node, ("step", numel))


def realise(prob: GroupProblem, choice: Sequence[int]) -> Realised:
    """Totals and collectives of one strategy index per op."""
    time = step = 0.0
    memory = prob.const_memory
    comms: list[tuple[str, object]] = []
    for k, j in enumerate(choice):
        node, s = prob.nodes[k], prob.strategies[k][j]
        time += prob.time[k][j]
        step += prob.step[k][j]
        memory += prob.memory[k][j]
        comms += [(node.name, c) for c in prob.comms[k][j]]
        if s.step:
            comms.append((node.name, ("step", s.step)))
    for e in prob.edges:
        key = (prob.strategies[e.u][choice[e.u]].output, prob.strategies[e.v][choice[e.v]].inputs[e.i])
        time += e.costs[key]
        comms += [(prob.nodes[e.v].name, c) for c in e.comms[key]]
    for name, users in prob.partial.items():
        chosen = [k for k, j in users if choice[k] == j]
        if chosen:
            time += prob.partial_cost[name]
            comms.append((prob.nodes[min(chosen)].name, prob.partial_comm[name]))
    for p, users in prob.shared.items():
        dims = {d for k, j, d in users if choice[k] == j}
        memory += prob.shared_bytes[p] / (prob.tp if dims and None not in dims else 1)
    return Realised(tuple(choice), time, step, memory, tuple(comms))
