"""The public entry points: wiring of capture -> cost model (-> solver -> codegen), nothing else."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from torch import nn

from .capture import capture
from .capture.export import LossFn
from .cluster import Cluster
from .config import DEFAULT_TIE_TOLERANCE, ParallelConfig, Precision
from .errors import ConfigError
from .plan import Plan
from .codegen.inputs import with_inputs
from .solver import price, solve
from .solver.sharding import NODE_LIMIT


def plan(model: nn.Module, cluster: Cluster, example_inputs: Any, *, global_batch_size: int,
         fixed: Mapping[str, Any] | None = None, time_limit: float | None = None, loss_fn: LossFn | None = None,
         precision: Precision | None = None, profile: bool = False,
         profile_db: str | os.PathLike | None = None, verbose: bool = True,
         ilp_time_limit: float | None = None, ilp_node_limit: int | None = NODE_LIMIT,
         tie_tolerance: float = DEFAULT_TIE_TOLERANCE) -> Plan:
    """The fastest parallel plan for ``model`` on ``cluster`` that fits in memory; among plans within
    ``tie_tolerance`` of the fastest (default 1%, under the cost model's own error) the one with the
    fewest moving parts (lower ZeRO stage, fewer parallel dimensions, no interleaving; 0: the fastest).

    Searches data x tensor x pipeline degrees, micro-batch size, schedule, ZeRO stage,
    recompute (per stage) and sequence parallelism; partitions the layers into stages
    exactly (DP) and shards each layer's ops by ILP. ``fixed`` pins ParallelConfig fields,
    e.g. ``{"tp": 8, "pp": 8}``. With ``time_limit`` (seconds) the search returns the best
    plan found by then (``plan.optimal`` is False if it stopped early, and ``plan.gap`` says by at
    most how much it could be beaten). ``ilp_node_limit`` (branch-and-bound nodes; None: none)
    bounds each sharding ILP solve by work, so the plan does not depend on the machine's load;
    ``ilp_time_limit`` (seconds) adds a wall-clock bound only when given; a solver that fails falls back to the
    next, then to greedy sharding, and the plan's notes say so. Raises
    :class:`autopar.InfeasiblePlanError` when nothing fits, saying what would.
    ``profile=True`` times the model's own ops on this machine (``cluster`` must be
    :meth:`Cluster.local`), cached in ``profile_db`` (default ``~/.cache/autopar/profile.json``).
    ``verbose=False`` hides the progress bars (shown on a terminal for work over a second).
    ``loss_fn(output, inputs)`` is the loss of a model that returns none (``inputs``: the example inputs,
    keys ``forward`` does not take, such as targets, included); without it such a model is priced with
    the mean of its output, a stand-in the plan's notes name and ``parallelize`` refuses to train on.
    """
    _check_cluster(cluster)
    graph = capture(model, example_inputs, loss_fn, progress=verbose)
    measured = _profiler(model, example_inputs, loss_fn, graph, cluster, profile_db) if profile else None
    best, _ = solve(graph, cluster, global_batch_size, precision=precision, fixed=fixed, time_limit=time_limit,
                    measured=measured, progress=verbose, ilp_time_limit=ilp_time_limit, ilp_node_limit=ilp_node_limit,
                    tie_tolerance=tie_tolerance)
    return with_inputs(_profiled(best, measured), example_inputs)


def _check_cluster(cluster: Any) -> None:
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster must be an autopar.Cluster (e.g. Cluster.from_spec('1x8xA100-80GB')), "
                          f"got {type(cluster).__name__}")


def estimate(model: nn.Module, cluster: Cluster, example_inputs: Any, config: ParallelConfig, *,
             global_batch_size: int, loss_fn: LossFn | None = None, precision: Precision | None = None,
             profile: bool = False, profile_db: str | os.PathLike | None = None) -> Plan:
    """Predict what ``config`` costs for ``model`` on ``cluster``: step time, memory, per-stage breakdown.

    The same pricing as :func:`plan` with every field of ``config`` pinned (the sharding ILP's
    per-op layout, the stage DP's partition): ``estimate(..., config)`` and ``plan(..., fixed=<every
    field of config>)`` have the same step time, memory and sharding, and ``parallelize`` runs
    either. An estimate is not a search (``optimal`` None, no runners-up), and a configuration that
    fits nowhere is priced anyway (``fits`` False). ``example_inputs`` (tuple or dict of tensors,
    batch on dim 0, any batch size) are only traced, never computed on; the model may live on the
    meta device. ``precision``
    defaults to bf16 mixed precision with Adam (fp32 on a CPU cluster). ``profile=True``
    times the model's ops on this machine instead (real weights; ``cluster`` from
    :meth:`Cluster.local`), cached in ``profile_db``.
    """
    _check_cluster(cluster)
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be an autopar.ParallelConfig, got {type(config).__name__}")
    graph = capture(model, example_inputs, loss_fn)
    measured = _profiler(model, example_inputs, loss_fn, graph, cluster, profile_db) if profile else None
    plan_ = price(graph, cluster, config, global_batch_size, precision=precision, measured=measured)
    return with_inputs(_profiled(plan_, measured), example_inputs)


def _profiler(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None, graph, cluster: Cluster,
              profile_db: str | os.PathLike | None):
    from .profiler import op_profiler
    return op_profiler(model, example_inputs, loss_fn, graph, cluster.device, profile_db)


def _profiled(plan_: Plan, measured) -> Plan:
    """The plan with a note of what the profiler measured (and which ops it priced analytically)."""
    if measured is None:
        return plan_
    return dataclasses.replace(plan_, notes=plan_.notes + (measured.summary(),))
