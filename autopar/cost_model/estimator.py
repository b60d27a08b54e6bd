"""Predict step time and memory of one ParallelConfig: OpGraph + Cluster + config -> Plan.

Step time = pipeline time + exposed data-parallel communication + optimizer step::

    T_step = T_pipe(x_0..x_{p-1}, m, schedule) + T_dp_exposed + T_opt

``x_i``, the work of pipeline device ``i`` per micro-batch, sums its layers' forward,
backward, recomputation and tensor-parallel collectives (layer_cost.py) and two p2p
transfers per model chunk boundary (activations forward, gradients backward; with
tensor parallelism the Megatron scatter/gather optimisation sends ``1/t`` of them).

Data parallelism (ZeRO 0-2): gradients are all-reduced (ZeRO 1/2: reduce-scattered,
then the updated weights all-gathered) in buckets that overlap the backward pass of
the last micro-batch; what is exposed is ``max(T_dp - B_last, T_dp / n_buckets)``.
ZeRO 3 gathers each layer's weights in forward and again in backward and
reduce-scatters its gradients, for every micro-batch, prefetched under compute:
exposed ``max(0, T_ag - F) + max(0, T_ag + T_rs - B)`` per micro-batch.

The optimizer step streams the local shard's weights, gradients and states through
memory once: ``Psi_local (2 K + g + w) / (W e_mem)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import ParallelConfig, Precision
from ..errors import ConfigError
from .comm import Collective, GroupPlacement, collective_time, place_axes
from .layer_cost import LayerCost, LayerCostModel
from .memory import MemoryBreakdown, in_flight, model_state_bytes
from .schedule import even_partition, pipeline_time

DP_BUCKET_BYTES = 25e6  # PyTorch DDP's default bucket size


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

    @property
    def work(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp_comm + self.p2p


def check_config(graph: OpGraph, cluster: Cluster, cfg: ParallelConfig, global_batch_size: int) -> int:
    """Validate the config against cluster and batch; return micro-batches per pipeline."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size!r} must be a positive integer")
    if cfg.devices != cluster.devices:
        raise ConfigError(f"dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp} = {cfg.devices} devices, but the cluster "
                          f"{cluster.describe()} has {cluster.devices}: make the product equal the device count")
    per_step = cfg.dp * cfg.micro_batch_size
    if global_batch_size % per_step:
        raise ConfigError(f"global_batch_size={global_batch_size} does not divide into dp={cfg.dp} replicas x "
                          f"micro_batch_size={cfg.micro_batch_size}: use a global batch that is a multiple of "
                          f"{per_step}, or change dp / micro_batch_size")
    chunks = cfg.pp * cfg.virtual_stages
    blocks = sum(1 for layer in graph.layers if layer.is_block)
    if cfg.schedule == "interleaved" and blocks % chunks:
        raise ConfigError(f"interleaved schedule with pp={cfg.pp} x virtual_stages={cfg.virtual_stages} = {chunks} "
                          f"chunks, but the model's {blocks} repeated layers do not divide by {chunks}: pick "
                          "virtual_stages so that pp * virtual_stages divides the layer count")
    if chunks > len(graph.layers):
        raise ConfigError(f"pp*virtual_stages = {chunks} chunks but the model has only {len(graph.layers)} layers: "
                          "lower pp or virtual_stages")
    return global_batch_size // per_step


