"""``solve``: OpGraph + Cluster + global batch -> the best Plan (wiring of search, stages, sharding)."""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import Precision
from ..cost_model.compute import MeasuredTimes
from ..errors import ConfigError, InfeasiblePlanError
from ..plan import Plan
from .search import Search, SearchStats, alternatives, with_search_results
from .sharding import SOLVE_TIME_LIMIT, VARIANTS, ILPLimits, ShardingSolver
from .space import check_fixed


def solve(graph: OpGraph, cluster: Cluster, global_batch_size: int, *, precision: Precision | None = None,
          fixed: Mapping[str, Any] | None = None, time_limit: float | None = None,
          measured: MeasuredTimes | None = None, progress: bool = False,
          ilp_time_limit: float = SOLVE_TIME_LIMIT, ilp_node_limit: int | None = None) -> tuple[Plan, SearchStats]:
    """The fastest plan that fits, and what the search did. Raises InfeasiblePlanError when none fits.

    Wiring: the sharding ILP (sharding.py) gives each tensor-parallel degree its layouts, the
    outer search (search.py) walks the configurations by bound, the stage DP (stages.py) splits
    each one's layers, and the cost model estimates the result (with ``measured`` op times when
    profiled; the sharding ILP keeps the analytic op costs to choose layouts). ``progress`` shows a
    bar on a terminal once the search has taken a second.

    Limits: ``time_limit`` (seconds) stops the search once it has a plan (then ``plan.optimal`` is
    False and ``plan.gap`` bounds how far from optimal it is); ILPs not started by then are replaced
    by greedy sharding. ``ilp_time_limit`` (seconds) and ``ilp_node_limit`` (branch-and-bound
    nodes) bound each sharding ILP solver call (sharding.py)."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size!r} must be a positive integer")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or not time_limit > 0):
        raise ConfigError(f"time_limit={time_limit!r} must be a positive number of seconds (or None)")
    fixed = check_fixed(fixed)
    precision = precision or Precision.for_device(cluster.device.name)
    limits = ILPLimits(ilp_time_limit, ilp_node_limit)
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    sharding = ShardingSolver(graph, cluster, precision, limits=limits, deadline=deadline)
    search = Search(graph, cluster, global_batch_size, precision, layouts_for(sharding), fixed, time_limit,
                    splits_batch=sharding.splits_batch, measured=measured, progress=progress)
    best, best_c, seen = search.run()
    search.stats.ilp_seconds, search.stats.ilp_solves = sharding.seconds, sharding.solves
    search.stats.ilp_stopped_early, search.stats.ilp_greedy = sharding.stopped_early, sharding.greedy_after_deadline
    search.stats.ilp_fallbacks = tuple(sharding.fallbacks)
    if best is None:
        raise _infeasible(search, fixed)
    alts = alternatives(best, seen, cluster.device.memory)
    described = tuple(sharding.describe(best.config.tp, best_c.variant)) if best.config.tp > 1 else ()
    plan = with_search_results(best, search.stats, alts, described, f"ilp-{best_c.variant}")
    return plan, search.stats


def layouts_for(sharding: ShardingSolver) -> dict:
    """The tensor-parallel layout variants the search compares: name -> layout_fn(graph, tp): the
    sharding ILP's fastest layout and its leanest (the global step time decides between them)."""
    return {variant: sharding.layout_fn(variant) for variant in VARIANTS}


def _infeasible(search: Search, fixed: Mapping[str, Any]) -> InfeasiblePlanError:
    cluster = search.cluster
    if search.stats.candidates == 0:
        return InfeasiblePlanError(
            f"no configuration of {cluster.devices} devices matches global_batch_size={search.global_batch_size}"
            f"{' and fixed=' + repr(dict(fixed)) if fixed else ''}: dp must divide the global batch, "
            "dp * cp * tp * pp must equal the device count, pp must not exceed the layers "
            f"({len(search.graph.layers)} here), an interleaved schedule needs pp * virtual_stages to divide the "
            "repeated blocks, and a layout that splits the batch needs micro_batch_size divisible by tp; "
            "change the global batch or what is fixed")
    need, arg = search.least_memory_overall()
    have = cluster.device.memory
    scaled = math.ceil(cluster.devices * need / have)
    hints = [f"more devices (this cluster has {cluster.devices}; if memory per device shrank in proportion, "
             f"about {scaled} would do)", f"a device with more than {_gb(need)}"]
    if arg is not None and arg.micro_batch_size > 1:
        hints.append("a smaller micro-batch (pin micro_batch_size=1)")
    if fixed:
        hints.append(f"fewer pinned fields (fixed={dict(fixed)!r} rules out the leaner configurations)")
    where = f" (the leanest is {arg.short()})" if arg is not None else ""
    return InfeasiblePlanError(
        f"no plan fits on {cluster.describe()}: the leanest plan needs {_gb(need)} per device"
        f"{where}, but each {cluster.device.name} has {_gb(have)}. "
        f"Use {', or '.join(hints)}.")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"
