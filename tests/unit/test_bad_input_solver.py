"""Solver limits and failures: time and node limits are honoured, an ILP solver that fails falls
back to the next one and then to greedy sharding, and the plan says what happened."""

from __future__ import annotations

import pulp
import pytest

from autopar import Cluster, ConfigError
from autopar.capture import capture
from autopar.models import GPTConfig, build_gpt
from autopar.solver import plan_search, search, sharding, sharding_solver, solve
from autopar.solver.sharding import ILPLimits, greedy_choice, lp_solvers

TWO = Cluster.from_spec("1x2xA100-80GB")


@pytest.fixture(scope="module")
def tiny():
    model, inputs = build_gpt(GPTConfig(vocab_size=64, hidden=64, heads=4, layers=2, seq_len=16), batch_size=1,
                              device="meta")
    return capture(model, inputs)


class Broken:
    """A solver that crashes the way a missing or broken binary does."""

    def solve(self, model, objective):
        raise pulp.PulpSolverError("Pulp: Error while executing broken-solver")


class GivesUp:
    """A solver that ends without a solution."""

    def solve(self, model, objective):
        return "Not Solved", None, 0


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(time=0), ("ilp_time_limit=0", "positive")),
    (dict(nodes=0), ("ilp_node_limit=0", "positive integer")),
    (dict(nodes=2.5), ("ilp_node_limit=2.5",)),
])
def test_limits_validated(kwargs, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        ILPLimits(**kwargs)
    assert all(f in str(info.value) for f in fragments), str(info.value)


def test_node_limit_reaches_the_solver(tiny) -> None:
    """The node limit is passed to every solver (HiGHS mip_max_nodes, CBC maxNodes) with no wall-clock
    limit unless one is asked for, and the plan still comes out whole."""
    solvers = dict(lp_solvers(ILPLimits(time=3.0, nodes=1)))
    assert "maxNodes 1" in solvers["CBC"].command.getOptions() and solvers["CBC"].timeLimit == 3.0   # its command
    assert solvers["HiGHS"].options["mip_max_nodes"] == 1 and solvers["HiGHS"].options["time_limit"] == 3.0
    assert all(s.timeLimit is None for _, s in lp_solvers())   # by default: work, not the clock
    plan, _ = solve(tiny, TWO, 4, fixed={"tp": 2}, ilp_node_limit=1)
    assert plan.config.tp == 2 and plan.fits and plan.sharding


def test_broken_solver_falls_back_to_the_next(tiny, monkeypatch) -> None:
    real = lp_solvers
    monkeypatch.setattr(sharding, "lp_solvers", lambda limits=ILPLimits(), **kw: [("Broken", Broken())] + real(limits, **kw))
    plan, stats = solve(tiny, TWO, 4, fixed={"tp": 2})
    fallbacks = [n for n in plan.notes if n.startswith("sharding ILP fallback:")]
    nxt = real()[0][0]
    assert fallbacks and all("Broken raised PulpSolverError" in n and f"{nxt} solved it" in n for n in fallbacks)
    assert plan.optimal is True   # CBC proved its solutions optimal
    reference, _ = solve(tiny, TWO, 4, fixed={"tp": 2})
    assert plan.step_time == pytest.approx(reference.step_time, rel=1e-12)


def test_cbc_alone_gives_the_layouts_highs_gives(tiny, monkeypatch) -> None:
    """CBC (the fallback: the same arrays rebuilt as a pulp model) proves the same optima: the same
    step time to the second solve's tolerance on the first criterion (1e-6), and optimal."""
    real = lp_solvers
    monkeypatch.setattr(sharding, "lp_solvers", lambda limits=ILPLimits(), **kw: [s for s in real(limits, **kw)
                                                                                  if s[0] == "CBC"])
    plan, stats = solve(tiny, TWO, 4, fixed={"tp": 2})
    monkeypatch.undo()
    reference, _ = solve(tiny, TWO, 4, fixed={"tp": 2})
    assert plan.optimal is True and stats.ilp_solves > 0 and not stats.ilp_fallbacks
    assert plan.step_time == pytest.approx(reference.step_time, rel=1e-6)


@pytest.mark.parametrize("solver", [Broken(), GivesUp()], ids=["raises", "no-solution"])
def test_every_solver_failing_falls_back_to_greedy(tiny, monkeypatch, solver) -> None:
    monkeypatch.setattr(sharding, "lp_solvers", lambda limits=ILPLimits(), **kw: [("Only", solver)])
    plan, stats = solve(tiny, TWO, 4, fixed={"tp": 2})
    assert plan.fits and plan.config.tp == 2 and plan.sharding
    assert plan.optimal is False and stats.ilp_stopped_early > 0
    assert any("every ILP solver failed, sharded greedily" in n for n in plan.notes), plan.notes
    assert any("not proven optimal" in n for n in plan.notes)


def test_greedy_choice_is_a_valid_layout(tiny) -> None:
    """Greedy picks one strategy per op that every edge can join; never cheaper than the ILP."""
    solver = sharding_solver.ShardingSolver(tiny, TWO, plan_search.Precision())
    for sol in solver.solutions(2, "fast"):
        choice = greedy_choice(sol.problem, "fast")
        greedy = sharding.realise(sol.problem, choice)
        ilp = sol.result
        assert greedy.time + greedy.step >= (ilp.time + ilp.step) * (1 - 1e-9)


def test_time_limit_with_greedy_layouts(tiny) -> None:
    """Stopped at once: not optimal, the layouts greedy (the ILPs had no time), no gap claimed."""
    plan, stats = solve(tiny, Cluster.from_spec("1x8xA100-80GB"), 64, fixed={"tp": 2}, time_limit=1e-9)
    assert stats.timed_out and plan.optimal is False and plan.gap is None
    assert stats.ilp_greedy > 0 and plan.extra["search"]["ilp_sharded_greedily"] == stats.ilp_greedy
    assert plan.config.tp == 2 and plan.fits
    assert any("stopped at time_limit" in n for n in plan.notes), plan.notes


class Clock:
    """search.py's clock, advanced one second by each call of one Search method only."""

    def __init__(self, monkeypatch, method: str) -> None:
        self.now = 0.0
        monkeypatch.setattr(search, "time", self)
        real = getattr(search.Search, method)

        def ticking(searcher, *args):
            self.now += 1.0
            return real(searcher, *args)
        monkeypatch.setattr(search.Search, method, ticking)

    def perf_counter(self) -> float:
        return self.now


def test_time_limit_gives_the_gap(tiny, monkeypatch) -> None:
    """Every candidate bounded and every layout an ILP optimum, the search stopped after one
    evaluation: the gap bounds how far the plan is from the optimum."""
    Clock(monkeypatch, "evaluate")
    monkeypatch.setattr(plan_search, "ShardingSolver",
                        lambda *args, deadline=None, **kwargs: sharding_solver.ShardingSolver(*args, **kwargs))
    cluster = Cluster.from_spec("1x8xA100-80GB")
    quick, stats = solve(tiny, cluster, 64, time_limit=0.5)
    monkeypatch.undo()
    full, full_stats = solve(tiny, cluster, 64)
    assert full_stats.evaluated > 1   # else stopping after one evaluation cuts nothing short
    assert stats.timed_out and stats.evaluated == 1 and not stats.unbounded and quick.optimal is False
    assert quick.gap is not None and 0.0 <= quick.gap < 1.0
    assert full.step_time >= quick.step_time * (1 - quick.gap) * (1 - 1e-9)   # the gap is a true bound
    assert any("faster under the cost model" in n for n in quick.notes), quick.notes


def test_time_limit_while_bounding(tiny, monkeypatch) -> None:
    """The limit passing before every candidate has its bound: the rest are left out, no gap. The
    space is bounded a branch (a mesh and micro-batch) at a time, the clock ticking once per branch; branches
    stop joining the queue at search.BOUNDING_SHARE of the limit (the rest is the first plan's)."""
    clock = Clock(monkeypatch, "_branch_parts")
    plan, stats = solve(tiny, Cluster.from_spec("1x8xA100-80GB"), 64, time_limit=2.5 / search.BOUNDING_SHARE)
    assert stats.unbounded and stats.timed_out and plan.optimal is False and plan.gap is None
    assert clock.now == 3.0 and plan.fits   # three branches: the third passed 2.5 s, the rest left out
    monkeypatch.undo()
    assert stats.candidates < solve(tiny, Cluster.from_spec("1x8xA100-80GB"), 64)[1].candidates


@pytest.mark.parametrize("limit", [0, -1.0, "10s", True])
def test_time_limit_validated(tiny, limit) -> None:
    with pytest.raises(ConfigError, match=f"time_limit={limit!r}"):
        solve(tiny, TWO, 4, time_limit=limit)


def test_a_model_met_again_is_answered_without_solving(tiny, monkeypatch) -> None:
    """HiGHS under a node limit alone is deterministic: a model it solved before in this process (the same
    arrays, objective and options) is answered from memory with the same layouts; with a wall-clock limit
    every model is solved anew (its answer depends on the clock). Models the search's second process solved
    (ShardingSolver.prefetch) come back into this process's memory."""
    import highspy

    from autopar.solver import ilp_solvers, sharding_solver
    monkeypatch.setattr(ilp_solvers, "_SOLVED", type(ilp_solvers._SOLVED)())
    ahead, _ = solve(tiny, TWO, 4, fixed={"tp": 2})   # its layouts solved in a second process
    sent_back = set(ilp_solvers._SOLVED)
    # the same in this process alone (no fork: nothing is solved ahead), counting HiGHS's runs
    monkeypatch.setattr(sharding_solver.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    monkeypatch.setattr(ilp_solvers, "_SOLVED", type(ilp_solvers._SOLVED)())
    runs = []
    real_run = highspy.Highs.run
    monkeypatch.setattr(highspy.Highs, "run", lambda self: runs.append(1) or real_run(self))
    first, stats = solve(tiny, TWO, 4, fixed={"tp": 2})
    solved = len(runs)
    assert solved > 0 and len(ilp_solvers._SOLVED) == solved and set(ilp_solvers._SOLVED) == sent_back
    assert first.sharding == ahead.sharding and first.step_time == ahead.step_time
    again, stats_again = solve(tiny, TWO, 4, fixed={"tp": 2})
    assert len(runs) == solved and stats_again.ilp_solves == stats.ilp_solves
    assert again.sharding == first.sharding and again.step_time == first.step_time
    solve(tiny, TWO, 4, fixed={"tp": 2}, ilp_time_limit=30.0)
    assert len(runs) >= 2 * solved
