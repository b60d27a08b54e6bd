"""The gradient a device's backward completes last, and the bucket that holds it.

A bucketed reduction (DDP, Megatron-Core's buffers, FSDP2's units) never splits a tensor, and the tensor its
backward completes last is the first one its forward reads (ParamTables.lead_params: a language model's token
embedding on the first stage). Its bucket's reduction has no backward left to hide under, and ZeRO-1's gather
under the next forward needs it first: StepTail.dp_time exposes at least that tensor's collective, where an
equal share of the buckets was all it exposed before."""

from __future__ import annotations

import numpy as np
import pytest

from autopar import Cluster, ParallelConfig, Precision
from autopar.cost_model import Estimator, estimate_plan
from autopar.cost_model.comm import Collective
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.solver.sharding_solver import ShardingSolver


def _estimator(graph, cluster, precision=Precision()):
    layout = ShardingSolver(graph, cluster, precision).layout_fn("fast")
    return Estimator(graph, cluster, precision, LayerCostModel(graph, cluster, precision, layout_fn=layout))


def test_the_lead_tensor_is_the_first_parameter_a_layer_reads(graph):
    cluster = Cluster.from_spec("1x8xA100-80GB")
    est = _estimator(graph, cluster)
    lead = est.lead_params(ParallelConfig(dp=8))
    assert graph.layers[0].name == "embed.tok" and lead[0] == 4096 * 1024     # the token embedding
    block = next(i for i, layer in enumerate(graph.layers) if layer.name == "blocks.0")
    assert lead[block] == 1024                                                # its first norm's weight
    # the head owns nothing but reads the tied embedding: a stage starting there completes that copy's gradient last
    assert graph.layers[-1].params == () and lead[-1] == 4096 * 1024
    split = est.lead_params(ParallelConfig(dp=4, tp=2))[0]
    assert split == est.local_numel("embed.tok.weight", 2)                    # one rank's share under tp


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_lead_tensors_collective_is_never_hidden(graph, zero):
    """With a backward long enough to hide everything else, what dp_time exposes grows with the lead tensor and is at
    least its reduction (ZeRO 0-1) or its unit's gather and reduce-scatter (ZeRO-3: the step's first and last); a lead
    no larger than an equal bucket's share changes nothing; the floor stays below."""
    cluster = Cluster.from_spec("2x8xA100-80GB")
    precision = Precision(param_gather="overlapped")
    est = _estimator(graph, cluster, precision)
    tail = est.tail
    cfg = ParallelConfig(dp=16, zero=zero)
    groups = est.placements(cfg)
    params, fwd, bwd = 4e9, 10.0, 20.0

    def exposed(lead):
        return float(tail.dp_time(cfg, 1, groups, params, fwd, bwd, 0.0, 0.0, 0.0, 8, lead=lead))

    base = exposed(0.0)
    assert exposed(1e3) == pytest.approx(base)
    leads = [1e8, 5e8, 2e9]
    prices = [exposed(n) for n in leads]
    assert base <= prices[0] <= prices[1] <= prices[2] and prices[2] > base
    kind = Collective.ALL_REDUCE if zero == 0 else Collective.REDUCE_SCATTER
    reduce = float(tail.collective(kind, 2e9 * precision.grad_bytes, groups["dp"]))
    if zero == 3:
        reduce += float(tail.collective(Collective.ALL_GATHER, 2e9 * precision.weight_bytes, groups["dp"]))
    assert prices[2] >= reduce * (1 - cluster.device.overlap_slowdown) - 1e-12
    assert tail.dp_floor(cfg, 1, groups, params) <= min(prices) + 1e-12


def test_a_plan_exposes_its_embeddings_reduction(graph):
    """End to end: a data-parallel plan's exposed data-parallel time is at least the all-reduce of the token
    embedding's gradient, whatever backward runs beside the other buckets."""
    cluster = Cluster.from_spec("2x8xA100-80GB")
    cfg = ParallelConfig(dp=16, micro_batch_size=1, zero=0)
    plan = estimate_plan(graph, cluster, cfg, 16, Precision())
    est = _estimator(graph, cluster)
    embedding = 4096 * 1024 * Precision().grad_bytes
    floor = float(est.tail.collective(Collective.ALL_REDUCE, embedding, est.placements(cfg)["dp"]))
    assert plan.breakdown.dp_comm >= floor - 1e-12
    assert np.isfinite(plan.step_time)