@dataclass
class Estimator:
    """Estimates configs of one graph on one cluster; reuse it across configs (it caches layer costs)."""

    graph: OpGraph
    cluster: Cluster
    precision: Precision
    layers: LayerCostModel | None = None

    def __post_init__(self) -> None:
        if self.layers is None:
            self.layers = LayerCostModel(self.graph, self.cluster, self.precision)

    def placements(self, cfg: ParallelConfig) -> dict[str, GroupPlacement]:
        return place_axes(self.cluster, [("tp", cfg.tp), ("dp", cfg.dp), ("pp", cfg.pp)])

    def layer_costs(self, cfg: ParallelConfig, tp_group: GroupPlacement) -> list[LayerCost]:
        return [self.layers.cost(layer, cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, cfg.recompute,
                                 tp_group) for layer in self.graph.layers]

    def devices(self, cfg: ParallelConfig, micro_batches: int) -> list[DeviceCost]:
        groups = self.placements(cfg)
        costs = self.layer_costs(cfg, groups["tp"])
        chunks = even_partition(self.graph, cfg.pp * cfg.virtual_stages,
                                [c.fwd + c.bwd + c.recompute + c.tp_fwd + c.tp_bwd for c in costs])
        p2p = self._p2p_times(cfg, chunks, groups["pp"])
        out = []
        for d in range(cfg.pp):
            mine = [c for c in range(len(chunks)) if c % cfg.pp == d]
            out.append(self._device(cfg, d, [tuple(chunks[c]) for c in mine], sum(p2p[c] for c in mine),
                                    costs, micro_batches, groups["dp"]))
        return out

    def _p2p_times(self, cfg: ParallelConfig, chunks: list[list[int]], group: GroupPlacement) -> list[float]:
        """Per chunk, seconds of p2p per micro-batch: it sends its activations over its outgoing cut
        and its input gradients back over its incoming cut (the matching receives overlap them)."""
        scale = cfg.micro_batch_size / self.graph.batch_size
        split = cfg.tp if cfg.tp > 1 else 1  # Megatron's scatter/gather: each TP rank sends 1/t
        cut = []
        for c in range(len(chunks) - 1):
            bd, const = self.layers.crossing_numel(chunks[c][-1])
            nbytes = (bd * scale / split + const) * self.precision.activation_bytes
            cut.append(collective_time(Collective.P2P, nbytes, group, self.cluster))
        return [(cut[c] if c < len(cut) else 0.0) + (cut[c - 1] if c > 0 else 0.0) for c in range(len(chunks))]

    def _device(self, cfg: ParallelConfig, d: int, chunks: list[tuple[int, ...]], p2p: float,
                costs: list[LayerCost], micro_batches: int, dp_group: GroupPlacement) -> DeviceCost:
        idx = [i for chunk in chunks for i in chunk]
        # each parameter once per device, tied ones included (a pipeline stage may hold a copy)
        params = self._local_params(dict.fromkeys(n for i in idx for n in self._layer_param_names(i)), cfg)
        w, g, k = model_state_bytes(params, self.precision, cfg.zero, cfg.dp)
        per_chunk = [sum(costs[i].activations for i in chunk) for chunk in chunks]
        acts = max(per_chunk) if cfg.schedule == "interleaved" else sum(per_chunk)
        flights = in_flight(cfg, d, micro_batches)
        largest = max(costs[i].largest_tensor for i in idx)
        working = max(costs[i].activations_full for i in idx) if cfg.recompute != "none" else 0.0
        zero3 = 2 * max(self._layer_params(i, cfg) for i in idx) * self.precision.weight_bytes if cfg.zero == 3 else 0
        buffers = 2 * largest + working + zero3
        memory = MemoryBreakdown(params=w, grads=g, optimizer=k, activations=acts * flights, buffers=buffers)
        return DeviceCost(
            chunks=tuple(chunks), fwd=sum(costs[i].fwd for i in idx), bwd=sum(costs[i].bwd for i in idx),
            recompute=sum(costs[i].recompute for i in idx),
            tp_comm=sum(costs[i].tp_fwd + costs[i].tp_bwd for i in idx), p2p=p2p,
            activations=acts, in_flight=flights, params=params, buffers=buffers, memory=memory,
            tp_grad_bytes=sum(self.layers.step_comm_bytes(self.graph.layers[i], cfg.tp) for i in idx))

    def _layer_param_names(self, i: int) -> tuple[str, ...]:
        layer = self.graph.layers[i]
        return layer.params + layer.shared_params

    def _local_params(self, names, cfg: ParallelConfig) -> int:
        """Parameters of ``names`` one device holds after tensor parallelism splits them."""
        split = self.layers.layout(cfg.tp).split_params
        return sum(self.graph.params[n].numel // (cfg.tp if n in split else 1)
                   for n in names if n in self.graph.params)

    def _layer_params(self, i: int, cfg: ParallelConfig) -> int:
        return self._local_params(self._layer_param_names(i), cfg)

    def dp_exposed(self, cfg: ParallelConfig, dev: DeviceCost, micro_batches: int,
                   group: GroupPlacement, tp_group: GroupPlacement | None = None) -> float:
        """Data-parallel / ZeRO communication of one device that compute does not hide, per step
        (with the tensor-parallel group's own gradient all-reduce, when the layout has one)."""
        tp_sync = 0.0
        if dev.tp_grad_bytes and tp_group is not None:
            tp_sync = collective_time(Collective.ALL_REDUCE, dev.tp_grad_bytes, tp_group, self.cluster)
        if cfg.dp == 1:
            return max(tp_sync - (dev.bwd + dev.recompute), 0.0) if tp_sync else 0.0
        grad_bytes = dev.params * self.precision.grad_bytes
        weight_bytes = dev.params * self.precision.weight_bytes
        if cfg.zero == 3:
            ag = collective_time(Collective.ALL_GATHER, weight_bytes, group, self.cluster)
            rs = collective_time(Collective.REDUCE_SCATTER, grad_bytes, group, self.cluster)
            fwd_c, bwd_c = dev.fwd + dev.tp_comm / 2, dev.bwd + dev.recompute + dev.tp_comm / 2
            per_mb = max(0.0, ag - fwd_c) + max(0.0, ag + rs - bwd_c)
            first = ag / max(1, len([i for c in dev.chunks for i in c]))  # the first layer's gather is never hidden
            return micro_batches * per_mb + first + tp_sync
        if cfg.zero == 0:
            total = collective_time(Collective.ALL_REDUCE, grad_bytes, group, self.cluster)
        else:
            total = (collective_time(Collective.REDUCE_SCATTER, grad_bytes, group, self.cluster)
                     + collective_time(Collective.ALL_GATHER, weight_bytes, group, self.cluster))
        total += tp_sync
        buckets = max(1, math.ceil(grad_bytes / DP_BUCKET_BYTES))
        return max(total - (dev.bwd + dev.recompute), total / buckets)

    def optimizer_time(self, cfg: ParallelConfig, dev: DeviceCost) -> float:
        local = dev.params / (cfg.dp if cfg.zero >= 1 else 1)
        p = self.precision
        per_param = 2 * p.optimizer_bytes + p.grad_bytes + p.weight_bytes
        bandwidth = self.cluster.device.memory_bandwidth * self.cluster.device.memory_efficiency
        return local * per_param / bandwidth
