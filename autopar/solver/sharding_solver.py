"""``ShardingSolver``: the sharding ILPs (sharding.py) of one graph, cluster and precision, run over
every layer group for a tensor-parallel degree and variant, their layouts assembled and cached.

For each degree ``t`` and variant, every layer group is solved once for each candidate boundary
spec (``R``, and ``S(0)`` where a crossing tensor can take it), groups in graph order so that a
parameter shared with an earlier group keeps the split that group chose; :func:`_pick` then takes
the boundary whose whole-model totals the variant prefers (sharding.py's two criteria). Past the
search's deadline a group is sharded greedily instead. The assembled TPLayout is what the cost model
prices and the plan's ``sharding`` records.
"""

from __future__ import annotations

import functools
import gc
import math
import multiprocessing
import threading
import time as _time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ..capture.fusion import for_kernels
from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import Precision
from ..cost_model.comm import GroupPlacement, place_axes
from ..cost_model.compute import fused_ops
from ..cost_model.tensor_parallel import TPLayout, replicated_layout
from ..errors import ConfigError
from ..plan.placement import Replicate, Shard
from ..plan.sharding import OpSharding, ShardingGroup, replicated
from . import ilp_solvers
from .sharding import MEMORY_SLACK, TIME_SLACK, VARIANTS, WHOLE_BATCH, ILPLimits, greedy_choice, solve_group
from .sharding_layout import GroupSolution, LayerGroup, assemble, consumers_of, layer_groups, totals
from .sharding_problem import Boundary, Pricing, build_problem, realise
from .strategies import OpContext

