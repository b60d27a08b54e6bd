"""Precision.grad_reduce: ZeRO-1's gradients reduce-scattered (each rank receives its shard's sum: parallelize,
Megatron-Core, DeepSpeed from 0.13) or all-reduced (every rank receives the whole sum: DeepSpeed 0.4.4-0.12's stage
1, whose engine turns contiguous_gradients off there). The price follows, by exactly the all-reduce's extra time
where nothing hides it; ZeRO-0 and ZeRO-2/3 do not read it; StepTail.dp_floor stays a lower bound."""

from __future__ import annotations

import pytest

from autopar import Cluster, ConfigError, ParallelConfig, Precision
from autopar.cost_model import Estimator
from autopar.cost_model.comm import Collective
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.cost_model.step_tail import _buckets


def test_default_and_choices():
    assert Precision().grad_reduce == "reduce_scatter"
    with pytest.raises(ConfigError, match="grad_reduce"):
        Precision(grad_reduce="reduce")


def _tail(graph, cluster, precision):
    return Estimator(graph, cluster, precision, LayerCostModel(graph, cluster, precision)).tail


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
