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

Solver: HiGHS (``highspy``, a dependency; in-process) when it imports, else CBC through pulp;
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

import functools
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import pulp

from ..errors import AutoparError, ConfigError, InfeasiblePlanError
from .sharding_problem import GroupProblem, Realised, realise

VARIANTS: tuple[str, ...] = ("fast", "lean")
WHOLE_BATCH = "-whole-batch"    # suffix of a variant solved without splitting any batch dim (strategies.py)
_US, _MB = 1e6, 1e-6            # the model's units: microseconds, megabytes
_TIE = 1e-4                     # per strategy index, in the second objective's units
TIME_SLACK, MEMORY_SLACK = 1e-6, 0.01      # the second solve's tolerance on the first criterion
SECOND_GAP = 1e-4               # the second solve's relative optimality gap
SECOND_GAP_ABS = _TIE / 2       # and its absolute one: half a tie step
NODE_LIMIT = 20_000             # branch-and-bound nodes per solver call by default (deterministic work)


@dataclass(frozen=True)
class ILPLimits:
    """Limits on every sharding ILP solver call: ``nodes`` branch-and-bound nodes (deterministic:
    the same plan on any machine; None: no limit) and ``time`` seconds of wall clock (None, the
    default: no clock limit; set one only when a bounded solve time matters more than a plan that
    does not depend on how busy the machine is). Past either the best integer solution is used."""

    time: float | None = None
    nodes: int | None = NODE_LIMIT

    def __post_init__(self) -> None:
        if self.time is not None and (isinstance(self.time, bool) or not isinstance(self.time, (int, float))
                                      or not self.time > 0):
            raise ConfigError(f"ilp_time_limit={self.time!r} must be a positive number of seconds (or None for "
                              "no wall-clock limit)")
        if self.nodes is not None and (isinstance(self.nodes, bool) or not isinstance(self.nodes, int)
                                       or self.nodes < 1):
            raise ConfigError(f"ilp_node_limit={self.nodes!r} must be a positive integer (or None for no limit)")


def lp_solvers(limits: ILPLimits = ILPLimits(), gap_abs: float = 0.0, gap_rel: float = 0.0) -> list[tuple[str, Any]]:
    """The solvers to try, in order, as (name, pulp solver): HiGHS when ``highspy`` imports (in
    process: no solver binary to start, no files), then CBC (bundled with pulp). Both stop within an
    absolute gap of ``gap_abs`` (objective units) or a relative one of ``gap_rel`` of the optimum (0:
    exact), on one thread. Almost every group solves in well under a second; the node limit stops a
    rare hard one from stalling the search."""
    out: list[tuple[str, Any]] = []
    if _highs_ready():
        nodes = {} if limits.nodes is None else {"mip_max_nodes": limits.nodes}
        # no MIP restarts: HiGHS 1.16's restart after root presolve can loop without end and without
        # checking its time limit (found on a hybrid attention/Mamba layer's group by the Hugging
        # Face sweep, bench/hf_coverage.py); without them the node limit bounds every solve
        out.append(("HiGHS", _HiGHS(msg=False, threads=1, timeLimit=limits.time, gapRel=gap_rel,
                                        gapAbs=gap_abs, mip_allow_restart=False, **nodes)))
    with warnings.catch_warnings():  # PuLP 3.3 announces its bundled CBC will move to an extra in 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        cbc = pulp.PULP_CBC_CMD(msg=False, threads=1, timeLimit=limits.time, maxNodes=limits.nodes, gapRel=gap_rel,
                                gapAbs=gap_abs)
    if cbc.available():
        out.append(("CBC", cbc))
    return out


class _HiGHS(pulp.HiGHS):
    """PuLP's in-process HiGHS, reading HiGHS's node-limit status as a stop at a limit. HiGHS ends a
    solve that reaches ``mip_max_nodes`` with ``kSolutionLimit``, which PuLP (3.3) does not map: it
    raised KeyError after reading the solution, and every node-limit stop was solved again by CBC."""

    def findSolutionValues(self, lp):
        try:
            return super().findSolutionValues(lp)
        except KeyError:
            import highspy
            if lp.solverModel.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
                raise
            if math.isfinite(lp.solverModel.getObjectiveValue()):   # the best integer solution so far
                return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