@dataclass
class ShardingSolver:
    """Per-op sharding ILPs for one graph, cluster and precision; layouts cached per (tp, variant).

    ``seconds`` and ``solves`` count the time spent building and solving ILPs (in whichever process) and
    the number of group ILPs solved (each has two solver calls) for the layouts asked for (a layout the
    second process solved ahead counts once :meth:`solutions` is asked for it, so that the counts do not
    depend on how far ahead it got); ``waited`` the part of it the callers
    of :meth:`solutions` spent solving or waiting for a :meth:`prefetch` to finish a layout they asked
    for. ``deadline`` (a ``time.perf_counter()`` value, the search's time limit): groups reached after
    it are sharded greedily, without an ILP.

    :meth:`prefetch` solves layouts in a second process (forked: it has the graph and every cache as
    they are) while the caller goes on, and sends each back as it is solved: on two cores the search
    bounds the layouts it has while the next are solved, neither waiting for the other's Python (a
    thread shares Python's lock: building a group's ILP, half its time, held the search up). A layout
    the search asks for before it arrives is solved here when the second process has not started it,
    and waited for when it has; while it waits, this process takes the last layouts the second process
    has not reached and solves them itself (telling it to pass them over: both processes solve then, not
    one solving while the other idles). One it asks for that was not prefetched (or once the prefetch is
    stopped) is solved where it is asked for. Either way it is
    the same layout (one HiGHS thread under a node limit is deterministic; under a wall-clock limit no
    layout is reproducible anyway). Without ``fork`` (Windows, macOS by default), or inside a daemonic process,
    nothing is solved ahead.

    No ILP reads the device's memory (the lean variants minimise memory, they are not bounded by
    it; the search decides what fits), so one solver serves clusters that differ only in it
    (:meth:`serves`): exploring device sizes re-solves nothing."""

    graph: OpGraph
    cluster: Cluster
    precision: Precision
    limits: ILPLimits = ILPLimits()
    deadline: float | None = None
    seconds: float = 0.0
    solves: int = 0
    stopped_early: int = 0  # group ILPs that stopped at a limit or fell back to greedy (not proven optimal)
    greedy_after_deadline: int = 0   # groups sharded greedily because the deadline had passed
    fallbacks: list[str] = field(default_factory=list)   # solver failures and what replaced them
    waited: float = 0.0
    _layouts: dict[tuple[int, str], TPLayout] = field(default_factory=dict, repr=False)
    _solutions: dict[tuple[int, str], list[GroupSolution]] = field(default_factory=dict, repr=False)
    _contexts: dict[bool, OpContext] = field(default_factory=dict, repr=False)
    _failed: dict[tuple[int, str], BaseException] = field(default_factory=dict, repr=False, compare=False)
    _ahead: "_Ahead | None" = field(default=None, repr=False, compare=False)   # the prefetch under way
    _uncounted: dict[tuple[int, str], tuple] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.graph = for_kernels(self.graph, self.precision.kernels)   # the activations its kernels keep

    def serves(self, cluster: Cluster) -> bool:
        """Whether this solver's layouts are those of ``cluster``: the same cluster but perhaps for
        the device's memory."""
        same_memory = replace(cluster, device=replace(cluster.device, memory=self.cluster.device.memory))
        return same_memory == self.cluster

    def layout(self, tp: int, variant: str = "fast") -> TPLayout:
        """The layout the ILP chooses for tensor-parallel degree ``tp`` (1: everything R/C)."""
        _check(tp, variant)
        key = (tp, variant)
        if key not in self._layouts:
            if tp == 1:
                self._layouts[key] = replicated_layout(self.graph)
            else:
                self._layouts[key] = assemble(self.graph, tp, self.solutions(tp, variant))
        return self._layouts[key]

    def layout_fn(self, variant: str) -> Callable[[OpGraph, int], TPLayout]:
        """``layout_fn(graph, tp)`` for ``LayerCostModel(layout_fn=...)``."""
        _check(2, variant)

        def fn(graph: OpGraph, tp: int) -> TPLayout:
            if graph is not self.graph and graph.content_hash != self.graph.content_hash:
                raise ConfigError(f"this ShardingSolver was built for {self.graph.model_name} "
                                  f"({self.graph.content_hash}), not {graph.model_name} ({graph.content_hash}): "
                                  "make one ShardingSolver per graph")
            return self.layout(tp, variant)
        return fn

    def solutions(self, tp: int, variant: str) -> list[GroupSolution]:
        """The solved groups (tp > 1), in layer order."""
        _check(tp, variant)
        key = (tp, variant)
        if key not in self._solutions:
            start = _time.perf_counter()
            self._solve(key)
            self.waited += _time.perf_counter() - start
        if key in self._uncounted:   # solved in the second process: its counts join once it is used
            solves, stopped, greedy, fallbacks = self._uncounted.pop(key)
            self.solves, self.stopped_early = self.solves + solves, self.stopped_early + stopped
            self.greedy_after_deadline, self.fallbacks = self.greedy_after_deadline + greedy, self.fallbacks + fallbacks
        if key in self._failed:
            raise self._failed[key]
        return self._solutions[key]

    def solved(self, tp: int, variant: str) -> bool:
        """Whether :meth:`solutions` of ``(tp, variant)`` returns without solving or waiting."""
        if tp == 1:
            return True
        self._receive()
        return (tp, variant) in self._solutions or (tp, variant) in self._failed

    def prefetch(self, keys: Sequence[tuple[int, str]]) -> None:
        """Solve the layouts of ``keys`` ((tp, variant) pairs, tp > 1), in order, in a second process (those
        solved are skipped, and a whole-batch one whose base layout does not split the batch, :meth:`_wanted`);
        :meth:`stop_prefetch` ends it."""
        for tp, variant in keys:
            _check(tp, variant)
        self.stop_prefetch()
        keys = [k for k in keys if k not in self._solutions and k not in self._failed]
        if not keys or "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
            return   # no second process to be had (a daemonic process may not start one): each solved where asked
        # what every solve shares, made here once (the second process starts with it)
        _ = (self._groups, self._consumers, self._fused, self._context(True), self._context(False))
        context = multiprocessing.get_context("fork")
        receiver, sender = context.Pipe(duplex=False)
        skipped, skip = context.Pipe(duplex=False)   # the keys this process took back (_Ahead.take)
        process = context.Process(target=self._solve_ahead, args=(keys, sender, receiver, skipped, skip),
                                  name="autopar-sharding-ilp", daemon=True)
        with warnings.catch_warnings():   # Python 3.12+ warns of fork beside threads: the child runs no one's locks
            warnings.simplefilter("ignore", DeprecationWarning)
            process.start()
        sender.close()
        skipped.close()
        self._ahead = _Ahead(process, receiver, set(keys), tuple(keys), skip)
        self._ahead.reader.start()

    def stop_prefetch(self) -> None:
        """End the second process (the layouts it has sent are kept; any other is solved where asked for)."""
        self._receive()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def forget_prefetch(self) -> None:
        """In a process forked from the one that prefetches (ahead.py's walker): leave the prefetch alone (its
        pipes and reader thread are that process's: a layout taken from it here would be missed there); any
        layout not yet here is solved here."""
        self._ahead = None

    def _solve_ahead(self, keys: Sequence[tuple[int, str]], sender: Any, receiver: Any, skipped: Any,
                     skip: Any) -> None:
        """The second process: each key's solutions (or its failure), the counts it added and the ILP models it
        solved (ilp_solvers' memory, so that this process answers them again without solving), sent in order.
        It closes its copy of the pipe's reading end, so that a send after this process died (killed, where
        no exit handler ends its daemonic children) fails and it stops instead of waiting forever. It never
        collects what it inherited (gc.freeze): garbage of the caller's, a process group of an earlier
        program among it, would run its destructor here, where the threads it joins do not exist (a gloo
        process group's waited forever on a condition variable, hanging the search that waited for it)."""
        gc.freeze()
        receiver.close()
        skip.close()
        known = set(ilp_solvers.solved_models())
        taken: set[tuple[int, str]] = set()   # keys the search solves itself
        for key in keys:
            try:
                while skipped.poll():
                    taken.add(skipped.recv())
            except (EOFError, OSError):
                pass
            if key in taken:
                continue
            before = (self.seconds, self.solves, self.stopped_early, self.greedy_after_deadline, len(self.fallbacks))
            # a whole-batch key whose base the search took is passed over too (whether it is wanted would take
            # solving the base again here): sent as not wanted, solved there if asked for
            found = self._attempt(key) if _base(key) not in taken and self._wanted(key) else None
            if found is not None:
                self._keep(key, found)   # what a whole-batch key asks of its base layout (_wanted)
            models = {k: v for k, v in ilp_solvers.solved_models().items() if k not in known}
            known.update(models)
            added = (self.seconds - before[0], self.solves - before[1], self.stopped_early - before[2],
                     self.greedy_after_deadline - before[3], self.fallbacks[before[4]:], models)
            try:
                sender.send((key, found, added))
            except OSError:            # the process that started this one is gone: no one to send to
                return
            except Exception as exc:   # noqa: BLE001 - an error that does not pickle: its text
                sender.send((key, RuntimeError(f"solving the tp={key[0]} {key[1]!r} layout failed: {found!r} "
                                               f"(not sent back: {exc})"), added))
        sender.close()

    def _wanted(self, key: tuple[int, str]) -> bool:
        """Whether the second process solves ``key``: a whole-batch layout only where its base layout, solved
        before it, splits the batch (the search asks for it there alone, Search._variant)."""
        if not key[1].endswith(WHOLE_BATCH):
            return True
        try:
            return self.splits_batch(*_base(key))
        except Exception:   # noqa: BLE001 - the base layout failed: the search raises that one where it asks
            return False

    def _receive(self, until: tuple[int, str] | None = None) -> None:
        """Take what the second process has sent (and, with ``until``, wait for that key's)."""
        ahead = self._ahead
        if ahead is None:
            return
        with ahead.arrived:
            if until is not None:
                ahead.arrived.wait_for(lambda: until in ahead.received or ahead.ended)
            received, ahead.received = ahead.received, {}
            ended = ahead.ended and ahead.pending - set(received)
        for key, (found, (seconds, solves, stopped, greedy, fallbacks, models)) in received.items():
            ilp_solvers.remember(models)
            ahead.pending.discard(key)
            self.seconds += seconds
            if key in ahead.taken:   # solved here too (_Ahead.take): counted once, as here
                continue
            if found is not None:    # None: not wanted (_wanted); solved here if ever asked for
                self._keep(key, found)
                self._uncounted[key] = (solves, stopped, greedy, fallbacks)
        if ended:   # it ended before sending them all: the rest are solved here
            self._ahead = None
            ahead.close()

    def _solve(self, key: tuple[int, str]) -> None:
        """Solve ``key``'s layout unless it is solved or on its way from the second process: solved here when
        that process has not started it, else waited for, solving meanwhile the last layouts it has not reached
        (class docstring). A failure is kept for whoever asks for the layout (:meth:`solutions` raises it)."""
        while self._ahead is not None and key in self._ahead.pending:
            self._receive()
            ahead = self._ahead
            if ahead is None or key not in ahead.pending:
                break
            took = ahead.take(key, self._stealable)
            if took is None:
                self._receive(until=key)
                break
            if took not in self._solutions and took not in self._failed:
                self._keep(took, self._attempt(took))
        if key not in self._solutions and key not in self._failed:
            self._keep(key, self._attempt(key))

    def _stealable(self, key: tuple[int, str]) -> bool:
        """Whether this process may take ``key`` from the second one without solving anything else first: a
        whole-batch layout only once its base layout is here, and only where the second process would solve it
        (:meth:`_wanted`)."""
        return not key[1].endswith(WHOLE_BATCH) or (_base(key) in self._solutions and self._wanted(key))

    def _attempt(self, key: tuple[int, str]) -> list[GroupSolution] | Exception:
        """``key``'s solutions, or the failure to raise where the layout is asked for; its seconds counted."""
        start = _time.perf_counter()
        try:
            return self._solve_all(*key)
        except Exception as exc:   # noqa: BLE001 - raised where the layout is asked for
            return exc
        finally:
            self.seconds += _time.perf_counter() - start

    def _keep(self, key: tuple[int, str], found: list[GroupSolution] | BaseException) -> None:
        if isinstance(found, BaseException):
            self._failed[key] = found
        else:
            self._solutions[key] = found

    def describe(self, tp: int, variant: str) -> tuple[ShardingGroup, ...]:
        """The plan's record of the layout: per layer group its layers (the first ``solved`` were solved, the
        rest repeat the first) and each solved op's strategy, placements and parameter split dims, keyed by
        its structural identity (volatile ops have none and are left out: the compiler carries their
        input's placement through them, plan/sharding.py)."""
        graph = self.graph
        if tp == 1:
            return replicated(graph)
        out = []
        for sol in self.solutions(tp, variant):
            layers = list(sol.group.solved) + [c[0] for c in sol.group.copies]
            ops = []
            for k, (node, j) in enumerate(zip(sol.problem.nodes, sol.result.choice)):
                op_id = graph.op_id(node.name)
                if op_id is None:
                    continue
                s = sol.problem.strategies[k][j]
                ops.append(OpSharding(op_id, s.name, s.output, tuple(s.inputs), tuple(s.params)))
            out.append(ShardingGroup(tuple(graph.layers[i].name for i in layers), len(sol.group.solved),
                                     tuple(ops), sol.boundary))
        return tuple(out)

    def splits_batch(self, tp: int, variant: str) -> bool:
        """Whether the layout splits a batch dim (data parallelism inside the tensor-parallel group): then
        every micro-batch must hold a multiple of ``tp`` samples (the search gives the others the
        variant's ``WHOLE_BATCH`` layout). The cost model does not check it."""
        if tp == 1 or variant.endswith(WHOLE_BATCH):
            return False
        batch_dims = self._context(True).batch_dims
        for sol in self.solutions(tp, variant):
            if sol.boundary != Replicate():
                return True
            for k, node in enumerate(sol.problem.nodes):
                s = sol.problem.strategies[k][sol.result.choice[k]]
                specs = [(node.name, s.output)] + list(zip(node.inputs, s.inputs))
                if any(isinstance(spec, Shard) and spec.dim in batch_dims.get(name, ()) for name, spec in specs):
                    return True
        return False

    def _context(self, batch_split: bool) -> OpContext:
        if batch_split not in self._contexts:
            self._contexts[batch_split] = OpContext(self.graph, batch_split=batch_split)
        return self._contexts[batch_split]

    @functools.cached_property
    def _consumers(self) -> dict[str, list[str]]:
        return consumers_of(self.graph)

    @functools.cached_property
    def _groups(self) -> list[LayerGroup]:
        """The layer groups (the same for every degree and variant)."""
        return layer_groups(self.graph, self._consumers)

    @functools.cached_property
    def _fused(self) -> frozenset[str]:
        return fused_ops(self.graph, self.precision.kernels)

    def _solve_all(self, tp: int, variant: str) -> list[GroupSolution]:
        graph = self.graph
        ctx = self._context(not variant.endswith(WHOLE_BATCH))
        variant = variant.removesuffix(WHOLE_BATCH)
        pricing = Pricing(graph, self.cluster, self.precision, tp, tp_group(self.cluster, tp), self._fused)
        consumers, groups = self._consumers, self._groups
        candidates = [Boundary(Replicate())]
        crossing = {name for layer in graph.layers for name in layer.inputs if name in graph.node_index}
        if any(Boundary(Shard(0)).of(ctx, name, tp) == Shard(0) for name in sorted(crossing)):
            candidates.append(Boundary(Shard(0)))
        options = [self._solve_groups(ctx, pricing, consumers, groups, variant, b) for b in candidates]
        return options[_pick(options, variant)]

    def _solve_groups(self, ctx: OpContext, pricing: Pricing, consumers: Mapping[str, list[str]],
                      groups: Sequence[LayerGroup], variant: str, boundary: Boundary) -> list[GroupSolution]:
        graph = self.graph
        decided: dict[str, int | None] = {}
        out = []
        for g in groups:
            nodes = [graph.nodes[i] for li in g.solved for i in graph.layers[li].nodes]
            start = _time.perf_counter()
            problem = build_problem(ctx, pricing, nodes, consumers, decided, boundary)
            stats: dict[str, Any] = {"ops": len(nodes)}
            if self.deadline is not None and start > self.deadline:
                result = realise(problem, greedy_choice(problem, variant))
                self.greedy_after_deadline += 1
                stats["stopped_early"] = True
            else:   # an ILP started before the deadline stops at it (or at its own limit)
                limits = self.limits if self.deadline is None else ILPLimits(
                    time=min(self.limits.time or math.inf, max(self.deadline - start, 0.05)),
                    nodes=self.limits.nodes)
                result = solve_group(problem, variant, stats=stats, limits=limits)
                self.solves += 1
                self.fallbacks += stats["fallbacks"]
            stats["seconds"] = _time.perf_counter() - start
            self.stopped_early += bool(stats.get("stopped_early"))
            for k, j in enumerate(result.choice):
                for p, d in problem.strategies[k][j].params:
                    decided.setdefault(p, d)
                    for _, _, pmap in g.copies:
                        decided.setdefault(pmap.get(p, p), d)
            out.append(GroupSolution(g, problem, result, boundary.spec, stats))
        return out


