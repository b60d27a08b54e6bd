r"""The outer search's bounds (search.py): a lower bound on a candidate's step time and memory.

For every candidate ``c`` of the space (space.py) a lower bound on its step time needs only
per-layer costs (cached per layer signature; the candidates of one space.Branch and layout share
``W``, ``w_p`` and ``min_cut`` below, and ``opt``/``states`` per ZeRO stage: SearchBounds.leaf_bounds
looks them up once for all their schedules and ZeRO stages)::

    LB_T(c) = (m - 1) max((W + C) / p, w_p) + W + C + opt(P / p)           (1F1B, GPipe)
    LB_T(c) = (m + (p - 1) / v) max((W + C) / p, w_p) + opt(P / p)          (interleaved)
    LB_T(c) = m max((W + C) / p, w_p) + (p - 1) / p D + opt(P / p)          (ZB-H1)
    LB_T(c) = m max((W + C) / p, w_p) + opt(P / p)                          (ZB-V)
    LB_M(c) = states(P / p) + sum_l min_r a_l^r / p

``W = sum_l c_l`` is the work of one micro-batch through all layers in the cheapest recompute
mode, ``w_p = max_k ceil(k / p) c_(k)`` with ``c_(k)`` the ``k``-th costliest layer (some device
holds ``ceil(k / p)`` of the ``k`` costliest: 80 blocks on 32 stages put 3 on some),
``D = max((W + C - W_w) / 2, W_f + C / 2, W_p + C / 2 - W_f - W_w)`` with ``W_w`` and ``W_f`` the weight-gradient and
forward seconds of all layers and ``W_p`` their work without recomputation (each the same in every mode) floors
ZB-H1's drain (``zbh1_drain_floor``); ZB-V's fill, at least ``(p - 1)/2`` of the least forward of any
device (a device-by-device floor), enters the even split's bound. ``C = 2 (p v - 1) min_cut`` the p2p of the ``p v - 1`` cuts between chunks (``p v - 2`` under ZB-V,
whose turn stays on one device) (each seen by its
sender and its receiver; ``min_cut`` the cheapest cut of the model, ``v = 1`` unless
interleaved), ``P`` the parameters after tensor parallelism and
``opt``/``states`` the optimizer time and model-state bytes of that many parameters: the
slowest stage has at least the mean work and the mean parameters, and the pipeline formula
(cost_model/schedule.py) is increasing in both. Where micro-batches' weight gradients are added up by
autograd (Precision.grad_accumulation), each device's work per micro-batch also holds its share of that pass,
linear in its parameters: ``W`` above takes ``A = p acc(P / p) / m`` more (:meth:`SearchBounds._accumulated`;
ZB-H1's drain floor none: the pass is in the weight-gradient work, which the floor's terms subtract), and an
even split's device-by-device bound each device's own share. In ``LB_M``, ``a_l^r`` are the activation bytes
of layer ``l`` in mode ``r``: every device holds at least one pass of each of its layers at its
peak (below), so the fullest holds at least the mean of states and activations (a micro-batch
of 1024 sequences is refused here, not after its stage DP). A candidate with ``LB_M > M`` cannot fit
(pruned by memory). A branch (one mesh and micro-batch) enters the queue under floors of its candidates'
bounds (``branch_floor``): every schedule's pipeline term is at least ``m max((W + C_1) / p, w_p)``
(``W + C >= max((W + C) / p, w_p)``; ``C_1 = 2 (p - 1) min_cut``, the fewest crossings), plus the least
``opt`` of its ZeRO stages; and ``LB_M`` at least the least ``states + sum_l min_r a_l^r / p``: a branch
whose floor on memory exceeds ``M`` is pruned whole, the others are bounded candidate by candidate when
their floor reaches the queue's head (most never do). Before that floor, which prices every layer of the
branch op by op, a branch enters under a quicker one (``quick_floor``): the same formula with each layer's
``c_l`` replaced by a floor of its work that is linear in the micro-batch (cost_model LayerCostModel.least_work:
its ops' rooflines at the device's best GEMM efficiency, its tensor-parallel collectives, the ring's exposed
transfers at that floor), and the states alone for memory; the branch is priced when that floor reaches the head
(HF GPT-2 175B on 1,024 GPUs: the quick floor is a median 96% of the priced one, and 2,600 layer pricings of
(layout, tp, micro-batch, cp) become about 500). The rest are visited in increasing ``LB_T``; each is solved exactly by the
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
cheapest mode changes), and ``W_M`` replaces ``W`` above. Under a split backward (ZB-H1, ZB-V) each
backward pass reruns a recomputing layer's forward (cost_model/estimator.reruns), so ``c_l^r`` counts its
recomputation twice there; ZB-H1's drain floor ``D`` takes ``W_M`` with it once (``zbh1_drain_floor``).
When even ``sum_l min_r a_l^r > B`` the candidate cannot fit (pruned by memory). The refined bound also adds the data-parallel
communication of ``P / p`` parameters that no overlap hides (``StepTail.dp_floor``: the
device with the most parameters pays at least that much after its pipeline) and the loss's
all-reduce.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from ..config import SPLIT_BACKWARD, SPLIT_EVERY_BACKWARD, V_SHAPED, ParallelConfig
from ..cost_model.memory import least_passes
from .even_split import PricedModes, even_pipeline_floor, even_splits, prepare_splits
from .layer_work import LayerWork
from .space import Candidate, compatible

if TYPE_CHECKING:
    from .bounded_queue import Unbounded


class SearchBounds:
    """The bounds of search.Search's candidates (a mixin: Search provides ``estimator``, ``graph``,
    ``cluster``, ``precision``, ``global_batch_size``, ``must_fit``, ``modes``, ``_even_split``, ``ahead`` and the caches
    ``_work``, ``_cuts``, ``_splits``, ``_prepared``, ``_stage_floor``, ``_held``, ``_params``, ``_fixed``, ``_accumulate``
    and ``_tails``)."""

    @functools.cached_property
    def bound_modes(self) -> tuple[str, ...]:
        """The modes the bounds choose from: the search's, and "none" beside "full" (a partial
        recomputation, :meth:`_partial`, leaves the layers after each chunk's first unrecomputed)."""
        return self.modes + (("none",) if "full" in self.modes and "none" not in self.modes else ())

    def _layer_work(self, c: Candidate) -> LayerWork:
        """Per-layer work and activations in every mode, parameters after tensor and expert
        parallelism, and the expert ones among them (cached: the same for every mesh around them)."""
        key = (c.variant, c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.ep)
        if key not in self._work:
            est = self.estimator(c.variant)
            cfg = c.config()
            groups = est.placements(cfg)
            split = est.split_groups(cfg, groups)
            costs = [est.kind_costs(cfg, groups["tp"], m, split) for m in self.bound_modes]
            kinds = self._kinds(est)    # layers of one kind share their costs: each priced once
            # (kinds, 3 x modes): work, activations and recomputation, as tuples: the distinct rows, sorted
            # (np.unique(axis=0)'s, without its cost on a few rows)
            table = [tuple(x.work for x in row) + tuple(x.activations for x in row) + tuple(x.recompute for x in row)
                     for row in zip(*costs)]
            distinct = sorted(set(table))
            where = {row: i for i, row in enumerate(distinct)}
            rows = np.array(distinct)
            layer_rows = np.array([where[row] for row in table])[kinds]
            modes = len(self.bound_modes)
            work, acts = rows[:, :modes], rows[:, modes:2 * modes]
            cheapest = work.min(axis=1)[layer_rows]
            params, experts = self._local_params(c, cfg)
            self._work[key] = LayerWork(
                total=float(cheapest.sum()), params=params, experts=experts,
                work=work, acts=acts, rerun=rows[:, 2 * modes:],
                counts=np.bincount(layer_rows, minlength=len(rows)).astype(float),
                least_acts=float(acts.min(axis=1)[layer_rows].sum()), costliest=-np.sort(-cheapest),
                layer_rows=layer_rows,
                kind_forward=np.array([x.fwd + x.tp_fwd + x.cp_fwd + x.ep_fwd for x in costs[0]]),
                kind_wgrad=np.array([x.wgrad for x in costs[0]]),
                kind_plain=np.array([x.work - x.recompute for x in costs[0]]), kinds=kinds)
        return self._work[key]

    def _kinds(self, est) -> np.ndarray:
        """Each layer's kind (Estimator.kinds), as an index array (one per estimator's graph: the same for all)."""
        if self._kind_index is None:
            self._kind_index = np.array(est.kinds[0], dtype=np.intp)
        return self._kind_index

    def _local_params(self, c: Candidate, cfg: ParallelConfig) -> tuple[float, float]:
        """(parameters per device after tensor and expert parallelism, the expert ones among them):
        the same for every candidate of one layout, tp and ep."""
        key = (c.variant, c.tp, c.ep)
        if key not in self._params:
            est = self.estimator(c.variant)
            self._params[key] = (float(est._local_params(self.graph.params, cfg)),
                                 float(est._local_params(est.experts, cfg)))
        return self._params[key]

    def bounds(self, c: Candidate) -> tuple[float, float]:
        """(LB_T, LB_M) of the module docstring."""
        return self._bounds(c, self._layer_work(c).total)

    def leaf_bounds(self, rep: Candidate, schedules: Sequence[tuple[str, int]], zeros: Sequence[int],
                    ) -> Iterator[tuple[float, float, str, int, int]]:
        """:meth:`bounds` of every candidate that differs from ``rep`` only in its schedule (and
        virtual stages) and ZeRO stage, as (LB_T, LB_M, schedule, virtual stages, zero), schedules
        outermost: what they share is looked up once."""
        lw = self._layer_work(rep)
        m, p, total = rep.micro_batches(self.global_batch_size), rep.pp, lw.total
        cut = self._least_cut(rep) if p > 1 else 0.0
        largest = self._largest_stage(rep)
        steps = [self._per_step(rep, z) for z in zeros]
        acts = lw.least_acts
        added = {z: self._accumulated(rep, m, z) for z in zeros}
        for schedule, v in schedules:
            crossing = 2 * _crossings(schedule, p, v) * cut
            pipes = {a: _pipe(schedule, v, m, p, total + a, crossing, largest, lw, total) for a in set(added.values())}
            tried = [(z, step) for z, step in zip(zeros, steps) if compatible(schedule, z)]
            if not tried:
                continue
            if not _all_held(schedule, m, p):
                for z, (optimizer, states) in tried:
                    yield pipes[added[z]] + optimizer, states, schedule, v, z
                continue
            inverse, most = self._passes_of(rep, schedule, v, m)
            for z, (optimizer, states) in tried:
                yield (pipes[added[z]] + optimizer, max(states + acts / p, (acts + p * states / most) / inverse),
                       schedule, v, z)

    def quick_floor(self, pending: "Unbounded") -> tuple[float, float] | None:
        """A floor on :meth:`branch_floor` that prices no layer op by op (module docstring), or None with measured
        op times (which have no such floor): ``W`` and ``w_p`` from each layer's least work
        (Estimator.least_kind_work), memory from the model states alone."""
        if self.measured is not None:
            return None
        return self._floor(pending, self._quick_terms)

    def branch_floor(self, pending: "Unbounded") -> tuple[float, float]:
        """(a floor on LB_T, a floor on LB_M) of every candidate of a branch's ``pending`` parts (module
        docstring): ``m max((W + C_1) / p, w_p) + min_z opt_z`` with ``C_1 = 2 (p - 1) min_cut`` the fewest
        crossings of any schedule (every schedule's pipeline term is at least ``m`` times its ``max(...)``:
        ``W + C >= max((W + C) / p, w_p)``), and the least ``states_z (+ least_acts / p)`` of any ZeRO stage;
        made a millionth lower, so that rounding in the candidates' own bounds cannot put one under it."""
        return self._floor(pending, self._priced_terms)

    def _floor(self, pending: "Unbounded", terms: Callable[[Candidate], tuple[float, float, float]]
               ) -> tuple[float, float]:
        """:meth:`branch_floor`'s formula with ``terms(rep)`` = (``W``, ``w_p``, the activations one pass of every
        layer holds at least) of each part's representative candidate."""
        b, schedules = pending.branch, pending.schedules
        m, p = self.global_batch_size // (b.dp * b.micro_batch_size), b.pp
        zeros = [z for z in b.zeros if any(compatible(s, z) for s, _ in schedules)]
        held = all(_all_held(s, m, p) for s, _ in schedules)
        floor = least = math.inf
        for variant, sp in pending.parts:
            rep = pending.representative(variant, sp)
            total, largest, acts = terms(rep)
            cut = self._least_cut(rep) if p > 1 else 0.0
            steps = [self._per_step(rep, z) for z in zeros]
            floor = min(floor, min(m * max((total + self._accumulated(rep, m, z) + 2 * (p - 1) * cut) / p, largest)
                                   + optimizer for z, (optimizer, _) in zip(zeros, steps)))
            least = min(least, min(states + acts / p if held else states for _, states in steps))
        return floor * (1 - 1e-6), least

    def _priced_terms(self, c: Candidate) -> tuple[float, float, float]:
        lw = self._layer_work(c)
        return lw.total, self._largest_stage(c), lw.least_acts

    def _quick_terms(self, c: Candidate) -> tuple[float, float, float]:
        total, costliest = self._least_work(c)
        return total, _most_held(costliest, c.pp), 0.0

    def _least_work(self, c: Candidate) -> tuple[float, np.ndarray]:
        """(a floor on ``W``, each layer's floor costliest first) of :meth:`_layer_work`'s key, from
        Estimator.least_kind_work (cached)."""
        key = (c.variant, c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.ep)
        if key not in self._least:
            est = self.estimator(c.variant)
            cfg = c.config()
            groups = est.placements(cfg)
            layers = np.array(est.least_kind_work(cfg, groups["tp"], est.split_groups(cfg, groups)))[self._kinds(est)]
            self._least[key] = (float(layers.sum()), -np.sort(-layers))
        return self._least[key]

    def _bounds(self, c: Candidate, total: float, drained: float | None = None) -> tuple[float, float]:
        """(LB_T, LB_M) with ``total`` for ``W`` (and ``drained`` for ZB-H1's drain floor, :func:`_pipe`)."""
        lw = self._layer_work(c)
        m, p = c.micro_batches(self.global_batch_size), c.pp
        p2p = 2 * _crossings(c.schedule, p, c.virtual_stages) * self._least_cut(c) if p > 1 else 0.0
        optimizer, states = self._per_step(c)
        lb_t = _pipe(c.schedule, c.virtual_stages, m, p, total + self._accumulated(c, m), p2p, self._largest_stage(c),
                     lw, total if drained is None else drained) + optimizer
        if not _all_held(c.schedule, m, p):
            return lb_t, states
        inverse, most = self._passes(c, m)
        return lb_t, max(states + lw.least_acts / p, (lw.least_acts + p * states / most) / inverse)

    def _passes(self, c: Candidate, m: int) -> tuple[float, int]:
        return self._passes_of(c, c.schedule, c.virtual_stages, m)

    def _passes_of(self, c: Candidate, schedule: str, virtual_stages: int, m: int) -> tuple[float, int]:
        """``(sum_d 1 / f_d, max_d f_d)``, ``f_d`` the passes of each of its layers pipeline device ``d``
        holds at least at its peak (memory.least_passes) under ``schedule`` with ``virtual_stages`` and
        ``m`` micro-batches on ``c``'s pipeline; cached by schedule, pp, chunks and m."""
        key = (schedule, c.pp, virtual_stages, m)
        if key not in self._held:
            cfg = replace(c, schedule=schedule, virtual_stages=virtual_stages).config()
            passes = [least_passes(cfg, d, m) for d in range(c.pp)]
            self._held[key] = (sum(1 / f for f in passes), max(passes))
        return self._held[key]

    def _accumulated(self, c: Candidate, m: int, zero: int | None = None) -> float:
        """``A``: what adding the micro-batches' weight gradients (StepTail.accumulation_time; 0 when fused or with
        one micro-batch) puts into one micro-batch's pass through every device, at least: ``p`` times its mean
        share per micro-batch on the mean pipeline device (``P / p`` parameters; linear in them, so the devices'
        sum is at least that), of ``c`` at ZeRO stage ``zero`` when given: ``(m - 1) / m`` of one pass
        (StepTail.accumulation_pass), which is cached by what it depends on (not the micro-batch)."""
        if m <= 1 or self.precision.grad_accumulation == "fused":
            return 0.0
        zero = c.zero if zero is None else zero
        key = (c.variant, c.tp, c.cp, c.dp, c.ep, c.pp, zero)
        if key not in self._accumulate:
            cfg = replace(c, zero=zero, schedule="1f1b", virtual_stages=1).config()
            (params, experts), p, est = self._local_params(c, cfg), c.pp, self.estimator(c.variant)
            self._accumulate[key] = float(est.tail.accumulation_pass(cfg, params / p, experts / p)) * p
        return self._accumulate[key] * (m - 1) / m

    def _per_step(self, c: Candidate, zero: int | None = None) -> tuple[float, float]:
        """``(opt(P / p), states(P / p))``: the optimizer step's seconds and the model-state bytes of
        the mean pipeline device (of ``c`` at ZeRO stage ``zero`` when given); cached by what they depend
        on (not the micro-batch or schedule)."""
        zero = c.zero if zero is None else zero
        key = (c.variant, c.tp, c.sequence_parallel, c.cp, c.ep, c.pp, c.dp, zero, c.offload)
        if key not in self._fixed:
            # any schedule prices the step alike: 1F1B's takes every ZeRO stage (the zero-bubble ones 0-1 only)
            cfg = replace(c, zero=zero, schedule="1f1b", virtual_stages=1).config()
            (params, experts), p, est = self._local_params(c, cfg), c.pp, self.estimator(c.variant)
            self._fixed[key] = (float(est.tail.optimizer_time(cfg, params / p, experts / p)),
                                float(sum(est.state_bytes(cfg, params / p, experts / p))))
        return self._fixed[key]

    def _largest_stage(self, c: Candidate) -> float:
        """A floor on the slowest pipeline device's work, whatever the split: some device holds at
        least ``ceil(k / p)`` of the ``k`` costliest layers (in their cheapest modes), each costing at
        least the ``k``-th's, for every ``k`` (80 blocks on 32 stages put 3 on some)."""
        key = (c.variant, c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.ep, c.pp)
        if key not in self._stage_floor:
            self._stage_floor[key] = _most_held(self._layer_work(c).costliest, c.pp)
        return self._stage_floor[key]

    def _least_cut(self, c: Candidate) -> float:
        """The least p2p time of any pipeline cut per micro-batch (as one device beside it sees it): the
        same for every layout (what crosses a cut is the graph's)."""
        key = (c.tp, c.cp, c.micro_batch_size, c.pp)
        if key not in self._cuts:
            est, cfg = self.estimator(c.variant), c.config()
            self._cuts[key] = est.least_cut_time(cfg, est.placements(cfg)["pp"])
        return self._cuts[key]

    def refine(self, c: Candidate, lb_t: float) -> float | None:
        """``LB_T`` with ``W_M``, the work the activations' memory forces, plus the data-parallel
        communication no overlap hides, and for an even split the device-by-device bound (module
        docstring); None when the activations cannot fit in any mode."""
        tighter = self._refine_summed(c, lb_t)
        return tighter if tighter is None or not self._even_split(c) else self._refine_even(c, tighter)

    def _refine_summed(self, c: Candidate, lb_t: float) -> float | None:
        """:meth:`refine` without the even split's own bound."""
        m = c.micro_batches(self.global_batch_size)
        lw = self._layer_work(c)
        total = drained = lw.total
        if self._holds(c, m):
            budget = np.array([self._budget(c, m)])
            floors = lw.knapsack.floors(budget)
            if floors is None:
                return None
            total = drained = max(total, float(floors[0]))
            if c.schedule in SPLIT_EVERY_BACKWARD:   # the recomputation it forces, paid twice
                total = max(total, float(lw.split_knapsack.floors(budget)[0]))
        return max(lb_t, self._bounds(c, total, drained)[0] + self._tail(c, m))

    def _refine_even(self, c: Candidate, lb_t: float) -> float | None:
        """The even split's device-by-device bound (even_split.py), the costlier part of :meth:`refine`:
        the search takes it only for a candidate whose summed bound reaches the queue's head (half of them
        from a second process when one walks the queue ahead, ahead.py)."""
        key = (c.variant, c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.ep, c.pp, c.virtual_stages,
               c.schedule in V_SHAPED)   # the V places the chunks otherwise
        if self.ahead is not None:
            return self.ahead.refine(key, c, lb_t, self._even_bound)
        return self._even_bound(c, lb_t, key)

    def _even_bound(self, c: Candidate, lb_t: float, key: tuple) -> float | None:
        """:meth:`_refine_even` computed here (``key``: the candidate's even splits, cached)."""
        m = c.micro_batches(self.global_batch_size)
        lw, est, cfg = self._layer_work(c), self.estimator(c.variant), c.config()
        if key not in self._splits:
            self._splits[key] = even_splits(est, cfg, lw.layer_work)
        prepared_key = (key, c.schedule, m)   # the knapsacks: every ZeRO stage's and offload's alike
        if prepared_key not in self._prepared:
            # ZB-V's device work with its recomputation paid twice (its floor needs each device's work alone);
            # ZB-H1's drain floor takes it once (zbh1_drain_floor: the second rerun goes to the weight-gradient pass)
            work = lw.layer_work + lw.layer_rerun if c.schedule == "zbv" else lw.layer_work
            self._prepared[prepared_key] = prepare_splits(cfg, m, self._splits[key], work, lw.layer_acts,
                                                          lw.layer_rows, self._priced_modes(c))
        pipe = even_pipeline_floor(est, cfg, m, self._prepared[prepared_key], lw.layer_forward, lw.layer_wgrad,
                                   self.cluster.device.memory if self._holds(c, m) else math.inf)
        if pipe is None:
            return None
        return max(lb_t, pipe + self._per_step(c)[0] + self._tail(c, m))

    def _priced_modes(self, c: Candidate) -> PricedModes:
        """The recompute choices EvenSplitPlans._even prices for ``c``, as columns of :attr:`bound_modes`."""
        column = {mode: k for k, mode in enumerate(self.bound_modes)}
        modes = self.modes_of(c)
        full = "full" in modes
        return PricedModes(tuple(column[mode] for mode in modes if mode != "full"),
                           column["full"] if full else None, column.get("none"),
                           int(self.fixed.get("recompute_layers") or 0))

    def _holds(self, c: Candidate, m: int) -> bool:
        """Whether the memory argument bounds the work: the plan must fit, and :func:`_all_held`."""
        return self.must_fit and _all_held(c.schedule, m, c.pp)

    def _tail(self, c: Candidate, m: int) -> float:
        """The data-parallel communication no overlap hides and the loss's all-reduce (the least of it that
        any backward leaves exposed)."""
        key = (c.variant, c.tp, c.cp, c.dp, c.ep, c.pp, c.zero, m if c.zero >= 2 else 0, c.offload)   # what they depend on
        if key not in self._tails:
            lw, est, cfg = self._layer_work(c), self.estimator(c.variant), c.config()
            self._tails[key] = (est.tail.dp_floor(cfg, m, est.placements(cfg), lw.params / c.pp, lw.experts / c.pp)
                                + est.tail.loss_share_time(cfg))
        return self._tails[key]

    def _budget(self, c: Candidate, m: int) -> float:
        """``B``, the most activation bytes one pass of all layers may take (module docstring):
        device ``d`` holds at least ``f_d`` passes of each of its layers (memory.least_passes), so
        ``f_d A_d <= M - s_d``; summed with ``sum_d s_d >= p states(P / p)``, ``sum_d A_d`` is at most
        ``M sum_d 1 / f_d - p states(P / p) / max_d f_d`` (and at most ``p (M - states(P / p))``)."""
        memory, states = self.cluster.device.memory, self._per_step(c)[1]
        inverse, most = self._passes(c, m)
        return min(c.pp * (memory - states), memory * inverse - c.pp * states / most)


