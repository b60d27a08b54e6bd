r"""Pipeline stage partition: an exact dynamic programme over contiguous layer runs.

Given one configuration (mesh, micro-batch, schedule, ZeRO, sequence parallelism) and the
recompute modes allowed, choose the cuts ``0 = b_0 < b_1 < ... < b_p = n`` of the ``n``
captured layers into ``p`` stages and a recompute mode ``r_k`` per stage to minimise the
estimator's step time (cost_model/__init__.py) on that partition::

    T = (m - 1) max_k x_k + sum_k x_k + max_k y_k                  (1F1B and GPipe)

    x_k = sum_{l in [b_k, b_{k+1})} c_l^{r_k} + q_in(b_k) + q_out(b_{k+1} - 1)
    y_k = dp_exposed(stage k) + optimizer(stage k)
    s.t.  mem_k = states(params_k) + f_k sum_l a_l^{r_k} + buffers_k(r_k) <= M

``c_l^r`` is layer ``l``'s work per micro-batch under recompute mode ``r`` (forward,
backward, recomputation, tensor-parallel collectives), ``q`` the p2p time of a cut,
``a_l^r`` its activation bytes, ``f_k`` the micro-batches stage ``k`` holds at its peak (1F1B:
``min(m, p - k)``, so the first stage holds the most; GPipe: ``m``), ``params_k`` the
parameters of its layers (a tied weight counted once per stage that uses it) and ``M`` the
device memory. Every term of a stage depends only on its own run and index, so for fixed
bounds ``X`` on ``max x_k`` and ``Y`` on ``max y_k`` the remaining objective ``sum_k x_k``
decomposes (:func:`_min_sum`)::

    D_0(0) = 0,   D_k(j) = min_{i < j, r : x^r(i,j) <= X, y^r(i,j) <= Y, mem_k^r(i,j) <= M}
                           D_{k-1}(i) + x^r(i, j),          S(X, Y) = D_p(n)

and ``T* = min_{X, Y} (m - 1) X + S(X, Y) + Y`` over the finitely many values ``x`` and ``y``
take on layer runs. With ``G(X) = min_Y S(X, Y) + Y``, both ``G`` and ``S`` are
non-increasing step functions, and the partition attaining ``S(X, Y)`` (whose largest run
work is ``x* <= X``) stays optimal for every bound in ``[x*, X]``. :func:`partition` minimises
``(m - 1) X + G(X)`` over ``X >= X_min`` (the bottleneck optimum, :func:`_min_max`) and each
``G(X)`` over ``Y >= Y_min(X)`` by bisection (:func:`_step_min`): an interval whose two ends give
the same ``S`` is constant, and one whose lower bound cannot beat the best is skipped, so
the optimum is exact. With a ``cutoff`` (the search needs no plan that slow) the bisection starts
from it, and ``slope X_min + S(inf, inf) + Y_min`` (three DPs) at or above it ends the problem
before any bisection. The DP runs on runs of at most ``L`` layers, ``L`` the most one stage
can hold within memory (:class:`Band`): ``O(p n L)`` per DP, vectorised with numpy. When
``m = 1`` the ``X`` term vanishes and one ``X`` suffices.

ZB-H1 (cost_model/schedule.py) prices ``T = m max_k x_k + (p - 1) / p sum_k b_k + max_k y_k``,
``b_k`` its drain share of the run's forward, input- and weight-gradient passes: the same DP with
``b`` summed in place of ``x`` and slope ``m`` in place of ``m - 1`` (the bound ``X`` still on
``x``), so its partition is exact too.

An interleaved schedule (or ZB-V) puts ``v`` chunks from all over the model on each device, which
breaks the stage independence above; it keeps Megatron's even split of the blocks, balanced by
cost when they do not divide into the chunks (:func:`autopar.cost_model.schedule.even_partition`),
and one recompute mode.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..config import ParallelConfig
from ..cost_model.estimator import Estimator, reruns
from ..cost_model.memory import in_flight

INF = float("inf")


class _Above:
    """:func:`partition`'s answer when no partition is below its ``cutoff`` (one fits: none is faster)."""

    def __repr__(self) -> str:
        return "ABOVE"


ABOVE = _Above()
CUTOFF_MARGIN = 1e-6   # relative: the DP's objective and the estimate's step time agree to ~1e-8


@dataclass(frozen=True)
class Partition:
    """The DP's answer: chunks of layer indices and the recompute mode of each stage (the caller
    estimates the step time of this partition)."""

    chunks: tuple[tuple[int, ...], ...]
    modes: tuple[str, ...]


