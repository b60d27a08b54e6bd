"""ZeRO-1's data-parallel collectives, as the program runs them.

Precision.param_gather: the all-gather of the updated weights runs after the optimizer step with nothing beside it
("after_step": parallelize, DeepSpeed, Megatron-Core's default), or under the next step's forward ("overlapped":
Megatron-Core's --overlap-param-gather). Precision.grad_reduce: the gradients reduce-scattered (each rank receives
its shard's sum: parallelize, Megatron-Core, DeepSpeed from 0.13) or all-reduced (every rank receives the whole
sum: DeepSpeed 0.4.4-0.12's stage 1, whose engine turns contiguous_gradients off there). The price follows each;
programs autopar compiles refuse the overlapped gather and the all-reduce; StepTail.dp_floor stays a lower bound
of dp_time either way."""

from __future__ import annotations

import pytest

from autopar import Cluster, ConfigError, ParallelConfig, Precision
from autopar.cost_model import Estimator, estimate_plan
from autopar.cost_model.comm import Collective
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.cost_model.step_tail import _buckets


def test_param_gather_default_and_choices():
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


def test_grad_reduce_default_and_choices():
    assert Precision().grad_reduce == "reduce_scatter"
    with pytest.raises(ConfigError, match="grad_reduce"):
        Precision(grad_reduce="reduce")


@pytest.mark.parametrize("spec", ["2x8xA100-80GB", "1x8xH100-SXM"])
def test_an_all_reduce_costs_its_extra_bytes_at_zero_1_only(graph, spec):
    """With no backward to hide under (bwd 0), all_reduce - reduce_scatter is the all-reduce's time less the
    reduce-scatter's over the same buckets; ZeRO-0 (all-reduce either way) and ZeRO-2 price the same under both."""
    cluster = Cluster.from_spec(spec)
    tails = {how: _tail(graph, cluster, Precision(grad_reduce=how)) for how in ("reduce_scatter", "all_reduce")}
    params, fwd = 2e9, 0.5
    for zero in (0, 1, 2):
        cfg = ParallelConfig(dp=cluster.devices, zero=zero)
        groups = Estimator(graph, cluster, Precision(), LayerCostModel(graph, cluster, Precision())).placements(cfg)
        t = {how: tail.dp_time(cfg, 4, groups, params, fwd, 0.0, 0.0, 0.0, 0.0, 1.0) for how, tail in tails.items()}
        for how, tail in tails.items():
            assert tail.dp_floor(cfg, 4, groups, params) <= t[how] + 1e-12
        if zero != 1:
            assert t["all_reduce"] == pytest.approx(t["reduce_scatter"])
            continue
        tail, nbytes = tails["reduce_scatter"], params * 2
        buckets = _buckets(nbytes, cluster.devices, 2)
        extra = (tail.collective(Collective.ALL_REDUCE, nbytes, groups["dp"], buckets)
                 - tail.collective(Collective.REDUCE_SCATTER, nbytes, groups["dp"], buckets))
        assert extra > 0 and t["all_reduce"] - t["reduce_scatter"] == pytest.approx(extra)
