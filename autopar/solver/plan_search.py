"""``solve``: OpGraph + Cluster + global batch -> the best Plan (wiring of search, stages, sharding)."""

from __future__ import annotations

import math
import time
from dataclasses import fields, replace
from typing import Any, Mapping

from ..capture.fusion import for_kernels
from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import DEFAULT_TIE_TOLERANCE, ParallelConfig, Precision
from ..cost_model import check_config
from ..cost_model.compute import MeasuredTimes
from ..cost_model.low_precision import check_device
from ..errors import ConfigError, InfeasiblePlanError
from ..plan import Plan
from .batch import batch_notes
from .choice import alternatives, check_tolerance, with_search_results
from .search import Search, SearchStats
from .sharding import NODE_LIMIT, VARIANTS, WHOLE_BATCH, ILPLimits
from .sharding_solver import ShardingSolver
from .space import PIN_RULES, check_fixed, nearest


def solve(graph: OpGraph, cluster: Cluster, global_batch_size: int, *, precision: Precision | None = None,
          fixed: Mapping[str, Any] | None = None, time_limit: float | None = None,
          measured: MeasuredTimes | None = None, progress: bool = False,
          ilp_time_limit: float | None = None, ilp_node_limit: int | None = NODE_LIMIT,
          sharding: ShardingSolver | None = None,
          tie_tolerance: float = DEFAULT_TIE_TOLERANCE) -> tuple[Plan, SearchStats]:
    """The plan that fits with the fewest moving parts among those within ``tie_tolerance`` of the
    fastest (choice.py; 0: the fastest), and what the search did. Raises InfeasiblePlanError when none fits.

    Wiring: the sharding ILP (sharding.py) gives each tensor-parallel degree its layouts, the
    outer search (search.py) walks the configurations by bound, the stage DP (stages.py) splits
    each one's layers, and the cost model estimates the result (with ``measured`` op times when
    profiled; the sharding ILP keeps the analytic op costs to choose layouts). ``progress`` shows a
    bar on a terminal once the search has taken a second.

    Limits: ``time_limit`` (seconds) stops the search once it has a plan (then ``plan.optimal`` is
    False and ``plan.gap`` bounds how far from optimal it is; no branch is bounded after 60% of it, so that
    the rest finds a first plan: search.BOUNDING_SHARE); ILPs not started by then are replaced
    by greedy sharding. ``ilp_node_limit`` (branch-and-bound nodes, deterministic) and, only when
    given, ``ilp_time_limit`` (seconds of wall clock) bound each sharding ILP solver call (sharding.py). ``sharding``: a ShardingSolver of this
    graph, cluster and precision to reuse (its layouts are cached), e.g. across several solves."""
    search, sharding = _search(graph, cluster, global_batch_size, precision, fixed, time_limit, measured, progress,
                               ilp_time_limit, ilp_node_limit, sharding)
    search.tie_tolerance = check_tolerance(tie_tolerance)
    best, stats = _run(search, sharding, must_fit=True)

    def solve_at(batch: int, dp: int) -> Plan:   # the same search at another batch and dp, on the same layouts
        again, _ = _search(graph, cluster, batch, precision, {**(fixed or {}), "dp": dp}, None, measured, False,
                           ilp_time_limit, ilp_node_limit, sharding)
        again.tie_tolerance = search.tie_tolerance
        again.share_estimators(search)   # the same graph, cluster, precision and layouts: their costs cached
        return _run(again, sharding, must_fit=True)[0]

    notes = batch_notes(graph, cluster, global_batch_size, search.fixed, best,
                        None if time_limit is not None else solve_at)
    return (replace(best, notes=best.notes + notes) if notes else best), stats


def price(graph: OpGraph, cluster: Cluster, config: ParallelConfig, global_batch_size: int, *,
          precision: Precision | None = None, measured: MeasuredTimes | None = None,
          ilp_time_limit: float | None = None, ilp_node_limit: int | None = NODE_LIMIT,
          sharding: ShardingSolver | None = None) -> Plan:
    """``config`` priced: what :func:`solve` with every field of ``config`` pinned returns (the same
    sharding ILP layout, stage partition, step time and memory), as an estimate: ``optimal`` None, no
    alternatives, no search counts. When no stage partition of ``config`` fits in memory, the fastest
    partition regardless of memory, with ``fits`` False (``solve`` would raise). A configuration the
    model or cluster rule out raises InfeasiblePlanError naming the rule (as ``solve`` does)."""
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be an autopar.ParallelConfig, got {type(config).__name__}")
    check_config(graph, cluster, config, global_batch_size)   # the rules, each named (ConfigError)
    fixed = {f.name: getattr(config, f.name) for f in fields(ParallelConfig)}
    search, sharding = _search(graph, cluster, global_batch_size, precision, fixed, None, measured, False,
                               ilp_time_limit, ilp_node_limit, sharding)
    try:
        plan, _ = _run(search, sharding, must_fit=True)
    except InfeasiblePlanError:
        if search.stats.candidates == 0:
            raise
        search.stats = SearchStats()
        plan, _ = _run(search, sharding, must_fit=False)
    extra = {k: v for k, v in plan.extra.items() if k != "search"}
    return replace(plan, optimal=None, gap=None, alternatives=(), extra=extra)


