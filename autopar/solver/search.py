r"""The outer search: the fastest configuration that fits, by best-first branch and bound.

For every candidate ``c`` of the space (space.py) a lower bound on its step time needs only
per-layer costs (cached per layer signature)::

    LB_T(c) = (m - 1) max((W + C) / p, w_p) + W + C + opt(P / p)           (1F1B, GPipe)
    LB_T(c) = (m + (p - 1) / v) max((W + C) / p, w_p) + opt(P / p)          (interleaved)
    LB_M(c) = states(P / p)

``W = sum_l c_l`` is the work of one micro-batch through all layers in the cheapest recompute
mode, ``w_p = max_k ceil(k / p) c_(k)`` with ``c_(k)`` the ``k``-th costliest layer (some device
holds ``ceil(k / p)`` of the ``k`` costliest: 80 blocks on 32 stages put 3 on some),
``C = 2 (p v - 1) min_cut`` the p2p of the ``p v - 1`` cuts between chunks (each seen by its
sender and its receiver; ``min_cut`` the cheapest cut of the model, ``v = 1`` unless
interleaved), ``P`` the parameters after tensor parallelism and
``opt``/``states`` the optimizer time and model-state bytes of that many parameters: the
slowest stage has at least the mean work and the mean parameters, and the pipeline formula
(cost_model/schedule.py) is increasing in both. A candidate with ``LB_M > M`` cannot fit
(pruned by memory). The rest are visited in increasing ``LB_T``; each is solved exactly by the
stage DP (stages.py) and estimated; the search stops when the next bound reaches the best
step time found (every remaining candidate is pruned by the bound). GPipe is never visited
unless pinned: under this cost model it takes the same time as 1F1B and holds more
micro-batches (dominated).

Where activations do not fit, the cheapest mode is not reachable and ``W`` is loose (a 405B
model at sequence 8192 recomputes on every plan: a third more work). When a candidate reaches
the head of the queue its ``W`` is tightened by memory (:meth:`Search.refine`) and it goes back
into the queue with the new bound. Pipeline device ``d`` holds at least ``f_d`` micro-batch
passes of each of its layers at its peak (cost_model/memory.least_passes; 1F1B ``min(m, p - d)``;
interleaved with ``m`` a multiple of ``p``, the chunk its warm-up runs fewest times, at least
one), so its layers' activations ``A_d`` satisfy ``f_d A_d <= M - s_d``. Summed over devices, with
``a_l^r`` the activation bytes of layer ``l`` in mode ``r`` and ``sum_d s_d >= p states(P / p)``,
any plan's modes satisfy::

    sum_l a_l^{r_l} <= B = min(p (M - states(P / p)),  M sum_d 1 / f_d - p states(P / p) / max_d f_d)

(1F1B on 32 stages: ``sum_d 1 / f_d`` is 4.1 where one pass per device gave 32). A candidate
on Megatron's even split (interleaved, or a pinned ``recompute_layers``) has its layers' places
known, and the same argument holds device by device, each with its own passes of each chunk
(even_split.py). Its work is then at least the Lagrangian bound
of that multiple-choice knapsack::

    W_M = max_{lambda >= 0}  sum_l min_r (c_l^r + lambda a_l^r) - lambda B

(concave and piecewise linear in ``lambda``: its maximum is at 0 or a breakpoint where a layer's
cheapest mode changes), and ``W_M`` replaces ``W`` above. When even ``sum_l min_r a_l^r > B``
the candidate cannot fit (pruned by memory). The refined bound also adds the data-parallel
communication of ``P / p`` parameters that no overlap hides (``Estimator.dp_floor``: the
device with the most parameters pays at least that much after its pipeline) and the loss's
all-reduce.

The search returns the simplest plan within ``tie_tolerance`` of the fastest (choice.py): once the
fastest is found, the candidates whose bound lies within the tolerance of it are evaluated too when
their moving parts (counted without recomputation, a lower bound) could come before the choice so
far; when the choice uses ZeRO, the zero=0 candidates are then visited in bound order up to the best
of them, a runner-up the user always sees.

The layout variants (the sharding ILP's "fast" and "lean" solutions, sharding.py) are
separate candidates with their own layer costs, so the global step time, not the ILP's
per-layer objective, decides between them.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import ParallelConfig, Precision
from ..cost_model import Estimator, estimate_plan
from ..cost_model.compute import MeasuredTimes
from ..cost_model.layer_cost import LayerCostModel
from ..cost_model.memory import least_passes
from ..cost_model.tensor_parallel import TPLayout
from ..plan import Plan
from ..progress import progress_bar
from .choice import TIE, TOP_ALTERNATIVES, DEFAULT_TIE_TOLERANCE, Seen, choose, could_beat
from .even_split import EvenSplitPlans, Split, even_pipeline_floor, even_splits, knapsack_floors
from .sharding import WHOLE_BATCH
from .space import Candidate, candidates, placeable, recompute_modes
from .stages import least_memory, partition, run_tables


@dataclass(frozen=True)
class LayerWork:
    """What a candidate's bounds need from its layers (one micro-batch), by layout, tensor,
    sequence, context and expert parallelism and micro-batch size."""

    total: float        # W: every layer in its cheapest mode
    params: float       # P: parameters per device after tensor and expert parallelism
    experts: float      # of which expert weights
    work: np.ndarray    # (distinct layers, modes) seconds
    acts: np.ndarray    # (distinct layers, modes) activation bytes
    counts: np.ndarray  # layers of each distinct row
    layer_work: np.ndarray   # (layers, modes) seconds, in layer order
    layer_acts: np.ndarray   # (layers, modes) activation bytes, in layer order


@dataclass
class SearchStats:
    """What the search did (counts are deterministic; seconds are not and stay out of the plan)."""

    candidates: int = 0
    evaluated: int = 0
    pruned_bound: int = 0
    pruned_memory: int = 0
    dominated: int = 0
    infeasible: int = 0
    timed_out: bool = False
    search_seconds: float = 0.0
    ilp_seconds: float = 0.0
    ilp_solves: int = 0
    ilp_stopped_early: int = 0      # group ILPs stopped at a time or node limit, or sharded greedily
    ilp_greedy: int = 0             # groups sharded greedily because time_limit had passed
    ilp_fallbacks: tuple[str, ...] = ()   # ILP solver failures and what replaced them
    gap: float | None = None        # when stopped at time_limit: (best - least remaining bound) / best
    unbounded: bool = False         # time_limit passed before every candidate had its bound

    def counts(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "evaluated": self.evaluated, "pruned_by_bound": self.pruned_bound,
                "pruned_by_memory": self.pruned_memory, "dominated": self.dominated,
                "did_not_fit": self.infeasible,
                "ilp_solves": self.ilp_solves, "ilp_stopped_early": self.ilp_stopped_early,
                "ilp_sharded_greedily": self.ilp_greedy, "stopped_at_time_limit": self.timed_out}


@dataclass
class Search(EvenSplitPlans):
    """One search of one graph on one cluster and global batch."""

    graph: OpGraph
    cluster: Cluster
    global_batch_size: int
    precision: Precision
    layouts: Mapping[str, Callable[[OpGraph, int], TPLayout]]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    time_limit: float | None = None
    splits_batch: Callable[[int, str], bool] | None = None   # (tp, variant) -> the layout splits the batch
    measured: MeasuredTimes | None = None                    # profiled op times (profile=True)
    progress: bool = False                                   # a progress bar once the search takes over 1 s
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE   # plans this close to the fastest are ties (choice.py)
    must_fit: bool = True      # False: the fastest plan whatever its memory (an estimate of a config that fits nowhere)
    stats: SearchStats = field(default_factory=SearchStats)
    _estimators: dict[str, Estimator] = field(default_factory=dict)
    _work: dict[tuple, LayerWork] = field(default_factory=dict)
    _mesh_ok: dict[tuple, bool] = field(default_factory=dict)       # (tp, cp, dp, ep, pp) -> placeable
    _layout_facts: dict[tuple, tuple[bool, bool]] = field(default_factory=dict)  # (variant, tp) -> facts
    _cuts: dict[tuple, float] = field(default_factory=dict)   # (variant, tp, cp, mb, pp) -> least p2p cut
    _splits: dict[tuple, tuple[Split, ...]] = field(default_factory=dict)   # even splits of a layer work and mesh
    _stage_floor: dict[tuple, float] = field(default_factory=dict)    # _largest_stage

    def estimator(self, variant: str) -> Estimator:
        if variant not in self._estimators:
            layers = LayerCostModel(self.graph, self.cluster, self.precision, measured=self.measured,
                                    layout_fn=self.layouts[variant])
            self._estimators[variant] = Estimator(self.graph, self.cluster, self.precision, layers)
        return self._estimators[variant]

    @functools.cached_property
    def modes(self) -> tuple[str, ...]:
        return recompute_modes(self.graph, self.fixed)

    @functools.cached_property
    def bound_modes(self) -> tuple[str, ...]:
        """The modes the bounds choose from: the search's, and "none" beside "full" (a partial
        recomputation, :meth:`_partial`, leaves the layers after each chunk's first unrecomputed)."""
        return self.modes + (("none",) if "full" in self.modes and "none" not in self.modes else ())

    def _usable(self):
        """The space's candidates whose mesh places uniformly on the topology, each with a layout that
        can run its micro-batch: a variant whose layout splits the batch gives a micro-batch that
        does not divide by tp its WHOLE_BATCH sibling (solved only when needed)."""
        base = tuple(v for v in self.layouts if not v.endswith(WHOLE_BATCH))
        for c in candidates(self.graph, self.cluster, self.global_batch_size, base, self.fixed):
            mesh = (c.tp, c.cp, c.dp, c.ep, c.pp)
            if mesh not in self._mesh_ok:
                self._mesh_ok[mesh] = placeable(self.cluster, c.config())
            if not self._mesh_ok[mesh]:
                continue
            if c.micro_batch_size % c.tp and self._facts(c)[1]:
                c = replace(c, variant=c.variant + WHOLE_BATCH)
            yield c

    @property
    def blocks(self) -> int:
        return sum(1 for layer in self.graph.layers if layer.is_block)

    def pin_values(self, name: str) -> set:
        """The values field ``name`` takes over the usable candidates with its pin dropped (the other
        pins kept): what it could be pinned to."""
        others = {k: v for k, v in self.fixed.items() if k != name}
        values = set()
        for c in candidates(self.graph, self.cluster, self.global_batch_size, tuple(self.layouts)[:1], others,
                            capped=False):
            mesh = (c.tp, c.cp, c.dp, c.ep, c.pp)
            if mesh not in self._mesh_ok:
                self._mesh_ok[mesh] = placeable(self.cluster, c.config())
            if self._mesh_ok[mesh]:
                values.add(getattr(c, name))
        return values

    def _duplicate(self, c: Candidate) -> bool:
        return self._facts(c)[0]

    def _facts(self, c: Candidate) -> tuple[bool, bool]:
        """Per (variant, tp), computed once: (a later variant whose layout equals an earlier one's,
        which adds nothing; the layout splits the batch, so micro-batches must divide by tp)."""
        key = (c.variant, c.tp)
        if key not in self._layout_facts:
            variants = list(self.layouts)
            mine = self.estimator(c.variant).layers.layout(c.tp)
            duplicate = any(self.estimator(v).layers.layout(c.tp) == mine
                            for v in variants[:variants.index(c.variant)])
            splits = self.splits_batch is not None and self.splits_batch(c.tp, c.variant)
            self._layout_facts[key] = (duplicate, splits)
        return self._layout_facts[key]

    # --- bounds ------------------------------------------------------------------------------
    def _layer_work(self, c: Candidate) -> LayerWork:
        """Per-layer work and activations in every mode, parameters after tensor and expert
        parallelism, and the expert ones among them (cached: the same for every mesh around them)."""
        key = (c.variant, c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.ep)
        if key not in self._work:
            est = self.estimator(c.variant)
            cfg = c.config()
            groups = est.placements(cfg)
            costs = [est.layer_costs(cfg, groups["tp"], m, groups) for m in self.bound_modes]
            work = np.array([[x.work for x in col] for col in costs]).T            # (layers, modes)
            acts = np.array([[x.activations for x in col] for col in costs]).T
            rows, counts = np.unique(np.concatenate([work, acts], axis=1), axis=0, return_counts=True)
            cheapest = work.min(axis=1)
            modes = len(self.bound_modes)
            self._work[key] = LayerWork(
                total=float(cheapest.sum()),
                params=float(est._local_params(self.graph.params, cfg)),
                experts=float(est._local_params(est.experts, cfg)),
                work=rows[:, :modes], acts=rows[:, modes:], counts=counts.astype(float),
                layer_work=work, layer_acts=acts)
        return self._work[key]

    def bounds(self, c: Candidate) -> tuple[float, float]:
        """(LB_T, LB_M) of the module docstring."""
        return self._bounds(c, self._layer_work(c).total)

    def _bounds(self, c: Candidate, total: float) -> tuple[float, float]:
        """(LB_T, LB_M) with ``total`` for ``W``."""
        lw = self._layer_work(c)
        m, p = c.micro_batches(self.global_batch_size), c.pp
        est = self.estimator(c.variant)
        cfg = c.config()
        p2p = 2 * (p * c.virtual_stages - 1) * self._least_cut(c) if p > 1 else 0.0
        x = max((total + p2p) / p, self._largest_stage(c))
        if c.schedule == "interleaved":
            pipe = (m + (p - 1) / c.virtual_stages) * x
        else:
            pipe = (m - 1) * x + total + p2p
        lb_t = pipe + est.optimizer_time(cfg, lw.params / p, lw.experts / p)
        lb_m = sum(est.state_bytes(cfg, lw.params / p, lw.experts / p))
        return lb_t, lb_m

    def _largest_stage(self, c: Candidate) -> float:
        """A floor on the slowest pipeline device's work, whatever the split: some device holds at
        least ``ceil(k / p)`` of the ``k`` costliest layers (in their cheapest modes), each costing at
        least the ``k``-th's, for every ``k`` (80 blocks on 32 stages put 3 on some)."""
        key = (c.variant, c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.ep, c.pp)
        if key not in self._stage_floor:
            costliest = -np.sort(-self._layer_work(c).layer_work.min(axis=1))
            share = np.ceil(np.arange(1, len(costliest) + 1) / c.pp)
            self._stage_floor[key] = float((share * costliest).max())
        return self._stage_floor[key]

    def _least_cut(self, c: Candidate) -> float:
        """The least p2p time of any pipeline cut per micro-batch (as one device beside it sees it)."""
        key = (c.variant, c.tp, c.cp, c.micro_batch_size, c.pp)
        if key not in self._cuts:
            est, cfg = self.estimator(c.variant), c.config()
            self._cuts[key] = est.least_cut_time(cfg, est.placements(cfg)["pp"])
        return self._cuts[key]

    def refine(self, c: Candidate, lb_t: float, lb_m: float) -> float | None:
        """``LB_T`` with ``W_M``, the work the activations' memory forces, plus the data-parallel
        communication no overlap hides, and for an even split the device-by-device bound (module
        docstring); None when the activations cannot fit in any mode."""
        tighter = self._refine_summed(c, lb_t, lb_m)
        return tighter if tighter is None or not self._even_split(c) else self._refine_even(c, tighter)

    def _refine_summed(self, c: Candidate, lb_t: float, lb_m: float) -> float | None:
        """:meth:`refine` without the even split's own bound."""
        m = c.micro_batches(self.global_batch_size)
        lw = self._layer_work(c)
        total = lw.total
        if self._holds(c, m):
            floors = knapsack_floors(lw.work, lw.acts, lw.counts[:, None], np.array([self._budget(c, m, lb_m)]))
            if floors is None:
                return None
            total = max(total, float(floors[0]))
        return max(lb_t, self._bounds(c, total)[0] + self._tail(c, m))

    def _refine_even(self, c: Candidate, lb_t: float) -> float | None:
        """The even split's device-by-device bound (even_split.py), the costlier part of :meth:`refine`:
        the search takes it only for a candidate whose summed bound reaches the queue's head."""
        m = c.micro_batches(self.global_batch_size)
        lw, est, cfg = self._layer_work(c), self.estimator(c.variant), c.config()
        key = (c.variant, c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.ep, c.pp, c.virtual_stages)
        if key not in self._splits:
            self._splits[key] = even_splits(est, cfg, lw.layer_work)
        pipe = even_pipeline_floor(est, cfg, m, self._splits[key], lw.layer_work, lw.layer_acts,
                                   self.cluster.device.memory if self._holds(c, m) else math.inf)
        if pipe is None:
            return None
        return max(lb_t, pipe + est.optimizer_time(cfg, lw.params / c.pp, lw.experts / c.pp) + self._tail(c, m))

    def _holds(self, c: Candidate, m: int) -> bool:
        """Whether the memory argument applies: it needs every layer's activations held at once,
        not so for an interleaved order with m not a multiple of p (which the space never offers)."""
        return self.must_fit and not (c.schedule == "interleaved" and m % c.pp)

    def _tail(self, c: Candidate, m: int) -> float:
        """The data-parallel communication no overlap hides and the loss's all-reduce."""
        lw, est, cfg = self._layer_work(c), self.estimator(c.variant), c.config()
        return est.dp_floor(cfg, m, est.placements(cfg), lw.params / c.pp, lw.experts / c.pp) + est.loss_share_time()

    def _budget(self, c: Candidate, m: int, lb_m: float) -> float:
        """``B``, the most activation bytes one pass of all layers may take (module docstring):
        device ``d`` holds at least ``f_d`` passes of each of its layers (memory.least_passes), so
        ``f_d A_d <= M - s_d``; summed with ``sum_d s_d >= p states(P / p)``, ``sum_d A_d`` is at most
        ``M sum_d 1 / f_d - p states(P / p) / max_d f_d`` (and at most ``p (M - states(P / p))``)."""
        memory, cfg = self.cluster.device.memory, c.config()
        passes = [least_passes(cfg, d, m) for d in range(c.pp)]
        return min(c.pp * (memory - lb_m),
                   memory * sum(1 / f for f in passes) - c.pp * lb_m / max(passes))

    # --- evaluation --------------------------------------------------------------------------
    def evaluate(self, c: Candidate) -> Plan | float:
        """The best plan of this candidate (partition and recompute solved), or, when nothing
        fits, the least peak memory per device it could reach (bytes)."""
        est = self.estimator(c.variant)
        m = c.micro_batches(self.global_batch_size)
        memory = self.cluster.device.memory if self.must_fit else math.inf
        if self._even_split(c):
            tried = self._even(c)
            fitting = [pl for pl in tried if isinstance(pl, Plan)]
            if not fitting:
                return min(pl.peak for pl in tried)
            return min(fitting, key=lambda pl: pl.step_time)
        cfg = self._config(c)
        tables = run_tables(est, cfg, m, self.modes)
        part = partition(tables, cfg, m, memory)
        if part is None:
            return least_memory(tables, cfg, m)[0]
        return estimate_plan(self.graph, self.cluster, c.with_modes(part.modes), self.global_batch_size,
                             self.precision, est, chunks=part.chunks)

    def _config(self, c: Candidate) -> ParallelConfig:
        """The candidate's config for the stage DP, with the recompute mode of each stage when pinned."""
        return c.config(self.fixed.get("recompute", "none"), tuple(self.fixed.get("stage_recompute") or ()))

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> tuple[Plan | None, Candidate | None, Seen]:
        """The chosen plan and its candidate (choice.py: the simplest within ``tie_tolerance`` of the
        fastest), and every evaluated candidate with its result (for the alternatives).

        Three passes over one queue ordered by bound: (1) branch and bound to the fastest plan; (2)
        the candidates whose bound lies within the tolerance of it and that could come before the
        choice so far (fewer moving parts); (3) when the choice uses ZeRO, the best plain
        data-parallel plan, for the runners-up."""
        t0 = time.perf_counter()
        deadline = None if self.time_limit is None else t0 + self.time_limit
        queue = self._queue(deadline)
        seen: Seen = []
        fastest: list[Plan] = []      # the fastest plan so far (at most one)

        def evaluate(lb_t: float, c: Candidate) -> None:
            result = self.evaluate(c)
            self.stats.evaluated += 1
            seen.append((lb_t, c, result))
            if not isinstance(result, Plan):
                self.stats.infeasible += 1
            elif not fastest or result.step_time < fastest[0].step_time:
                fastest[:] = [result]

        bar = progress_bar(iter(lambda: self._next(queue, fastest[0].step_time if fastest else math.inf, deadline),
                                     None),
                           "autopar: searching", total=len(queue), enabled=self.progress)
        for lb_t, _, _, _, c in bar:
            if self._past(deadline) and fastest:
                # every candidate left has a bound >= this one's (the queue is in bound order)
                self.stats.timed_out = True
                if not self.stats.unbounded:
                    self.stats.gap = max(0.0, (fastest[0].step_time - lb_t) / fastest[0].step_time)
                break
            evaluate(lb_t, c)
        if fastest and not self.stats.timed_out:
            band = fastest[0].step_time * (1 + self.tie_tolerance) * (1 + TIE)
            deferred = []
            choice = choose((r for _, _, r in seen if isinstance(r, Plan)), self.tie_tolerance)
            while (entry := self._next(queue, band, deadline)) is not None:
                if self._past(deadline):
                    self.stats.timed_out = True   # the choice among ties may not be the simplest
                    deferred.append(entry)
                    break
                if could_beat(entry[-1], entry[0], choice):
                    evaluate(entry[0], entry[-1])
                    if isinstance(seen[-1][2], Plan):   # no plan here is faster than fastest[0]
                        choice = choose((choice, seen[-1][2]), self.tie_tolerance, fastest[0].step_time)
                else:
                    deferred.append(entry)
            queue += deferred
        plans = [r for _, _, r in seen if isinstance(r, Plan)]
        best = choose(plans, self.tie_tolerance)
        if best is not None and best.config.zero and not self._past(deadline):
            self._plain(queue, seen, evaluate, deadline)
        if best is not None:
            self._runners_up(best, queue, seen, evaluate, deadline)
        self.stats.pruned_bound = self.stats.candidates - self.stats.dominated - self.stats.pruned_memory \
            - self.stats.evaluated
        self.stats.search_seconds = time.perf_counter() - t0
        best_c = next((c for _, c, r in seen if r is best), None)
        return best, best_c, seen

    def _runners_up(self, best: Plan, queue: list, seen: Seen, evaluate: Callable[[float, Candidate], None],
                    deadline: float | None) -> None:
        """Evaluate the next candidates in bound order until TOP_ALTERNATIVES configurations other than
        ``best``'s have a plan (the runners-up plan.explain() shows): where the bounds are tight the
        search proves its choice with few evaluations, and a user still sees what came next."""
        def others() -> int:
            return len({r.config for _, _, r in seen if isinstance(r, Plan) and r.config != best.config})
        while others() < TOP_ALTERNATIVES and not self._past(deadline) and \
                (entry := self._next(queue, math.inf, deadline)) is not None:
            evaluate(entry[0], entry[-1])

    def _plain(self, queue: list, seen: Seen, evaluate: Callable[[float, Candidate], None],
               deadline: float | None) -> None:
        """Evaluate the zero=0 candidates in bound order up to the fastest zero=0 plan (a runner-up)."""
        plain = [e for e in queue if e[-1].zero == 0]
        queue[:] = [e for e in queue if e[-1].zero != 0]
        heapq.heapify(plain)

        def best_plain() -> float:
            return min((r.step_time for _, _, r in seen if isinstance(r, Plan) and r.config.zero == 0),
                       default=math.inf)
        while not self._past(deadline) and (entry := self._next(plain, best_plain(), deadline)) is not None:
            evaluate(entry[0], entry[-1])
        queue += plain

    @staticmethod
    def _past(deadline: float | None) -> bool:
        return deadline is not None and time.perf_counter() > deadline

    def _queue(self, deadline: float | None) -> list:
        """Every usable candidate not dominated or pruned by memory, as a heap of
        (bound, sort key, index, pending refinement: its memory bound at first (_next), candidate)."""
        queue = []
        for c in self._usable():
            if queue and self._past(deadline):
                # past the limit with something to evaluate: the candidates not yet bounded are
                # left out, so no gap can be claimed for them
                self.stats.timed_out, self.stats.unbounded = True, True
                break
            self.stats.candidates += 1
            if self._duplicate(c) or (c.schedule == "gpipe" and "schedule" not in self.fixed):
                self.stats.dominated += 1
                continue
            lb_t, lb_m = self.bounds(c)
            if lb_m > self.cluster.device.memory and self.must_fit:
                self.stats.pruned_memory += 1
                continue
            queue.append((lb_t, c.sort_key(), len(queue), lb_m, c))   # the index keeps ties ordered
        heapq.heapify(queue)
        return queue

    def _next(self, queue: list, limit: float, deadline: float | None = None) -> tuple | None:
        """The queue's next entry with a bound below ``limit``, each refined before it is returned (a
        refined bound goes back into the queue); None when none is left below it. An entry's
        ``pending`` is what is left to refine: its memory bound (the summed refinement), "even" (an
        even split's own bound, taken only once the summed one reaches the head), or None. Past the
        ``deadline`` an even split's own bound is skipped (it only prunes, and costs the most)."""
        while queue:
            entry = heapq.heappop(queue)
            lb_t, key, index, pending, c = entry
            if lb_t >= limit:
                heapq.heappush(queue, entry)
                return None
            if pending is None or (pending == "even" and self._past(deadline)):
                return (lb_t, key, index, None, c)
            if pending == "even":
                tighter, after = self._refine_even(c, lb_t), None
            else:
                tighter = self._refine_summed(c, lb_t, pending)
                after = "even" if self._even_split(c) else None
            if tighter is None:
                self.stats.pruned_memory += 1
                continue
            heapq.heappush(queue, (tighter, key, index, after, c))
        return None

    def least_memory_overall(self) -> tuple[float, ParallelConfig | None]:
        """The least peak memory per device over every candidate, and the configuration reaching it
        (used when nothing fits): visits candidates in increasing memory bound and stops when the
        bound reaches the best found."""
        order = []
        for c in self._usable():
            if self._duplicate(c) or (c.schedule == "gpipe" and "schedule" not in self.fixed):
                continue
            order.append((self.bounds(c)[1], c.sort_key(), c))
        order.sort(key=lambda e: (e[0], e[1]))
        best, arg = float("inf"), None
        for lb_m, _, c in order:
            if lb_m >= best:
                break
            mem, cfg = self.leanest(c)
            if mem < best:
                best, arg = mem, cfg
        return best, arg

    def leanest(self, c: Candidate) -> tuple[float, ParallelConfig]:
        """The least peak memory of one candidate over partitions and recompute modes."""
        est = self.estimator(c.variant)
        m = c.micro_batches(self.global_batch_size)
        if self._even_split(c):
            lean = min(self._even(c), key=lambda pl: pl.peak_memory if isinstance(pl, Plan) else pl.peak)
            return (lean.peak_memory, lean.config) if isinstance(lean, Plan) else lean
        cfg = self._config(c)
        mem, modes = least_memory(run_tables(est, cfg, m, self.modes), cfg, m)
        return mem, c.with_modes(modes)
