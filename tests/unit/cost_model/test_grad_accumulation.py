"""Precision.grad_accumulation: a stack that adds micro-batches' weight gradients by autograd pays a memory-bound
pass over the device's gradients per micro-batch after the first (StepTail.accumulation_time); Megatron-LM's
gradient-accumulation fusion pays none. The default follows the kernels; the exports write or say it."""

from __future__ import annotations

import pytest

from autopar import Cluster, ConfigError, ParallelConfig, Precision
from autopar.cost_model import estimate_plan
from autopar.exports import export


def test_default_follows_the_kernels():
    assert Precision(kernels="fused").grad_accumulation == "fused"
    assert Precision(kernels="eager").grad_accumulation == "autograd"
    assert Precision(kernels="compiled").grad_accumulation == "autograd"
    assert Precision(kernels="fused", grad_accumulation="autograd").grad_accumulation == "autograd"
    with pytest.raises(ConfigError, match="grad_accumulation"):
        Precision(grad_accumulation="hooks")


@pytest.mark.parametrize("grads", ["bf16", "fp32"])
def test_one_pass_per_micro_batch_after_the_first(graph, grads):
    """At pp = 1 the step is every micro-batch's work: autograd's plan is slower than the fused one's by exactly
    (m - 1) passes reading the accumulated and the new gradients and writing the sum; one micro-batch, none."""
    cluster = Cluster.from_spec("1x1xA100-80GB")
    device = cluster.device
    cfg = ParallelConfig(dp=1, tp=1, pp=1, micro_batch_size=1)
    for m in (1, 4):
        plans = {how: estimate_plan(graph, cluster, cfg, m, Precision(grads=grads, kernels="fused",
                                                                         grad_accumulation=how))
                 for how in ("fused", "autograd")}
        p = plans["autograd"].precision
        params = plans["autograd"].stages[0].param_count
        one = params * (2 * p.grad_bytes + p.weight_bytes) / (device.memory_bandwidth * device.memory_efficiency)
        expected = (m - 1) * one * device.concurrency_slowdown
        assert plans["autograd"].step_time - plans["fused"].step_time == pytest.approx(expected, rel=1e-9, abs=1e-12)
        if m > 1:
            assert expected > 0


def test_zero3_adds_only_its_shard(graph):
    """Under ZeRO-2/3 each micro-batch's gradients are reduce-scattered first: the pass covers the shard."""
    cluster = Cluster.from_spec("1x8xA100-80GB")
    from autopar.cost_model import Estimator
    from autopar.cost_model.layer_cost import LayerCostModel
    precision = Precision(kernels="eager")
    est = Estimator(graph, cluster, precision, LayerCostModel(graph, cluster, precision))
    whole = est.tail.accumulation_time(ParallelConfig(dp=8, zero=1), 1e9, 0.0, 4)
    shard = est.tail.accumulation_time(ParallelConfig(dp=8, zero=3), 1e9, 0.0, 4)
    assert whole > 0 and shard == pytest.approx(whole / 8 * (3 * precision.grad_bytes)
                                                / (2 * precision.grad_bytes + precision.weight_bytes))


def test_exports_write_or_say_it(graph):
    """Megatron-LM fuses by default: an autograd plan's export turns the fusion off; a fused plan exported to a stack
    that accumulates by autograd says it will run slower than predicted."""
    cluster = Cluster.from_spec("1x8xA100-80GB")
    cfg = ParallelConfig(dp=8, tp=1, pp=1, micro_batch_size=1, zero=1)
    autograd = estimate_plan(graph, cluster, cfg, 32, Precision(kernels="fused", grad_accumulation="autograd"))
    fused = estimate_plan(graph, cluster, cfg, 32, Precision(kernels="fused"))
    keys = lambda e: {f.key for f in e.fields}   # noqa: E731
    assert "--no-gradient-accumulation-fusion" in keys(export(autograd, "megatron"))
    assert "--no-gradient-accumulation-fusion" not in keys(export(fused, "megatron"))
    for stack in ("deepspeed", "torchtitan", "accelerate"):
        assert any("grad_accumulation = 'fused'" in w for w in export(fused, stack).warnings), stack
        assert not any("grad_accumulation" in w for w in export(autograd, stack).warnings), stack