@functools.lru_cache(maxsize=None)
def _highs_ready() -> bool:
    """Whether HiGHS imports. Its first ``Highs()`` prints a banner from C++ to standard output
    whatever the options; that one is made here with the output file descriptor pointed at
    /dev/null, so that a plan's output (a CLI summary, a notebook cell) stays the plan's."""
    try:
        import highspy
    except ImportError:
        return False
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return True


def _var(prob: pulp.LpProblem, name: str, low: float, up: float, cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    """A variable of ``prob`` (PuLP >= 3.3 attaches it to the model; older versions build it apart)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


# ---------------------------------------------------------------- the ILP, one constraint family each

@dataclass
class _Model:
    prob: pulp.LpProblem
    s: list[list[pulp.LpVariable]]
    time: pulp.LpAffineExpression = field(default_factory=pulp.LpAffineExpression)
    memory: pulp.LpAffineExpression = field(default_factory=pulp.LpAffineExpression)
    tie: pulp.LpAffineExpression = field(default_factory=pulp.LpAffineExpression)
    bounds: int = 0
    timed_out: bool = False
    nodes: int = 0      # branch-and-bound nodes of the solves so far (HiGHS reports them; CBC through pulp does not)


def add_one_hot(prob: pulp.LpProblem, gp: GroupProblem) -> _Model:
    s = [[_var(prob, f"s_{k}_{j}", 0, 1, pulp.LpBinary) for j in range(len(opts))]
         for k, opts in enumerate(gp.strategies)]
    for k, vs in enumerate(s):
        prob += pulp.lpSum(vs) == 1, f"one_hot_{k}"
    m = _Model(prob, s)
    m.time = pulp.LpAffineExpression([(v, _US * (gp.time[k][j] + gp.step[k][j]))
                                      for k, vs in enumerate(s) for j, v in enumerate(vs)])
    m.memory = pulp.LpAffineExpression([(v, _MB * gp.memory[k][j]) for k, vs in enumerate(s) for j, v in enumerate(vs)],
                                       constant=_MB * gp.const_memory)
    m.tie = pulp.LpAffineExpression([(v, _TIE * j) for vs in s for j, v in enumerate(vs) if j])
    return m


def add_resharding(m: _Model, gp: GroupProblem) -> None:
    """Per edge, one variable per joinable (producer output, consumer input) pair, tied to both ends'
    one-hot choices: a strategy whose layout no strategy at the other end can join (no key of the
    edge's costs) is ruled out, since its row or column has no variable to equal it."""
    for n, edge in enumerate(gp.edges):
        outs = dict.fromkeys(s.output for s in gp.strategies[edge.u])
        needs = dict.fromkeys(s.inputs[edge.i] for s in gp.strategies[edge.v])
        if len(outs) == 1 and len(needs) == 1 and len(edge.costs) == 1:
            (key, cost), = edge.costs.items()
            m.time += _US * cost
            continue
        e = {key: _var(m.prob, f"e_{n}_{idx}", 0, 1) for idx, key in enumerate(edge.costs)}
        for idx, a in enumerate(outs):
            prod = [v for j, v in enumerate(m.s[edge.u]) if gp.strategies[edge.u][j].output == a]
            m.prob += pulp.lpSum(x for k, x in e.items() if k[0] == a) == pulp.lpSum(prod), f"row_{n}_{idx}"
        for idx, b in enumerate(needs):
            cons = [v for j, v in enumerate(m.s[edge.v]) if gp.strategies[edge.v][j].inputs[edge.i] == b]
            m.prob += pulp.lpSum(x for k, x in e.items() if k[1] == b) == pulp.lpSum(cons), f"col_{n}_{idx}"
        m.time += pulp.LpAffineExpression([(x, _US * edge.costs[k]) for k, x in e.items() if edge.costs[k]])


def add_partial_gradients(m: _Model, gp: GroupProblem) -> None:
    for n, (name, users) in enumerate(gp.partial.items()):
        cost = _US * gp.partial_cost[name]
        if len(users) == 1:
            (k, j), = users
            m.time += cost * m.s[k][j]
            continue
        g = _var(m.prob, f"g_{n}", 0, 1)
        for k, j in users:
            m.prob += g >= m.s[k][j], f"partial_{n}_{k}_{j}"
        m.time += cost * g


def add_param_consistency(m: _Model, gp: GroupProblem) -> None:
    for n, (param, users) in enumerate(gp.shared.items()):
        dims = list(dict.fromkeys(d for _, _, d in users))
        x = {d: _var(m.prob, f"x_{n}_{'none' if d is None else d}", 0, 1) for d in dims}
        m.prob += pulp.lpSum(x.values()) == 1, f"param_{n}"
        for k, j, d in users:
            m.prob += m.s[k][j] <= x[d], f"param_{n}_{k}_{j}"
        full = gp.shared_bytes[param] * _MB
        m.memory += pulp.LpAffineExpression([(v, full / (gp.tp if d is not None else 1)) for d, v in x.items()])


def add_memory(m: _Model, budget: float) -> None:
    """``memory <= budget`` (bytes)."""
    m.bounds += 1
    m.prob += m.memory <= budget * _MB, f"memory_{m.bounds}"


def add_time(m: _Model, bound: float) -> None:
    """``time <= bound`` (seconds)."""
    m.bounds += 1
    m.prob += m.time <= bound * _US, f"time_{m.bounds}"


def solve_group(gp: GroupProblem, variant: str, budget: float | None = None,
                stats: dict[str, Any] | None = None, limits: ILPLimits = ILPLimits()) -> Realised:
    """The variant's two solves on one group; the chosen strategies with their exact totals.

    ``stats``, when given, receives the model's size (``variables``, ``constraints``), whether a
    solve stopped at a limit (``stopped_early``), the branch-and-bound ``nodes`` of both solves
    (HiGHS; 0 under CBC) and the fallbacks taken (``fallbacks``: one line each)."""
    prob = pulp.LpProblem("sharding", pulp.LpMinimize)
    m = add_one_hot(prob, gp)
    add_resharding(m, gp)
    add_partial_gradients(m, gp)
    add_param_consistency(m, gp)
    if budget is not None:
        add_memory(m, budget)
    stats = {} if stats is None else stats
    stats.update(variables=prob.numVariables(), constraints=prob.numConstraints())
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
    result = _run(m, gp, second + m.tie, "second", limits, fallbacks)
    stats["stopped_early"] = m.timed_out or result is None
    stats["nodes"] = m.nodes
    return best if result is None else result   # the second solve only breaks the first's ties


def _where(gp: GroupProblem) -> str:
    return f"the sharding ILP of the {len(gp.nodes)} ops from {gp.nodes[0].name}"


def _run(m: _Model, gp: GroupProblem, objective: pulp.LpAffineExpression, stage: str, limits: ILPLimits,
         fallbacks: list[str]) -> Realised | None:
    """Solve with the first solver of :func:`lp_solvers` that succeeds; None when none does (each
    failure is described in ``fallbacks``)."""
    m.prob.setObjective(objective)
    failed: list[str] = []
    # the first solve is exact; the second stops within half a tie step or 0.01% of its optimum:
    # proving which of two layouts a few bytes (or picoseconds) apart is the smaller took hybrid
    # linear-attention layers of 1,000 ops hundreds of branch-and-bound nodes a second solve
    gaps = dict(gap_abs=SECOND_GAP_ABS, gap_rel=SECOND_GAP) if stage == "second" else {}
    for name, solver in lp_solvers(limits, **gaps):
        try:
            status = m.prob.solve(solver)
        except Exception as exc:  # noqa: BLE001 - a solver crash (pulp.PulpSolverError, OSError, ...) moves on
            failed.append(f"{name} raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        highs = getattr(m.prob, "solverModel", None)
        if name == "HiGHS" and highs is not None:
            m.nodes += int(highs.getInfo().mip_node_count)
        if m.prob.sol_status == pulp.LpSolutionIntegerFeasible:  # stopped at a limit with a solution
            m.timed_out = True
        elif pulp.LpStatus[status] != "Optimal":
            failed.append(f"{name} ended {pulp.LpStatus[status]}")
            continue
        if failed:
            fallbacks.append(f"{_where(gp)} ({stage} solve): {'; '.join(failed)}; {name} solved it")
        choice = [max(range(len(vs)), key=lambda j: (vs[j].varValue or 0.0, -j)) for vs in m.s]
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