def _most_held(costliest: np.ndarray, p: int) -> float:
    """``max_k ceil(k / p) c_(k)`` over layer costs sorted costliest first: within each run of ``k`` sharing
    ``ceil(k / p) = j + 1`` the run's first, ``c_(j p + 1)``, is the costliest, so only those are compared."""
    firsts = costliest[::p]
    return float((firsts * np.arange(1, len(firsts) + 1)).max())


def _pipe(schedule: str, virtual_stages: int, m: int, p: int, total: float, p2p: float, largest: float,
          lw: LayerWork, drained: float | None = None) -> float:
    """The pipeline term of ``LB_T`` (module docstring): ``m`` micro-batches of ``total`` work and ``p2p``
    over ``p`` devices, the slowest holding at least ``largest``; ZB-H1's drain floored with ``drained`` work
    (default ``total``; under a split backward ``total`` may count the recomputation twice, the drain floor's
    work only once)."""
    x = max((total + p2p) / p, largest)
    if schedule == "interleaved":
        return (m + (p - 1) / virtual_stages) * x
    if schedule == "zbh1" and m >= p:
        work = total if drained is None else drained
        return m * x + (p - 1) / p * zbh1_drain_floor(work + p2p, lw.forward_total + p2p / 2, lw.wgrad_total,
                                                      lw.plain_total + p2p)
    if schedule in SPLIT_BACKWARD:   # a V's fill needs each device's forward: the even split's bound has it
        return m * x
    return (m - 1) * x + total + p2p