@dataclass
class _Ahead:
    """A prefetch under way: the second process, the end of the pipe it sends on, the keys not yet taken,
    and what a thread of this process has read from the pipe (:meth:`drain`: the second process never
    waits for the search to read a layout it sent)."""

    process: Any
    receiver: Any
    pending: set[tuple[int, str]]
    order: tuple[tuple[int, str], ...]   # the keys in the order the second process solves them
    skip: Any                            # the pipe telling it which keys this process took back
    taken: set[tuple[int, str]] = field(default_factory=set)   # those keys
    received: dict[tuple[int, str], tuple] = field(default_factory=dict)
    ended: bool = False
    arrived: threading.Condition = field(default_factory=threading.Condition)
    reader: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self.drain, name="autopar-sharding-ilp-pipe", daemon=True)

    def take(self, key: tuple[int, str], stealable: Callable[[tuple[int, str]], bool]) -> tuple[int, str] | None:
        """A key this process solves instead of the second one (None: none to take): ``key`` itself when the
        second process is at an earlier one (it goes in order; the first pending is the one it works on),
        else the last pending key it has not reached; told to pass it over. A key it started as the message
        went is solved by both (the same layout: its copy and counts are dropped, ShardingSolver._receive)."""
        waiting = [k for k in self.order if k in self.pending]
        if not waiting:
            return None
        later = [k for k in waiting[1:] if stealable(k)]
        if not later:
            return None
        took = key if key in later else later[-1]
        self.pending.discard(took)
        self.taken.add(took)
        try:
            self.skip.send(took)
        except (OSError, ValueError):   # the process has ended: it solves nothing more
            pass
        return took

    def close(self) -> None:
        """End the process, then the reader (which sees the pipe close), then the pipes."""
        self.process.terminate()
        self.process.join()
        self.reader.join()
        self.receiver.close()
        self.skip.close()

    def drain(self) -> None:
        while True:
            try:
                key, found, added = self.receiver.recv()
            except (EOFError, OSError):   # every layout sent, or the process ended (stopped, or killed)
                with self.arrived:
                    self.ended = True
                    self.arrived.notify_all()
                return
            with self.arrived:
                self.received[key] = (found, added)
                self.arrived.notify_all()


