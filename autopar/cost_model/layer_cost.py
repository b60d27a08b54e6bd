"""Costs of one layer for one micro-batch under a tensor-parallel layout (cached per signature).

A layer's forward is the sum of its ops' forward times plus its forward
tensor-parallel collectives; backward likewise. Recomputation adds forward work to
backward: the whole forward (collectives included) for "full", the attention core's
forward for "selective", for "op" the forward of every op whose output it does not keep (memory.py
``op_kept``) and the forward collectives but reduce-scatters (runtime/recompute.py keeps those).
Under tensor parallelism each op of the generated layer code reads its arguments through the
lowering's conversions (codegen/lower.py), which costs the device's ``dispatch_overhead`` per op
(``dispatch_overhead_backward`` per op of the backward) on the host (measured by the profiler,
profiler/step_conditions.py; 0 for the GPU presets, whose kernels run asynchronously behind the
host).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import numpy as np

from ..capture.fusion import for_kernels
from ..capture.opgraph import Layer, OpGraph, OpKind, OpNode
from ..cluster import Cluster
from ..config import Precision
from . import context_parallel, expert_parallel
from .comm import SELF_TRANSPOSED, Collective, GroupPlacement, collective_time
from .compute import FREE_KINDS, ComputeModel, MeasuredTimes, OpTime, fused_ops
from .low_precision import AMAX_SYNCS, check_device, is_fp8_linear, recipe_of
from .memory import ActivationModel, op_kept, saved_owner
from .tensor_parallel import TPLayout, Work, sequence_gathers, single_rank_layout


@dataclass(frozen=True)
class LayerCost:
    """Seconds and bytes of one layer for one micro-batch on one device."""

    fwd: float               # compute only
    bwd: float
    recompute: float         # extra forward work during backward
    tp_fwd: float            # tensor-parallel collectives in forward
    tp_bwd: float
    activations: float       # bytes kept until backward (under the recompute mode)
    activations_full: float  # bytes it would keep without recomputation
    largest_tensor: float    # bytes of its largest activation
    flops: float             # forward + backward FLOPs (whole layer, all tensor-parallel ranks)
    recompute_flops: float
    cp_fwd: float = 0.0      # context-parallel ring communication compute does not hide
    cp_bwd: float = 0.0
    ep_fwd: float = 0.0      # expert-parallel dispatch and combine all-to-alls
    ep_bwd: float = 0.0
    wgrad: float = 0.0       # of ``bwd``, the weight gradients (:func:`weight_share`): a zero-bubble W pass

    @property
    def comm(self) -> float:
        """Communication on the critical path per micro-batch: tensor, context and expert parallel."""
        return self.tp_fwd + self.tp_bwd + self.cp_fwd + self.cp_bwd + self.ep_fwd + self.ep_bwd

    @property
    def work(self) -> float:
        """Everything this layer costs one device per micro-batch."""
        return self.fwd + self.bwd + self.recompute + self.comm


def weight_share(node: OpNode) -> float:
    """The share of an op's backward that computes its parameters' gradients (what a zero-bubble
    schedule's W pass runs): none without parameters; all of an embedding's (its input, indices, has
    no gradient); half of any other's (a matrix product's backward is two products of its forward's
    size, one for the input and one for the weight; a norm's two reductions likewise)."""
    if not node.params:
        return 0.0
    return 1.0 if node.kind is OpKind.EMBEDDING else 0.5


def split_dim(node: OpNode, layout: TPLayout) -> str:
    """GEMM dimension tensor parallelism splits for this node: "n", "k", "batch" or ""."""
    if layout.tp == 1 or node.gemm is None:
        return ""
    if node.name in layout.gemm_split:
        return layout.gemm_split[node.name]
    if node.params and node.params[0] in layout.split_params:
        return "n" if layout.state.get(node.name) == Work.SPLIT else "k"
    return "batch" if layout.state.get(node.name) == Work.SPLIT else ""


def compute_shard(node: OpNode, layout: TPLayout, sequence_parallel: bool) -> int:
    """Divisor of the node's compute under the layout."""
    if node.params and node.params[0] in layout.split_params:
        return layout.tp
    return layout.work_shard(node.name, sequence_parallel) if node.batch_dependent or layout.state.get(
        node.name) == Work.SPLIT else 1


@dataclass(frozen=True)
class SplitGroups:
    """The groups a layer's communication runs over, beyond tensor parallelism (None: degree 1)."""

    cp: int = 1
    cp_group: GroupPlacement | None = None
    ep: int = 1
    ep_group: GroupPlacement | None = None


NO_SPLIT = SplitGroups()


@dataclass(frozen=True)
class _Timed:
    """A layer priced without recomputation, and what the recompute modes add from it."""

    cost: LayerCost          # recompute "none"
    core_fwd: float          # forward seconds of the attention core (what "selective" recomputes)
    fwd_flops: float
    core_flops: float
    op_fwd: float            # forward seconds of what "op" reruns: ops and collectives
    op_flops: float
    acts: ActivationModel
    scale: float


@dataclass
class LayerCostModel:
    """Layer costs for one graph, cluster and precision; caches by (signature, tp, sp, mb, recompute,
    context- and expert-parallel groups), the op-by-op pricing once for the four recompute modes.

    ``layout_fn`` gives the tensor-parallel layout per degree: the sharding ILP's
    (``ShardingSolver.layout_fn``) for every pricing; the default knows only ``tp = 1``."""

    graph: OpGraph
    cluster: Cluster
    precision: Precision
    measured: MeasuredTimes | None = None
    layout_fn: Callable[[OpGraph, int], TPLayout] = single_rank_layout
    _layouts: dict[int, TPLayout] = field(default_factory=dict)
    _cache: dict[tuple, LayerCost] = field(default_factory=dict)
    _timed: dict[tuple, "_Timed"] = field(default_factory=dict)   # the same keys without the recompute mode
    _step_bytes: dict[tuple[int, int], float] = field(default_factory=dict)
    _owner: Mapping[str, int] | None = None
    _fused: frozenset[str] | None = None
    _acts: dict[tuple[int, bool], ActivationModel] = field(default_factory=dict)   # by (tp, sp)
    _facts: dict[tuple, tuple] = field(default_factory=dict)   # _node_facts, by (layer, tp, sp)
    _comms: dict[tuple, tuple] = field(default_factory=dict)   # _layer_comms, by (layer, tp, sp)
    _op_times: dict[tuple, OpTime] = field(default_factory=dict)   # the graph's op times, by (node, scale, shard, dim)
    _layer_flops: dict[tuple, tuple] = field(default_factory=dict)   # _flops, by (layer, scale)
    _least: dict[tuple, tuple] = field(default_factory=dict)   # least_work's rates, by (kind, tp, sp)
    _comm_times: dict[tuple, tuple[float, float, float]] = field(default_factory=dict)   # _tp_comm's
    expert_load_cv: float = expert_parallel.DEFAULT_LOAD_CV   # spread of the experts' shares of the rows

    def __post_init__(self) -> None:
        check_device(self.cluster.device, self.precision)              # fp8 needs fp8 tensor cores
        self.graph = for_kernels(self.graph, self.precision.kernels)   # what the program's kernels keep

    def layout(self, tp: int) -> TPLayout:
        if tp not in self._layouts:
            self._layouts[tp] = self.layout_fn(self.graph, tp)
        return self._layouts[tp]

    @property
    def owner(self) -> Mapping[str, int]:
        if self._owner is None:
            self._owner = saved_owner(self.graph)
        return self._owner

    @property
    def fused(self) -> frozenset[str]:
        if self._fused is None:
            self._fused = fused_ops(self.graph, self.precision.kernels)
        return self._fused

    @functools.cached_property
    def compute(self) -> ComputeModel:
        """The graph's op times (one model: it caches them)."""
        return ComputeModel.of(self.graph, self.cluster.device, self.precision, self.measured)

    @staticmethod
    def kind(layer: Layer) -> tuple[str, int]:
        """What a layer's cost depends on besides the configuration: its signature, and its place
        unless it is a repeated block (blocks of one signature cost the same)."""
        return layer.signature, -1 if layer.is_block else layer.index

    def cost(self, layer: Layer, tp: int, sp: bool, micro_batch: int, recompute: str,
             tp_group: GroupPlacement, split: SplitGroups = NO_SPLIT) -> LayerCost:
        if not self.graph.recomputable[layer.index]:
            recompute = "none"
        key = (*self.kind(layer), tp, sp, micro_batch, split)
        if (*key, recompute) not in self._cache:
            if key not in self._timed:
                self._timed[key] = self._time(layer, tp, sp, micro_batch, tp_group, split)
            self._cache[(*key, recompute)] = self._recomputed(self._timed[key], layer, recompute)
        return self._cache[(*key, recompute)]

    def least_work(self, layer: Layer, tp: int, sp: bool, micro_batch: int, tp_group: GroupPlacement,
                   split: SplitGroups = NO_SPLIT) -> float:
        """A floor on ``cost(...).work`` of the same arguments in every recompute mode, for a bound that must
        not price every op (solver/bounds.py): its ops at the device's best GEMM efficiency
        (ComputeModel.least_time, linear in the micro-batch: a few numbers per layer kind, degree and
        sequence-parallel choice), its tensor-parallel collectives and host dispatch as :meth:`cost` prices
        them, each attention op's ring under context parallelism with the exposed time of its transfers at
        that floor (attention plus exposed ring only grows with the attention's time: the ring hides at most
        ``(cp - 1) / cp`` of it, context_parallel.ring_exposed), and none of what only adds to them: the
        recomputation, the expert all-to-alls, the busiest expert rank's excess, fp8 casts and scale
        all-reduces. Analytic times only: with ``measured`` op times there is no such floor
        (ComputeModel.least_time raises)."""
        key = (*self.kind(layer), tp, sp)
        if key not in self._least:
            rate = fixed = 0.0
            rings = []   # the attention ops' (node, shard, rate, fixed), which context parallelism rings
            for node, shard, _, _ in self._node_facts(layer, tp, sp):
                r, c = self.compute.least_time(node, shard, self.fused)
                rate, fixed = rate + r.fwd + r.bwd, fixed + c.fwd + c.bwd
                if node.kind is OpKind.ATTENTION:
                    rings.append((node, self.layout(tp).shard(node.name, False), r, c))
            if tp > 1:
                ops, grad_ops = self._flops(layer, 1.0)[:2]
                fixed += (ops * self.cluster.device.dispatch_overhead
                          + grad_ops * self.cluster.device.dispatch_overhead_backward)
            self._least[key] = (rate, fixed, tuple(rings))
        rate, fixed, rings = self._least[key]
        scale = micro_batch / (self.graph.batch_size * split.cp)
        tp_fwd, tp_bwd, _ = self._tp_comm(layer, self.layout(tp), scale, tp_group, sp)
        ring = 0.0
        if split.cp > 1:
            per = self.precision.activation_bytes
            for node, kv_shard, r, c in rings:
                kv = context_parallel.kv_numel(node, self.graph) * scale * per / kv_shard
                f, b = context_parallel.ring_exposed(kv, r.fwd * scale + c.fwd, r.bwd * scale + c.bwd, split.cp,
                                                     split.cp_group, self.cluster)
                ring += f + b
        return rate * scale + fixed + tp_fwd + tp_bwd + ring

    def _recomputed(self, timed: "_Timed", layer: Layer, recompute: str) -> LayerCost:
        """The layer's cost under ``recompute``, from what it costs without."""
        base = timed.cost
        if recompute == "full":   # the ring and the all-to-alls rerun
            recompute_time, recompute_flops = base.fwd + base.tp_fwd + base.cp_fwd + base.ep_fwd, timed.fwd_flops
        elif recompute == "selective":
            recompute_time, recompute_flops = timed.core_fwd + base.cp_fwd, timed.core_flops
        elif recompute == "op":
            recompute_time, recompute_flops = timed.op_fwd, timed.op_flops
        else:
            return base
        return replace(base, recompute=recompute_time, recompute_flops=recompute_flops,
                       activations=timed.acts.layer_bytes(layer, recompute, timed.scale, self.owner))

    def _time(self, layer: Layer, tp: int, sp: bool, micro_batch: int, tp_group: GroupPlacement,
              split: SplitGroups) -> "_Timed":
        layout = self.layout(tp)
        scale = micro_batch / (self.graph.batch_size * split.cp)   # a rank holds 1/cp of each sequence
        model = self.compute
        experts = expert_parallel.region_nodes(self.graph, layer.index) if split.ep > 1 else frozenset()
        imbalance = expert_parallel.imbalance(self.graph, layer.index, split.ep, self.expert_load_cv)
        ops, grad_ops, flops, fwd_flops, core_flops, op_flops = self._flops(layer, scale)
        fwd = bwd = core_fwd = op_fwd = cp_fwd = cp_bwd = wgrad = 0.0
        ring, times, fused = split.cp > 1, self._op_times, self.fused
        for node, shard, dim, is_kept in self._node_facts(layer, tp, sp):
            load = 1.0
            if ring and node.kind is OpKind.ATTENTION:
                t = context_parallel.ring_attention_time(model, node, scale * split.cp, shard, dim, split.cp)
                load = imbalance if node.name in experts else 1.0
                kv = context_parallel.kv_numel(node, self.graph) * scale * self.precision.activation_bytes
                f, b = context_parallel.ring_exposed(kv / layout.shard(node.name, False), t.fwd, t.bwd, split.cp,
                                                     split.cp_group, self.cluster)
                cp_fwd += f
                cp_bwd += b
            elif node.name in experts:
                t = model.op_time(expert_parallel.local_experts(node, split.ep), scale, shard, dim, fused)
                load = imbalance   # the busiest expert rank sets the pace
            else:   # the graph's own op: its time cached by (node, scale, shard, dim) across configurations
                t = times.get((node.name, scale, shard, dim))
                if t is None:
                    t = times[(node.name, scale, shard, dim)] = model.op_time(node, scale, shard, dim, fused)
            fwd += t.fwd * load
            bwd += t.bwd * load
            wgrad += t.bwd * load * weight_share(node)
            if node.attention_core:
                core_fwd += t.fwd
            if not is_kept:
                op_fwd += t.fwd * load
        if tp > 1:  # the lowered layer code's host-side cost per op (its conversions, shape forms)
            fwd += ops * self.cluster.device.dispatch_overhead
            bwd += grad_ops * self.cluster.device.dispatch_overhead_backward
        tp_fwd, tp_bwd, tp_rerun = self._tp_comm(layer, layout, scale, tp_group, sp)
        syncs = self._amax_syncs(layer, tp, sp)
        if syncs:   # tensor-wise fp8 scales of sharded operands: one scalar all-reduce each (low_precision.py)
            t = syncs * collective_time(Collective.ALL_REDUCE, 4.0, tp_group, self.cluster) / 2
            tp_fwd, tp_bwd, tp_rerun = tp_fwd + t, tp_bwd + t, tp_rerun + t
        ep_fwd = ep_bwd = 0.0
        if split.ep > 1:
            ep_fwd, ep_bwd = expert_parallel.dispatch_time(self.graph, layer.index, layout, sp, scale,
                                                           self.precision.activation_bytes, imbalance,
                                                           split.ep_group, self.cluster)
        acts = self._activations(tp, sp)
        full = acts.layer_bytes(layer, "none", scale, self.owner)
        cost = LayerCost(fwd=fwd, bwd=bwd, recompute=0.0, tp_fwd=tp_fwd, tp_bwd=tp_bwd, activations=full,
                         activations_full=full, largest_tensor=acts.largest_tensor([layer], scale), flops=flops,
                         recompute_flops=0.0, cp_fwd=cp_fwd, cp_bwd=cp_bwd, ep_fwd=ep_fwd, ep_bwd=ep_bwd,
                         wgrad=wgrad)
        return _Timed(cost, core_fwd, fwd_flops, core_flops, op_fwd + tp_rerun + cp_fwd + ep_fwd, op_flops, acts,
                      scale)

    def _amax_syncs(self, layer: Layer, tp: int, sp: bool) -> int:
        """Scalar all-reduces of tensor-wise fp8 scales per micro-batch: ``AMAX_SYNCS`` per fp8 linear whose
        GEMM tensor parallelism splits (none without tp, or for row-wise and block scales)."""
        recipe = recipe_of(self.precision)
        if tp == 1 or recipe is None or not recipe.tensor_scale:
            return 0
        return AMAX_SYNCS * sum(1 for node, shard, _, _ in self._node_facts(layer, tp, sp)
                                if shard > 1 and is_fp8_linear(node))

    def _flops(self, layer: Layer, scale: float) -> tuple[int, int, float, float, float, float]:
        """(ops, ops with a backward, FLOPs, forward FLOPs, the attention core's forward FLOPs, forward FLOPs
        recompute "op" reruns) of ``layer`` at micro-batch ``scale``: no layout or group changes them
        (cached)."""
        key = (layer.index, scale)
        if key not in self._layer_flops:
            ops = grad_ops = 0
            flops = fwd_flops = core_flops = op_flops = 0.0
            kept = op_kept(self.graph, layer)
            for node in self.graph.layer_nodes(layer):
                ops += 1
                grad_ops += node.requires_grad
                node_scale = scale if node.batch_dependent else 1.0
                flops += (node.flops_fwd + node.flops_bwd) * node_scale
                fwd_flops += node.flops_fwd * node_scale
                if node.attention_core:
                    core_flops += node.flops_fwd * node_scale
                if node.name not in kept:
                    op_flops += node.flops_fwd * node_scale
            self._layer_flops[key] = (ops, grad_ops, flops, fwd_flops, core_flops, op_flops)
        return self._layer_flops[key]

    def _tp_comm(self, layer: Layer, layout: TPLayout, scale: float, group: GroupPlacement,
                 sp: bool) -> tuple[float, float, float]:
        """(forward, backward, forward but reduce-scatters: what recompute "op" reruns) seconds (cached: a bound
        takes them before the layer is priced, least_work)."""
        key = (*self.kind(layer), layout.tp, scale, group, sp)
        if key not in self._comm_times:
            self._comm_times[key] = self._price_comms(layer, layout, scale, group, sp)
        return self._comm_times[key]

    def _price_comms(self, layer: Layer, layout: TPLayout, scale: float, group: GroupPlacement,
                     sp: bool) -> tuple[float, float, float]:
        fwd = bwd = rerun = 0.0
        per = self.precision.activation_bytes
        for comm in self._layer_comms(layer, layout, sp):
            nbytes = comm.numel * per * (scale if comm.batch_dependent else 1.0)
            kind = Collective.of(comm.kind)
            t = collective_time(kind, nbytes, group, self.cluster)
            if comm.phase == "fwd":
                fwd += t
                rerun += t if kind is not Collective.REDUCE_SCATTER else 0.0
                if kind in SELF_TRANSPOSED:
                    bwd += t  # backward of a gather is a reduce-scatter of the same volume (and vice versa)
            else:
                bwd += t
        return fwd, bwd, rerun

    def _node_facts(self, layer: Layer, tp: int, sp: bool) -> tuple[tuple[OpNode, int, str, bool], ...]:
        """(node, compute shard, split GEMM dim, kept by recompute "op") of each node of ``layer`` under
        tp's layout that takes time (views cost nothing: compute.py): what its pricing needs that no
        micro-batch size changes (cached)."""
        key = (layer.index, tp, sp)
        if key not in self._facts:
            layout, kept = self.layout(tp), op_kept(self.graph, layer)
            self._facts[key] = tuple((node, compute_shard(node, layout, sp), split_dim(node, layout), node.name in kept)
                                     for node in self.graph.layer_nodes(layer) if node.kind not in FREE_KINDS)
        return self._facts[key]

    def _layer_comms(self, layer: Layer, layout: TPLayout, sp: bool) -> tuple:
        """The layer's tensor-parallel collectives per micro-batch (the layout's, and under sequence
        parallelism its gathers), without the once-per-step gradient ones (Estimator.dp_exposed); cached."""
        key = (layer.index, layout.tp, sp)
        if key not in self._comms:
            gathers = sequence_gathers(self.graph, layout, self.graph.layer_nodes(layer)) if sp else []
            self._comms[key] = tuple(c for c in (*layout.comms.get(layer.index, ()), *gathers) if c.phase != "step")
        return self._comms[key]

    def _activations(self, tp: int, sp: bool) -> ActivationModel:
        """The activation model of tp's layout (one per layout: it caches each layer's terms)."""
        if (tp, sp) not in self._acts:
            self._acts[(tp, sp)] = ActivationModel(self.graph, self.layout(tp), self.precision, sp)
        return self._acts[(tp, sp)]

    def step_comm_bytes(self, layer: Layer, tp: int) -> float:
        """Gradient bytes this layer all-reduces inside its tensor-parallel group once per step."""
        key = (layer.index, tp)
        if key not in self._step_bytes:
            self._step_bytes[key] = sum(c.numel for c in self.layout(tp).comms.get(layer.index, ())
                                        if c.phase == "step") * self.precision.grad_bytes
        return self._step_bytes[key]

    @functools.cached_property
    def crossing_numels(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch-dependent, constant) elements produced at or before layer ``l`` and used after it,
        for every cut ``l`` (graph inputs excluded: every rank has the batch; and the values computed
        from the batch and buffers alone, which each reading chunk computes again: capture/replicated.py),
        in one pass: a tensor produced in layer ``a`` whose last user is in layer ``b > a`` crosses the
        cuts after ``a, ..., b - 1``."""
        graph = self.graph
        last: dict[str, int] = {}
        for layer in graph.layers:
            for name in layer.inputs:
                last[name] = max(last.get(name, -1), layer.index)
        bd, const = np.zeros(len(graph.layers) + 1, dtype=np.int64), np.zeros(len(graph.layers) + 1, dtype=np.int64)
        for name, used in last.items():
            if name not in graph.node_index:
                continue
            node = graph.node(name)
            if name in graph.replicated or node.layer >= used:
                continue
            out = bd if node.batch_dependent else const
            out[node.layer] += node.outputs[0].numel
            out[used] -= node.outputs[0].numel
        return np.cumsum(bd), np.cumsum(const)