def zbh1_drain_floor(work: float, forward: float, wgrad: float, plain: float) -> float:
    """At most ``sum_k b_k`` (cost_model/schedule.py's ZB-H1 drain shares, ``b = max(x - 2w, f, x - f - w)``
    of each device's passes) of devices whose work sums to at least ``work`` and whose forward,
    weight-gradient and work without recomputation sum to exactly ``forward``, ``wgrad`` and ``plain``:
    recomputation (rerun in both passes, estimator.reruns) adds ``r`` to ``x`` and half of it to ``w``, so
    ``x - f - w >= x_plain - f - w``, and ``b >= max(f, x - f - w) >= (x - w) / 2`` whatever the mode; a
    sum of maxima is at least the maximum of the sums."""
    return max((work - wgrad) / 2, forward, plain - forward - wgrad)


def _crossings(schedule: str, p: int, v: int) -> int:
    """Cuts between chunks on two devices: ``p v - 1``, but a V's turn, whose two chunks share a device."""
    if p == 1:
        return 0
    return p * v - 1 - (schedule in V_SHAPED)


def _all_held(schedule: str, m: int, p: int) -> bool:
    """Whether each device holds a pass of every one of its layers at its peak: not so for an
    interleaved order with m not a multiple of p (which the space never offers)."""
    return not (schedule == "interleaved" and m % p)
