"""The public entry points: wiring of capture -> cost model (-> solver -> codegen), nothing else."""

from __future__ import annotations

from typing import Any

from torch import nn

from .capture import capture
from .capture.export import LossFn
from .cluster import Cluster
from .config import ParallelConfig, Precision
from .cost_model import estimate_plan
from .errors import ConfigError
from .plan import Plan


def estimate(model: nn.Module, cluster: Cluster, example_inputs: Any, config: ParallelConfig, *,
             global_batch_size: int, loss_fn: LossFn | None = None, precision: Precision | None = None,
             profile: bool = False) -> Plan:
    """Predict what ``config`` costs for ``model`` on ``cluster``: step time, memory, per-stage breakdown.

    ``example_inputs`` (tuple or dict of tensors, batch on dim 0, any batch size) are only
    traced, never computed on; the model may live on the meta device. ``precision``
    defaults to bf16 mixed precision with Adam (fp32 on a CPU cluster).
    """
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster must be an autopar.Cluster (e.g. Cluster.from_spec('1x8xA100-80GB')), "
                          f"got {type(cluster).__name__}")
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be an autopar.ParallelConfig, got {type(config).__name__}")
    if profile:
        raise ConfigError("profile=True needs the profiler, which this version does not have yet: "
                          "leave profile=False to use the analytical cost model")
    graph = capture(model, example_inputs, loss_fn)
    return estimate_plan(graph, cluster, config, global_batch_size, precision)
