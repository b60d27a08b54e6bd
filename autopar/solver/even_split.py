r"""Megatron's even split (interleaved 1F1B, or a pinned ``recompute_layers``): a candidate's plans
(:class:`EvenSplitPlans`, one per recompute mode and the fastest partial recomputation that fits)
and a lower bound on its pipeline time. Where its layers go is known, so the memory argument of
search.py holds device by device instead of summed over the pipeline.

Device ``d`` runs chunks ``j = 0..v-1`` (layers ``L_dj``; ``v = 1`` unless interleaved) and holds
at some moment ``n_dj`` passes of chunk ``j`` (cost_model/memory.chunk_passes: interleaved, what
its warm-up and first steady forward keep before the first backward). With layer ``l`` in mode
``r_l`` (activation bytes ``a_l^r``, work ``c_l^r`` per micro-batch) and ``s_d`` the model states
of the parameters its layers own (a tied copy it also holds, not counted: fewer bytes, a lower
bound)::

    sum_j n_dj sum_{l in L_dj} a_l^{r_l} <= M - s_d

and its work per micro-batch is ``x_d = p2p_d + sum_{l on d} c_l^{r_l}``. The least ``x_d`` under
that constraint is at least its Lagrangian bound (concave and piecewise linear in ``lambda``, its
maximum at 0 or a breakpoint where a layer's cheapest mode changes)::

    x_d >= p2p_d + max_{lambda >= 0} sum_{l on d} min_r (c_l^r + lambda n_l a_l^r) - lambda (M - s_d)

and a device whose least activations ``sum_l n_l min_r a_l^r`` exceed ``M - s_d`` cannot fit. The
pipeline time (cost_model/schedule.py) is increasing in every ``x_d``, so it is at least the
schedule's time of these floors. Every mode choice the search prices (a mode for every layer, or
full recomputation of each chunk's first layers and none after) is one of the ``r_l`` above, and
buffers only add to the left side: the bound holds for each. Those choices are few (:class:`PricedModes`:
each mode, and ``recompute_layers = k`` for each ``k``), so they are also floored one by one: choice ``q``
fits only where ``sum_j n_dj sum_{l in L_dj} a_l^q <= M - s_d`` on every device, and the plan the search
prices is one that fits, so device ``d``'s work is at least ``p2p_d + min_{q fits} sum_{l on d} c_l^q``.
The floor of ``x_d`` is the larger of the two (the knapsack lets each layer take a mode of its own, and
each device fit alone; a choice gives every layer of a chunk one rule, and must fit on every device): on
HF GPT-2 175B over 1,024 A100s the
knapsack alone left zero-bubble V and interleaved candidates 10-40% below their plans (it kept a few
layers in selective recomputation where the plans recompute whole layers), and the search evaluated
62 candidates where it now evaluates 18. The split itself is balanced by the
work of the mode the estimate prices when the blocks do not divide evenly, so the bound is the
least over the splits of the search's modes.

On a 405B Llama over 16,384 H100s the summed argument (one pass per device on the last devices of
an interleaved pipeline) left interleaved candidates 30% below their step time: each holds about
``p`` passes of most of its layers, which forces recomputation the summed bound cannot see.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from ..config import ParallelConfig
from ..cost_model import Estimator, estimate_plan
from ..cost_model.estimator import device_p2p
from ..cost_model.memory import chunk_passes
from ..cost_model.schedule import even_partitions, pipeline_time
from ..plan import Plan
from .space import Candidate


@dataclass(frozen=True)
class Split:
    """One even split's facts that do not depend on the batch, ZeRO or memory."""

    members: np.ndarray    # (layers, devices): 1 where the device holds the layer
    device: np.ndarray     # (layers,) the layer's device
    chunk: np.ndarray      # (layers,) the layer's chunk among its device's (0..v-1)
    params: np.ndarray     # (devices,) parameters owned (a tied copy not counted), after tp and ep
    experts: np.ndarray    # (devices,) of which expert weights
    p2p: np.ndarray        # (devices,) p2p seconds per micro-batch
    rank: np.ndarray       # (layers,) the layer's count among its chunk's recomputable layers, itself included
    #                        (0: not recomputable): ``recompute_layers = k`` recomputes those ranked 1..k


