"""The vocabulary-parallel losses (codegen/shard_ops.py) against single-process ``F.cross_entropy`` and
``F.nll_loss``, on the session's 4 gloo ranks (worlds.py), each holding a quarter of the classes.

Every case builds the same full logits, targets and upstream gradient from a seed on every rank, runs
the reference on the whole, runs the parallel loss on this rank's columns, and records the largest
difference of the loss and of the gradient of its columns: every reduction, ``ignore_index`` (targets
of -100 and of a class id), label smoothing, logits of shape ``[N, C]``, ``[N, C, d]`` and ``[C]``, a
shard whose logits are all ``-inf`` for some rows (a padded vocabulary's masked tail: the rows' loss
and gradient stay finite), and logits far from 0 (the combine of the ranks' exponential sums rescales
each by its own max). Tolerance 1e-5 relative to the reference's largest value, float32.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from autopar.codegen import shard_ops  # noqa: E402

CLASSES = 16
TOL = 1e-5
REDUCTIONS = {"mean": shard_ops.MEAN, "sum": shard_ops.SUM, "none": shard_ops.NONE}


@dataclass(frozen=True)
class Case:
    loss: str            # cross_entropy | nll
    reduction: str       # mean | sum | none
    shape: str           # rows ([N, C]) | spatial ([N, C, d]) | single ([C])
    ignore: int = -100   # ignore_index; some targets equal it
    smoothing: float = 0.0
    masked: bool = False  # the last rank's classes are -inf in half the rows
    offset: float = 0.0  # added to every logit

    @property
    def name(self) -> str:
        extra = (f"-ignore{self.ignore}" if self.ignore != -100 else "") + (f"-smooth{self.smoothing}" if self.smoothing
                                                                            else "")
        extra += ("-masked" if self.masked else "") + (f"-offset{self.offset:g}" if self.offset else "")
        return f"{self.loss}-{self.reduction}-{self.shape}{extra}"


CASES = ([Case("cross_entropy", r, s) for r in REDUCTIONS for s in ("rows", "spatial", "single")]
         + [Case("nll", r, s) for r in REDUCTIONS for s in ("rows", "spatial")]
         + [Case("cross_entropy", "mean", "rows", ignore=3), Case("cross_entropy", "mean", "rows", smoothing=0.1),
            Case("cross_entropy", "sum", "spatial", smoothing=0.2, ignore=5),
            Case("cross_entropy", "mean", "rows", masked=True), Case("cross_entropy", "none", "rows", masked=True),
            Case("cross_entropy", "mean", "rows", offset=1000.0),
            Case("cross_entropy", "mean", "spatial", offset=-500.0)])


def make_inputs(case: Case) -> dict:
    g = torch.Generator().manual_seed(len(case.name))
    shape = {"rows": (12, CLASSES), "spatial": (3, CLASSES, 5), "single": (CLASSES,)}[case.shape]
    logits = torch.randn(shape, generator=g) * 3 + case.offset
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    target = torch.randint(0, CLASSES, tshape, generator=g)
    if target.dim():
        target.view(-1)[::4] = case.ignore   # every fourth target ignored
    if case.masked:   # the last quarter of the classes masked out in every other row; no target there
        rows = torch.arange(shape[0]) % 2 == 0
        logits[rows, -CLASSES // 4:] = float("-inf")
        target[rows] = torch.where(target[rows] >= CLASSES - CLASSES // 4, 0, target[rows])
    if case.loss == "nll":
        logits = logits.log_softmax(1 if len(shape) > 1 else 0)
    out_shape = tshape if case.reduction == "none" else ()
    return dict(logits=logits, target=target, grad=torch.randn(out_shape, generator=g))


def reference(case: Case, inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x = inp["logits"].clone().requires_grad_()
    if case.loss == "nll":
        out = F.nll_loss(x, inp["target"], reduction=case.reduction, ignore_index=case.ignore)
    else:
        out = F.cross_entropy(x, inp["target"], reduction=case.reduction, ignore_index=case.ignore,
                              label_smoothing=case.smoothing)
    out.backward(inp["grad"])
    return out.detach(), x.grad


def parallel(case: Case, inp: dict, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    dim = 1 if inp["logits"].dim() > 1 else 0
    x = inp["logits"].chunk(world, dim)[rank].clone().requires_grad_()
    reduction = REDUCTIONS[case.reduction]
    if case.loss == "nll":
        out = shard_ops.vocab_nll(x, inp["target"], None, reduction, case.ignore)
    else:
        out = shard_ops.vocab_cross_entropy(x, inp["target"], None, reduction, case.ignore, case.smoothing)
    out.backward(inp["grad"])
    return out.detach(), x.grad


def case_errors(case: Case, rank: int, world: int) -> dict:
    inp = make_inputs(case)
    want, want_grad = reference(case, inp)
    got, grad = parallel(case, inp, rank, world)
    dim = 1 if inp["logits"].dim() > 1 else 0
    want_grad = want_grad.chunk(world, dim)[rank]
    scale = max(want.abs().max().item(), 1.0)
    return {"finite": bool(got.isfinite().all() and grad.isfinite().all()),
            "loss": (got - want).abs().max().item() / scale,
            "grad": (grad - want_grad).abs().max().item() / max(want_grad.abs().max().item(), 1e-30)}


def run_all(rank: int, world: int) -> dict:
    """Every case on this rank of the session's world: name -> errors."""
    results = {}
    for case in CASES:
        try:
            results[case.name] = case_errors(case, rank, world)
        except Exception as exc:
            results[case.name] = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return results


@pytest.fixture(scope="module")
def spawned():
    import worlds
    return worlds.world(4).run("test_vocab_losses:run_all")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vocab_parallel_loss_matches_one_process(spawned, case):
    for rank, res in enumerate(spawned):
        errs = res[case.name]
        assert "error" not in errs, errs["error"]
        assert errs["finite"], f"rank {rank}: a loss or gradient is not finite"
        assert errs["loss"] <= TOL and errs["grad"] <= TOL, (rank, errs)


def test_cases_are_distinct():
    assert len({c.name for c in CASES}) == len(CASES)
