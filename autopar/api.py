"""The public entry points: wiring of capture -> cost model (-> solver -> codegen), nothing else."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from .capture import capture
from .capture.export import LossFn
from .cluster import Cluster
from .config import ParallelConfig, Precision
from .cost_model import estimate_plan
from .errors import ConfigError
from .plan import Plan
from .runtime.inputs import with_inputs
from .solver import solve


def plan(model: nn.Module, cluster: Cluster, example_inputs: Any, *, global_batch_size: int,
         fixed: Mapping[str, Any] | None = None, time_limit: float | None = None, loss_fn: LossFn | None = None,
         precision: Precision | None = None, profile: bool = False) -> Plan:
    """The fastest parallel plan for ``model`` on ``cluster`` that fits in memory.

    Searches data x tensor x pipeline degrees, micro-batch size, schedule, ZeRO stage,
    recompute (per stage) and sequence parallelism; partitions the layers into stages
    exactly (DP) and shards each layer's ops by ILP. ``fixed`` pins ParallelConfig fields,
    e.g. ``{"tp": 8, "pp": 8}``. With ``time_limit`` (seconds) the search returns the best
    plan found by then (``plan.optimal`` is False if it stopped early). Raises
    :class:`autopar.InfeasiblePlanError` when nothing fits, saying what would.
    """
    _check_cluster(cluster)
    if profile:
        raise ConfigError(_NO_PROFILER)
    graph = capture(model, example_inputs, loss_fn)
    best, _ = solve(graph, cluster, global_batch_size, precision=precision, fixed=fixed, time_limit=time_limit)
    return with_inputs(best, example_inputs)


def _check_cluster(cluster: Any) -> None:
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster must be an autopar.Cluster (e.g. Cluster.from_spec('1x8xA100-80GB')), "
                          f"got {type(cluster).__name__}")


_NO_PROFILER = ("profile=True needs the profiler, which this version does not have yet: "
                "leave profile=False to use the analytical cost model")


def estimate(model: nn.Module, cluster: Cluster, example_inputs: Any, config: ParallelConfig, *,
             global_batch_size: int, loss_fn: LossFn | None = None, precision: Precision | None = None,
             profile: bool = False) -> Plan:
    """Predict what ``config`` costs for ``model`` on ``cluster``: step time, memory, per-stage breakdown.

    ``example_inputs`` (tuple or dict of tensors, batch on dim 0, any batch size) are only
    traced, never computed on; the model may live on the meta device. ``precision``
    defaults to bf16 mixed precision with Adam (fp32 on a CPU cluster).
    """
    _check_cluster(cluster)
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be an autopar.ParallelConfig, got {type(config).__name__}")
    if profile:
        raise ConfigError(_NO_PROFILER)
    graph = capture(model, example_inputs, loss_fn)
    return with_inputs(estimate_plan(graph, cluster, config, global_batch_size, precision), example_inputs)
