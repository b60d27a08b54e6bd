"""Predict step time and memory of one ParallelConfig: OpGraph + Cluster + config -> Plan.

Step time = pipeline time + exposed data-parallel communication + optimizer step::

    T_step = T_pipe(x_0..x_{p-1}, m, schedule) + T_dp_exposed + T_opt

``x_i``, the work of pipeline device ``i`` per micro-batch, sums its layers' forward,
backward, recomputation and tensor-parallel collectives (layer_cost.py) and two p2p
transfers per model chunk boundary (activations forward, gradients backward). Under tensor
parallelism each rank sends ``1/t`` of a batch-dependent value: its shard where sequence parallelism
splits it, else its ``1/t`` of the whole value every rank holds, which the receiving ranks all-gather
over their tensor-parallel group (Megatron-LM's scatter/gather, DeepSpeed's partitioned pipeline
buffers, runtime/pipeline.py's ``Value.scatter``): each side of a cut pays that all-gather too.

The step's tail, ``T_dp_exposed + T_opt`` (gradient synchronisation, ZeRO's gathers, the loss's
all-reduce, the optimizer step), is priced in step_tail.py; this module assembles each pipeline
device's layers, p2p and memory (the parameters each holds and its ZeRO units: param_tables.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

from ..capture.fusion import for_kernels
from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import SPLIT_BACKWARD, SPLIT_EVERY_BACKWARD, ParallelConfig, Precision
from . import context_parallel, expert_parallel
from .comm import Collective, GroupPlacement, collective_time
from .layer_cost import LayerCost, LayerCostModel, SplitGroups
from ..plan.record import MemoryBreakdown
from ..runtime.buckets import dp_bucket_bytes
from .memory import in_flight, interleaved_peak, model_state_bytes, op_kept, order_peak
from .offload import host_bytes, master_dtype_bytes
from .param_tables import ParamTables
from .mesh import mesh_groups
from .schedule import even_partition
from .step_tail import StepTail


@dataclass(frozen=True)
class DeviceCost:
    """One pipeline device: its chunks' layers and per-micro-batch costs."""

    chunks: tuple[tuple[int, ...], ...]
    fwd: float
    bwd: float
    recompute: float
    tp_comm: float
    p2p: float
    activations: float        # bytes per micro-batch pass (per chunk pass when interleaved)
    in_flight: int
    params: int               # parameters held (after tensor parallelism)
    buffers: float
    memory: MemoryBreakdown
    tp_grad_bytes: float = 0.0  # gradients all-reduced inside the tensor-parallel group once per step
    param_tensors: int = 0      # parameter tensors held (the optimizer's per-tensor work)
    cp_comm: float = 0.0        # context-parallel ring communication not hidden, per micro-batch
    ep_comm: float = 0.0        # expert-parallel all-to-alls, per micro-batch
    expert_params: int = 0      # of ``params``, those of experts (reduced over the expert replicas)
    fwd_comm: float = 0.0       # of the collectives above, the forward's (tensor, context, expert parallel)
    wgrad: float = 0.0          # of ``bwd``, the weight gradients (layer_cost.weight_share)
    reruns: int = 1             # of ``recompute``, the forward reruns (reruns(): two when every backward is split)

    @property
    def work(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp_comm + self.p2p + self.cp_comm + self.ep_comm

    @property
    def passes(self) -> tuple[float, float, float]:
        """(forward, input gradient, weight gradient) seconds of :attr:`work`, as a zero-bubble schedule
        splits it: the forward with its collectives and the p2p it sends, the weight gradients with one
        rerun of the recomputed forward, and the rest (with the other rerun)."""
        forward = self.fwd + self.fwd_comm + self.p2p / 2
        weight = self.wgrad + self.recompute * (self.reruns - 1) / self.reruns
        return forward, self.work - forward - weight, weight


def reruns(cfg: ParallelConfig) -> int:
    """How many times a recomputing layer reruns its forward per micro-batch: once per backward pass, so
    twice under ZB-H1 and ZB-V, whose input- and weight-gradient passes each unpack the layer's
    checkpoint (torch.utils.checkpoint recomputes on each; counted on the runtime's split, test_pipeline).
    DualPipeV's steady pairs run whole backwards: once (its split passes' second rerun is in the
    simulated schedule, cost_model/schedule.py)."""
    return 2 if cfg.schedule in SPLIT_EVERY_BACKWARD and cfg.pp > 1 else 1


def device_p2p(cuts: Sequence[float], chunks: Sequence[Sequence[int]], mine: Sequence[int]) -> float:
    """p2p seconds per micro-batch of the device holding chunks ``mine`` of ``chunks``: each chunk
    receives at its start but the first and sends at its end but the last (``cuts``:
    :meth:`Estimator.p2p_cut_times`), except from and to a chunk of its own (ZB-V's turn: in memory)."""
    own = set(mine)
    return sum((cuts[chunks[c][-1]] if c < len(chunks) - 1 and c + 1 not in own else 0.0)
               + (cuts[chunks[c][0] - 1] if c > 0 and c - 1 not in own else 0.0) for c in mine)


@dataclass
class Estimator(ParamTables):
    """Estimates configs of one graph on one cluster; reuse it across configs (it caches layer costs). What each
    device holds of the parameters, and the ZeRO units of each run of layers, come from :class:`ParamTables`."""

    graph: OpGraph
    cluster: Cluster
    precision: Precision
    layers: LayerCostModel | None = None
    _cuts: dict = field(default_factory=dict)
    _numel: dict = field(default_factory=dict)
    _units: dict = field(default_factory=dict)
    _device_params: dict = field(default_factory=dict)
    _costs: dict = field(default_factory=dict)
    _groups: dict = field(default_factory=dict)   # placements, by (tp, cp, dp, ep, pp)
    _last: tuple = ()    # the last even split's (config, micro-batches, devices): memory, then time
    run_cache: dict = field(default_factory=dict)   # what the stage DP's run tables share (solver/stages.py)
    experts: frozenset[str] = field(init=False)   # the expert parameters (divided by ep)
    layer_flops: tuple[tuple[float, ...], ...] = field(init=False)   # _layer_flops
    sequence_length: int | None = field(init=False)   # what fused attention runs over (context_parallel.py)
    tail: StepTail = field(init=False)   # the step's gradient synchronisation and optimizer (step_tail.py)

    def __post_init__(self) -> None:
        self.graph = for_kernels(self.graph, self.precision.kernels)   # what the program's kernels keep
        if self.layers is None:
            self.layers = LayerCostModel(self.graph, self.cluster, self.precision)
        self.experts = expert_parallel.expert_params(self.graph)
        self.layer_flops = _layer_flops(self.graph)
        self.sequence_length = context_parallel.sequence_length(self.graph)
        self.tail = StepTail(self.cluster, self.precision, self.layers.measured)

    def placements(self, cfg: ParallelConfig) -> Mapping[str, GroupPlacement]:
        """mesh.mesh_groups of ``cfg`` (cached by the degrees it depends on: the search asks for the same
        mesh under every micro-batch size, schedule and ZeRO stage); read-only."""
        key = (cfg.tp, cfg.cp, cfg.dp, cfg.ep, cfg.pp)
        if key not in self._groups:
            self._groups[key] = MappingProxyType(mesh_groups(self.cluster, cfg))
        return self._groups[key]

    def split_groups(self, cfg: ParallelConfig, groups: dict[str, GroupPlacement]) -> SplitGroups:
        return SplitGroups(cp=cfg.cp, cp_group=groups["cp"] if cfg.cp > 1 else None,
                           ep=cfg.ep, ep_group=groups["ep"] if cfg.ep > 1 else None)

    def layer_costs(self, cfg: ParallelConfig, tp_group: GroupPlacement, recompute: str | None = None,
                    groups: dict[str, GroupPlacement] | None = None) -> tuple[LayerCost, ...]:
        """Every layer's cost in one recompute mode (cached: the search prices the same layers under
        many meshes and partitions)."""
        mode = cfg.recompute if recompute is None else recompute
        split = self.split_groups(cfg, groups if groups is not None else self.placements(cfg))
        key = (cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, mode, tp_group, split)
        if key not in self._costs:
            priced = self.kind_costs(cfg, tp_group, mode, split)   # each kind of layer priced once
            self._costs[key] = tuple(priced[k] for k in self.kinds[0])
        return self._costs[key]

    def kind_costs(self, cfg: ParallelConfig, tp_group: GroupPlacement, mode: str,
                   split: SplitGroups) -> list[LayerCost]:
        """The cost of each kind of layer (:attr:`kinds`, LayerCostModel.kind) in one recompute mode: what
        :meth:`layer_costs` repeats for every layer of the kind (not cached here: the layer model caches
        each)."""
        return [self.layers.cost(layer, cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, mode, tp_group, split)
                for layer in self.kinds[1]]

    def least_kind_work(self, cfg: ParallelConfig, tp_group: GroupPlacement, split: SplitGroups) -> list[float]:
        """A floor on each kind of layer's work in every recompute mode (LayerCostModel.least_work), in the
        order of :meth:`kind_costs`: what a bound takes before it prices the layers."""
        return [self.layers.least_work(layer, cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, tp_group, split)
                for layer in self.kinds[1]]

    @functools.cached_property
    def kinds(self) -> tuple[tuple[int, ...], tuple]:
        """(each layer's kind as an index, the first layer of each kind), kinds in order of first layer."""
        index: dict[tuple, int] = {}
        first = []
        for layer in self.graph.layers:
            if self.layers.kind(layer) not in index:
                index[self.layers.kind(layer)] = len(first)
                first.append(layer)
        return tuple(index[self.layers.kind(layer)] for layer in self.graph.layers), tuple(first)

    def peak_memory(self, cfg: ParallelConfig, micro_batches: int,
                    chunks: Sequence[Sequence[int]] | None = None) -> float:
        """The largest per-device memory of ``cfg`` (what :func:`estimate_plan` reports as peak),
        without pricing its time."""
        return max(d.memory.total for d in self.devices(cfg, micro_batches, chunks))

    def devices(self, cfg: ParallelConfig, micro_batches: int,
                chunks: Sequence[Sequence[int]] | None = None) -> list[DeviceCost]:
        """Per pipeline device costs. ``chunks`` (``pp * virtual_stages`` contiguous runs of layer
        indices, device ``d`` holding chunks ``cfg.device_chunks(d)``) defaults to Megatron's even split."""
        if chunks is None and self._last[:2] == (cfg, micro_batches):
            return list(self._last[2])
        out = self._devices(cfg, micro_batches, chunks)
        if chunks is None:
            self._last = (cfg, micro_batches, tuple(out))
        return out

    def _devices(self, cfg: ParallelConfig, micro_batches: int,
                 chunks: Sequence[Sequence[int]] | None) -> list[DeviceCost]:
        groups = self.placements(cfg)

        by_mode: dict[str, tuple[LayerCost, ...]] = {}

        def costs(mode: str) -> tuple[LayerCost, ...]:
            if mode not in by_mode:
                by_mode[mode] = self.layer_costs(cfg, groups["tp"], mode, groups)
            return by_mode[mode]
        if chunks is None:
            uniform = costs(cfg.stage_mode(0))
            chunks = even_partition(self.graph, cfg.pp * cfg.virtual_stages, [c.work for c in uniform],
                                    cfg.v_shaped)
        chunks = [list(c) for c in chunks]
        cuts = self.p2p_cut_times(cfg, groups["pp"])
        recomputable = self.graph.recomputable
        out = []
        for d in range(cfg.pp):
            mine = list(cfg.device_chunks(d))
            p2p = device_p2p(cuts, chunks, mine)
            # each layer at its own mode: with recompute_layers only a chunk's first blocks recompute
            held = {i: costs(m)[i] for c in mine
                    for i, m in zip(chunks[c], cfg.chunk_modes(d, [recomputable[i] for i in chunks[c]]))}
            out.append(self._device(cfg, d, [tuple(chunks[c]) for c in mine], p2p, held, micro_batches))
        return out

    def p2p_cut_times(self, cfg: ParallelConfig, group: GroupPlacement) -> list[float]:
        """Seconds of p2p per micro-batch for a pipeline cut after layer ``l`` (index ``l``), as seen by
        each of the two devices beside it: the sender's activations forward, the receiver's gradients
        back (the matching receives overlap them). Tensor parallelism: each rank sends ``1/t`` of a
        batch-dependent tensor; without sequence parallelism the receivers all-gather it whole over their
        tensor-parallel group (activations on the later device, gradients on the earlier)."""
        key = (cfg.tp, cfg.cp, cfg.micro_batch_size, cfg.sequence_parallel, group)
        if key not in self._cuts:
            gather = cfg.tp > 1 and not cfg.sequence_parallel
            tp_group = self.placements(cfg)["tp"] if gather else None
            self._cuts[key] = [collective_time(Collective.P2P, float(sent), group, self.cluster)
                               + (collective_time(Collective.ALL_GATHER, float(whole), tp_group, self.cluster)
                                  if gather else 0.0)
                               for sent, whole in zip(self._cut_bytes(cfg), self._cut_bytes(cfg, gathered=True))]
        return self._cuts[key]

    def least_cut_time(self, cfg: ParallelConfig, group: GroupPlacement) -> float:
        """The least of :meth:`p2p_cut_times` (0 for a model of one layer), with one collective's
        pricing: a p2p's time grows with its bytes."""
        nbytes = self._cut_bytes(cfg)
        return collective_time(Collective.P2P, float(nbytes.min()), group, self.cluster) if len(nbytes) else 0.0

    def _cut_bytes(self, cfg: ParallelConfig, gathered: bool = False) -> np.ndarray:
        """Bytes one device sends across the cut after each layer but the last, per micro-batch (``gathered``:
        the batch-dependent values whole, as the receivers all-gather them)."""
        bd, const = (a[:len(self.graph.layers) - 1] for a in self.layers.crossing_numels)
        scale = cfg.micro_batch_size / (self.graph.batch_size * cfg.cp)
        if gathered:
            return bd * scale * self.precision.activation_bytes
        return (bd * scale / cfg.tp + const) * self.precision.activation_bytes

    def _device(self, cfg: ParallelConfig, d: int, chunks: list[tuple[int, ...]], p2p: float,
                costs: Mapping[int, LayerCost], micro_batches: int) -> DeviceCost:
        idx = [i for chunk in chunks for i in chunk]
        names, params, experts = self._held(tuple(idx), cfg)
        w, g, k = self.state_bytes(cfg, params, experts)
        per_chunk = [sum(costs[i].activations for i in chunk) for chunk in chunks]
        acts = max(per_chunk) if cfg.virtual_stages > 1 else sum(per_chunk)
        flights = in_flight(cfg, d, micro_batches)
        if cfg.schedule == "interleaved":
            held = interleaved_peak(cfg, d, micro_batches, per_chunk)
        elif cfg.schedule in SPLIT_BACKWARD and cfg.pp > 1:
            held = order_peak(cfg, d, micro_batches, per_chunk)
        else:
            held = acts * flights
        buffers = self.buffer_bytes(cfg, cfg.stage_mode(d), max(costs[i].largest_tensor for i in idx),
                                    max(costs[i].activations_full for i in idx),
                                    max(self._unit_params(chunk, cfg) for chunk in chunks) if cfg.zero >= 2 else 0,
                                    g, params, experts)
        memory = MemoryBreakdown(params=w, grads=g, optimizer=k, activations=held, buffers=buffers)
        rerun = sum(costs[i].recompute for i in idx)   # once per backward pass: twice when it is split
        # the weight gradients added up across micro-batches, in the weight-gradient pass (a mean per micro-batch)
        accumulate = self.tail.accumulation_time(cfg, params, experts, micro_batches) / micro_batches
        return DeviceCost(
            chunks=tuple(chunks), fwd=sum(costs[i].fwd for i in idx),
            bwd=sum(costs[i].bwd for i in idx) + accumulate,
            recompute=rerun * reruns(cfg),
            tp_comm=sum(costs[i].tp_fwd + costs[i].tp_bwd for i in idx), p2p=p2p,
            activations=acts, in_flight=flights, params=params, buffers=buffers, memory=memory,
            tp_grad_bytes=sum(self.layers.step_comm_bytes(self.graph.layers[i], cfg.tp) for i in idx),
            param_tensors=len(names), cp_comm=sum(costs[i].cp_fwd + costs[i].cp_bwd for i in idx),
            ep_comm=sum(costs[i].ep_fwd + costs[i].ep_bwd for i in idx), expert_params=experts,
            fwd_comm=sum(costs[i].tp_fwd + costs[i].cp_fwd + costs[i].ep_fwd for i in idx),
            wgrad=sum(costs[i].wgrad for i in idx) + accumulate, reruns=reruns(cfg))

    def state_bytes(self, cfg: ParallelConfig, params, experts=0.0):
        """(weights, gradients, optimizer state) bytes of ``params`` parameters on one device, ``experts``
        of them expert weights: dense ones ZeRO-sharded over ``dp * cp``, expert ones over ``dp * cp / ep``.
        Floats or numpy arrays."""
        dense = model_state_bytes(params - experts, self.precision, cfg.zero, cfg.grad_replicas)
        expert = model_state_bytes(experts, self.precision, cfg.zero, cfg.expert_replicas)
        w, g, k = (a + b for a, b in zip(dense, expert))
        if cfg.offload == "all" and not self.cluster.device.is_cpu:   # in host memory (offload.py; a CPU is its own)
            return (0.0 * params, 0.0 * params, 0.0 * params)
        if cfg.offload == "optimizer":   # the states in host memory; on a CPU, the master copy beside the weights
            if not self.cluster.device.is_cpu:
                return (w, g, 0.0 * k)
            extra = master_dtype_bytes(self.precision) - self.precision.master_bytes   # beyond the states counted
            k = k + extra * self.optimizer_params(cfg, params, experts)
        return (w, g, k)

    @staticmethod
    def optimizer_params(cfg: ParallelConfig, params, experts=0.0):
        """Parameters a device's optimizer steps: its ZeRO shard of ``params`` (ZeRO >= 1), or all of them."""
        return params if cfg.zero == 0 else cfg.zero_shard(params, experts)

    def host_bytes(self, cfg: ParallelConfig, params, experts=0.0):
        """Host memory a device's offloaded states take (0 without offload; offload.host_bytes)."""
        if cfg.offload == "all":
            return host_bytes(self.precision, cfg, cfg.zero_shard(params, experts))
        return host_bytes(self.precision, cfg, self.optimizer_params(cfg, params, experts))

    def buffer_bytes(self, cfg: ParallelConfig, recompute: str, largest, working, layer_params, grads=0.0,
                     params=0.0, experts=0.0):
        """Transient bytes: two of the largest activation (output and gradient buffers), the
        recomputed layer's working set; under ZeRO-3 two gathered units of weights (prefetch;
        ``layer_params``: the largest unit's); under ZeRO-2/3 two units of gradients (FSDP2 reduce-scatters a
        unit's gradients from a flattened copy, while the next unit's backward makes its own); under ZeRO-2 the
        weights' shards beside the gathered weights (FSDP2 keeps both from the first forward to the last
        backward; ``params``, ``experts``: the device's, of which its shard); under ZeRO-0/1 with gradient
        replicas the bucket the reducer flattens (runtime/data_parallel.py, one at a time; at most the device's
        ``grads``). bench/step_memory.py measures these against a program's peak.
        Works on floats and numpy arrays alike."""
        work = working if recompute != "none" else 0.0
        wb, gb = self.precision.weight_bytes, self.precision.grad_bytes
        zero3 = 2 * layer_params * wb if cfg.zero == 3 else 0.0
        scatter = 2 * layer_params * gb if cfg.zero >= 2 else 0.0
        shards = wb * cfg.zero_shard(params, experts) if cfg.zero == 2 else 0.0
        bucket = 0.0
        if cfg.zero <= 1 and cfg.grad_replicas > 1:
            cap = float(dp_bucket_bytes(cfg.grad_replicas, gb))
            bucket = np.minimum(cap, grads) if isinstance(grads, np.ndarray) else min(cap, float(grads))
        return 2 * largest + work + zero3 + scatter + shards + bucket

    def dp_exposed(self, cfg: ParallelConfig, dev: DeviceCost, micro_batches: int,
                   groups: dict[str, GroupPlacement]) -> float:
        """Data-parallel / ZeRO communication of one device that compute does not hide, per step
        (with the tensor-parallel group's own gradient all-reduce, when the layout has one)."""
        chunks = [self.shard_units(c, cfg) for c in dev.chunks]
        kept = [u for c in chunks for u in c.kept]
        fp8 = None
        if self.precision.gathers_fp8(cfg):   # (elements, tensors) gathered in fp8, all and those in kept units
            held = self._held(tuple(i for c in dev.chunks for i in c), cfg)[0]
            in_kept = self._held(tuple(i for u in kept for i in u), cfg)[0]
            fp8 = tuple(x for names in (held, in_kept) for x in self._fp8_gathered(names))
        # the device's last gradient: its first chunk's first tensor (an interleaved device's last backward is chunk 0)
        lead = float(self.lead_params(cfg)[dev.chunks[0][0]]) if dev.chunks and dev.chunks[0] else 0.0
        return float(self.tail.dp_time(cfg, micro_batches, groups, dev.params, dev.fwd, dev.bwd, dev.recompute,
                                  dev.tp_comm, dev.tp_grad_bytes, sum(len(c.units) for c in chunks),
                                  dev.expert_params, sum(self._layer_params(i, cfg) for u in kept for i in u),
                                  len(kept), fp8, lead))


def _layer_flops(graph: OpGraph) -> tuple[tuple[float, ...], ...]:
    """Per layer, FLOPs at the captured batch, each split into (batch-dependent ops, the others): forward
    + backward of every op, forward of every op, forward of the attention core's ops, forward of the
    ops recompute "op" reruns. Whoever totals them scales the batch-dependent half to the micro-batch."""
    out = [[0.0] * 8 for _ in graph.layers]
    kept = frozenset().union(*(op_kept(graph, layer) for layer in graph.layers))
    for n in graph.nodes:
        row, half = out[n.layer], 0 if n.batch_dependent else 1
        row[half] += n.flops_fwd + n.flops_bwd
        row[2 + half] += n.flops_fwd
        if n.attention_core:
            row[4 + half] += n.flops_fwd
        if n.name not in kept:
            row[6 + half] += n.flops_fwd
    return tuple(tuple(r) for r in out)
