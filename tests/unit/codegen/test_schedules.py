"""Pipeline schedules as action lists: complete, deadlock-free, and in agreement with the cost
model's pipeline time and in-flight formulas (simulated, no communication)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import ConfigError, ParallelConfig
from autopar.cost_model.memory import chunk_passes, in_flight, interleaved_peak, least_passes
from autopar.cost_model.schedule import pipeline_time
from autopar.runtime.schedules import Action, build, check, format_schedule, simulate

CASES = ([("gpipe", p, m, 1) for p in range(2, 7) for m in range(1, 13)]
         + [("1f1b", p, m, 1) for p in range(1, 7) for m in range(1, 13)]
         + [("interleaved", p, m, v) for p in range(2, 6) for v in (2, 3, 4) for m in range(p, 13, p)])


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_complete_deadlock_free_and_matches_cost_model(kind, p, m, v):
    schedule = build(kind, p, m, v)
    check(schedule, m, v)
    sim = simulate(schedule, v, lambda a: (1.0 if a.kind == "F" else 2.0) / v)
    # balanced chunks: the simulated makespan is the cost model's pipeline time exactly
    assert sim.makespan == pytest.approx(pipeline_time([3.0] * p, m, kind, v).total, rel=1e-12)
    cfg = ParallelConfig(pp=p, schedule=kind, virtual_stages=v)
    assert list(sim.peak_in_flight) == [in_flight(cfg, d, m) for d in range(p)]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 6), groups=st.integers(1, 3), v=st.integers(2, 4),
       sizes=st.lists(st.floats(0.0, 10.0), min_size=4, max_size=4))
def test_interleaved_peak_is_the_runtime_orders_peak(p, groups, v, sizes):
    """The cost model's interleaved activation peak, for chunks of unequal sizes (the head's chunk
    holds the logits), is the most the runtime's action order holds at once on every device, and
    at least memory.chunk_passes passes of each chunk."""
    m, sizes = groups * p, sizes[:v]
    cfg = ParallelConfig(pp=p, schedule="interleaved", virtual_stages=v)
    for d, actions in enumerate(build("interleaved", p, m, v)):
        held = peak = 0.0
        for a in actions:
            held += sizes[a.stage // p] if a.kind == "F" else -sizes[a.stage // p]
            peak = max(peak, held)
        assert interleaved_peak(cfg, d, m, sizes) == pytest.approx(peak, rel=1e-12, abs=1e-12)
        # the search's memory bounds: whatever the chunks' sizes, at least chunk_passes of each
        held = sum(k * size for k, size in zip(chunk_passes(cfg, d, m), sizes))
        assert peak >= held * (1 - 1e-12) - 1e-12
        assert held >= least_passes(cfg, d, m) * sum(sizes) * (1 - 1e-12) - 1e-12
        if len(set(sizes)) == 1:   # equal chunks: in_flight passes of one chunk
            assert interleaved_peak(cfg, d, m, sizes) == pytest.approx(in_flight(cfg, d, m) * sizes[0])


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(2, 6), m=st.integers(1, 12),
       work=st.lists(st.floats(0.1, 5.0), min_size=6, max_size=6))
def test_unbalanced_stages_never_exceed_the_formula(kind, p, m, work):
    """For unequal stages (m - 1) max x + sum x is an upper bound of the simulated makespan (it is
    exact when the slowest stage is last; a slow early stage lets later ones catch up)."""
    work = work[:p]
    sim = simulate(build(kind, p, m), 1, lambda a: work[a.stage] * (1 / 3 if a.kind == "F" else 2 / 3))
    assert sim.makespan <= pipeline_time(work, m, kind, 1).total * (1 + 1e-9)


def test_formula_is_pessimistic_for_a_slow_first_stage():
    """Measured by simulation: stages of work (2, 1), 2 micro-batches: 4.33 vs the formula's 5."""
    sim = simulate(build("1f1b", 2, 2), 1, lambda a: (2.0, 1.0)[a.stage] * (1 / 3 if a.kind == "F" else 2 / 3))
    assert sim.makespan == pytest.approx(13 / 3)
    assert pipeline_time([2.0, 1.0], 2, "1f1b", 1).total == pytest.approx(5.0)


def test_deadlock_is_found_and_named():
    good = build("1f1b", 2, 2)
    # device 1 runs its backward of micro-batch 0 before the forward it needs
    swapped = (good[0], (Action(1, "B", 0), Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1)))
    with pytest.raises(ConfigError, match=r"deadlocks: .*device 1 waits at B1\.0"):
        check(swapped, 2)


def test_incomplete_or_misplaced_schedules_are_refused():
    good = build("gpipe", 2, 2)
    with pytest.raises(ConfigError, match="missing"):
        check((good[0][:-1], good[1]), 2)
    with pytest.raises(ConfigError, match="does not hold"):
        check((good[1], good[0]), 2)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="multiple of pp"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="not one of"):
        build("zigzag", 2, 4)
    with pytest.raises(ConfigError, match="needs schedule='interleaved'"):
        build("1f1b", 2, 4, 2)


def test_printable():
    text = format_schedule(build("1f1b", 2, 3))
    assert text.splitlines()[0] == "device 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2"
    assert text.splitlines()[1] == "device 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2"


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(2, 6), m=st.integers(1, 12),
       work=st.lists(st.floats(0.1, 5.0), min_size=6, max_size=6))
def test_formula_is_exact_when_the_slowest_stage_is_last(kind, p, m, work):
    work = work[:p]
    work = [x for x in work if x != max(work)] + [max(work)] * work.count(max(work))
    sim = simulate(build(kind, p, m), 1, lambda a: work[a.stage] * (1 / 3 if a.kind == "F" else 2 / 3))
    assert sim.makespan == pytest.approx(pipeline_time(work, m, kind, 1).total, rel=1e-9)
