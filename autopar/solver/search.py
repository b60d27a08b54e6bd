r"""The outer search: the fastest configuration that fits, by best-first branch and bound.

Every candidate ``c`` of the space (space.py) gets a lower bound on its step time and on its memory
from per-layer costs alone (bounds.py, where the maths is), a branch at a time (space.Branch: the
candidates of one mesh and micro-batch, whose schedules, ZeRO stages, sequence parallelism and layout
variants share their layers' costs); the queue (bounded_queue.py) holds them as groups of one branch,
sequence-parallel choice and variant, each ordered as its least member and opened into one sort key per
candidate when it reaches the head, and a Candidate is made when the search reaches it. Those not pruned
by memory or dominated are visited in increasing bound; each is solved exactly by the stage DP
(stages.py), or on Megatron's even split (even_split.py), and estimated; the search stops when the next
bound reaches the best step time found (every remaining candidate is pruned by the bound). A candidate's stage DP stops as soon as its
floor shows it slower than every plan the search can still return or show (``_Needed``: the tie band
of the fastest, the six fastest configurations, the fastest of each kind the runners-up name); such a
candidate counts as pruned by the bound, and the plan and its runners-up are the same as without it.
A bound is tightened in steps as its candidate reaches the queue's head: by the memory its
activations force, then, for an even split, device by device.

The search returns the simplest plan within ``tie_tolerance`` of the fastest (choice.py): once the
fastest is found, the candidates whose bound lies within the tolerance of it are evaluated too when
their moving parts (counted without recomputation, a lower bound) could come before the choice so
far; when the choice uses ZeRO, the zero=0 candidates are then visited in bound order up to the best
of them, a runner-up the user always sees; and the next candidates in bound order until five other
configurations have plans (the runners-up plan.explain() shows).

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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..collector import collector_paused
from ..config import DEFAULT_TIE_TOLERANCE, SPLIT_BACKWARD, ParallelConfig, Precision
from ..cost_model import Estimator, estimate_plan
from ..cost_model.compute import MeasuredTimes
from ..cost_model.layer_cost import LayerCostModel
from ..cost_model.tensor_parallel import TPLayout
from ..plan import Plan
from ..progress import counter
from .choice import TIE, TOP_ALTERNATIVES, Seen, choose, could_beat
from .ahead import walk_ahead
from .bounded_queue import BoundedQueue, Settled
from .bounds import SearchBounds
from .even_split import EvenSplitPlans, Split
from .layer_work import LayerWork
from .sharding import WHOLE_BATCH
from .space import Branch, Candidate, branches, candidates, compatible, placeable, recompute_modes
from .stages import ABOVE, least_memory, partition, run_tables

if TYPE_CHECKING:
    from .sharding_solver import ShardingSolver


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
    ilp_seconds: float = 0.0        # building and solving sharding ILPs, in either process (ShardingSolver.prefetch)
    ilp_waited: float = 0.0         # of search_seconds, spent solving them or waiting for them
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


BOUNDING_SHARE = 0.6
"""Of a search's ``time_limit``, the share that may go to bounding branches into the queue before the search
turns to its first plan: finding one past the bounds took the built-in Llama-3 405B on 2,048 x 8 H100s 0.5-1.0 s
of refinements and pricing on a 2-core machine (bench/time_limit.py), whatever the limit."""

# The runners-up plan.explain() shows besides the fastest few: the best plan of each of these kinds
# (choice.alternatives' counterfactuals), which a candidate of that kind may be
_KINDS = {"no cp": lambda c: c.cp == 1, "no ep": lambda c: c.ep == 1, "no ZeRO-3": lambda c: c.zero < 3,
          "no ZeRO": lambda c: c.zero == 0 and c.offload == "none", "no offload": lambda c: c.offload == "none"}


@dataclass
class _Needed:
    """Which plans the search must price exactly: the fastest within the tie band (choice.choose), the
    TOP_ALTERNATIVES + 1 fastest configurations (choice.alternatives' runners-up besides the choice), and the
    fastest of each of :data:`_KINDS`. A candidate none of whose plans could be one of them (every plan at or
    above :meth:`cutoff`) needs no plan: its stage DP stops at the cutoff (stages.partition)."""

    by_config: dict[ParallelConfig, float] = field(default_factory=dict)
    by_kind: dict[str, float] = field(default_factory=dict)

    def add(self, plan: Plan) -> None:
        cfg, t = plan.config, plan.step_time
        self.by_config[cfg] = min(t, self.by_config.get(cfg, math.inf))
        for kind, holds in _KINDS.items():
            if holds(cfg):
                self.by_kind[kind] = min(t, self.by_kind.get(kind, math.inf))

    def cutoff(self, c: Candidate, band: float) -> float:
        """Seconds at and above which no plan of ``c`` is needed (infinite until enough plans are known)."""
        times = sorted(self.by_config.values())
        limit = max(band, times[TOP_ALTERNATIVES] if len(times) > TOP_ALTERNATIVES else math.inf)
        for kind, holds in _KINDS.items():
            if holds(c):
                limit = max(limit, self.by_kind.get(kind, math.inf))
        return limit


@dataclass
class Search(BoundedQueue, SearchBounds, EvenSplitPlans):
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
    layouts_ahead: "ShardingSolver | None" = None   # solves the layouts in a second process while the bounds run
    progress: bool = False                                   # a progress bar once the search takes over 1 s
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE   # plans this close to the fastest are ties (choice.py)
    must_fit: bool = True      # False: the fastest plan whatever its memory (an estimate of a config that fits nowhere)
    stats: SearchStats = field(default_factory=SearchStats)
    settled: Settled | None = None     # the run's queue, as its bar counts it
    ahead: Any = None      # while the run's queue is walked ahead in a second process (ahead.py)
    _estimators: dict[str, Estimator] = field(default_factory=dict)
    _work: dict[tuple, LayerWork] = field(default_factory=dict)
    _least: dict[tuple, tuple[float, np.ndarray]] = field(default_factory=dict)   # SearchBounds._least_work
    _mesh_ok: dict[tuple, bool] = field(default_factory=dict)       # (tp, cp, dp, ep, pp) -> placeable
    _layout_facts: dict[tuple, tuple[bool, bool]] = field(default_factory=dict)  # (variant, tp) -> facts
    _cuts: dict[tuple, float] = field(default_factory=dict)   # (tp, cp, mb, pp) -> least p2p cut
    _splits: dict[tuple, tuple[Split, ...]] = field(default_factory=dict)   # even splits of a layer work and mesh
    _prepared: dict[tuple, tuple] = field(default_factory=dict)   # their knapsacks, by schedule and micro-batches
    _parts_of: dict[tuple, tuple] = field(default_factory=dict)   # a branch's parts, by mesh and micro-batch
    _deferred: dict[tuple, list] = field(default_factory=dict)    # offloading branches waiting for their twin
    _release_to: list | None = None                               # the queue they go into
    _stage_floor: dict[tuple, float] = field(default_factory=dict)    # _largest_stage
    _held: dict[tuple, tuple[float, int]] = field(default_factory=dict)   # _passes
    _params: dict[tuple, tuple[float, float]] = field(default_factory=dict)   # _local_params
    _fixed: dict[tuple, tuple[float, float]] = field(default_factory=dict)    # _per_step
    _accumulate: dict[tuple, float] = field(default_factory=dict)   # _accumulated
    _tails: dict[tuple, float] = field(default_factory=dict)    # _tail
    _kind_index: np.ndarray | None = None    # SearchBounds._kinds

    def estimator(self, variant: str) -> Estimator:
        if variant not in self._estimators:
            layers = LayerCostModel(self.graph, self.cluster, self.precision, measured=self.measured,
                                    layout_fn=self.layouts[variant])
            self._estimators[variant] = Estimator(self.graph, self.cluster, self.precision, layers)
        return self._estimators[variant]

    def share_estimators(self, other: "Search") -> None:
        """Price with ``other``'s estimators (and what they have cached): a search of the same graph, cluster,
        precision, measured times and layouts (one ShardingSolver's) at another batch or with other pins."""
        if (other.graph is not self.graph or other.cluster != self.cluster or other.precision != self.precision
                or other.measured is not self.measured or set(other.layouts) != set(self.layouts)
                or other.layouts_ahead is None or other.layouts_ahead is not self.layouts_ahead):
            raise ValueError("share_estimators: the searches price different graphs, clusters or layouts")
        self._estimators = other._estimators

    @functools.cached_property
    def modes(self) -> tuple[str, ...]:
        return recompute_modes(self.graph, self.fixed)

    def modes_of(self, c: Candidate) -> tuple[str, ...]:
        """:attr:`modes` that candidate ``c``'s schedule runs: the zero-bubble ones' two backward passes go
        through a layer's checkpoint twice, which per-op recomputation does not allow (config.py)."""
        return tuple(m for m in self.modes if m != "op") if c.schedule in SPLIT_BACKWARD else self.modes

    def _branches(self) -> Iterator[Branch]:
        """The space's branches whose mesh places uniformly on the topology; without the zero-bubble
        schedules under compiled kernels (a compiled chunk's backward is one node: it cannot be split)."""
        for b in branches(self.graph, self.cluster, self.global_batch_size, self.fixed):
            if self.precision.kernels == "compiled" and any(s in SPLIT_BACKWARD for s, _ in b.schedules):
                b = replace(b, schedules=tuple((s, v) for s, v in b.schedules if s not in SPLIT_BACKWARD))
                if not b.schedules:
                    continue
            mesh = (b.tp, b.cp, b.dp, b.ep, b.pp)
            if mesh not in self._mesh_ok:
                self._mesh_ok[mesh] = placeable(self.cluster, b.candidate("", False, *b.schedules[0], b.zeros[0]).config())
            if self._mesh_ok[mesh]:
                yield b

    def _variant(self, variant: str, tp: int, micro_batch_size: int) -> str:
        """The layout a candidate of ``variant`` runs: a variant whose layout splits the batch gives a
        micro-batch that does not divide by tp its WHOLE_BATCH sibling (solved only when needed)."""
        if micro_batch_size % tp and self._facts(variant, tp)[1]:
            return variant + WHOLE_BATCH
        return variant

    @property
    def _base_variants(self) -> tuple[str, ...]:
        return tuple(v for v in self.layouts if not v.endswith(WHOLE_BATCH))

    def _usable(self) -> Iterator[Candidate]:
        """The space's candidates whose mesh places uniformly on the topology, each with a layout that
        can run its micro-batch (:meth:`_variant`)."""
        for b in self._branches():
            for schedule, v in b.schedules:
                for zero in b.zeros:
                    if not compatible(schedule, zero):
                        continue
                    for sp in b.sequence_parallel:
                        for variant in self._base_variants:
                            yield b.candidate(self._variant(variant, b.tp, b.micro_batch_size), sp, schedule, v,
                                              zero)

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

    def _dominated(self, c: Candidate) -> bool:
        """GPipe (unless pinned: under this cost model it takes the time of 1F1B and holds more
        micro-batches), or a layout that repeats an earlier variant's."""
        return not self._visits(c.schedule) or self._facts(c.variant, c.tp)[0]

    def _visits(self, schedule: str) -> bool:
        """Whether the search visits ``schedule``: not GPipe, unless the schedule is pinned (:meth:`_dominated`)."""
        return schedule != "gpipe" or "schedule" in self.fixed

    def _facts(self, variant: str, tp: int) -> tuple[bool, bool]:
        """Per (variant, tp), computed once: (a later variant whose layout equals the one an earlier variant
        runs on the same micro-batches (:meth:`_variant`: a whole-batch one's, those tp does not divide), which
        adds nothing; the layout splits the batch, so micro-batches must divide by tp)."""
        key = (variant, tp)
        if key not in self._layout_facts:
            bases = list(self._base_variants)
            base = variant.removesuffix(WHOLE_BATCH)
            micro_batch = 1 if variant != base else tp    # a micro-batch size this variant runs
            mine = self.estimator(variant).layers.layout(tp)
            duplicate = any(self.estimator(self._variant(v, tp, micro_batch)).layers.layout(tp) == mine
                            for v in bases[:bases.index(base)])
            splits = self.splits_batch is not None and self.splits_batch(tp, variant)
            self._layout_facts[key] = (duplicate, splits)
        return self._layout_facts[key]

    # --- evaluation --------------------------------------------------------------------------
    def evaluate(self, c: Candidate, cutoff: float = math.inf) -> Plan | float | None:
        """The best plan of this candidate (partition and recompute solved), or, when nothing
        fits, the least peak memory per device it could reach (bytes; infinite when an offloading
        candidate's states overflow host memory), or None when a partition fits but none is faster
        than ``cutoff`` (seconds: the search needs no plan that slow, :meth:`_Needed.cutoff`)."""
        result = self._evaluate(c, cutoff)
        if c.offload != "none" and self.must_fit and isinstance(result, Plan) and not result.fits:
            return math.inf   # device memory fits (the partition saw to it): the host's does not
        return result

    def _evaluate(self, c: Candidate, cutoff: float = math.inf) -> Plan | float | None:
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
        tables = run_tables(est, cfg, m, self.modes_of(c))
        part = partition(tables, cfg, m, memory, cutoff)
        if part is None:
            return least_memory(tables, cfg, m)[0]
        if part is ABOVE:
            return None
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
        ahead = self.layouts_ahead
        if ahead is not None:   # the layouts the bounds will ask for, in the order they will: each degree's, with
            # its whole-batch ones where a micro-batch does not divide by it (asked for where the base layout
            # splits the batch, _variant; solved here while the search waited for them otherwise)
            meshes = {(b.tp, b.micro_batch_size % b.tp != 0) for b in self._branches() if b.tp > 1}
            degrees = sorted({tp for tp, _ in meshes})
            ahead.prefetch([(tp, variant + suffix) for tp in degrees
                            for suffix in ("", WHOLE_BATCH) if not suffix or (tp, True) in meshes
                            for variant in self._base_variants])
        try:
            return self._run(t0, deadline)
        finally:
            if ahead is not None:
                ahead.stop_prefetch()

    def _run(self, t0: float, deadline: float | None) -> tuple[Plan | None, Candidate | None, Seen]:
        """:meth:`run` once the layouts are on their way."""
        with collector_paused():
            # with a limit, branches stop joining the queue at BOUNDING_SHARE of it: the rest is the first
            # plan's (its candidate's bounds refined, its stage DP and estimate)
            queue = self._queue(None if deadline is None else t0 + BOUNDING_SHARE * (deadline - t0))
            total = self.settled.total
            self.ahead = walk_ahead(self, queue)
            try:
                with counter("autopar: searching", total=total, unit="candidates", enabled=self.progress) as bar:
                    best, best_c, seen = self._search(queue, deadline, bar)
                    bar.update(total - bar.n)   # the rest are pruned by the bound
            finally:
                if self.ahead is not None:
                    self.ahead.close()
                    self.ahead = None
            # the queue's entries (thousands of branches, groups and candidates) freed now, by their counts:
            # alive when the collector resumes, its first pass walks them too (HF GPT-2 175B's 17,706 groups,
            # when every branch was bounded: 0.20 s, 0.12 without)
            del queue
        self.stats.pruned_bound = self.stats.candidates - self.stats.dominated - self.stats.pruned_memory \
            - self.stats.evaluated
        self.stats.search_seconds = time.perf_counter() - t0
        return best, best_c, seen

    def _search(self, queue: list, deadline: float | None, bar) -> tuple[Plan | None, Candidate | None, Seen]:
        """:meth:`run`'s three passes over the bounded ``queue``, moving ``bar`` by the settled candidates."""
        seen: Seen = []
        fastest: list[Plan] = []      # the fastest plan so far (at most one)
        needed = _Needed()

        def evaluate(lb_t: float, index: int, c: Candidate) -> Plan | float | None:
            cutoff = needed.cutoff(c, fastest[0].step_time * (1 + self.tie_tolerance) * (1 + TIE) if fastest
                                   else math.inf)
            result = self.evaluate(c, cutoff)
            self.settled.done[index] = True
            # None: a plan fits, slower than any the search can return or show (counted as pruned by the bound)
            if result is not None:
                self.stats.evaluated += 1
                seen.append((lb_t, c, result))
                if not isinstance(result, Plan):
                    self.stats.infeasible += 1
                else:
                    needed.add(result)
                    if not fastest or result.step_time < fastest[0].step_time:
                        fastest[:] = [result]
            bar.update(self.settled.count(fastest[0].step_time if fastest else math.inf) - bar.n)
            return result

        for lb_t, _, index, _, c in iter(lambda: self._next(queue, fastest[0].step_time if fastest else math.inf,
                                                           deadline), None):
            if self._past(deadline) and fastest:
                # every candidate left has a bound >= this one's (the queue is in bound order)
                self.stats.timed_out = True
                if not self.stats.unbounded:
                    self.stats.gap = max(0.0, (fastest[0].step_time - lb_t) / fastest[0].step_time)
                break
            evaluate(lb_t, index, c)
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
                    result = evaluate(entry[0], entry[2], entry[-1])
                    if isinstance(result, Plan):   # no plan here is faster than fastest[0]
                        choice = choose((choice, result), self.tie_tolerance, fastest[0].step_time)
                else:
                    deferred.append(entry)
            queue += deferred
            heapq.heapify(queue)
        plans = [r for _, _, r in seen if isinstance(r, Plan)]
        best = choose(plans, self.tie_tolerance)
        if best is not None and best.config.zero and not self._past(deadline):
            self._plain(queue, seen, evaluate, deadline)
        if best is not None:
            self._runners_up(best, queue, seen, evaluate, deadline)
        best_c = next((c for _, c, r in seen if r is best), None)
        return best, best_c, seen

    def _runners_up(self, best: Plan, queue: list, seen: Seen, evaluate: Callable[[float, int, Candidate], Any],
                    deadline: float | None) -> None:
        """Evaluate the next candidates in bound order until TOP_ALTERNATIVES configurations other than
        ``best``'s have a plan (the runners-up plan.explain() shows): where the bounds are tight the
        search proves its choice with few evaluations, and a user still sees what came next."""
        def others() -> int:
            return len({r.config for _, _, r in seen if isinstance(r, Plan) and r.config != best.config})
        while others() < TOP_ALTERNATIVES and not self._past(deadline) and \
                (entry := self._next(queue, math.inf, deadline)) is not None:
            evaluate(entry[0], entry[2], entry[-1])

    def _plain(self, queue: list, seen: Seen, evaluate: Callable[[float, int, Candidate], Any],
               deadline: float | None) -> None:
        """Evaluate the plain data-parallel candidates (zero=0, nothing offloaded) in bound order up to the fastest
        such plan (a runner-up)."""
        plain, queue[:] = self._split(queue, lambda zero, offload: zero == 0 and offload == "none")

        def best_plain() -> float:
            return min((r.step_time for _, _, r in seen if isinstance(r, Plan) and _KINDS["no ZeRO"](r.config)),
                       default=math.inf)
        while not self._past(deadline) and (entry := self._next(plain, best_plain(), deadline)) is not None:
            evaluate(entry[0], entry[2], entry[-1])
        queue += plain
        heapq.heapify(queue)

    @staticmethod
    def _past(deadline: float | None) -> bool:
        return deadline is not None and time.perf_counter() > deadline

    def least_memory_overall(self) -> tuple[float, ParallelConfig | None]:
        """The least peak memory per device over every candidate, and the configuration reaching it
        (used when nothing fits): visits candidates in increasing memory bound and stops when the
        bound reaches the best found."""
        order = []
        for c in self._usable():
            if self._dominated(c):
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
        mem, modes = least_memory(run_tables(est, cfg, m, self.modes_of(c)), cfg, m)
        return mem, c.with_modes(modes)