def _base(key: tuple[int, str]) -> tuple[int, str]:
    """The layout a whole-batch key is the sibling of (the key itself for any other)."""
    return key[0], key[1].removesuffix(WHOLE_BATCH)


def _pick(options: Sequence[Sequence[GroupSolution]], variant: str) -> int:
    """The boundary candidate the variant prefers (the same two criteria as inside a group)."""
    tot = [totals(o) for o in options]
    if variant == "fast":
        best = min(t for t, _ in tot)
        near = [i for i, (t, _) in enumerate(tot) if t <= best * (1 + TIME_SLACK)]
        return min(near, key=lambda i: (tot[i][1], i))
    least = min(m for _, m in tot)
    near = [i for i, (_, m) in enumerate(tot) if m <= least * (1 + MEMORY_SLACK)]
    return min(near, key=lambda i: (tot[i][0], i))


def _check(tp: int, variant: str) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r} must be an integer >= 1")
    if variant.removesuffix(WHOLE_BATCH) not in VARIANTS:
        raise ConfigError(f"variant={variant!r} is not one of {', '.join(map(repr, VARIANTS))} (or one of them "
                          f"+ {WHOLE_BATCH!r})")


def tp_group(cluster: Cluster, tp: int) -> GroupPlacement:
    """Placement of one tensor-parallel group: ``tp`` consecutive ranks (the innermost mesh axis)."""
    if cluster.devices % tp:
        raise ConfigError(f"tp={tp} does not divide the {cluster.devices} devices of {cluster.describe()}: "
                          "choose a tensor-parallel degree that divides the device count")
    axes = [("tp", tp)] + ([("rest", cluster.devices // tp)] if cluster.devices > tp else [])
    return place_axes(cluster, axes)["tp"]
