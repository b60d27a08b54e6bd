"""Precision.param_gather: ZeRO-1's all-gather of the updated weights runs after the optimizer step with nothing
beside it ("after_step": parallelize, DeepSpeed, Megatron-Core's default), or under the next step's forward
("overlapped": Megatron-Core's --overlap-param-gather). The price follows; programs autopar compiles refuse the
overlapped one; StepTail.dp_floor stays a lower bound of dp_time either way."""

from __future__ import annotations

import pytest

from autopar import Cluster, ConfigError, ParallelConfig, Precision
from autopar.cost_model import Estimator, estimate_plan
from autopar.cost_model.comm import Collective
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.cost_model.step_tail import _buckets


def test_default_and_choices():
    assert Precision().param_gather == "after_step"
    assert Precision(kernels="fused").param_gather == "after_step"     # Megatron-Core's default too
    with pytest.raises(ConfigError, match="param_gather"):
        Precision(param_gather="prefetch")


def _tail(graph, cluster, precision):
    return Estimator(graph, cluster, precision, LayerCostModel(graph, cluster, precision)).tail


@pytest.mark.parametrize("spec", ["2x8xA100-80GB", "1x8xH100-SXM"])
def test_after_step_exposes_the_whole_gather(graph, spec):
    """After the step the gather is all exposed: after_step - overlapped is the share the next forward hides, at
    most the gather less its first bucket; ZeRO-0 has no gather and prices the same under both."""
    cluster = Cluster.from_spec(spec)
    tails = {how: _tail(graph, cluster, Precision(param_gather=how)) for how in ("after_step", "overlapped")}
    cfg = ParallelConfig(dp=cluster.devices, zero=1)
    groups = Estimator(graph, cluster, Precision(), LayerCostModel(graph, cluster, Precision())).placements(cfg)
    params, fwd, bwd = 2e9, 0.5, 1.0
    t = {how: tail.dp_time(cfg, 4, groups, params, fwd, bwd, 0.0, 0.0, 0.0, 1.0) for how, tail in tails.items()}
    tail = tails["after_step"]   # the gather in the reduction's buckets (bf16 weights and gradients)
    gather = tail.collective(Collective.ALL_GATHER, params * 2, groups["dp"], _buckets(params * 2, cluster.devices, 2))
    assert 0 < t["after_step"] - t["overlapped"] <= gather + 1e-12
    for how, tail in tails.items():   # the bounds' floor stays below the price
        assert tail.dp_floor(cfg, 4, groups, params) <= t[how] + 1e-12
    zero0 = ParallelConfig(dp=cluster.devices, zero=0)
    assert tails["after_step"].dp_time(zero0, 4, groups, params, fwd, bwd, 0.0, 0.0, 0.0, 1.0) == pytest.approx(
        tails["overlapped"].dp_time(zero0, 4, groups, params, fwd, bwd, 0.0, 0.0, 0.0, 1.0))


def test_a_plan_prices_the_gather_it_was_given(graph):
    cluster = Cluster.from_spec("2x8xA100-80GB")
    cfg = ParallelConfig(dp=16, tp=1, pp=1, micro_batch_size=1, zero=1)
    after = estimate_plan(graph, cluster, cfg, 16, Precision())
    hidden = estimate_plan(graph, cluster, cfg, 16, Precision(param_gather="overlapped"))
    assert hidden.step_time < after.step_time
    assert hidden.breakdown.dp_comm < after.breakdown.dp_comm
