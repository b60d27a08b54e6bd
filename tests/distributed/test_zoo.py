"""parallelize(model, plan) on the hand-written zoo models (BERT, T5, Mixtral) computes what one process computes.

The models are the registry's bert-tiny, t5-tiny and mixtral-tiny, shrunk further (vocabulary 128,
8 tokens) with dropout 0 (a rank's dropout masks differ from one process's) and, for Mixtral,
``capacity_factor=None``: with a capacity the tokens an expert drops depend on how many tokens one
forward call sees, so any split of the batch (data, pipeline micro-batches) changes the loss.

All cases run on the session's 2 gloo ranks (worlds.py; 4 would oversubscribe a 2-core machine): pinned
layouts per model, and one plan per model that ``autopar.plan`` picks freely for
``Cluster.from_spec("1x2xcpu")``. Each case is compared with one process by the harness
(tests/distributed/harness.py): loss and gradients of step 1, parameters after two AdamW steps.

Tolerances, all fp32, the same as test_parallelize.py's and for the same reasons:

- loss: relative error <= 1e-5. Only the order of additions differs (micro-batch means averaged,
  all-reduces, partial sums of split matmuls), which moves an fp32 loss by a few ulps; observed
  <= 2e-7.
- gradients: max |difference| <= 1e-4 of the largest gradient, for the same reason; observed
  <= 5e-7 of it.
- parameters after two AdamW steps (lr 1e-3, eps 1e-4: harness.EPS): max |difference| <= 1e-4, i.e. 5% of the most
  two steps can move a parameter (2 lr); AdamW normalises each element's update, so a
  rounding-level difference on an element whose gradient is near zero moves it by a fraction of lr;
  observed <= 4e-5 (Mixtral tp=2).

The harness looks models and batches up by name (``MODELS``, ``batches``); :func:`register` adds
the zoo's to it, in this process (undone after the module) and in every spawned rank (before the
harness's worker runs).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
from harness import Case, reference  # noqa: E402
from suite import ALL_CASES  # noqa: E402

LOSS_RTOL = 1e-5
GRAD_TOL = 1e-4      # of the largest reference gradient
PARAM_ATOL = 1e-4

VOCAB, SEQ, DECODER_SEQ = 128, 8, 8


def _config(name: str, **changes):
    from autopar.models.registry import spec
    return dataclasses.replace(spec(name).config, vocab_size=VOCAB, seq_len=SEQ, **changes)


def _bert():
    from autopar.models import BERT
    torch.manual_seed(0)
    return BERT(_config("bert-tiny", dropout=0.0))


def _t5():
    from autopar.models import T5
    torch.manual_seed(0)
    return T5(_config("t5-tiny", decoder_seq_len=DECODER_SEQ, dropout=0.0))


def _mixtral():
    from autopar.models import Mixtral
    torch.manual_seed(0)
    return Mixtral(_config("mixtral-tiny", capacity_factor=None))


ZOO = {"bert-tiny": _bert, "t5-tiny": _t5, "mixtral-tiny": _mixtral}


def zoo_batches(model_name: str, n: int, global_batch: int) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``global_batch`` rows for a zoo model (the harness's for any other name)."""
    if model_name not in ZOO:
        return _HARNESS_BATCHES(model_name, n, global_batch)
    from autopar.models.bert import mlm_labels
    from autopar.models.t5 import shift_right
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
        if model_name == "bert-tiny":
            # A quarter of the positions predicted, the same number in every row, so that the mean
            # over predicted positions of a shard of rows averages to the whole batch's.
            out.append({"input_ids": ids, "labels": mlm_labels(ids, 0.25)})
        elif model_name == "t5-tiny":
            labels = torch.randint(0, VOCAB, (global_batch, DECODER_SEQ), generator=g)
            out.append({"input_ids": ids, "decoder_input_ids": shift_right(labels), "labels": labels})
        else:
            out.append({"input_ids": ids, "labels": torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)})
    return out


_HARNESS_BATCHES = harness.batches


def register(setattr_=setattr) -> None:
    """Make the harness know the zoo models (``setattr_``: a MonkeyPatch's, to undo it)."""
    setattr_(harness, "MODELS", {**harness.MODELS, **ZOO})
    setattr_(harness, "batches", zoo_batches)


BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
PINNED = {
    "bert-tiny": {"dp2": dict(dp=2), "tp2_sp": dict(tp=2, micro_batch_size=2, sequence_parallel=True)},
    "t5-tiny": {"pp2_1f1b": dict(pp=2),   # 4 micro-batches of 1
                "tp2": dict(tp=2, micro_batch_size=2)},
    "mixtral-tiny": {"tp2": dict(tp=2, micro_batch_size=2), "dp2_zero3": dict(dp=2, zero=3)},
}
# The batch is a dimension of the program, not a constant of the plan: plans made from example inputs
# of one batch size run at micro-batches of another (the rank exports at its micro-batch; the lowering
# re-derives what a merged batch dim means there). make bench sweeps example x micro-batch over
# {1, 2, 3, 8}^2 (AUTOPAR_ALL_CASES=1); the suite runs a sample of the pairs that differ.
BATCH_SWEEP = {"mixtral-tiny-tp2": ("mixtral-tiny", dict(tp=2), 1), "t5-tiny-pp2": ("t5-tiny", dict(pp=2), 2)}
SIZES = (1, 2, 3, 8)
PAIRS = [(e, m) for e in SIZES for m in SIZES] if ALL_CASES else \
    [(1, 3), (3, 2), (8, 1)]
CASES = [Case(f"{m}-{k}", m, {**BASE, **v}, 2) for m, kinds in PINNED.items() for k, v in kinds.items()] \
    + [Case(f"{m}-planner", m, None, 2) for m in ZOO] \
    + [Case(f"{name}-example{e}-micro{mb}", model, {**BASE, **cfg, "micro_batch_size": mb}, 2,
            global_batch=mb * per_replica, example_batch=e)
       for name, (model, cfg, per_replica) in BATCH_SWEEP.items() for e, mb in PAIRS]


def make_plan(case: Case):
    """The harness's plan for a pinned case; for a free one, autopar.plan on a plain 1x2xcpu cluster."""
    if case.fixed is not None:
        return harness.make_plan(case)
    import autopar
    from autopar.runtime.batches import slice_batch
    example = slice_batch(zoo_batches(case.model, 1, case.global_batch)[0], 0, 1, case.global_batch)
    return autopar.plan(ZOO[case.model](), autopar.Cluster.from_spec(f"1x{case.world}xcpu"), example,
                        global_batch_size=case.global_batch, verbose=False)


def run_case(rank: int, world: int, case: Case, plan_dict: dict) -> dict:
    """The harness's case on a rank that knows the zoo models."""
    register()
    return harness.run_case(rank, world, case, plan_dict)


@pytest.fixture(scope="module")
def zoo():
    with pytest.MonkeyPatch.context() as mp_:
        register(mp_.setattr)
        yield


@pytest.fixture(scope="module")
def plans(zoo):
    return {}


@pytest.fixture(scope="module")
def results(zoo, plans):
    """Per rank: case name -> the harness's result, from the session's 2-rank world (each case sent as
    soon as it is planned)."""
    def plan(case):
        plans[case.name] = make_plan(case)
        return plans[case.name]
    return harness.run_cases(CASES, 2, function="test_zoo:run_case", plan=plan)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_zoo_matches_single_process(zoo, plans, results, case):
    ref = reference(case)
    per_rank = [r[case.name] for r in results]
    for rank, got in enumerate(per_rank):
        assert "error" not in got, got.get("error")
        assert math.isclose(got["loss"], ref["loss"], rel_tol=LOSS_RTOL), (rank, got["loss"], ref["loss"])
        largest = max(g.abs().max().item() for g in ref["grads"].values())
        assert set(got["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            diff = (got["grads"][name] - g).abs().max().item()
            assert diff <= GRAD_TOL * largest, (rank, name, diff, largest)
        for name, p in ref["params"].items():
            diff = (got["params"][name] - p).abs().max().item()
            assert diff <= PARAM_ATOL, (rank, name, diff)
    # Pinned layouts only (as test_parallelize.py): the planner may choose a layout that splits nothing.
    if case.fixed and (case.fixed["tp"] > 1 or case.fixed["pp"] > 1 or case.fixed["zero"] == 3):
        total = sum(p.numel() for p in ref["params"].values())
        assert per_rank[0]["local_numel"] < total, "the rank holds every parameter whole: nothing was split"
