"""LayerCostModel.least_work: the floor of a layer's work the search's quick branch floor takes (solver/bounds.py)
is at most the priced work in every recompute mode, for every layer kind, degree, micro-batch, context and
expert parallelism, precision and device; and close enough to it to prune (a floor of zero would pass the first
check and prune nothing)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar import Cluster, ParallelConfig, Precision
from autopar.capture import capture
from autopar.cost_model.compute import ComputeModel
from autopar.cost_model.estimator import Estimator
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.models import GPTConfig, build_gpt
from autopar.models.llama import LlamaConfig, build_llama
from autopar.models.moe import MixtralConfig, build_mixtral
from autopar.solver.sharding_solver import ShardingSolver

MODES = ("none", "selective", "op", "full")


def _graph(name: str):
    if name == "gpt":
        model, inputs = build_gpt(GPTConfig(vocab_size=4096, hidden=1024, heads=8, layers=2, seq_len=1024),
                                  batch_size=1, device="meta")
    elif name == "llama":   # grouped-query attention, SwiGLU, rotary tables
        model, inputs = build_llama(LlamaConfig(vocab_size=4096, hidden=1024, heads=8, kv_heads=2, layers=2,
                                                ffn_hidden=2816, seq_len=2048), batch_size=1, device="meta")
    else:
        model, inputs = build_mixtral(MixtralConfig(vocab_size=4096, hidden=512, heads=8, kv_heads=2, layers=2,
                                                    ffn_hidden=1024, seq_len=512, num_experts=8, top_k=2,
                                                    capacity_factor=None), batch_size=1, device="meta")
    return capture(model, inputs)


def _estimator(graph, cluster, precision) -> Estimator:
    """An estimator on the sharding ILP's fast layouts, as the search prices."""
    layers = LayerCostModel(graph, cluster, precision, layout_fn=ShardingSolver(graph, cluster, precision).layout_fn("fast"))
    return Estimator(graph, cluster, precision, layers)


CASES = [   # (model, cluster, precision, configurations)
    ("gpt", "2x8xA100-80GB", Precision(), [ParallelConfig(dp=16, micro_batch_size=mb) for mb in (1, 4)]
     + [ParallelConfig(dp=4, tp=4, sequence_parallel=sp, micro_batch_size=2) for sp in (False, True)]
     + [ParallelConfig(dp=1, tp=16, micro_batch_size=1)]),
    ("llama", "1x8xH100-SXM", Precision(kernels="fused"),
     [ParallelConfig(dp=2, cp=4, micro_batch_size=1), ParallelConfig(dp=1, tp=2, cp=4, sequence_parallel=True),
      ParallelConfig(dp=4, tp=2, micro_batch_size=2)]),
    ("llama", "1x8xH100-SXM", Precision(compute="fp8"),
     [ParallelConfig(dp=8, micro_batch_size=2), ParallelConfig(dp=2, tp=4, sequence_parallel=True)]),
    ("moe", "2x8xH100-SXM", Precision(), [ParallelConfig(dp=16, ep=8), ParallelConfig(dp=8, tp=2, ep=4)]),
]


@pytest.mark.parametrize("name,spec,precision,configs", CASES, ids=[f"{c[0]}-{c[1]}-{c[2].compute}" for c in CASES])
def test_least_work_floors_every_mode_and_is_close(name, spec, precision, configs):
    est = _estimator(_graph(name), Cluster.from_spec(spec), precision)
    ratios = []
    for cfg in configs:
        groups = est.placements(cfg)
        split = est.split_groups(cfg, groups)
        floors = est.least_kind_work(cfg, groups["tp"], split)
        priced = [est.kind_costs(cfg, groups["tp"], mode, split) for mode in MODES]
        for k, floor in enumerate(floors):
            least = min(costs[k].work for costs in priced)
            assert floor <= least * (1 + 1e-9), (cfg.short(), k, floor, least)
            ratios.append(floor / least)
    # the blocks' floors hold most of their work: efficiency, waves and what only adds are left out
    assert max(ratios) > 0.8 and sorted(ratios)[len(ratios) // 2] > 0.5, ratios


def test_least_work_floors_ranks_that_share_their_cores():
    """A device whose ranks slow each other down (Device.concurrency_slowdown: CPU ranks) and pay the lowered
    code's host dispatch per op (tp > 1): both in the floor as in the pricing."""
    graph = _graph("gpt")
    cluster = Cluster.from_spec("1x4xA100-80GB")
    slow = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, concurrency_slowdown=1.5, dispatch_overhead=2e-5, dispatch_overhead_backward=3e-5))
    est = _estimator(graph, slow, Precision())
    for cfg in (ParallelConfig(dp=4, micro_batch_size=2), ParallelConfig(dp=2, tp=2)):
        groups = est.placements(cfg)
        split = est.split_groups(cfg, groups)
        for floor, cost in zip(est.least_kind_work(cfg, groups["tp"], split),
                               est.kind_costs(cfg, groups["tp"], "none", split)):
            assert 0.5 * cost.work < floor <= cost.work * (1 + 1e-9)


def test_measured_times_have_no_floor():
    graph = _graph("gpt")

    class Measured:
        def lookup(self, node, batch_scale, shard, split_dim, dtype):
            return None

        def optimizer_seconds_per_param(self, kernels):
            return None
    model = ComputeModel(graph, Cluster.from_spec("1x8xA100-80GB").device, "bf16", Measured())
    with pytest.raises(ValueError, match="measured"):
        model.least_time(next(n for n in graph.nodes if n.gemm is not None), 1)
