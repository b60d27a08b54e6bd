"""Compiled data parallelism ends a compiled region at each gradient bucket (ChunkModule.break_before, as
torch's DDPOptimizer splits a DDP model), so that a bucket is all-reduced while the layers before it
run their backward; and it trains exactly as the eager program does.

On 2 gloo ranks: the MLP (4 layers of 1024 x 1024, 17 MB of fp32 gradients) at dp=2, its buckets made
4 MB (the runtime's 25 MB would hold the whole model in one), eager and through ``torch.compile``
(aot_eager): the compiled program's chunk has regions starting at the buckets' first layers, dynamo
compiled one graph per region, and both programs' losses and parameters after 2 AdamW steps agree.
Each step makes one all-reduce per bucket and no other: the step's losses go in the last bucket's
(ParallelConfig.losses_ride_gradients), as DDP makes one collective per bucket. At these bucket sizes
each weight is alone in its bucket, reduced (and under ZeRO-1 broadcast after the step) with no flat
copy: ZeRO-1 trains as plain data parallelism does.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, make_plan  # noqa: E402

BASE = dict(dp=2, tp=1, pp=1, micro_batch_size=2, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)


def run(rank: int, world: int, plan_dict: dict, zero1_dict: dict) -> dict:
    import torch
    import torch._dynamo

    import autopar
    import autopar.runtime.data_parallel as data_parallel
    import autopar.runtime.optim as optim
    from harness import batches, fresh, loss_fn_of, shared_exports
    data = batches("mlp", 2, 4)
    out = {}
    for backend, plan in ((None, plan_dict), ("aot_eager", plan_dict), ("zero1", zero1_dict)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        whole = data_parallel.dp_bucket_bytes
        data_parallel.dp_bucket_bytes = optim.dp_bucket_bytes = lambda ranks, element_bytes: 4 * 2 ** 20
        try:
            with shared_exports("mlp"):   # the eager program's export, copied for the compiled one
                program = autopar.parallelize(fresh("mlp"), autopar.Plan.from_dict(plan),
                                              loss_fn=loss_fn_of("mlp"),
                                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                              compile=backend if backend != "zero1" else False)
        finally:
            data_parallel.dp_bucket_bytes = optim.dp_bucket_bytes = whole
        calls, all_reduce = [], torch.distributed.all_reduce
        torch.distributed.all_reduce = lambda *args, **kwargs: calls.append(1) or all_reduce(*args, **kwargs)
        try:
            losses = [float(program.train_step(batch)) for batch in data]
        finally:
            torch.distributed.all_reduce = all_reduce
        out[backend or "eager"] = {
            "losses": losses, "buckets": len(program.reducers[0].buckets[0]), "all_reduces": len(calls) / len(data),
            "breaks": sorted(i for c in program.chunks.values() for i in c.breaks),
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            "params": {fqn: p.detach().clone() for fqn, p in program.params.items()}}
    return out


@pytest.fixture(scope="module")
def results():
    import worlds
    plan = make_plan(Case("mlp-dp2-buckets", "mlp", BASE, 2)).to_dict()
    zero1 = make_plan(Case("mlp-dp2-zero1-buckets", "mlp", {**BASE, "zero": 1}, 2)).to_dict()
    return worlds.world(2).run("test_compiled_buckets:run", plan, zero1)


def test_compiled_regions_start_at_buckets(results):
    for rank, got in enumerate(results):
        assert "error" not in got, got["error"]
        eager, compiled = got["eager"], got["aot_eager"]
        assert compiled["buckets"] >= 3 and len(compiled["breaks"]) >= 2, (rank, compiled["buckets"],
                                                                            compiled["breaks"])
        assert eager["breaks"] == [] and compiled["graphs"] > len(compiled["breaks"]), (rank, compiled)


def test_a_step_makes_one_all_reduce_per_bucket(results):
    for rank, got in enumerate(results):
        for mode in ("eager", "aot_eager"):
            assert got[mode]["all_reduces"] == got[mode]["buckets"], (rank, mode, got[mode]["all_reduces"])


def _trains_as(rank: int, want: dict, got: dict) -> None:
    """``got``'s run took ``want``'s losses (1e-6 relative) to ``want``'s parameters (1e-6)."""
    for a, b in zip(want["losses"], got["losses"]):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (rank, want["losses"], got["losses"])
    for fqn, p in want["params"].items():
        diff = (p - got["params"][fqn]).abs().max().item()
        assert diff <= 1e-6, (rank, fqn, diff)


def test_compiled_regions_train_as_eager(results):
    for rank, got in enumerate(results):
        _trains_as(rank, got["eager"], got["aot_eager"])


def test_tensors_alone_in_their_buckets_train_as_eager(results):
    """With 4 MB buckets each 1024 x 1024 weight is alone in its bucket, reduced (and, under ZeRO-1, broadcast
    after the step) as it is, with no flat copy (data_parallel.lone): ZeRO-1 trains as plain data parallelism."""
    for rank, got in enumerate(results):
        _trains_as(rank, got["eager"], got["zero1"])