@dataclass(frozen=True)
class RunTables:
    """Per recompute mode, every layer run ``[i, j]`` as an ``n x n`` matrix (``inf`` where ``i > j``)."""

    modes: tuple[str, ...]
    work: np.ndarray       # (R, n, n) x^r(i, j) seconds per micro-batch, p2p included
    tail: np.ndarray       # (R, n, n) y^r(i, j) seconds per step
    fixed_mem: np.ndarray  # (R, n, n) model states + buffers, bytes
    act: np.ndarray        # (R, n, n) activation bytes per micro-batch
    summed: np.ndarray     # (R, n, n) what the objective sums per stage: ``work``, or ZB-H1's drain share


def run_tables(est: Estimator, cfg: ParallelConfig, micro_batches: int, modes: Sequence[str]) -> RunTables:
    """Build the run matrices for ``cfg`` (its recompute fields are ignored: ``modes`` are tried)."""
    graph = est.graph
    n = len(graph.layers)
    groups = est.placements(cfg)
    cuts = np.array(est.p2p_cut_times(cfg, groups["pp"]) + [0.0])   # cut after layer l; none after the last
    q_in = np.concatenate([[0.0], cuts[:-1]])                        # cut before layer i
    i_idx, j_idx = np.indices((n, n))
    valid = i_idx <= j_idx
    key = ("params", cfg.tp, cfg.ep)   # what they depend on (read-only)
    if key not in est.run_cache:
        est.run_cache[key] = _run_params(est, cfg, n)
    params, experts = est.run_cache[key]
    weights, grads, optimizer = est.state_bytes(cfg, params, experts)
    states = weights + grads + optimizer
    step = np.array([est.layers.step_comm_bytes(layer, cfg.tp) for layer in graph.layers], dtype=float)
    units, unit_params, kept, n_kept = est.unit_tables(cfg)   # ZeRO-2/3 units of each run, its largest, the kept ones
    lead = est.lead_params(cfg)[:, None]   # a run's last gradient: its first layer's lead (broadcast over j)
    works, tails, fixed, acts, sums = [], [], [], [], []
    for mode in modes:
        costs = est.layer_costs(cfg, groups["tp"], mode, groups)
        col = lambda attr: np.array([getattr(c, attr) for c in costs], dtype=float)  # noqa: E731
        fwd, bwd = _run_sum(col("fwd")), _run_sum(col("bwd"))
        rec = _run_sum(col("recompute")) * reruns(cfg)   # estimator.reruns: twice under a split backward
        tp = _run_sum(col("tp_fwd") + col("tp_bwd"))
        other = _run_sum(col("cp_fwd") + col("cp_bwd") + col("ep_fwd") + col("ep_bwd"))
        p2p = q_in[:, None] + cuts[None, :]
        work = fwd + bwd + rec + tp + other + p2p
        dp = est.tail.dp_time(cfg, micro_batches, groups, params, fwd, bwd, rec, tp, _run_sum(step), units, experts,
                              kept, n_kept, est.fp8_layer_tables(cfg), lead)
        tail = dp + est.tail.optimizer_time(cfg, params, experts)
        buffers = est.buffer_bytes(cfg, mode, _run_max(col("largest_tensor")), _run_max(col("activations_full")),
                                   unit_params, grads, params, experts)
        works.append(np.where(valid, work, INF))
        tails.append(np.where(valid, tail, INF))
        fixed.append(np.where(valid, states + buffers, INF))
        acts.append(np.where(valid, _run_sum(col("activations")), INF))
        if cfg.schedule == "zbh1":   # DeviceCost.passes of each run, and schedule.zbh1_drain of them
            forward = fwd + _run_sum(col("tp_fwd") + col("cp_fwd") + col("ep_fwd")) + p2p / 2
            weight = _run_sum(col("wgrad")) + rec / 2   # DeviceCost.passes: with its pass's rerun
            drain = np.maximum(np.maximum(work - 2 * weight, forward), work - forward - weight)
            sums.append(np.where(valid, drain * (cfg.pp - 1) / cfg.pp, INF))
        else:
            sums.append(works[-1])
    return RunTables(tuple(modes), np.stack(works), np.stack(tails), np.stack(fixed), np.stack(acts),
                     np.stack(sums))


def _run_sum(values: np.ndarray) -> np.ndarray:
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[None, 1:] - prefix[:-1, None]


def _run_max(values: np.ndarray) -> np.ndarray:
    """``out[i, j] = max(values[i..j])`` for ``i <= j``, 0 below the diagonal."""
    n = len(values)
    upper = _upper(n)
    return np.where(upper, np.maximum.accumulate(np.where(upper, values[None, :], -np.inf), axis=1), 0.0)


