"""A rank that dies or goes silent makes the others fail within the timeout, naming it and the step;
a non-finite loss stops the step on every rank; plans for another world size or another model are
refused."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import FAILURE_TIMEOUT, Case, make_plan, run_failure, run_kill  # noqa: E402

PP2 = dict(dp=1, tp=1, pp=2, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
           sequence_parallel=False)

SLACK = 20.0   # seconds past the timeout a loaded machine may take (a test must not fail on a slow machine)


@pytest.fixture(scope="module")
def plan():
    return make_plan(Case("failure", "gpt", PP2, 2))


@pytest.mark.parametrize("mode", ["silent", "dead"])
def test_peer_failure_is_named_within_the_timeout(plan, mode):
    out = run_failure(plan, mode)
    assert out["step"].startswith("RuntimeFailure: rank 0, step 0:"), out["step"]
    assert "rank 1" in out["step"] and ("receive" in out["step"] or "send" in out["step"]), out["step"]
    # silent: the wait itself times out; dead: the broken connection is seen at once. Either way
    # after about the timeout plus the step's own work (well under a second on an idle machine);
    # the bound leaves a loaded machine room, and is still far below a wait without a deadline.
    assert out["seconds"] <= FAILURE_TIMEOUT + SLACK, out["seconds"]
    assert out["world"].startswith("PlanMismatchError") and "4 devices" in out["world"] and "2 ranks" in out["world"]
    assert out["fingerprint"].startswith("PlanMismatchError") and "fingerprint" in out["fingerprint"]


DP2_PP2 = dict(PP2, dp=2)


def test_killed_rank_fails_every_other_rank_within_the_timeout():
    """4 gloo ranks (dp=2 x pp=2 MLP); rank 3 dies by os._exit in the middle of step 2."""
    survivors = run_kill(make_plan(Case("kill", "mlp", DP2_PP2, 4)))
    for out in survivors:
        rank = out["rank"]
        # step 1: sample 3 is NaN, i.e. micro-batch 1 of replica 1; every rank refuses the step alike
        assert out["nan"].startswith(f"RuntimeFailure: rank {rank}, step 1: the loss of micro-batch 1 of "
                                     "data-parallel replica 1 (samples 3..3 of the global batch) is nan"), out["nan"]
        assert out["unchanged"], f"rank {rank}: the parameters changed in a step with a NaN loss"
        # step 2: every survivor raises RuntimeFailure naming itself, the step and a peer, within the timeout
        assert out["kill"].startswith(f"RuntimeFailure: rank {rank}, step 2:"), out["kill"]
        assert "rank" in out["kill"].split(":", 2)[2], out["kill"]
        assert out["seconds"] <= FAILURE_TIMEOUT + SLACK, (rank, out["seconds"], out["kill"])
