"""The outer search's queue (search.py): every candidate's bound on a heap, refined as it reaches the head.

Entries are ``(bound, sort key, index, pending, payload)``: the sort key (space.Key) breaks ties between
equal bounds, the index keeps the rest ordered and is the entry's place in :class:`Settled` (what the
progress bar counts), ``pending`` what is left to do when the entry reaches the head, and ``payload`` the
candidate (made from its key only when the search reaches it) or a group's leaves.

The space enters the heap a branch (a mesh and micro-batch) at a time (``pending`` "floor"), under a quick floor
(SearchBounds.quick_floor: from a floor of each layer's work, without pricing its ops), and goes back under its own
floor when that one reaches the head (``pending`` "branch"): a floor below every one of its candidates' bounds
(SearchBounds.branch_floor: from the per-layer costs its candidates share, without their schedules' and ZeRO
stages' own terms); a branch whose floor on memory exceeds the device's is pruned whole there. While a second
process solves the sharding layouts (ShardingSolver.prefetch), the branches whose layouts are there go first. A branch whose floor reaches the
head is bounded candidate by candidate (SearchBounds.leaf_bounds); the ones of one sequence-parallel choice
and layout variant that fit go back as one *group* entry (``pending`` "group"), ordered as the least of them
(its bound and key), and their own entries are made when it reaches the head. A search that settles most of
the space by its first plans bounds few branches one by one (HF GPT-2 175B on 1,024 GPUs: 5,844 branches,
280,768 candidates) and visits the candidates in the same order as a heap of all of them: a branch's entry
sorts before every one of its candidates would (its floor is at most their bounds, its key at most their
keys), a group's as its least member would, and the rest follow it. A branch whose floor on memory exceeds
the device's is pruned whole; the candidates of a branch the search never reaches are pruned by the bound
(whether they would also have been pruned by memory is not asked).

A branch that offloads (ParallelConfig.offload) waits outside the heap for its twin without offload (the same
mesh and micro-batch) to reach the head, and then enters it under its own floor: that floor is at least the
twin's (BoundedQueue._offload_follows) and its key sorts after the twin's, so the order is unchanged, and the
offloading branches of twins the search never reaches are never floored (HF GPT-2 175B: 5,840 of the 8,760
branches wait; 1,252 enter the heap, 984 of them are bounded).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from ..progress import counter
from ..config import OFFLOADS, ParallelConfig
from ..errors import ConfigError
from .space import Branch, Candidate, Key, compatible

# (bound, schedule, virtual stages, ZeRO stage) of each candidate of a group, least first
Leaves = tuple[tuple[float, str, int, int], ...]


@dataclass(frozen=True)
class Group:
    """The fitting candidates of one branch, sequence-parallel choice and layout variant, with their bounds."""

    branch: Branch
    variant: str
    sequence_parallel: bool
    leaves: Leaves

    def key(self, leaf: tuple[float, str, int, int]) -> Key:
        b, (_, schedule, v, zero) = self.branch, leaf
        return Key(self.variant, b.dp, b.tp, b.pp, b.cp, b.ep, b.micro_batch_size, schedule, v, zero,
                   self.sequence_parallel, OFFLOADS.index(b.offload))

    def entry(self, index: int) -> tuple:
        """Its heap entry: the bound and key of its least candidate (the leaves are sorted)."""
        return (self.leaves[0][0], self.key(self.leaves[0]), index, "group", self)

    def split(self, holds: Callable[[int, str], bool]) -> tuple["Group | None", "Group | None"]:
        """(the candidates for whose ZeRO stage and offload ``holds``, the rest), each a group or None when empty."""
        offload = self.branch.offload
        yes = tuple(leaf for leaf in self.leaves if holds(leaf[3], offload))
        no = tuple(leaf for leaf in self.leaves if not holds(leaf[3], offload))
        return (Group(self.branch, self.variant, self.sequence_parallel, yes) if yes else None,
                Group(self.branch, self.variant, self.sequence_parallel, no) if no else None)


@dataclass(frozen=True)
class Unbounded:
    """A branch's candidates before their own bounds: the visited ``schedules`` of ``branch`` (its ZeRO stages
    ``branch.zeros``) for each (layout variant, sequence parallelism) of ``parts`` (those not dominated)."""

    branch: Branch
    schedules: tuple[tuple[str, int], ...]
    parts: tuple[tuple[str, bool], ...]

    @property
    def size(self) -> int:
        return len(self.parts) * sum(compatible(s, z) for s, _ in self.schedules for z in self.branch.zeros)

    def representative(self, variant: str, sp: bool) -> Candidate:
        """A candidate of part (``variant``, ``sp``): the first schedule and ZeRO stage that go together (what its
        candidates share does not depend on them)."""
        b = self.branch
        schedule, v, zero = next((s, v, z) for s, v in self.schedules for z in b.zeros if compatible(s, z))
        return b.candidate(variant, sp, schedule, v, zero)

    def key(self) -> Key:
        """A key at most every one of its candidates' (the least variant, then the branch's fields, then a
        schedule, virtual stage count, ZeRO stage and sequence-parallel choice before any real one)."""
        b = self.branch
        return Key(min(v for v, _ in self.parts), b.dp, b.tp, b.pp, b.cp, b.ep, b.micro_batch_size, "", 0, -1, False,
                   OFFLOADS.index(b.offload))

    def split(self, holds: Callable[[int, str], bool]) -> tuple["Unbounded | None", "Unbounded | None"]:
        """(the candidates for whose ZeRO stage and offload ``holds``, the rest), each as its own Unbounded or None
        when empty."""
        out = []
        for want in (True, False):
            zeros = tuple(z for z in self.branch.zeros if holds(z, self.branch.offload) == want)
            part = Unbounded(replace(self.branch, zeros=zeros), self.schedules, self.parts)
            out.append(part if zeros and part.size else None)
        return out[0], out[1]


@dataclass
class Settled:
    """The queued candidates whose fate is known, which the search's bar counts: evaluated, pruned by
    memory when refined, or with a bound at or above the fastest plan so far (pruned by the bound: the
    search never visits them, the best only gets faster). Most are settled by the first plans found,
    so the bar's rate and remaining time are those of the search, not of visiting every candidate.
    By entry index: a branch's or a group's entry weighs its candidates until it reaches the head, then nothing
    (its groups' or candidates' own entries take over)."""

    bound: np.ndarray = field(default_factory=lambda: np.empty(1024))
    done: np.ndarray = field(default_factory=lambda: np.zeros(1024, dtype=bool))
    weight: np.ndarray = field(default_factory=lambda: np.zeros(1024, dtype=np.int64))
    size: int = 0

    def add(self, bound: float, weight: int = 1) -> int:
        """A new entry's index."""
        if self.size == len(self.bound):
            grow = len(self.bound)
            self.bound = np.concatenate([self.bound, np.empty(grow)])
            self.done = np.concatenate([self.done, np.zeros(grow, dtype=bool)])
            self.weight = np.concatenate([self.weight, np.zeros(grow, dtype=np.int64)])
        index, self.size = self.size, self.size + 1
        self.bound[index], self.weight[index] = bound, weight
        return index

    @property
    def total(self) -> int:
        return int(self.weight[:self.size].sum())

    def count(self, limit: float) -> int:
        n = self.size
        return int(self.weight[:n][self.done[:n] | (self.bound[:n] >= limit)].sum())


