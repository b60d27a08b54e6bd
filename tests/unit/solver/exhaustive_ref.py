"""Reference for the solver's optimality tests: enumerate every configuration, every contiguous
layer partition and every per-stage recompute assignment, and estimate each one.

Deliberately naive and independent of the solver's search, bounds and DP: only the cost
model (``estimate_plan``) and the layouts are shared.
"""

from __future__ import annotations

import itertools

from autopar.config import SPLIT_BACKWARD, ParallelConfig
from autopar.cost_model import context_parallel, estimate_plan, expert_parallel
from autopar.solver.sharding import WHOLE_BATCH
from autopar.solver.space import divisors, placeable


def partitions(n: int, parts: int):
    """Every split of layers 0..n-1 into ``parts`` non-empty contiguous runs."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


def configs(graph, devices: int, global_batch: int, modes, valid=lambda cfg: True, offload: bool = False):
    """Every configuration; with ``offload`` (the device describes a host), the optimizer offloaded (at ZeRO 1-3,
    or 0 on one replica) and ZeRO-3 offloaded whole, on one replica as well."""
    blocks = sum(1 for layer in graph.layers if layer.is_block)
    n = len(graph.layers)
    for tp, cp in itertools.product(divisors(devices), divisors(devices)):
        if devices % (tp * cp) or context_parallel.unsupported(graph, cp) is not None:
            continue
        for pp in divisors(devices // (tp * cp)):
            if pp > n:
                continue
            dp = devices // (tp * cp * pp)
            if global_batch % dp:
                continue
            for ep, mb in itertools.product(divisors(dp), divisors(global_batch // dp)):
                if expert_parallel.unsupported(graph, ep) is not None:
                    continue
                mesh = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
                if not valid(ParallelConfig(**mesh, micro_batch_size=mb)):
                    continue
                m = global_batch // (dp * mb)
                # the zero-bubble schedules: ZB-H1 where its drain is full (m >= pp), ZB-V and DualPipeV with a block
                # a chunk and m >= 2 pp
                scheds = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1)] + [
                    ("interleaved", v) for v in range(2, 9) if blocks and blocks % (pp * v) == 0] + [
                    ("zbh1", 1)] * (m >= pp) + [("zbv", 2), ("dualpipev", 2)] * (2 * pp <= blocks and m >= 2 * pp)
                stages = [0, 1, 2, 3] if dp * cp > 1 else [0]
                sharded = [1, 2, 3] if dp * cp > 1 else [0]   # the optimizer offloaded with its states sharded
                zeros = [(z, "none") for z in stages] + ([(z, "optimizer") for z in sharded] + [(3, "all")]) * offload
                for (sched, v), (zero, off), sp in itertools.product(scheds, zeros, [False, True] if tp > 1 else [False]):
                    split = sched in SPLIT_BACKWARD
                    if split and zero > 1:   # the split backward takes ZeRO 0 or 1
                        continue
                    # and recomputation but per-op (whose checkpoint allows one backward through a layer)
                    tried = [m for m in modes if m != "op"] if split else modes
                    base = dict(**mesh, micro_batch_size=mb, schedule=sched, virtual_stages=v,
                                zero=zero, offload=off, sequence_parallel=sp)
                    if v > 1:   # Megatron's even split
                        for mode in tried:
                            yield ParallelConfig(**base, recompute=mode), None
                            if mode == "full":   # the first k blocks of each chunk only
                                for k in range(1, blocks or n):
                                    yield ParallelConfig(**base, recompute=mode, recompute_layers=k), None
                        continue
                    for stage_modes in itertools.product(tried, repeat=pp):
                        for chunks in partitions(n, pp):
                            extra = {"stage_recompute": stage_modes} if len(set(stage_modes)) > 1 else {}
                            yield ParallelConfig(**base, recompute=stage_modes[0], **extra), chunks


def all_plans(search):
    """(step time, peak memory, config) of every plan of the space (neither depends on the
    device's memory size, only whether a plan fits does)."""
    graph, cluster, gbs = search.graph, search.cluster, search.global_batch_size
    out = []
    for variant in search.layouts:
        est = search.estimator(variant)

        def valid(cfg, variant=variant):
            """The space's rules: uniform placement; a layout that splits the batch runs micro-batches
            that divide by tp, and its WHOLE_BATCH sibling the ones that do not."""
            base = variant.removesuffix(WHOLE_BATCH)
            uneven = cfg.micro_batch_size % cfg.tp and search.splits_batch(cfg.tp, base)
            return placeable(cluster, cfg) and bool(uneven) == (variant != base)
        offload = cluster.device.host is not None and not cluster.device.is_cpu
        for cfg, chunks in configs(graph, cluster.devices, gbs, search.modes, valid, offload):
            plan = estimate_plan(graph, cluster, cfg, gbs, search.precision, est, chunks=chunks)
            out.append((plan.step_time, plan.peak_memory, cfg))
    return out