@functools.lru_cache(maxsize=None)
def _upper(n: int) -> np.ndarray:
    """``mask[i, j]``: ``i <= j`` (read-only)."""
    mask = np.triu(np.ones((n, n), dtype=bool))
    mask.setflags(write=False)
    return mask


def _run_params(est: Estimator, cfg: ParallelConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Parameters a stage holding layers ``[i, j]`` keeps: each layer's own, plus a tied parameter
    first used before ``i`` once if any layer of the run uses it; and, of those, the expert weights."""
    graph = est.graph
    local = lambda p: est.local_numel(p, cfg.tp, cfg.ep)  # noqa: E731
    own = np.array([sum(local(p) for p in layer.params if p in graph.params) for layer in graph.layers], dtype=float)
    experts = _run_sum(np.array([sum(local(p) for p in layer.params if p in est.experts)
                                 for layer in graph.layers], dtype=float))
    out = _run_sum(own)
    owner = {p: layer.index for layer in graph.layers for p in layer.params}
    users: dict[str, list[int]] = {}
    for layer in graph.layers:
        for p in layer.shared_params:
            if p in graph.params:
                users.setdefault(p, []).append(layer.index)
    for p, used in users.items():
        numel = local(p)
        for i in range(owner.get(p, -1) + 1, n):
            first = next((u for u in used if u >= i), None)
            if first is not None:
                out[i, first:] += numel
    out.setflags(write=False)
    experts.setflags(write=False)
    return out, experts


@dataclass(frozen=True)
class Band:
    """The run tables indexed by run END ``j`` and length - 1 ``l`` (start ``j - l``), for runs of at
    most ``L`` layers: the DP then costs ``O(p n L)``, and memory limits keep ``L`` small for big
    models (a stage of a model that needs many stages holds few layers)."""

    work: np.ndarray     # (R, n, L)
    tail: np.ndarray
    fixed_mem: np.ndarray
    act: np.ndarray
    summed: np.ndarray
    start: np.ndarray    # (n, L) int: j - l, clipped at 0
    valid: np.ndarray    # (n, L) bool: j - l >= 0
    _masks: dict = field(default_factory=dict, compare=False)

    def memory_mask(self, flights: int, memory: float) -> np.ndarray:
        """(R, n, L): 0 where a stage holding ``flights`` micro-batches of the run fits ``memory``,
        inf where it does not."""
        key = (flights, memory)
        if key not in self._masks:
            self._masks[key] = np.where(self.fixed_mem + flights * self.act <= memory, 0.0, INF)
        return self._masks[key]


def band(tables: RunTables, length: int) -> Band:
    n = tables.work.shape[-1]
    j, ell = np.indices((n, max(1, min(length, n))))
    start = j - ell
    valid = start >= 0
    start = np.maximum(start, 0)

    def cut(a: np.ndarray) -> np.ndarray:
        return np.where(valid[None], a[:, start, j], INF)
    return Band(cut(tables.work), cut(tables.tail), cut(tables.fixed_mem), cut(tables.act), cut(tables.summed),
                start, valid)


def _longest_run(tables: RunTables, flights: Sequence[int], memory: float) -> int:
    """The most layers one stage can hold within memory (0 if not even one layer fits)."""
    ok = (tables.fixed_mem + min(flights) * tables.act <= memory).any(axis=0)
    if not ok.any():
        return 0
    i, j = np.nonzero(ok)
    return int((j - i).max()) + 1


def _min_sum(b: Band, flights: Sequence[int], memory: float, x_bound: float, y_bound: float,
             pinned: Sequence[int] | None = None) -> tuple[float, list[tuple[int, int, int]] | None]:
    """min sum_k of the summed values (x_k; ZB-H1's drain shares) under the bounds: ``(value, [(start, end,
    mode) per stage])`` or ``(inf, None)``."""
    return _dp(b, lambda k: b.summed, flights, memory, x_bound, y_bound, np.add, pinned)


def _min_max(b: Band, value: np.ndarray, flights: Sequence[int], memory: float,
             x_bound: float = INF, y_bound: float = INF, pinned: Sequence[int] | None = None) -> float:
    """min over partitions of max_k value_k (bottleneck DP), within memory and the bounds."""
    return _dp(b, lambda k: value, flights, memory, x_bound, y_bound, np.maximum, pinned)[0]


def _dp(b: Band, value_of, flights: Sequence[int], memory: float, x_bound: float, y_bound: float,
        combine, pinned: Sequence[int] | None = None) -> tuple[float, list[tuple[int, int, int]] | None]:
    """The DP of the module docstring with ``combine`` (np.add: min-sum; np.maximum: bottleneck);
    ``value_of(k)`` gives stage ``k``'s (R, n, L) values; ``pinned[k]``, when given, is the only
    recompute mode (index into the tables' modes) stage ``k`` may use.

    Masks are additive (0 where allowed, inf where not) and the memory one is kept on the band per
    in-flight count: the partition's many DPs share them, and a stage's best mode per run is an
    elementwise minimum over the modes (``np.where`` and ``argmin`` over the mode axis cost ten
    times more); the mode of each chosen run is recovered at the end."""
    p, n = len(flights), b.work.shape[1]
    bounded = np.isfinite(x_bound) or np.isfinite(y_bound)
    within = np.where((b.work <= x_bound) & (b.tail <= y_bound), 0.0, INF) if bounded else None
    values: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # id -> (the values, kept alive; within bounds)

    def masked(k: int) -> np.ndarray:
        value = value_of(k)
        if id(value) not in values:
            values[id(value)] = (value, value if within is None else value + within)
        return values[id(value)][1] + b.memory_mask(flights[k], memory)

    best = np.full(n + 2, INF)      # index n + 1: where a run that would start before layer 0 looks
    best[0] = 0.0 if combine is np.add else -INF
    start = np.where(b.valid, b.start, n + 1)
    rows = np.arange(n)
    choice = []
    for k in range(p):
        per_mode = masked(k)
        cost = per_mode[pinned[k]] if pinned is not None else functools.reduce(np.minimum, per_mode)
        total = combine(best[start], cost)                              # stages 0..k-1 end before j - l
        ell = np.argmin(total, axis=1)
        best = np.full(n + 2, INF)
        best[1:n + 1] = total[rows, ell]
        choice.append(ell)
    if not np.isfinite(best[n]):
        return INF, None
    runs, j = [], n - 1
    for k in range(p - 1, -1, -1):
        ell = int(choice[k][j])
        i = j - ell
        mode = pinned[k] if pinned is not None else int(np.argmin(masked(k)[:, j, ell]))
        runs.append((i, j, mode))
        j = i - 1
    return float(best[n]), runs[::-1]


def flights_of(cfg: ParallelConfig, micro_batches: int) -> list[int]:
    return [in_flight(cfg, k, micro_batches) for k in range(cfg.pp)]


def step_of(tables: RunTables, runs: Sequence[tuple[int, int, int]], micro_batches: int, cfg: ParallelConfig) -> float:
    x = [tables.work[r, i, j] for i, j, r in runs]
    y = [tables.tail[r, i, j] for i, j, r in runs]
    summed = [tables.summed[r, i, j] for i, j, r in runs]
    return _slope(cfg, micro_batches) * max(x) + sum(summed) + max(y)


def _slope(cfg: ParallelConfig, micro_batches: int) -> float:
    """The objective's factor on the largest run work: ``m - 1`` (1F1B, GPipe), ``m`` (ZB-H1)."""
    return float(micro_batches - (cfg.schedule != "zbh1"))


def pinned_modes(tables: RunTables, cfg: ParallelConfig) -> tuple[int, ...] | None:
    """The tables' mode index each stage must use when ``cfg`` pins ``stage_recompute``, else None."""
    if not cfg.stage_recompute:
        return None
    return tuple(tables.modes.index(mode) for mode in cfg.stage_recompute)


def partition(tables: RunTables, cfg: ParallelConfig, micro_batches: int, memory: float,
              cutoff: float = INF) -> Partition | None | _Above:
    """The exact optimum of the module docstring's problem, or None when no partition fits, or
    :data:`ABOVE` when one fits but none has a step time below ``cutoff`` (times ``1 + CUTOFF_MARGIN``, for
    float noise; the caller needs no plan slower than that: the bisection skips every interval whose floor
    reaches it). When ``cfg.stage_recompute`` is set, stage ``k`` uses its mode ``cfg.stage_recompute[k]``
    (pinned).

    With ``G(X) = min {sum x + max y : max x <= X}`` the step time is ``min_X (m - 1) X + G(X)``
    over the run works ``X``, and ``G(X) = min_Y S(X, Y) + Y`` over the run tails ``Y``. Both ``G``
    and ``S`` are non-increasing step functions, which :func:`_step_min` minimises by bisection."""
    flights = flights_of(cfg, micro_batches)
    pinned = pinned_modes(tables, cfg)
    m = micro_batches
    longest = _longest_run(tables, flights, memory)
    if longest == 0:
        return None
    b = band(tables, longest)
    x_min = _min_max(b, b.work, flights, memory, pinned=pinned)
    if not np.isfinite(x_min):
        return None
    works = np.unique(b.work[np.isfinite(b.work)])
    tails = np.unique(b.tail[np.isfinite(b.tail)])

    y_lows: dict[float, float] = {}

    def least_tail(x_bound: float) -> float:
        if x_bound not in y_lows:
            y_lows[x_bound] = _min_max(b, b.tail, flights, memory, x_bound, pinned=pinned)
        return y_lows[x_bound]

    def inner(x_bound: float):
        """G(X) by bisection over Y: (G, max work of its partition, its runs)."""
        y_lo = least_tail(x_bound)

        def solve_y(y: float):
            s_val, runs = _min_sum(b, flights, memory, x_bound, y, pinned)
            y_used = max(tables.tail[r, i, j] for i, j, r in runs)
            return s_val, y_used, runs
        return _step_min(tails, y_lo, solve_y, slope=1.0)

    def solve_x(x: float):
        g, runs = inner(x)
        x_used = max(tables.work[r, i, j] for i, j, r in runs)
        return g, x_used, runs

    slope = _slope(cfg, m)
    limit = cutoff * (1 + CUTOFF_MARGIN)
    # every partition's objective is at least slope X_min + S(inf, inf) + Y_min: three DPs before the bisections
    if limit < INF and slope * x_min + _min_sum(b, flights, memory, INF, INF, pinned)[0] + least_tail(INF) >= limit:
        return ABOVE
    if slope == 0:  # the max-work term vanishes
        value, runs = inner(INF)
        runs = runs if value < limit else None
    else:
        _, runs = _step_min(works, x_min, solve_x, slope=slope, above=limit)
    if runs is None:
        return ABOVE
    return Partition(tuple(tuple(range(i, j + 1)) for i, j, _ in runs),
                     tuple(tables.modes[r] for _, _, r in runs))


def _step_min(values: np.ndarray, lowest: float, solve, slope: float, above: float = INF):
    """``min_v slope * v + S(v)`` over the sorted ``values >= lowest`` (and ``v = inf``), where
    ``solve(v) -> (S(v), used, runs)`` gives a non-increasing step function ``S`` whose optimum
    under bound ``v`` only uses ``used <= v`` (so ``S`` is constant on ``[used, v]``). Bisection:
    an interval whose lower bound ``slope * v_lo + S(v_hi)`` cannot beat the best so far (at first
    ``above``) is skipped, and one whose ends have equal ``S`` is constant (its best is its lowest end).
    Returns (best objective, runs attaining it): ``(above, None)`` when nothing is below ``above``."""
    cand = values[values >= lowest]
    cache: dict[int, tuple] = {}

    def at(k: int):
        if k not in cache:
            v = float(cand[k]) if k < len(cand) else INF
            cache[k] = solve(v)
        return cache[k]

    best = [above, None]

    def consider(k: int) -> None:
        s_val, used, runs = at(k)
        value = slope * used + s_val
        if value < best[0]:
            best[:] = [value, runs]

    def search(lo: int, hi: int) -> None:
        consider(hi)
        # S is constant on [used(hi), v(hi)]: move hi down to used's index
        used = at(hi)[1]
        hi = min(hi, int(np.searchsorted(cand, used, side="left")))
        if hi <= lo:
            return
        if slope * float(cand[lo]) + at(hi)[0] >= best[0]:
            return
        consider(lo)
        if at(lo)[0] == at(hi)[0] or hi - lo <= 1:
            return
        mid = (lo + hi) // 2
        search(mid, hi)
        search(lo, mid)

    search(0, len(cand))
    return best[0], best[1]


def _below(values: np.ndarray, limit: float, inclusive: bool) -> float:
    """The largest of the sorted ``values`` below ``limit`` (``-inf`` if none)."""
    k = np.searchsorted(values, limit, side="right" if inclusive else "left")
    return float(values[k - 1]) if k > 0 else -INF


def least_memory(tables: RunTables, cfg: ParallelConfig, micro_batches: int) -> tuple[float, tuple[str, ...]]:
    """The smallest peak memory per device any partition (and per-stage recompute, unless pinned) of
    ``cfg`` reaches, and the recompute mode of each stage that reaches it."""
    flights = flights_of(cfg, micro_batches)
    b = band(tables, tables.work.shape[-1])
    value, runs = _dp(b, lambda k: b.fixed_mem + flights[k] * b.act, flights, INF, INF, INF, np.maximum,
                      pinned_modes(tables, cfg))
    return value, tuple(tables.modes[r] for _, _, r in runs) if runs else ()