def even_splits(est: Estimator, cfg: ParallelConfig, work: np.ndarray) -> tuple[Split, ...]:
    """The distinct even splits of ``cfg``'s mesh and micro-batch, one per mode's column of ``work``
    (each layer's work per micro-batch, ``(layers, modes)``); the same for every ZeRO stage, dp and
    micro-batch count (the search caches them)."""
    p, chunks = cfg.pp, cfg.pp * cfg.virtual_stages
    cuts = est.p2p_cut_times(cfg, est.placements(cfg)["pp"]) if p > 1 else []
    columns = list(dict.fromkeys(tuple(work[:, k].tolist()) for k in range(work.shape[1])))
    runs = set(even_partitions(est.graph, chunks, columns, cfg.v_shaped))
    own, own_experts = est.own_params(cfg)
    out = []
    for split in sorted(runs, key=lambda split: [(run.start, run.stop) for run in split]):
        members, device, chunk, held = _placement(split, cfg, len(work))
        params = np.array([own[h].sum() for h in held])
        experts = np.array([own_experts[h].sum() for h in held])
        p2p = np.array([device_p2p(cuts, split, cfg.device_chunks(d)) for d in range(p)], dtype=float)
        out.append(Split(members, device, chunk, params, experts, p2p, _ranks(split, est.graph.recomputable)))
    return tuple(out)


def _ranks(split: tuple[range, ...], recomputable: Sequence[bool]) -> np.ndarray:
    """Split.rank: within each chunk, the running count of recomputable layers (ParallelConfig.chunk_modes'
    count), 0 where a layer is not recomputable."""
    out = np.zeros(len(recomputable), dtype=int)
    for run in split:
        counted = 0
        for i in run:
            if recomputable[i]:
                counted += 1
                out[i] = counted
    out.setflags(write=False)
    return out


def _placement(split: tuple[range, ...], cfg: ParallelConfig, layers: int) -> tuple[np.ndarray, ...]:
    """(members, device, chunk, the layers each device holds) of chunks ``split`` on ``cfg``'s pipeline
    (device ``d`` holds chunks ``cfg.device_chunks(d)``): the same for every micro-batch, layout and ZeRO
    stage of a pipeline (cached by the placement, read-only)."""
    return _placed(split, tuple(cfg.device_chunks(d) for d in range(cfg.pp)), layers)


@functools.lru_cache(maxsize=4096)
def _placed(split: tuple[range, ...], places: tuple[tuple[int, ...], ...], layers: int) -> tuple:
    p = len(places)
    members = np.zeros((layers, p))
    device, chunk = np.zeros(layers, dtype=int), np.zeros(layers, dtype=int)
    held = []
    for d in range(p):
        mine = places[d]
        for j, c in enumerate(mine):
            run = slice(split[c].start, split[c].stop)
            members[run, d], device[run], chunk[run] = 1.0, d, j
        held.append(np.concatenate([np.arange(split[c].start, split[c].stop) for c in mine]).astype(int))
    for a in (members, device, chunk, *held):
        a.setflags(write=False)
    return members, device, chunk, tuple(held)


