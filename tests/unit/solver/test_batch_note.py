"""A global batch whose factors cap data parallelism (63 = 3^2 x 7 on 8 devices: dp=1 only) is named in
the plan's notes, with the plan at the nearest batch that allows the largest degree ruled out, that
degree pinned (solver/batch.py); a batch that did not limit the choice adds no note."""

from __future__ import annotations

import pytest

from autopar import Cluster
from autopar.config import Precision
from autopar.solver import solve
from autopar.errors import InfeasiblePlanError
from autopar.solver.batch import batch_notes, factors
from autopar.solver.sharding_solver import ShardingSolver

A100 = Cluster.from_spec("1x8xA100-80GB")


@pytest.fixture(scope="module")
def sharding(plan_graph):
    return ShardingSolver(plan_graph, A100, Precision.for_device(A100.device.name))


@pytest.fixture(scope="module")
def at_63(plan_graph, sharding):
    return solve(plan_graph, A100, 63, sharding=sharding)[0]


def _batch_notes(plan):
    return [n for n in plan.notes if n.startswith("global batch")]


def test_factors():
    assert [factors(n) for n in (1, 2, 63, 64, 1000, 97)] == ["1", "2 (prime)", "3^2 x 7", "2^6", "2^3 x 5^3",
                                                                 "97 (prime)"]


def test_a_batch_with_few_factors_is_named_with_the_plan_a_nearby_batch_gets(plan_graph, sharding, at_63):
    plan = at_63
    at_64, _ = solve(plan_graph, A100, 64, fixed={"dp": 8}, sharding=sharding)
    assert plan.config.dp == 1 and at_64.throughput > plan.throughput
    (note,) = _batch_notes(plan)
    assert note.startswith("global batch 63 = 3^2 x 7 allows data parallelism dp=1 only (dp must divide the "
                           "global batch; these 8 devices also allow dp=2, 4, 8): a global batch of 64 (or 56; "
                           "multiples of 8) allows dp up to 8"), note
    assert f"at 64 the plan with dp=8 is {at_64.config.short()} at {at_64.mfu * 100:.1f}% MFU against " \
           f"{plan.mfu * 100:.1f}% here ({at_64.throughput / plan.throughput:.2g}x the samples/s)" in note
    assert not _batch_notes(solve(plan_graph, A100, 64, sharding=sharding)[0])   # 64 = 2^6 allows every dp


def test_no_note_when_the_batch_did_not_limit_the_choice(plan_graph, sharding):
    pinned, _ = solve(plan_graph, A100, 63, fixed={"tp": 8}, sharding=sharding)    # tp=8 leaves dp=1 alone
    assert pinned.config.dp == 1 and not _batch_notes(pinned)
    chosen, _ = solve(plan_graph, A100, 63, fixed={"dp": 1}, sharding=sharding)    # the user chose dp
    assert not _batch_notes(chosen)


def test_without_the_second_search_the_note_states_the_constraint_alone(plan_graph, at_63):
    """Under a time_limit solve does not search again (solve_at None); nor when nothing fits at the nearby
    batch with that dp: the note is the constraint alone."""
    fact = ("global batch 63 = 3^2 x 7 allows data parallelism dp=1 only (dp must divide the global batch; these 8 "
            "devices also allow dp=2, 4, 8): a global batch of 64 (or 56; multiples of 8) allows dp up to 8")

    def nothing_fits(batch, dp):   # solve_at(batch, the pinned dp)
        raise InfeasiblePlanError("no plan fits")

    for solve_at in (None, nothing_fits):
        assert batch_notes(plan_graph, A100, 63, {}, at_63, solve_at) == (fact,)


def test_no_note_when_the_larger_dp_would_not_be_faster(plan_graph, at_63):
    """The plan at the nearby batch with the ruled-out dp moves no more samples per second: no note."""
    assert batch_notes(plan_graph, A100, 63, {}, at_63, lambda batch, dp: at_63) == ()
