"""Cost model: compute, communication, memory and pipeline-schedule time of a configuration."""

from __future__ import annotations

import functools
import re
from typing import Sequence

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import ParallelConfig, Precision
from .estimator import Estimator, reruns
from .mesh import check_config
from .offload import require_host
from .compute import MeasuredTimes
from .layer_cost import LayerCostModel
from ..plan import Plan, Stage, TimeBreakdown
from ..plan.record import MemoryBreakdown
from .schedule import pipeline_time

__all__ = ["Estimator", "MemoryBreakdown", "check_config", "estimate_plan"]


def estimate_plan(graph: OpGraph, cluster: Cluster, cfg: ParallelConfig, global_batch_size: int,
                  precision: Precision | None = None, estimator: Estimator | None = None,
                  chunks: Sequence[Sequence[int]] | None = None, measured: MeasuredTimes | None = None):
    """Predict one configuration's step time, memory and per-stage breakdown as a Plan.

    ``chunks`` fixes the layer partition (``pp * virtual_stages`` contiguous runs of layer
    indices); by default the blocks are split evenly as Megatron-LM does. ``measured`` (profiled op
    times) prices the ops when no ``estimator`` is given."""


    precision = precision or Precision.for_device(cluster.device.name)
    est = estimator or Estimator(graph, cluster, precision, LayerCostModel(graph, cluster, precision, measured))
    m = check_config(graph, cluster, cfg, global_batch_size)
    devices = est.devices(cfg, m, chunks)
    groups = est.placements(cfg)
    pipe = pipeline_time([d.work for d in devices], m, cfg.schedule, cfg.virtual_stages, [d.passes for d in devices],
                         [d.recompute / d.reruns for d in devices])
    # the losses' stage: one micro-batch's backward of its last chunk follows the last loss
    last = devices[cfg.chunk_device(cfg.pp * cfg.virtual_stages - 1)]
    loss = est.tail.loss_share_time(cfg, (last.bwd + last.recompute) / cfg.virtual_stages)
    dp = [est.dp_exposed(cfg, d, m, groups) + loss for d in devices]
    opt = [est.tail.optimizer_time(cfg, d.params, d.expert_params, d.param_tensors) for d in devices]
    slowest = max(range(len(devices)), key=lambda i: devices[i].work)
    tail = max(range(len(devices)), key=lambda i: dp[i] + opt[i])
    s = devices[slowest]
    breakdown = TimeBreakdown(compute=m * (s.fwd + s.bwd), recompute=m * s.recompute, tp_comm=m * s.tp_comm,
                              p2p=m * s.p2p, bubble=pipe.bubble, dp_comm=dp[tail], optimizer=opt[tail],
                              cp_comm=m * s.cp_comm, ep_comm=m * s.ep_comm)
    step = breakdown.total
    names = [layer.name for layer in graph.layers]
    stages = tuple(Stage(
        index=i, layers=tuple(names[j] for c in d.chunks for j in c),
        chunks=tuple(tuple(names[j] for j in c) for c in d.chunks), param_count=d.params,
        fwd_time=d.fwd, bwd_time=d.bwd, recompute_time=d.recompute, tp_comm_time=d.tp_comm, p2p_time=d.p2p,
        in_flight=d.in_flight, activation_per_microbatch=d.activations, memory=d.memory,
        cp_comm_time=d.cp_comm, ep_comm_time=d.ep_comm, expert_param_count=d.expert_params, wgrad_time=d.wgrad)
        for i, d in enumerate(devices))
    peak = max(d.memory.total for d in devices)
    scale = global_batch_size / graph.batch_size
    model_flops, recompute_flops = _flops(est, cfg, scale, devices)
    notes = _layout_notes(graph, est.layers.layout(cfg.tp)) + tuple(graph.warnings)
    fits = peak <= cluster.device.memory
    if cfg.offload != "none" and not cluster.device.is_cpu:   # the states in host memory (offload.py)
        host, held = require_host(cluster.device), max(float(est.host_bytes(cfg, d.params, d.expert_params))
                                                       for d in devices)
        fits = fits and held <= host.memory
        what = ("parameter, gradient and optimizer-state shards" if cfg.offload == "all"
                else "optimizer states, master weights and their gradients")
        notes += (f"offload: {held / 1e9:.1f} GB of {what} per device in host memory (of {host.memory / 1e9:.0f} GB "
                  "per device), the optimizer step on the CPU",)
    return Plan(model_name=graph.model_name, fingerprint=graph.fingerprint, structure=graph.structure,
                loss=graph.loss, cluster=cluster, config=cfg,
                precision=precision, global_batch_size=global_batch_size, micro_batches=m, step_time=step,
                peak_memory=peak, throughput=global_batch_size / step, model_flops=model_flops,
                hardware_flops=model_flops + recompute_flops, breakdown=breakdown, stages=stages,
                fits=fits, notes=notes,
                extra={"sequence_length": est.sequence_length} if cfg.cp > 1 else {})


def _layout_notes(graph: OpGraph, layout) -> tuple[str, ...]:
    """What tensor parallelism keeps whole, by weight family (``layers.*.attn.qkv.weight``): weights no
    split of which divides by tp, and weights the sharding ILP keeps whole by choice."""
    out = []
    if layout.replicated_weights:
        out.append(f"tensor parallelism left {weight_families(layout.replicated_weights)} whole: tp={layout.tp} does "
                   "not divide its split dimension")
    if layout.kept_whole:
        share = sum(graph.params[w].numel for w in layout.kept_whole if w in graph.params) / max(1, graph.param_numel)
        out.append(f"the sharding ILP keeps {weight_families(layout.kept_whole)} whole at tp={layout.tp} "
                   f"({share:.0%} of the parameters): replicating their ops costs less than splitting them at "
                   "this size, under the cost model")
    return tuple(out)


def weight_families(names: Sequence[str]) -> str:
    """Parameter names grouped by family, the layer index a ``*``: ``layers.*.mlp.up.weight (32 layers)``."""
    return _families(tuple(names))


@functools.lru_cache(maxsize=256)
def _families(names: tuple[str, ...]) -> str:
    families: dict[str, int] = {}
    for name in names:
        family = re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", name)
        families[family] = families.get(family, 0) + 1
    return ", ".join(f"{f} ({n} layers)" if n > 1 else f for f, n in families.items())


def _flops(est: Estimator, cfg: ParallelConfig, scale: float, devices) -> tuple[float, float]:
    """(model FLOPs, recomputation FLOPs) per step over the global batch."""
    graph, per_layer = est.graph, est.layer_flops
    model = sum(f[0] * scale + f[1] for f in per_layer)
    mode = {i: m for d, dev in enumerate(devices) for c in dev.chunks
            for i, m in zip(c, cfg.chunk_modes(d, [graph.recomputable[i] for i in c]))}
    rec = 0.0
    for i, f in enumerate(per_layer):
        m = mode.get(i, "none")
        if m == "full":
            rec += f[2] * scale + f[3]
        elif m == "selective":
            rec += f[4] * scale + f[5]
        elif m == "op":
            rec += f[6] * scale + f[7]
    return model, rec * reruns(cfg)