@dataclass(frozen=True)
class PricedModes:
    """The recompute choices :class:`EvenSplitPlans` prices on an even split, as columns of the bounds' work and
    activation tables (``(layers, modes)``): every layer recomputable in one mode (each of ``uniform``), and full
    recomputation of each chunk's first ``k`` recomputable layers, none after (``full``, ``none``: every ``k``,
    or only ``layers`` when it is pinned, ``k`` = all of them being full recomputation). A layer recomputation
    does not apply to runs in mode "none" (ParallelConfig.chunk_modes): its ``none`` column, or the least of its
    columns where the table has none."""

    uniform: tuple[int, ...]
    full: int | None = None
    none: int | None = None
    layers: int = 0

    def tables(self, split: Split, work: np.ndarray, acts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(work, activation bytes) of each layer in each choice on ``split``, ``(choices, layers)``."""
        rows = np.arange(len(work))
        recomputable = split.rank > 0
        if self.none is not None:
            plain_work, plain_acts = work[:, self.none], acts[:, self.none]
        else:
            plain_work, plain_acts = work.min(axis=1), acts.min(axis=1)
        columns = [np.full(len(work), u) for u in self.uniform]
        if self.full is not None:
            ks = (self.layers,) if self.layers else range(1, max(1, int(split.rank.max())) + 1)
            columns += [np.where(split.rank <= k, self.full, self.none) for k in ks]
        columns = np.array(columns)
        return (np.where(recomputable, work[rows, columns], plain_work),
                np.where(recomputable, acts[rows, columns], plain_acts))


class Prepared(NamedTuple):
    """One even split with what its floor needs besides the room the model states leave."""

    split: Split
    knapsack: "Knapsack"   # its devices' layers, any mode each
    work: np.ndarray       # (choices, devices) work per micro-batch of each priced choice (PricedModes)
    held: np.ndarray       # (choices, devices) the activation bytes each choice holds at least at its peak


def prepare_splits(cfg: ParallelConfig, micro_batches: int, splits: Sequence[Split], work: np.ndarray,
                   acts: np.ndarray, rows: np.ndarray, priced: PricedModes) -> tuple[Prepared, ...]:
    """Each of ``splits`` with the knapsack of its devices' layers and its priced choices' work and held bytes
    per device (what :func:`even_pipeline_floor` needs besides the room the model states leave, the same for
    every ZeRO stage and offload of one pipeline, schedule and micro-batch count). ``work`` and ``acts``: each
    layer's work and activation bytes per micro-batch in each mode the search prices, ``(layers, modes)``;
    ``rows`` each layer's row of its distinct ``(work, acts)`` rows (equal ids, equal rows): the knapsack takes
    each distinct row and number of held passes once, counted per device (96 blocks, a few rows)."""
    passes = _passes(cfg.schedule, cfg.pp, cfg.virtual_stages, micro_batches)   # (devices, v)
    out = []
    for split in splits:
        held = passes[split.device, split.chunk]
        kinds, first, which = np.unique(rows * (int(held.max()) + 1) + held, return_index=True, return_inverse=True)
        counts = np.zeros((len(kinds), cfg.pp))
        np.add.at(counts, (which.ravel(), split.device), 1.0)
        choice_work, choice_acts = priced.tables(split, work, acts)
        out.append(Prepared(split, Knapsack(work[first], acts[first] * held[first, None], counts),
                            choice_work @ split.members, (choice_acts * held) @ split.members))
    return tuple(out)


def even_pipeline_floor(est: Estimator, cfg: ParallelConfig, micro_batches: int, prepared: Sequence[Prepared],
                        forward: np.ndarray, wgrad: np.ndarray, memory: float) -> float | None:
    """The least pipeline time of ``cfg`` on any of its even splits over the choices of modes it prices
    (module docstring); None when none fits. ``prepared``: the splits with their knapsacks and choices
    (:func:`prepare_splits`); ``forward`` and ``wgrad`` each layer's forward (with its collectives) and
    weight-gradient seconds, the same in every mode (the zero-bubble schedules' passes); ``memory`` the
    device's bytes (``inf``: no memory argument)."""
    best = None
    for split, knapsack, choice_work, choice_held in prepared:
        room = memory - sum(est.state_bytes(cfg, split.params, split.experts))
        floors = knapsack.floors(room)
        fit = np.all(choice_held <= room, axis=1)
        if floors is not None and fit.any():
            # each device's share per micro-batch of adding the micro-batches' weight gradients (0 when fused)
            added = est.tail.accumulation_time(cfg, split.params, split.experts, micro_batches) / micro_batches
            x = np.maximum(floors, choice_work[fit].min(axis=0)) + split.p2p + added
            f, w = forward @ split.members + split.p2p / 2, wgrad @ split.members + added
            # ZB-H1's drain grows with each device's work at fixed forward and weight gradient: its time at
            # the floors is a floor; a V's bubble (ZB-V's, DualPipeV's) is at least its fill, (p - 1)/2 of the
            # slowest device's forward (tests/unit/cost_model/test_zero_bubble.py), at least the least device's
            zbh1 = cfg.schedule == "zbh1"
            t = pipeline_time(list(x), micro_batches, cfg.schedule, cfg.virtual_stages,
                              list(zip(f, x - f - w, w)) if zbh1 else None).total
            if cfg.v_shaped:
                t += (cfg.pp - 1) * float(f.min()) / 2
            best = t if best is None else min(best, t)
    return best


@functools.lru_cache(maxsize=4096)
def _passes(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> np.ndarray:
    """(devices, chunks) passes each device holds of each of its chunks (memory.chunk_passes; read-only: the
    same for every candidate of one pipeline and micro-batch count)."""
    cfg = ParallelConfig(pp=pp, schedule=schedule, virtual_stages=virtual_stages)
    out = np.array([chunk_passes(cfg, d, micro_batches) for d in range(pp)])
    out.setflags(write=False)
    return out


class Knapsack:
    """For each group ``d`` (a device, or the whole pipeline) of rows ``members[:, d]`` times each:
    ``max_lambda sum_l members[l, d] min_r (work[l, r] + lambda acts[l, r]) - lambda room[d]``,
    the Lagrangian bound of choosing one mode per row under ``sum_l members[l, d] acts[l, r_l] <=
    room[d]``, over the breakpoints of every row (where a row's cheapest mode changes: a superset of
    each group's own, so the maximum is among them). What does not depend on the room is computed
    once, when first needed (the search bounds one candidate's layers under many budgets)."""

    def __init__(self, work: np.ndarray, acts: np.ndarray, members: np.ndarray) -> None:
        self.work, self.acts, self.members = work, acts, members

    @functools.cached_property
    def least(self) -> np.ndarray:
        """Each group's least bytes: every row in its leanest mode."""
        return self.acts.min(axis=1) @ self.members

    @functools.cached_property
    def cheapest(self) -> np.ndarray:
        """Each group's least work, the room unbounded."""
        return self.work.min(axis=1) @ self.members

    @functools.cached_property
    def _lines(self) -> tuple[np.ndarray, np.ndarray]:
        """(breakpoints ``lambda``, ``sum_l members[l, d] min_r (work + lambda acts)`` at each)."""
        work, acts = self.work, self.acts
        dc = work[:, None, :] - work[:, :, None]       # [l, r, s] = c_s - c_r
        da = acts[:, :, None] - acts[:, None, :]       # [l, r, s] = a_r - a_s
        ok = (da > 0) & (dc > 0)
        lam = np.unique(np.concatenate([[0.0], dc[ok] / da[ok]]))
        return lam, (work[None] + lam[:, None, None] * acts[None]).min(axis=2) @ self.members

    def floors(self, room: np.ndarray) -> np.ndarray | None:
        """The bound of each group with ``room[d]`` bytes; None when some group's least bytes exceed its room."""
        if np.any(self.least > room):
            return None
        if np.all(np.isinf(room)):
            return self.cheapest
        lam, value = self._lines
        return (value - lam[:, None] * room[None, :]).max(axis=0)


class Unfit(NamedTuple):
    """A configuration the search tried that does not fit: its peak memory per device (bytes)."""

    peak: float
    config: ParallelConfig


class EvenSplitPlans:
    """The plans of a candidate on Megatron's even split, for the outer search (search.Search, which
    provides ``estimator``, ``graph``, ``cluster``, ``global_batch_size``, ``precision``, ``modes``, ``modes_of``,
    ``fixed`` and ``must_fit``)."""

    def _even_split(self, c: Candidate) -> bool:
        """Whether ``c`` takes Megatron's even split (:meth:`_even`) rather than the stage DP."""
        return c.virtual_stages > 1 or bool(self.fixed.get("recompute_layers"))

    def _even(self, c: Candidate) -> list[Plan | Unfit]:
        """Megatron's even split (stages.py: an interleaved candidate, or a pinned ``recompute_layers``,
        which the stage DP does not price): one estimate per recompute mode, and for "full" also the
        fastest partial recomputation that fits (:meth:`_partial`); a config that does not fit is
        only priced by its memory."""
        est = self.estimator(c.variant)
        modes = self.modes_of(c)
        tried = [self._try(est, c, c.config(mode)) for mode in modes if mode != "full"]
        if "full" in modes:
            # partial recomputation only pays when keeping every activation does not fit
            keeps_all = any(isinstance(p, Plan) and p.fits and p.config.recompute == "none" for p in tried)
            tried += self._partial(c, est, bisect=not keeps_all)
        return tried

    def _try(self, est: Estimator, c: Candidate, cfg: ParallelConfig) -> Plan | Unfit:
        """The plan of ``cfg`` (even split), or its peak memory when it does not fit (the estimate's
        time is then of no use, and the memory alone costs a third of it)."""
        m = c.micro_batches(self.global_batch_size)
        peak = est.peak_memory(cfg, m)
        if self.must_fit and peak > self.cluster.device.memory:
            return Unfit(peak, cfg)
        return estimate_plan(self.graph, self.cluster, cfg, self.global_batch_size, self.precision, est)

    def _partial(self, c: Candidate, est: Estimator, bisect: bool = True) -> list[Plan | Unfit]:
        """Full recomputation of every block, and of only the first ``k`` blocks of each chunk
        (``recompute_layers``) for the least ``k`` that fits: memory falls and time rises as ``k``
        grows, so that ``k`` is the fastest partial plan, found by bisection (skipped, ``bisect``
        False, when no recomputation at all fits: that plan is faster). A pinned
        ``recompute_layers`` is the only one tried."""
        def fits(k: int) -> bool:
            m = c.micro_batches(self.global_batch_size)
            return est.peak_memory(c.config("full", recompute_layers=k), m) <= self.cluster.device.memory
        if "recompute_layers" in self.fixed:
            return [self._try(est, c, c.config("full", recompute_layers=self.fixed["recompute_layers"]))]
        full = self._try(est, c, c.config("full"))
        if not isinstance(full, Plan):
            return [full]
        recomputable = {layer.name: ok for layer, ok in zip(self.graph.layers, self.graph.recomputable)}
        longest = max(sum(recomputable[name] for name in ch) for s in full.stages for ch in s.chunks)
        if not bisect or longest < 2:
            return [full]
        low, high = 1, longest   # recompute_layers = longest recomputes every block, as full does
        while low < high:
            mid = (low + high) // 2
            if fits(mid):
                high = mid
            else:
                low = mid + 1
        return [full] if low >= longest else [full, self._try(est, c, c.config("full", recompute_layers=low))]