def _search(graph: OpGraph, cluster: Cluster, global_batch_size: int, precision: Precision | None,
            fixed: Mapping[str, Any] | None, time_limit: float | None, measured: MeasuredTimes | None,
            progress: bool, ilp_time_limit: float | None, ilp_node_limit: int | None,
            sharding: ShardingSolver | None) -> tuple[Search, ShardingSolver]:
    """The Search (and its ShardingSolver) of one solve, after checking the arguments."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size!r} must be a positive integer")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or not time_limit > 0):
        raise ConfigError(f"time_limit={time_limit!r} must be a positive number of seconds (or None)")
    fixed = check_fixed(fixed)
    precision = precision or Precision.for_device(cluster.device.name)
    check_device(cluster.device, precision)          # an fp8 plan needs fp8 tensor cores
    graph = for_kernels(graph, precision.kernels)    # what the program's kernels keep for backward
    limits = ILPLimits(time=ilp_time_limit, nodes=ilp_node_limit)
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    if sharding is None:
        sharding = ShardingSolver(graph, cluster, precision, limits=limits, deadline=deadline)
    elif (sharding.graph is not graph or not sharding.serves(cluster) or sharding.precision != precision
          or sharding.limits != limits or deadline is not None):
        raise ConfigError("sharding= must be a ShardingSolver of the same graph, cluster (its device's memory "
                          "may differ), precision and ILP limits, and is not taken with time_limit: pass none to "
                          "make one")
    search = Search(graph, cluster, global_batch_size, precision, layouts_for(sharding), fixed, time_limit,
                    splits_batch=sharding.splits_batch, measured=measured, progress=progress, layouts_ahead=sharding)
    return search, sharding


def _run(search: Search, sharding: ShardingSolver, must_fit: bool) -> tuple[Plan, SearchStats]:
    search.must_fit = must_fit
    best, best_c, seen = search.run()
    search.stats.ilp_seconds, search.stats.ilp_solves = sharding.seconds, sharding.solves
    search.stats.ilp_waited = sharding.waited
    search.stats.ilp_stopped_early, search.stats.ilp_greedy = sharding.stopped_early, sharding.greedy_after_deadline
    search.stats.ilp_fallbacks = tuple(sharding.fallbacks)
    if best is None:
        raise _infeasible(search, search.fixed)
    alts = alternatives(best, seen, search.cluster.device.memory, search.tie_tolerance)
    described = tuple(sharding.describe(best.config.tp, best_c.variant)) if best.config.tp > 1 else ()
    plan = with_search_results(best, search.stats, alts, described, f"ilp-{best_c.variant}", seen,
                               search.tie_tolerance)
    return plan, search.stats


def layouts_for(sharding: ShardingSolver) -> dict:
    """The tensor-parallel layout variants the search compares: name -> layout_fn(graph, tp): the
    sharding ILP's fastest layout and its leanest (the global step time decides between them), and
    each solved without batch splits, for micro-batches that do not divide by tp."""
    return {variant: sharding.layout_fn(variant) for base in ("", WHOLE_BATCH) for variant in
            (v + base for v in VARIANTS)}


def _infeasible(search: Search, fixed: Mapping[str, Any]) -> InfeasiblePlanError:
    cluster = search.cluster
    if search.stats.candidates == 0:
        return InfeasiblePlanError(
            f"no configuration of {cluster.devices} devices matches global_batch_size={search.global_batch_size}"
            f"{' and fixed=' + repr(dict(fixed)) if fixed else ''}: {_pin_conflicts(search, fixed)}; "
            "change the global batch or what is fixed")
    need, arg = search.least_memory_overall()
    have = cluster.device.memory
    scaled = math.ceil(cluster.devices * need / have)
    hints = [f"more devices (this cluster has {cluster.devices}; if memory per device shrank in proportion, "
             f"about {scaled} would do)", f"a device with more than {_gb(need)}"]
    if arg is not None and arg.micro_batch_size > 1:
        hints.append("a smaller micro-batch (pin micro_batch_size=1)")
    if not cluster.device.is_cpu and not (arg is not None and arg.offload == "all"):
        if fixed.get("offload", "all") != "all":
            hints.append(f"more states in host memory (offload={fixed['offload']!r} is pinned: unpin it, or pin "
                         "offload='all' with zero=3)")
        elif cluster.device.host is None:
            hints.append(f"a host to offload states to (Device(host=Host(...)): {cluster.device.name!r} "
                         "describes none)")
    if fixed:
        hints.append(f"fewer pinned fields (fixed={dict(fixed)!r} rules out the leaner configurations)")
    where = f" (the leanest is {arg.short()})" if arg is not None else ""
    return InfeasiblePlanError(
        f"no plan fits on {cluster.describe()}: the leanest plan needs {_gb(need)} per device"
        f"{where}, but each {cluster.device.name} has {_gb(have)}. "
        f"Use {', or '.join(hints)}.")


def _pin_conflicts(search: Search, fixed: Mapping[str, Any]) -> str:
    """Each pinned field no configuration allows with the other pins while another value would: its
    rule and the nearest values that work (those the search's candidates take with that pin dropped)."""
    out = []
    for name in (f for f in PIN_RULES if f in fixed):
        values = search.pin_values(name)
        if values and fixed[name] not in values:
            out.append(f"{name}={fixed[name]!r} breaks the rule that {PIN_RULES[name]} "
                       f"({len(search.graph.layers)} layers, {search.blocks} repeated blocks; nearest valid: "
                       f"{nearest(values, fixed[name])})")
    return "; ".join(out) or ("each pinned value is possible alone but not all of them together: "
                              f"{'; '.join(f'{k}: {v}' for k, v in PIN_RULES.items() if k in fixed)}")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"
