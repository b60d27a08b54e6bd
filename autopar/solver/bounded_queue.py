"""The outer search's queue (search.py): every candidate's bound on a heap, refined as it reaches the head.

Entries are ``(bound, sort key, index, pending, candidate)``: the sort key (space.Key) breaks ties between
equal bounds, the index keeps the rest ordered and is the candidate's place in :class:`Settled` (what the
progress bar counts), ``pending`` the refinement still to take ("summed", then "even" for an even split,
bounds.py), and the candidate is made from its key only when the search reaches it. The space is bounded a
branch (a mesh and micro-batch) at a time, its candidates sharing their per-layer costs
(SearchBounds.leaf_bounds); while a second process solves the sharding layouts (ShardingSolver.prefetch), the
branches whose layouts are there go first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..progress import counter
from .space import Branch, Candidate, Key, compatible


@dataclass
class Settled:
    """The queued candidates whose fate is known, which the search's bar counts: evaluated, pruned by
    memory when refined, or with a bound at or above the fastest plan so far (pruned by the bound: the
    search never visits them, the best only gets faster). Most are settled by the first plans found,
    so the bar's rate and remaining time are those of the search, not of visiting every candidate."""

    bound: np.ndarray    # by queue index: the candidate's bound, as refined so far
    done: np.ndarray     # by queue index: evaluated or pruned by memory

    @classmethod
    def of(cls, queue: list) -> "Settled":
        bound = np.empty(len(queue))
        for entry in queue:
            bound[entry[2]] = entry[0]
        return cls(bound, np.zeros(len(queue), dtype=bool))

    def count(self, limit: float) -> int:
        return int(np.count_nonzero(self.done | (self.bound >= limit)))


class BoundedQueue:
    """The queue of search.Search (a mixin: Search provides ``cluster``, ``must_fit``, ``progress``, ``stats``,
    ``settled``, ``layouts_ahead``, ``_branches``, ``_base_variants``, ``_variant``, ``_facts``, ``_visits``,
    ``_past``, ``_even_split``, and from SearchBounds ``leaf_bounds``, ``_refine_summed`` and ``_refine_even``)."""

    def _queue(self, deadline: float | None) -> list:
        """Every usable candidate not dominated or pruned by memory, as a heap of (bound, sort key,
        index, pending refinement: "summed" at first (_next), candidate or None: made from the key
        when the search reaches it)."""
        queue = []
        memory = self.cluster.device.memory
        with counter("autopar: bounding", unit="candidates", enabled=self.progress) as bar:
            for b in self._ready_first():
                if queue and self._past(deadline):
                    # past the limit with something to evaluate: the candidates not yet bounded are
                    # left out, so no gap can be claimed for them
                    self.stats.timed_out, self.stats.unbounded = True, True
                    break
                for key, lb_t, lb_m in self._branch_bounds(b, bar):
                    if lb_m > memory and self.must_fit:
                        self.stats.pruned_memory += 1
                        continue
                    queue.append((lb_t, key, len(queue), "summed", None))   # the index keeps ties ordered
        heapq.heapify(queue)
        return queue

    def _ready_first(self) -> Iterator[Branch]:
        """:meth:`_branches`, those whose layouts are solved first: while a second process solves them
        (``layouts_ahead``), a branch whose layouts are not there yet waits until no other branch is ready,
        then the waiting ones of the least tensor-parallel degree go (waiting for their layouts)."""
        ahead = self.layouts_ahead
        if ahead is None:
            yield from self._branches()
            return
        waiting: dict[int, list[Branch]] = {}    # by tp, in the space's order

        def solved(tp: int) -> bool:
            return all(ahead.solved(tp, variant) for variant in self._base_variants)
        for b in self._branches():
            if b.tp not in waiting and solved(b.tp):
                yield b
            else:
                waiting.setdefault(b.tp, []).append(b)
                for tp in [t for t in waiting if solved(t)]:
                    yield from waiting.pop(tp)
        for tp in sorted(waiting):
            yield from waiting[tp]

    def _branch_bounds(self, b: Branch, bar=None) -> Iterator[tuple[Key, float, float]]:
        """(sort key, LB_T, LB_M) of each candidate of branch ``b`` that is not dominated, counted in
        the stats (and on ``bar``): a sequence-parallel choice and variant at a time, whose
        candidates share their per-layer costs (SearchBounds.leaf_bounds)."""
        schedules = tuple(sv for sv in b.schedules if self._visits(sv[0]))
        gpipe = sum(compatible(s, z) for s, _ in b.schedules if not self._visits(s) for z in b.zeros)
        for sp in b.sequence_parallel:
            for base in self._base_variants:
                self.stats.candidates += b.leaves
                if bar is not None:
                    bar.update(b.leaves)
                variant = self._variant(base, b.tp, b.micro_batch_size)
                if self._facts(variant, b.tp)[0]:
                    self.stats.dominated += b.leaves
                    continue
                self.stats.dominated += gpipe
                if not schedules:
                    continue
                rep = b.candidate(variant, sp, *schedules[0], b.zeros[0])
                for lb_t, lb_m, schedule, v, zero in self.leaf_bounds(rep, schedules, b.zeros):
                    yield Key(variant, b.dp, b.tp, b.pp, b.cp, b.ep, b.micro_batch_size, schedule, v, zero, sp,
                              b.offload), \
                        lb_t, lb_m

    def _next(self, queue: list, limit: float, deadline: float | None = None) -> tuple | None:
        """The queue's next entry with a bound below ``limit``, each refined before it is returned (a
        refined bound goes back into the queue); None when none is left below it. An entry's
        ``pending`` is what is left to refine: "summed" (the summed refinement), "even" (an
        even split's own bound, taken only once the summed one reaches the head), or None. Past the
        ``deadline`` an even split's own bound is skipped (it only prunes, and costs the most)."""
        while queue:
            entry = heapq.heappop(queue)
            lb_t, key, index, pending, c = entry
            if lb_t >= limit:
                heapq.heappush(queue, entry)
                return None
            c = c or Candidate.of(key)
            if pending is None or (pending == "even" and self._past(deadline)):
                return (lb_t, key, index, None, c)
            if pending == "even":
                tighter, after = self._refine_even(c, lb_t), None
            else:
                tighter = self._refine_summed(c, lb_t)
                after = "even" if self._even_split(c) else None
            if tighter is None:
                self.stats.pruned_memory += 1
                self._settle(index, None)
                continue
            self._settle(index, tighter)
            heapq.heappush(queue, (tighter, key, index, after, c))
        return None

    def _settle(self, index: int, bound: float | None) -> None:
        """Record a refinement for the bar (:class:`Settled`): the tighter bound, or None: pruned by memory."""
        if self.settled is not None:
            if bound is None:
                self.settled.done[index] = True
            else:
                self.settled.bound[index] = bound
