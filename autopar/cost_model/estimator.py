"""Predict step time and memory of one ParallelConfig: OpGraph + Cluster + config -> Plan.

Step time = pipeline time + exposed data-parallel communication + optimizer step::

    T_step = T_pipe(x_0..x_{p-1}, m, schedule) + T_dp_exposed + T_opt

``x_i``, the work of pipeline device ``i`` per micro-batch, sums its layers' forward,
backward, recomputation and tensor-parallel collectives (layer_cost.py) and two p2p
transfers per model chunk boundary (activations forward, gradients backward; with
tensor parallelism the Megatron scatter/gather optimisation sends ``1/t`` of them).

Data parallelism runs over the ``dp * cp`` ranks holding the same dense weights (context-
parallel ranks see different tokens of the same sequences, so their gradients are reduced
together, as Megatron-Core does), expert weights over the ``dp * cp / ep`` ranks holding the
same experts (expert_parallel.py); ZeRO shards over the same groups. Gradients (ZeRO 0-1) are
all-reduced (ZeRO 1: reduce-scattered, then the updated weights all-gathered) once per step in
buckets (``config.dp_bucket_bytes``: DDP's 25 MB, grown with the group as Megatron-Core grows
them, one collective and one ring latency each) that overlap the backward pass of the last
micro-batch. With ``o`` the fraction of a
collective's time that compute issued meanwhile hides (``Link.overlap``: 1 for NCCL, measured
for gloo, whose threads share the CPU cores) times ``1 - k``, where ``k`` is the compute the
overlapped collective slows down per second of it (``Device.overlap_slowdown``: its kernels take
SMs and memory bandwidth), what is exposed is
``T_dp - o * min(B_last, T_dp - T_dp / n_buckets)`` (the last bucket never hides; with
``o = 1`` this is ``max(T_dp - B_last, T_dp / n_buckets)``).
ZeRO 3 gathers each unit's weights in forward and again in backward (``T_ag'``: all but the kept
units: the chunk's root, which holds the runs outside the repeated block too small for a unit of
their own, and the model's last unit, the final norm and head, whose backward follows its forward at
once; both stay gathered in between, as FSDP2 keeps its root and torchtitan wraps the head) and
reduce-scatters its gradients (one collective per unit: each repeated block, each large run of the
other layers, the root; ModelStructure.shard_units, as the runtime wraps them), for every micro-batch,
prefetched under compute: exposed ``T_ag - o_f min(T_ag, F) + T_ag' + T_rs - o min(T_ag' + T_rs, B)``
per micro-batch, plus the hidden share of the first unit's gather, which nothing hides.
ZeRO 2 (FSDP2 without resharding after forward, and none between the step's micro-batches, as
the runtime runs it) gathers each unit's weights once per step, under the first forward, and
reduce-scatters its gradients after every backward, so that only a shard of them is ever held:
``T_ag - o_f min(T_ag, F)`` plus ``T_rs - o min(T_rs, B)`` per micro-batch, plus the first gather.
Forward prefetch (``o_f = o``) needs a host that runs ahead of its device, as with GPU
streams; on a CPU the compute runs on the thread that would issue the next gather
(FSDP2 prefetches explicitly only in backward), so ``o_f = 0`` there.

The runtime also all-reduces the step's loss (one float) over every device, which is
counted with ``T_dp_exposed``.

The optimizer step streams the local shard's weights, gradients and states through
memory once: ``Psi_local (2 K + g + w) / (W e_mem)``; profiled, it is the measured seconds
per parameter of an AdamW step on the model's own parameters times ``Psi_local``, plus, for
DTensor parameters (tensor parallelism, ZeRO-3), the device's per-op dispatch overhead for
each of the update's ADAM_OPS_PER_TENSOR ops on each parameter tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..capture.opgraph import OpGraph
from ..capture.structure import ShardUnits
from ..cluster import Cluster
from ..config import ParallelConfig, Precision, dp_bucket_bytes
from . import context_parallel, expert_parallel
from .comm import Collective, GroupPlacement, collective_lines, collective_time, place_axes
from .layer_cost import LayerCost, LayerCostModel, SplitGroups
from .memory import MemoryBreakdown, in_flight, interleaved_peak, model_state_bytes, op_kept
from .mesh import mesh_groups
from .schedule import even_partition

# Tensor ops per parameter of torch's single-tensor AdamW (the CPU default): weight decay, the two
# moment updates (lerp_, mul_ + addcmul_), sqrt, div, add_ (eps) and addcdiv_ (torch/optim/adam.py)
ADAM_OPS_PER_TENSOR = 8


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

    @property
    def work(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp_comm + self.p2p + self.cp_comm + self.ep_comm


def device_p2p(cuts: Sequence[float], chunks: Sequence[Sequence[int]], mine: Sequence[int]) -> float:
    """p2p seconds per micro-batch of the device holding chunks ``mine`` of ``chunks``: each chunk
    receives at its start but the first and sends at its end but the last (``cuts``:
    :meth:`Estimator.p2p_cut_times`)."""
    return sum((cuts[chunks[c][-1]] if c < len(chunks) - 1 else 0.0)
               + (cuts[chunks[c][0] - 1] if c > 0 else 0.0) for c in mine)


@dataclass
class Estimator:
    """Estimates configs of one graph on one cluster; reuse it across configs (it caches layer costs)."""

    graph: OpGraph
    cluster: Cluster
    precision: Precision
    layers: LayerCostModel | None = None
    _lines: dict = field(default_factory=dict)
    _cuts: dict = field(default_factory=dict)
    _numel: dict = field(default_factory=dict)
    _units: dict = field(default_factory=dict)
    _device_params: dict = field(default_factory=dict)
    _costs: dict = field(default_factory=dict)
    _last: tuple = ()    # the last even split's (config, micro-batches, devices): memory, then time
    experts: frozenset[str] = field(init=False)   # the expert parameters (divided by ep)
    layer_flops: tuple[tuple[float, ...], ...] = field(init=False)   # _layer_flops
    sequence_length: int | None = field(init=False)   # what fused attention runs over (context_parallel.py)

    def __post_init__(self) -> None:
        self.graph = self.graph.for_kernels(self.precision.kernels)   # what the program's kernels keep
        if self.layers is None:
            self.layers = LayerCostModel(self.graph, self.cluster, self.precision)
        self.experts = expert_parallel.expert_params(self.graph)
        self.layer_flops = _layer_flops(self.graph)
        self.sequence_length = context_parallel.sequence_length(self.graph)

    def placements(self, cfg: ParallelConfig) -> dict[str, GroupPlacement]:
        return mesh_groups(self.cluster, cfg)

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
            kinds: dict[tuple, LayerCost] = {}   # each kind of layer priced once (LayerCostModel.kind)
            for layer in self.graph.layers:
                if self.layers.kind(layer) not in kinds:
                    kinds[self.layers.kind(layer)] = self.layers.cost(
                        layer, cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, mode, tp_group, split)
            self._costs[key] = tuple(kinds[self.layers.kind(layer)] for layer in self.graph.layers)
        return self._costs[key]

    def peak_memory(self, cfg: ParallelConfig, micro_batches: int,
                    chunks: Sequence[Sequence[int]] | None = None) -> float:
        """The largest per-device memory of ``cfg`` (what :func:`estimate_plan` reports as peak),
        without pricing its time."""
        return max(d.memory.total for d in self.devices(cfg, micro_batches, chunks))

    def devices(self, cfg: ParallelConfig, micro_batches: int,
                chunks: Sequence[Sequence[int]] | None = None) -> list[DeviceCost]:
        """Per pipeline device costs. ``chunks`` (``pp * virtual_stages`` contiguous runs of layer
        indices, device ``d`` holding chunks ``d, d + pp, ...``) defaults to Megatron's even split."""
        if chunks is None and self._last[:2] == (cfg, micro_batches):
            return list(self._last[2])
        out = self._devices(cfg, micro_batches, chunks)
        if chunks is None:
            self._last = (cfg, micro_batches, tuple(out))
        return out

    def _devices(self, cfg: ParallelConfig, micro_batches: int,
                 chunks: Sequence[Sequence[int]] | None) -> list[DeviceCost]:
        groups = self.placements(cfg)

        def costs(mode: str) -> tuple[LayerCost, ...]:
            return self.layer_costs(cfg, groups["tp"], mode, groups)
        if chunks is None:
            uniform = costs(cfg.stage_mode(0))
            chunks = even_partition(self.graph, cfg.pp * cfg.virtual_stages, [c.work for c in uniform])
        chunks = [list(c) for c in chunks]
        cuts = self.p2p_cut_times(cfg, groups["pp"])
        recomputable = self.graph.recomputable
        out = []
        for d in range(cfg.pp):
            mine = [c for c in range(len(chunks)) if c % cfg.pp == d]
            p2p = device_p2p(cuts, chunks, mine)
            # each layer at its own mode: with recompute_layers only a chunk's first blocks recompute
            held = {i: costs(m)[i] for c in mine
                    for i, m in zip(chunks[c], cfg.chunk_modes(d, [recomputable[i] for i in chunks[c]]))}
            out.append(self._device(cfg, d, [tuple(chunks[c]) for c in mine], p2p, held, micro_batches))
        return out

    def p2p_cut_times(self, cfg: ParallelConfig, group: GroupPlacement) -> list[float]:
        """Seconds of p2p per micro-batch for a pipeline cut after layer ``l`` (index ``l``), as seen by
        each of the two devices beside it: the sender's activations forward, the receiver's gradients
        back (the matching receives overlap them). Tensor parallelism: Megatron's scatter/gather sends
        ``1/t`` of a batch-dependent tensor from each rank."""
        key = (cfg.tp, cfg.cp, cfg.micro_batch_size, group)
        if key not in self._cuts:
            self._cuts[key] = [collective_time(Collective.P2P, float(b), group, self.cluster)
                               for b in self._cut_bytes(cfg)]
        return self._cuts[key]

    def least_cut_time(self, cfg: ParallelConfig, group: GroupPlacement) -> float:
        """The least of :meth:`p2p_cut_times` (0 for a model of one layer), with one collective's
        pricing: a p2p's time grows with its bytes."""
        nbytes = self._cut_bytes(cfg)
        return collective_time(Collective.P2P, float(nbytes.min()), group, self.cluster) if len(nbytes) else 0.0

    def _cut_bytes(self, cfg: ParallelConfig) -> np.ndarray:
        """Bytes one device sends across the cut after each layer but the last, per micro-batch."""
        bd, const = (a[:len(self.graph.layers) - 1] for a in self.layers.crossing_numels)
        scale = cfg.micro_batch_size / (self.graph.batch_size * cfg.cp)
        return (bd * scale / cfg.tp + const) * self.precision.activation_bytes

    def _device(self, cfg: ParallelConfig, d: int, chunks: list[tuple[int, ...]], p2p: float,
                costs: Mapping[int, LayerCost], micro_batches: int) -> DeviceCost:
        idx = [i for chunk in chunks for i in chunk]
        names, params, experts = self._held(tuple(idx), cfg)
        w, g, k = self.state_bytes(cfg, params, experts)
        per_chunk = [sum(costs[i].activations for i in chunk) for chunk in chunks]
        acts = max(per_chunk) if cfg.schedule == "interleaved" else sum(per_chunk)
        flights = in_flight(cfg, d, micro_batches)
        held = (interleaved_peak(cfg, d, micro_batches, per_chunk) if cfg.schedule == "interleaved"
                else acts * flights)
        buffers = self.buffer_bytes(cfg, cfg.stage_mode(d), max(costs[i].largest_tensor for i in idx),
                                    max(costs[i].activations_full for i in idx),
                                    max(self._unit_params(chunk, cfg) for chunk in chunks) if cfg.zero == 3 else 0)
        memory = MemoryBreakdown(params=w, grads=g, optimizer=k, activations=held, buffers=buffers)
        return DeviceCost(
            chunks=tuple(chunks), fwd=sum(costs[i].fwd for i in idx), bwd=sum(costs[i].bwd for i in idx),
            recompute=sum(costs[i].recompute for i in idx),
            tp_comm=sum(costs[i].tp_fwd + costs[i].tp_bwd for i in idx), p2p=p2p,
            activations=acts, in_flight=flights, params=params, buffers=buffers, memory=memory,
            tp_grad_bytes=sum(self.layers.step_comm_bytes(self.graph.layers[i], cfg.tp) for i in idx),
            param_tensors=len(names), cp_comm=sum(costs[i].cp_fwd + costs[i].cp_bwd for i in idx),
            ep_comm=sum(costs[i].ep_fwd + costs[i].ep_bwd for i in idx), expert_params=experts)

    def _held(self, idx: tuple[int, ...], cfg: ParallelConfig) -> tuple[dict, int, int]:
        """(names, local parameters, local expert parameters) of a device holding layers ``idx``: each
        parameter once, tied ones included (a pipeline stage may hold a copy). Cached: the search
        asks for the same runs of layers many times."""
        key = (idx, cfg.tp, cfg.ep)
        if key not in self._device_params:
            names = dict.fromkeys(n for i in idx for n in self._layer_param_names(i) if n in self.graph.params)
            self._device_params[key] = (names, self._local_params(names, cfg),
                                        self._local_params([n for n in names if n in self.experts], cfg))
        return self._device_params[key]

    def own_params(self, cfg: ParallelConfig) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, the parameters it owns (shared ones counted at their owner only, so a run's
        sum is at most what a device holding it holds) and the expert ones among them, after tensor
        and expert parallelism (cached per tp and ep)."""
        key = ("own", cfg.tp, cfg.ep)
        if key not in self._numel:
            layers = self.graph.layers
            self._numel[key] = (np.array([self._local_params(l.params, cfg) for l in layers], dtype=float),
                                np.array([self._local_params([n for n in l.params if n in self.experts], cfg)
                                          for l in layers], dtype=float))
        return self._numel[key]

    def state_bytes(self, cfg: ParallelConfig, params, experts=0.0):
        """(weights, gradients, optimizer state) bytes of ``params`` parameters on one device, ``experts``
        of them expert weights: dense ones ZeRO-sharded over ``dp * cp``, expert ones over ``dp * cp / ep``.
        Floats or numpy arrays."""
        dense = model_state_bytes(params - experts, self.precision, cfg.zero, cfg.grad_replicas)
        expert = model_state_bytes(experts, self.precision, cfg.zero, cfg.expert_replicas)
        return tuple(a + b for a, b in zip(dense, expert))

    def buffer_bytes(self, cfg: ParallelConfig, recompute: str, largest, working, layer_params):
        """Transient bytes: two of the largest activation (output and gradient buffers), the
        recomputed layer's working set, and ZeRO-3's two gathered units of weights (prefetch;
        ``layer_params``: the largest unit's).
        Works on floats and numpy arrays alike."""
        work = working if recompute != "none" else 0.0
        zero3 = 2 * layer_params * self.precision.weight_bytes if cfg.zero == 3 else 0.0
        return 2 * largest + work + zero3

    def shard_units(self, layers: Sequence[int], cfg: ParallelConfig) -> ShardUnits:
        """The ZeRO-2/3 (FSDP2) units a chunk of ``layers`` is wrapped in (ModelStructure.shard_units, as
        the runtime wraps them): each unit one all-gather and one reduce-scatter."""
        return self.graph.structure.shard_units(layers, lambda i: self._layer_params(i, cfg) > 0)

    def _unit_params(self, layers: Sequence[int], cfg: ParallelConfig) -> int:
        """Parameters of the largest ZeRO-3 unit of a chunk (gathered whole, with the next prefetched)."""
        return max((sum(self._layer_params(i, cfg) for i in unit) for unit in self.shard_units(layers, cfg).units),
                   default=0)

    def unit_tables(self, cfg: ParallelConfig) -> tuple[np.ndarray, ...]:
        """For every run ``[i, j]`` of layers (one stage's chunk): how many ZeRO-2/3 units it makes, the
        parameters of its largest, and the parameters and number of the units ZeRO-3 keeps gathered
        after forward (``ShardUnits.kept``), as ``n x n`` arrays. ModelStructure.shard_units decides each
        layer's unit from the layers before it alone, so the units of ``[i, j]`` are those of ``[i, n)``
        cut at ``j``: one call per start."""
        key = (cfg.tp, cfg.ep)
        if key not in self._units:
            n = len(self.graph.layers)
            params = np.array([self._layer_params(i, cfg) for i in range(n)], dtype=float)
            count, largest, kept, n_kept = (np.zeros((n, n)) for _ in range(4))
            for i in range(n):
                starts, partial = np.zeros(n), np.zeros(n)   # partial: a unit's parameters up to each layer
                units = self.shard_units(range(i, n), cfg)
                for unit in units.units:
                    starts[unit[0]] = 1
                    partial[list(unit)] = np.cumsum(params[list(unit)])
                count[i, i:] = np.cumsum(starts[i:])
                largest[i, i:] = np.maximum.accumulate(partial[i:])
                if units.root:   # the root is kept in every chunk, from its first layer on
                    root = np.zeros(n)
                    root[list(units.root)] = partial[list(units.root)]
                    kept[i, i:] = np.maximum.accumulate(root[i:])
                    n_kept[i, units.root[0]:] = 1
                last = [u for u in units.kept if u != units.root]   # the last unit, of a chunk ending the model
                kept[i, n - 1] += sum(params[list(u)].sum() for u in last)
                n_kept[i, n - 1] += len(last)
            self._units[key] = (count, largest, kept, n_kept)
        return self._units[key]

    def _layer_param_names(self, i: int) -> tuple[str, ...]:
        layer = self.graph.layers[i]
        return layer.params + layer.shared_params

    def _local_params(self, names, cfg: ParallelConfig) -> int:
        """Parameters of ``names`` one device holds after tensor parallelism splits them."""
        return sum(self.local_numel(n, cfg.tp, cfg.ep) for n in names if n in self.graph.params)

    def local_numel(self, name: str, tp: int, ep: int = 1) -> int:
        """Elements of parameter ``name`` one device holds: divided by tp when the layout splits it,
        by ep when it is an expert weight."""
        key = (name, tp, ep)
        if key not in self._numel:
            numel = self.graph.params[name].numel
            numel = numel // tp if name in self.layers.layout(tp).split_params else numel
            self._numel[key] = numel // ep if name in self.experts else numel
        return self._numel[key]

    def _layer_params(self, i: int, cfg: ParallelConfig) -> int:
        key = (i, cfg.tp, cfg.ep)
        if key not in self._numel:
            self._numel[key] = self._local_params(self._layer_param_names(i), cfg)
        return self._numel[key]

    def _ct(self, kind: Collective, nbytes, group: GroupPlacement, calls=1):
        """collective_time on floats or arrays, for ``nbytes`` moved in ``calls`` equal collectives:
        ``min(calls * alpha + beta * nbytes)`` over the collective's lines; 0 for 0 bytes."""
        key = (kind, group)
        if key not in self._lines:
            self._lines[key] = collective_lines(kind, group, self.cluster)
        nbytes = np.asarray(nbytes, dtype=float)
        best = np.min([calls * alpha + beta * nbytes for alpha, beta in self._lines[key]], axis=0)
        return np.where(nbytes > 0, best, 0.0)

    def dp_exposed(self, cfg: ParallelConfig, dev: DeviceCost, micro_batches: int,
                   groups: dict[str, GroupPlacement]) -> float:
        """Data-parallel / ZeRO communication of one device that compute does not hide, per step
        (with the tensor-parallel group's own gradient all-reduce, when the layout has one)."""
        chunks = [self.shard_units(c, cfg) for c in dev.chunks]
        kept = [u for c in chunks for u in c.kept]
        return float(self.dp_time(cfg, micro_batches, groups, dev.params, dev.fwd, dev.bwd, dev.recompute,
                                  dev.tp_comm, dev.tp_grad_bytes, sum(len(c.units) for c in chunks),
                                  dev.expert_params, sum(self._layer_params(i, cfg) for u in kept for i in u),
                                  len(kept)))

    def dp_time(self, cfg: ParallelConfig, micro_batches: int, groups: dict[str, GroupPlacement],
                params, fwd, bwd, recompute, tp_comm, tp_grad_bytes, units, experts=0.0, kept=0.0, n_kept=0.0):
        """:meth:`dp_exposed` on floats or numpy arrays (the stage DP evaluates every layer run at once).

        Gradients go in ``dp_bucket_bytes`` buckets (one collective each); ZeRO-2 and 3 gather and
        reduce-scatter unit by unit (one collective per unit held, ``units``: :meth:`shard_units`);
        ZeRO-3 gathers again for backward every unit but the ``n_kept`` units of ``kept`` parameters
        (``ShardUnits.kept``).
        Dense weights synchronise over ``groups["dp"]`` (dp * cp ranks), the ``experts`` of ``params``
        over ``groups["edp"]``."""
        group, tp_group = groups["dp"], groups["tp"] if cfg.tp > 1 else None
        params = np.asarray(params, dtype=float)
        experts = np.asarray(experts, dtype=float)
        hidden = bwd + recompute
        parts = [(params - experts, group), (experts, groups["edp"])]
        tp_bytes = np.asarray(tp_grad_bytes, dtype=float)
        g_b, w_b = self.precision.grad_bytes, self.precision.weight_bytes
        tp_buckets = _buckets(tp_bytes, cfg.tp, g_b)
        tp_sync = (self._ct(Collective.ALL_REDUCE, tp_bytes, tp_group, tp_buckets) if tp_group is not None else 0.0)
        if cfg.grad_replicas == 1:
            total = tp_sync + 0.0 * params
            return total - self._overlap(tp_group) * np.minimum(hidden, total - total / tp_buckets)
        o = self._overlap(group)
        if cfg.zero >= 2:
            ag = sum(self._ct(Collective.ALL_GATHER, n * w_b, grp, units) for n, grp in parts)
            rs = sum(self._ct(Collective.REDUCE_SCATTER, n * g_b, grp, units) for n, grp in parts)
            fwd_c, bwd_c = fwd + tp_comm / 2, hidden + tp_comm / 2
            # forward prefetch needs a host that runs ahead of its device (GPU streams); a CPU rank
            # computes on the thread that would issue the next gather, so forward hides nothing there
            o_fwd = 0.0 if self.cluster.device.is_cpu else o
            gather = ag - o_fwd * np.minimum(ag, fwd_c)
            first = o_fwd * ag / np.maximum(1, units)  # the first unit's gather is never hidden
            if cfg.zero == 3:   # gathered again for backward, every micro-batch, all but the kept units
                kept = np.asarray(kept, dtype=float)
                again = (self._ct(Collective.ALL_GATHER, (parts[0][0] - kept) * w_b, group, units - n_kept)
                         + self._ct(Collective.ALL_GATHER, experts * w_b, groups["edp"], units))
                return micro_batches * (gather + again + rs - o * np.minimum(again + rs, bwd_c)) + first + tp_sync
            return gather + first + micro_batches * (rs - o * np.minimum(rs, bwd_c)) + tp_sync
        total, buckets = 0.0, 0.0
        for n, grp in parts:
            nb = _buckets(n * g_b, grp.size, g_b)
            buckets = buckets + np.where(n > 0, nb, 0.0)
            if cfg.zero == 0:
                total = total + self._ct(Collective.ALL_REDUCE, n * g_b, grp, nb)
            else:
                total = total + (self._ct(Collective.REDUCE_SCATTER, n * g_b, grp, nb)
                                 + self._ct(Collective.ALL_GATHER, n * w_b, grp, nb))
        buckets = np.maximum(1.0, buckets)
        total = total + tp_sync
        return total - o * np.minimum(hidden, total - total / buckets)

    def dp_floor(self, cfg: ParallelConfig, micro_batches: int, groups: dict[str, GroupPlacement],
                 params: float, experts: float = 0.0) -> float:
        """A lower bound on :meth:`dp_time` of any device holding at least ``params`` parameters
        (``experts`` of the total expert ones, for the mix of groups), whatever its compute: the
        part of each collective compute never hides, ``(1 - o)``, with one call each. Collective
        times are subadditive in bytes (``min`` of ``alpha + beta n`` lines, 0 at 0 bytes), so the
        dense and expert parts together take at least the cheaper group's time for their sum."""
        if cfg.grad_replicas == 1 or params <= 0:
            return 0.0
        spans = [groups["dp"]] + ([groups["edp"]] if experts > 0 else [])

        def least(kind: Collective, nbytes: float) -> float:
            return min(float(self._ct(kind, nbytes, g)) for g in spans)
        o = self._overlap(groups["dp"])
        g_b, w_b = self.precision.grad_bytes * params, self.precision.weight_bytes * params
        if cfg.zero >= 2:
            o_fwd = 0.0 if self.cluster.device.is_cpu else o
            ag, rs = least(Collective.ALL_GATHER, w_b), least(Collective.REDUCE_SCATTER, g_b)
            if cfg.zero == 2:
                return (1 - o_fwd) * ag + micro_batches * (1 - o) * rs
            return micro_batches * ((1 - o_fwd) * ag + (1 - o) * (ag + rs))
        if cfg.zero == 0:
            return (1 - o) * least(Collective.ALL_REDUCE, g_b)
        return (1 - o) * (least(Collective.REDUCE_SCATTER, g_b) + least(Collective.ALL_GATHER, w_b))

    def _overlap(self, group: GroupPlacement | None) -> float:
        """The fraction of a collective's time compute hides on the links ``group`` uses, net of the
        compute the overlap slows down (``Device.overlap_slowdown``)."""
        kept = 1.0 - self.cluster.device.overlap_slowdown
        if group is None:
            return kept
        return kept * (self.cluster.intra_node if group.nodes == 1 else self.cluster.inter_node).overlap

    def loss_share_time(self) -> float:
        """The step's loss, one float, all-reduced over every device once per step (the runtime's
        ``train_step`` returns it on every rank); counted with the data-parallel communication."""
        world = place_axes(self.cluster, [("world", self.cluster.devices)])["world"]
        return collective_time(Collective.ALL_REDUCE, 4.0, world, self.cluster)

    def optimizer_time(self, cfg: ParallelConfig, dev: DeviceCost | float, experts=0.0):
        """The optimizer step of one device (its parameters, ``experts`` of them expert weights, or a
        DeviceCost); floats or arrays. ZeRO divides the dense ones by dp * cp, the experts by dp * cp / ep."""
        params = dev.params if isinstance(dev, DeviceCost) else dev
        params, experts = np.asarray(params, dtype=float), np.asarray(experts, dtype=float)
        if isinstance(dev, DeviceCost):
            experts = np.asarray(float(dev.expert_params))
        local = params if cfg.zero == 0 else (params - experts) / cfg.grad_replicas + experts / cfg.expert_replicas
        measured = self.layers.measured.optimizer_seconds_per_param() if self.layers.measured is not None else None
        if measured is not None:
            out = local * measured
            if isinstance(dev, DeviceCost) and (cfg.tp > 1 or cfg.zero == 3):
                # DTensor parameters (tensor parallelism, FSDP2): every op of the per-tensor update pays
                # the runtime's dispatch overhead
                out = out + dev.param_tensors * ADAM_OPS_PER_TENSOR * self.cluster.device.dispatch_overhead
        else:
            p = self.precision
            per_param = 2 * p.optimizer_bytes + p.grad_bytes + p.weight_bytes
            bandwidth = self.cluster.device.memory_bandwidth * self.cluster.device.memory_efficiency
            out = local * per_param / bandwidth
        out = out * self.cluster.device.concurrency_slowdown   # every rank steps at once (compute.py)
        return float(out) if out.ndim == 0 else out


def _buckets(nbytes, ranks: int, element_bytes: int):
    """Gradient buckets of ``dp_bucket_bytes(ranks, element_bytes)`` (at least one)."""
    return np.maximum(1.0, np.ceil(np.asarray(nbytes, dtype=float) / dp_bucket_bytes(ranks, element_bytes)))


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
