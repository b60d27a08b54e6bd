r"""The per-op sharding ILP: which tensor-parallel strategy every op runs (Alpa, Zheng et al. OSDI'22, sec. 4).

It discovers the layout Megatron's rules (cost_model/tensor_parallel.py ``megatron_layout``, its
reference) hard-code, and returns a :class:`TPLayout`, which the cost model prices: every
tensor-parallel layout of a plan or an estimate comes from here.

**Groups.** One ILP per layer group: one per distinct block signature (solved on its first
layer and copied by node position to the others, after checking they match op for op),
and one over all non-block layers together (embedding, final norm, head, loss: a tied
embedding/head weight gets one split). Tensors cross between groups in one *boundary spec*
``b``: ``R``, or ``S(0)`` (the batch dim split: data parallelism between groups) for the
batch-dependent crossing tensors whose dim 0 divides by ``t``. A tensor entering a group
arrives in ``b`` (graph inputs always ``R``: every rank has the batch); an op whose output is
read outside its group must produce ``b`` (``R`` for the graph's output), or ``P`` reduced to
``b`` on the way out (all-reduce or reduce-scatter, charged to that op: a vocabulary-parallel
embedding feeding the first block). Every group is solved for each candidate ``b`` (``S(0)``
only when some crossing tensor can take it) and the variant's criteria below, applied to the
whole model's totals, pick one ``b``. Costs are for a micro-batch of one sample
(``batch_scale = 1 / B``, ``B`` the captured batch); sharding_problem.py prices every term
exactly as the cost model prices the resulting TPLayout (including its convention that a
forward all-gather, reduce-scatter or all-to-all costs its transpose again in backward).

**Variables.**

- ``s_v[i]`` binary, one per strategy ``i`` of op ``v`` (strategies.py lists them);
- ``e_uv[a, b] in [0, 1]`` per edge ``u -> v`` and pair of (producer output spec ``a``,
  consumer input spec ``b``) that resharding can join;
- ``g_u in [0, 1]``: the backward all-reduce of ``u``'s gradient runs (some consumer of ``u``
  uses a strategy that leaves it partial; one all-reduce serves all of them);
- ``x_p[d] in [0, 1]``: the split dim (or none) of a parameter read by several ops.

**Objective.** ``time = sum_v sum_i s_v[i] (c_v[i] + w_v[i]) + sum_uv sum_ab e_uv[a,b] r_uv(a,b)
+ sum_u g_u A_u``, with ``c`` compute (forward + backward) plus the strategy's own and boundary
collectives, ``w = max(0, T_allreduce(weight gradients) / B - backward_v)`` the exposed share per
sample of a once-per-step weight-gradient all-reduce (strategies that keep a weight whole while
splitting its op), ``r`` the resharding collectives and ``A_u`` the all-reduce of ``u``'s
gradient (all seconds, in microseconds in the model). ``memory = sum_v sum_i s_v[i] m_v[i] + sum_p sum_d x_p[d] M_p(d)``:
parameter states (``/ t`` when split) and the saved activations each op owns (``/ t`` when its
output is split).

- ``variant="fast"``: minimise time; then minimise memory with ``time <= T* (1 + 1e-6)``.
- ``variant="lean"``: minimise memory; then minimise time with ``memory <= 1.01 M*``.
- ``fast-whole-batch`` / ``lean-whole-batch``: the same, with no strategy (nor boundary) that splits
  a batch dim: the layouts for micro-batches that do not divide by ``t`` when the plain variant's
  layout splits the batch (:meth:`ShardingSolver.splits_batch`).

The second solve adds ``1e-4 * (strategy index)`` per op (0.1 ns or 100 bytes) to break exact
ties by strategy order, so that the layout does not depend on the solver. The first solve is
exact (zero gap); the second stops within half a tie step (``gapAbs``) or ``SECOND_GAP`` = 0.01%
(``gapRel``) of its optimum, whichever comes first: its criterion (memory among the fastest
layouts, or time among the leanest) is the refinement, and proving which of two layouts a few
bytes apart is the smaller took a 1,000-op hybrid linear-attention layer (Hugging Face's
Qwen3-Next, Bailing, Lara) thousands of branch-and-bound nodes, minutes at the default node limit.

**Constraints**, each family added by one function:

- ``add_one_hot``: ``sum_i s_v[i] = 1`` for every op;
- ``add_resharding``: the edge linearisation in its row/column-sum form (tighter than Alpa's
  ``e <= s_u, e <= s_v``): ``sum_b e_uv[a, b] = sum_{i: out_i = a} s_u[i]`` and
  ``sum_a e_uv[a, b] = sum_{j: in_j = b} s_v[j]``; pairs that cannot be joined (anything to
  ``P``) have no variable;
- ``add_partial_gradients``: ``g_u >= s_v[j]`` for every strategy ``j`` of a consumer ``v``
  that leaves ``u``'s gradient partial;
- ``add_param_consistency``: ``sum_d x_p[d] = 1`` and ``s_v[i] <= x_p[d_v,i(p)]``: every op
  reading ``p`` agrees on its split;
- ``add_memory``: ``memory <= budget`` (the lean variant's second solve; optional otherwise);
- ``add_time``: ``time <= T* (1 + 1e-6)`` (the fast variant's second solve).

Solvers (ilp_solvers.py): HiGHS (``highspy``, a dependency; in process) when it imports, else CBC through pulp;
both single-threaded and deterministic, with no relative gap (an optimum is exact). Each call is
bounded by deterministic work, not by the clock: :class:`ILPLimits` ``nodes``
(``NODE_LIMIT`` branch-and-bound nodes by default), so a plan is the same on an idle machine and
a busy one. A wall-clock ``time`` limit per call applies only when the user asks for one
(``ilp_time_limit``). At a limit the best integer solution is used and counted in
``ShardingSolver.stopped_early``; the plan says so in its notes and is not marked optimal. A
solver that fails (raises, or ends without a solution) is followed by the next one in
:func:`lp_solvers`, then by :func:`greedy_choice` (each op in graph order takes its cheapest
strategy compatible with the ops already chosen); every fallback is recorded in
``ShardingSolver.fallbacks`` and becomes a plan note. Past the search's deadline
(``time_limit``) no ILP is started: the remaining groups are sharded greedily. Layouts are
cached per (tp, variant) in the :class:`ShardingSolver` (sharding_solver.py), which also counts the ILP seconds and
solves.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import AutoparError, InfeasiblePlanError
from .ilp_solvers import NODE_LIMIT, ILPLimits, ILPModel, lp_solvers
from .sharding_problem import GroupProblem, Realised, realise

VARIANTS: tuple[str, ...] = ("fast", "lean")
WHOLE_BATCH = "-whole-batch"    # suffix of a variant solved without splitting any batch dim (strategies.py)
_US, _MB = 1e6, 1e-6            # the model's units: microseconds, megabytes
_TIE = 1e-4                     # per strategy index, in the second objective's units
TIME_SLACK, MEMORY_SLACK = 1e-6, 0.01      # the second solve's tolerance on the first criterion
SECOND_GAP = 1e-4               # the second solve's relative optimality gap
SECOND_GAP_ABS = _TIE / 2       # and its absolute one: half a tie step


# ---------------------------------------------------------------- the ILP, one constraint family each

def _add(terms: dict[int, float], column: int, coefficient: float) -> None:
    terms[column] = terms.get(column, 0.0) + coefficient


def add_one_hot(gp: GroupProblem) -> ILPModel:
    m = ILPModel()
    m.s = [[m.var(f"s_{k}_{j}", binary=True) for j in range(len(opts))] for k, opts in enumerate(gp.strategies)]
    for vs in m.s:
        m.row({v: 1.0 for v in vs}, 1.0, 1.0)
    for k, vs in enumerate(m.s):
        for j, v in enumerate(vs):
            _add(m.time, v, _US * (gp.time[k][j] + gp.step[k][j]))
            _add(m.memory, v, _MB * gp.memory[k][j])
            if j:
                _add(m.tie, v, _TIE * j)
    m.memory_constant = _MB * gp.const_memory
    return m


def add_resharding(m: ILPModel, gp: GroupProblem) -> None:
    """Per edge, one variable per joinable (producer output, consumer input) pair, tied to both ends'
    one-hot choices: a strategy whose layout no strategy at the other end can join (no key of the
    edge's costs) is ruled out, since its row or column has no variable to equal it."""
    for n, edge in enumerate(gp.edges):
        outs = dict.fromkeys(s.output for s in gp.strategies[edge.u])
        needs = dict.fromkeys(s.inputs[edge.i] for s in gp.strategies[edge.v])
        if len(outs) == 1 and len(needs) == 1 and len(edge.costs) == 1:
            (key, cost), = edge.costs.items()
            m.time_constant += _US * cost
            continue
        e = {key: m.var(f"e_{n}_{idx}") for idx, key in enumerate(edge.costs)}
        # per spec at each end: the pairs with that spec there = the end's strategies with that spec
        ends = ((0, edge.u, outs, lambda s: s.output), (1, edge.v, needs, lambda s: s.inputs[edge.i]))
        for side, op, specs, spec_of in ends:
            for spec in specs:
                row: dict[int, float] = {}
                for key, x in e.items():
                    if key[side] == spec:
                        _add(row, x, 1.0)
                for j, v in enumerate(m.s[op]):
                    if spec_of(gp.strategies[op][j]) == spec:
                        _add(row, v, -1.0)
                m.row(row, 0.0, 0.0)
        for key, x in e.items():
            if edge.costs[key]:
                _add(m.time, x, _US * edge.costs[key])


def add_partial_gradients(m: ILPModel, gp: GroupProblem) -> None:
    for n, (name, users) in enumerate(gp.partial.items()):
        cost = _US * gp.partial_cost[name]
        if len(users) == 1:
            (k, j), = users
            _add(m.time, m.s[k][j], cost)
            continue
        g = m.var(f"g_{n}")
        for k, j in users:
            m.row({g: 1.0, m.s[k][j]: -1.0}, 0.0, math.inf)    # g >= s
        _add(m.time, g, cost)


def add_param_consistency(m: ILPModel, gp: GroupProblem) -> None:
    for n, (param, users) in enumerate(gp.shared.items()):
        dims = list(dict.fromkeys(d for _, _, d in users))
        x = {d: m.var(f"x_{n}_{'none' if d is None else d}") for d in dims}
        m.row({v: 1.0 for v in x.values()}, 1.0, 1.0)
        for k, j, d in users:
            m.row({m.s[k][j]: 1.0, x[d]: -1.0}, -math.inf, 0.0)   # s <= x
        full = gp.shared_bytes[param] * _MB
        for d, v in x.items():
            _add(m.memory, v, full / (gp.tp if d is not None else 1))


def add_memory(m: ILPModel, budget: float) -> None:
    """``memory <= budget`` (bytes)."""
    m.row(dict(m.memory), -math.inf, budget * _MB - m.memory_constant)


def add_time(m: ILPModel, bound: float) -> None:
    """``time <= bound`` (seconds)."""
    m.row(dict(m.time), -math.inf, bound * _US - m.time_constant)


def solve_group(gp: GroupProblem, variant: str, budget: float | None = None,
                stats: dict[str, Any] | None = None, limits: ILPLimits = ILPLimits()) -> Realised:
    """The variant's two solves on one group; the chosen strategies with their exact totals.

    ``stats``, when given, receives the model's size (``variables``, ``constraints``), whether a
    solve stopped at a limit (``stopped_early``), the branch-and-bound ``nodes`` of both solves
    (HiGHS; 0 under CBC) and the fallbacks taken (``fallbacks``: one line each)."""
    m = add_one_hot(gp)
    add_resharding(m, gp)
    add_partial_gradients(m, gp)
    add_param_consistency(m, gp)
    if budget is not None:
        add_memory(m, budget)
    stats = {} if stats is None else stats
    stats.update(variables=len(m.names), constraints=len(m.rows))
    fallbacks: list[str] = stats.setdefault("fallbacks", [])
    first, second = (m.time, m.memory) if variant == "fast" else (m.memory, m.time)
    best = _run(m, gp, first, "first", limits, fallbacks)
    if best is None and budget is not None:   # greedy would ignore the budget: say the budget is the problem
        raise InfeasiblePlanError(f"{fallbacks.pop()}: a memory budget of {budget / 1e9:.3g} GB per device is below "
                                  "the least this group can reach (or the solver failed); raise the budget")
    if best is None:
        best = realise(gp, greedy_choice(gp, variant))
        fallbacks.append(f"{_where(gp)}: every ILP solver failed, sharded greedily")
        stats["stopped_early"] = True
        return best
    if variant == "fast":
        add_time(m, (best.time + best.step) * (1 + TIME_SLACK) + 1e-12)
    else:
        add_memory(m, best.memory * (1 + MEMORY_SLACK) + 1.0)
    objective = dict(second)
    for column, c in m.tie.items():
        _add(objective, column, c)
    result = _run(m, gp, objective, "second", limits, fallbacks)
    stats["stopped_early"] = m.timed_out or result is None
    stats["nodes"] = m.nodes
    return best if result is None else result   # the second solve only breaks the first's ties


def _where(gp: GroupProblem) -> str:
    return f"the sharding ILP of the {len(gp.nodes)} ops from {gp.nodes[0].name}"


def _run(m: ILPModel, gp: GroupProblem, objective: dict[int, float], stage: str, limits: ILPLimits,
         fallbacks: list[str]) -> Realised | None:
    """Solve with the first solver of :func:`lp_solvers` that succeeds; None when none does (each
    failure is described in ``fallbacks``)."""
    failed: list[str] = []
    # the first solve is exact; the second stops within half a tie step or 0.01% of its optimum:
    # proving which of two layouts a few bytes (or picoseconds) apart is the smaller took hybrid
    # linear-attention layers of 1,000 ops hundreds of branch-and-bound nodes a second solve
    gaps = dict(gap_abs=SECOND_GAP_ABS, gap_rel=SECOND_GAP) if stage == "second" else {}
    for name, solver in lp_solvers(limits, **gaps):
        try:
            status, values, nodes = solver.solve(m, objective)
        except Exception as exc:  # noqa: BLE001 - a solver crash (pulp.PulpSolverError, OSError, ...) moves on
            failed.append(f"{name} raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        m.nodes += nodes
        if values is None:
            failed.append(f"{name} ended {status}")
            continue
        m.timed_out |= status == "stopped"
        if failed:
            fallbacks.append(f"{_where(gp)} ({stage} solve): {'; '.join(failed)}; {name} solved it")
        choice = [max(range(len(vs)), key=lambda j: (values[vs[j]], -j)) for vs in m.s]
        return realise(gp, choice)
    fallbacks.append(f"{_where(gp)} ({stage} solve): {'; '.join(failed) or 'no ILP solver is installed'}")
    return None


def greedy_choice(gp: GroupProblem, variant: str = "fast") -> list[int]:
    """One strategy per op, in graph order, each the cheapest (time, or memory for ``lean``) among
    those compatible with the ops already chosen: every incoming edge can be joined (a key of its
    costs) and every shared parameter keeps the split dim its first reader chose. The fallback when
    no ILP solver works; raises AutoparError in the (never observed) case of a dead end."""
    choice: list[int] = []
    incoming: dict[int, list] = {}
    for e in gp.edges:
        incoming.setdefault(e.v, []).append(e)
    dims_of: dict[tuple[int, int], list[tuple[str, int | None]]] = {}
    for p, users in gp.shared.items():
        for k, j, d in users:
            dims_of.setdefault((k, j), []).append((p, d))
    shared_dim: dict[str, int | None] = {}
    for k, options in enumerate(gp.strategies):
        best, best_cost = None, math.inf
        for j, s in enumerate(options):
            keys = [(gp.strategies[e.u][choice[e.u]].output, s.inputs[e.i]) for e in incoming.get(k, ())]
            if any(key not in e.costs for key, e in zip(keys, incoming.get(k, ()))):
                continue
            if any(p in shared_dim and shared_dim[p] != d for p, d in dims_of.get((k, j), ())):
                continue
            cost = (gp.time[k][j] + gp.step[k][j] + sum(e.costs[key] for key, e in zip(keys, incoming.get(k, ())))
                    if variant == "fast" else gp.memory[k][j])
            if cost < best_cost:
                best, best_cost = j, cost
        if best is None:
            raise AutoparError(f"{_where(gp)}: no ILP solver worked and greedy sharding found no strategy for op "
                               f"{gp.nodes[k].name} compatible with its producers; plan with fixed={{'tp': 1}}")
        choice.append(best)
        for p, d in dims_of.get((k, best), ()):
            shared_dim.setdefault(p, d)
    return choice


__all__ = ["VARIANTS", "WHOLE_BATCH", "ILPLimits", "NODE_LIMIT", "lp_solvers", "add_one_hot", "add_resharding",
           "add_partial_gradients", "add_param_consistency", "add_memory", "add_time", "solve_group", "greedy_choice",
           "TIME_SLACK", "MEMORY_SLACK"]
