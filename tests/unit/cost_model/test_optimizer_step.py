"""The optimizer step of DTensor parameters (FSDP2's, ZeRO-2/3): DTensor dispatches every op of each tensor's
update, which the device's measured ``dtensor_step_overhead`` prices per parameter tensor (step_tail.py)."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar import ParallelConfig, Precision
from autopar.models import build


@pytest.fixture(scope="module")
def gpt():
    return build("gpt-tiny", batch_size=1)


def _optimizer(gpt, overhead: float, precision: Precision | None = None, **cfg) -> float:
    model, inputs = gpt
    cluster = autopar.Cluster.from_spec("1x2xcpu")
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, dtensor_step_overhead=overhead))
    plan = autopar.estimate(model, cluster, inputs, ParallelConfig(**cfg), global_batch_size=8, precision=precision)
    return plan.breakdown.optimizer


def test_dtensor_parameters_pay_the_measured_overhead_per_tensor(gpt):
    model, _ = gpt
    tensors = len(list(model.parameters()))   # ZeRO-2/3: every rank holds a shard of every tensor
    slowdown = autopar.Cluster.from_spec("1x2xcpu").device.concurrency_slowdown
    for zero in (2, 3):
        extra = _optimizer(gpt, 1e-4, dp=2, zero=zero) - _optimizer(gpt, 0.0, dp=2, zero=zero)
        assert extra == pytest.approx(tensors * 1e-4 * slowdown)
    # plain tensors: ZeRO-1's shards, tensor-parallel shards with nothing to shard over, a compiled step's local tensors
    assert _optimizer(gpt, 1e-4, dp=2, zero=1) == _optimizer(gpt, 0.0, dp=2, zero=1)
    assert _optimizer(gpt, 1e-4, tp=2, zero=3) == _optimizer(gpt, 0.0, tp=2, zero=3)
    compiled = Precision(compute="fp32", kernels="compiled")
    assert _optimizer(gpt, 1e-4, compiled, dp=2, zero=3) == _optimizer(gpt, 0.0, compiled, dp=2, zero=3)