def _twin(b: Branch) -> tuple:
    """What a branch and its twins of the other offload modes share: the mesh and micro-batch."""
    return (b.tp, b.cp, b.pp, b.dp, b.ep, b.micro_batch_size)


class BoundedQueue:
    """The queue of search.Search (a mixin: Search provides ``cluster``, ``must_fit``, ``progress``, ``stats``,
    ``settled``, ``layouts_ahead``, ``_branches``, ``_base_variants``, ``_variant``, ``_facts``, ``_visits``,
    ``_past``, ``_even_split``, and from SearchBounds ``leaf_bounds``, ``_refine_summed`` and ``_refine_even``)."""

    def _queue(self, deadline: float | None) -> list:
        """Every usable candidate not dominated, as a heap of branch entries (module docstring; a branch whose
        floor on memory exceeds the device's is pruned by memory); :attr:`settled` counts them."""
        queue = []
        self.settled = Settled()
        memory = self.cluster.device.memory
        self._deferred, self._release_to = {}, queue   # (offloading branch, its settled index) by twin
        twins: dict[tuple, float] = {}   # the queued branches without offload, by mesh and micro-batch: floors
        with counter("autopar: bounding", unit="candidates", enabled=self.progress) as bar:
            for b in self._ready_first():
                if queue and self._past(deadline):
                    # past the limit with something to evaluate: the candidates not yet bounded are
                    # left out, so no gap can be claimed for them
                    self.stats.timed_out, self.stats.unbounded = True, True
                    break
                pending = self._branch_parts(b, bar)
                if pending is None:
                    continue
                twin = _twin(b)
                if b.offload != "none" and twin in twins and self._offload_follows:
                    # its floor is at least its twin's: it waits for the twin to reach the head (_bound_branch)
                    self._deferred.setdefault(twin, []).append((pending, self.settled.add(twins[twin], pending.size)))
                    continue
                quick = self.quick_floor(pending)
                floor, least_memory = self.branch_floor(pending) if quick is None else quick
                if self.must_fit and least_memory > memory:
                    self.stats.pruned_memory += pending.size
                    continue
                if b.offload == "none":
                    twins[twin] = floor
                queue.append((floor, pending.key(), self.settled.add(floor, pending.size),
                              "branch" if quick is None else "floor", pending))
        heapq.heapify(queue)
        return queue

    @functools.cached_property
    def _offload_follows(self) -> bool:
        """Whether an offloading branch's floor (SearchBounds.branch_floor) is at least that of its twin without
        offload (the same mesh, micro-batch and schedules): its every other term is the twin's, and its
        optimizer step, linear in the parameters stepped as the twin's is, takes at least as long per
        parameter (the host's CPU and link against the device's memory: true of every preset). Then it enters
        the queue when its twin is bounded, behind it (its key sorts after the twin's), so that the candidates
        are visited in the same order as with every branch queued from the start, and the offloading branches
        of a twin the search never reaches are never floored."""
        tail = self.estimator(self._base_variants[0]).tail
        try:
            for cfg in (ParallelConfig(offload="optimizer"), ParallelConfig(zero=3, offload="all")):
                if tail.optimizer_time(cfg, 1e9) < tail.optimizer_time(replace(cfg, offload="none"), 1e9):
                    return False
        except ConfigError:   # no host to offload to: nothing is deferred
            return False
        return True

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

    def _branch_parts(self, b: Branch, bar=None) -> Unbounded | None:
        """Branch ``b``'s candidates that are not dominated (None: none), counted in the stats (and on ``bar``):
        a (layout variant, sequence parallelism) part at a time, whose candidates share their per-layer costs
        (the parts of a mesh and micro-batch found once for its offload twins)."""
        schedules = tuple(sv for sv in b.schedules if self._visits(sv[0]))
        key = (_twin(b), schedules, b.sequence_parallel)
        if key not in self._parts_of:
            parts, dominated = [], 0
            for sp in b.sequence_parallel:
                for base in self._base_variants:
                    variant = self._variant(base, b.tp, b.micro_batch_size)
                    if self._facts(variant, b.tp)[0]:
                        dominated += 1
                    elif schedules:
                        parts.append((variant, sp))
            self._parts_of[key] = (tuple(parts), dominated)
        parts, dominated = self._parts_of[key]
        pairs = len(b.sequence_parallel) * len(self._base_variants)
        gpipe = sum(compatible(s, z) for s, _ in b.schedules if not self._visits(s) for z in b.zeros)
        self.stats.candidates += pairs * b.leaves
        self.stats.dominated += dominated * b.leaves + (pairs - dominated) * gpipe
        if bar is not None:
            bar.update(pairs * b.leaves)
        return Unbounded(b, schedules, parts) if parts else None

    def _part_leaves(self, pending: Unbounded, variant: str, sp: bool) -> list[tuple[float, float, str, int, int]]:
        """(LB_T, LB_M, schedule, virtual stages, ZeRO stage) of each candidate of one part of ``pending``."""
        return list(self.leaf_bounds(pending.representative(variant, sp), pending.schedules, pending.branch.zeros))

    def _next(self, queue: list, limit: float, deadline: float | None = None) -> tuple | None:
        """The queue's next candidate entry with a bound below ``limit``, each refined before it is returned
        (a refined bound goes back into the queue); None when none is left below it. An entry's ``pending``
        is what is left to do: "group" (a group's candidates go into the queue), "summed" (the summed
        refinement), "even" (an even split's own bound, taken only once the summed one reaches the head), or
        None. Past the ``deadline`` an even split's own bound is skipped (it only prunes, and costs the most)."""
        while queue:
            entry = heapq.heappop(queue)
            lb_t, key, index, pending, c = entry
            if lb_t >= limit:
                heapq.heappush(queue, entry)
                return None
            if pending == "floor":
                self._floor_branch(queue, entry)
                continue
            if pending == "branch":
                self._bound_branch(queue, index, c)
                continue
            if pending == "group":
                self._expand(queue, index, c)
                continue
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

    def _floor_branch(self, queue: list, entry: tuple) -> None:
        """A branch queued under its quick floor back into the queue under its own (SearchBounds.branch_floor),
        or pruned whole when that floor on memory exceeds the device's."""
        quick, key, index, _, pending = entry
        floor, least_memory = self.branch_floor(pending)
        if self.must_fit and least_memory > self.cluster.device.memory:
            self.stats.pruned_memory += pending.size
            self._settle(index, None)
            self._release(pending)   # its offloading twins may fit where it does not
            return
        floor = max(floor, quick)
        self._settle(index, floor)
        heapq.heappush(queue, (floor, key, index, "branch", pending))

    def _bound_branch(self, queue: list, index: int, pending: Unbounded) -> None:
        """A branch's candidates bounded one by one: those that fit into the queue, a group entry per part (the
        branch's entry weighs nothing now), the rest pruned by memory."""
        settled, memory = self.settled, self.cluster.device.memory
        settled.weight[index] = 0
        self._release(pending)
        for variant, sp in pending.parts:
            leaves = self._part_leaves(pending, variant, sp)
            fit = sorted((lb_t, schedule, v, zero) for lb_t, lb_m, schedule, v, zero in leaves
                         if lb_m <= memory or not self.must_fit)
            if len(fit) < len(leaves):
                self.stats.pruned_memory += len(leaves) - len(fit)
                pruned = settled.add(math.inf, len(leaves) - len(fit))   # (add may grow the arrays: index first)
                settled.done[pruned] = True
            if fit:
                group = Group(pending.branch, variant, sp, tuple(fit))
                heapq.heappush(queue, group.entry(settled.add(fit[0][0], len(fit))))

    def _release(self, pending: Unbounded) -> None:
        """The offloading branches waiting for ``pending``'s branch, their twin (:meth:`_queue`), into the queue
        under their own floors, which are at least the twin's (_offload_follows), or pruned by memory."""
        settled, memory = self.settled, self.cluster.device.memory
        for waiting, at in self._deferred.pop(_twin(pending.branch), ()) if pending.branch.offload == "none" else ():
            floor, least_memory = self.branch_floor(waiting)
            settled.bound[at] = floor
            if self.must_fit and least_memory > memory:
                self.stats.pruned_memory += waiting.size
                settled.done[at] = True
            else:   # into the main queue (the twin may be in _plain's share of it: search._split)
                heapq.heappush(self._release_to, (floor, waiting.key(), at, "branch", waiting))

    def _expand(self, queue: list, index: int, group: Group) -> None:
        """A group's candidates into the queue, each with its own entry (the group's weighs nothing now)."""
        settled = self.settled
        settled.weight[index] = 0
        for leaf in group.leaves:
            heapq.heappush(queue, (leaf[0], group.key(leaf), settled.add(leaf[0]), "summed", None))

    def _split(self, queue: list, holds: Callable[[int, str], bool]) -> tuple[list, list]:
        """(the entries of candidates for whose ZeRO stage and offload ``holds``, the rest), each a heap: a group
        holding both is split in two (one keeps its index, the other gets its own)."""
        yes, no = [], []
        for entry in queue:
            if entry[3] not in ("group", "branch", "floor"):
                (yes if holds(entry[1].zero, OFFLOADS[entry[1].offload]) else no).append(entry)
                continue
            parts = [(part, out) for part, out in zip(entry[-1].split(holds), (yes, no)) if part is not None]
            for k, (part, out) in enumerate(parts):
                if entry[3] == "group":
                    bound, weight, key = part.leaves[0][0], len(part.leaves), part.key(part.leaves[0])
                else:   # the branch's floor is a floor of either part
                    bound, weight, key = entry[0], part.size, part.key()
                if k == 0:
                    index = entry[2]
                    self.settled.bound[index], self.settled.weight[index] = bound, weight
                else:
                    index = self.settled.add(bound, weight)
                out.append((bound, key, index, entry[3], part))
        heapq.heapify(yes)
        heapq.heapify(no)
        return yes, no

    def _settle(self, index: int, bound: float | None) -> None:
        """Record a refinement for the bar (:class:`Settled`): the tighter bound, or None: pruned by memory."""
        if self.settled is not None:
            if bound is None:
                self.settled.done[index] = True
            else:
                self.settled.bound[index] = bound
