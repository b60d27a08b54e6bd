"""The vocabulary-parallel losses (runtime/shard_ops.py) against the single-process aten op, for every op of
the op table's ``VOCAB_LOSSES`` (the losses the solver offers it for), on the session's 4 gloo ranks
(worlds.py), each holding a quarter of the classes.

Every case builds the same full logits, targets and upstream gradient from a seed on every rank, runs
the aten op on the whole, runs the parallel loss on this rank's columns as the lowering calls it (the
table's form, ``shard_ops.VOCAB_LOSS_FORMS``, with the op's arguments by name), and records the largest
difference of the loss and of the gradient of its columns: every reduction, ``ignore_index`` (targets
of -100 and of a class id), label smoothing, logits of shape ``[N, C]``, ``[N, C, d]``, ``[N, C, h, w]``
(``nll_loss2d``) and ``[C]``, a
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

sys.path.insert(0, os.path.dirname(__file__))

from autopar import ops  # noqa: E402
from autopar.runtime import shard_ops  # noqa: E402

CLASSES = 16
TOL = 1e-5
REDUCTIONS = {"mean": shard_ops.MEAN, "sum": shard_ops.SUM, "none": shard_ops.NONE}


@dataclass(frozen=True)
class Case:
    loss: str            # the aten op, one of ops.VOCAB_LOSSES
    reduction: str       # mean | sum | none
    shape: str           # rows ([N, C]) | spatial ([N, C, d]) | image ([N, C, h, w]) | single ([C])
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


CE = "cross_entropy_loss"
CASES = ([Case(CE, r, s) for r in REDUCTIONS for s in ("rows", "spatial", "single")]
         + [Case("nll_loss", r, "rows") for r in REDUCTIONS] + [Case("nll_loss_nd", r, "spatial") for r in REDUCTIONS]
         + [Case("nll_loss2d", r, "image") for r in REDUCTIONS]
         + [Case(CE, "mean", "rows", ignore=3), Case(CE, "mean", "rows", smoothing=0.1),
            Case(CE, "sum", "spatial", smoothing=0.2, ignore=5), Case(CE, "mean", "image"),
            Case(CE, "mean", "rows", masked=True), Case(CE, "none", "rows", masked=True),
            Case(CE, "mean", "rows", offset=1000.0), Case(CE, "mean", "spatial", offset=-500.0)])


def make_inputs(case: Case) -> dict:
    g = torch.Generator().manual_seed(len(case.name))
    shape = {"rows": (12, CLASSES), "spatial": (3, CLASSES, 5), "image": (2, CLASSES, 3, 4),
             "single": (CLASSES,)}[case.shape]
    logits = torch.randn(shape, generator=g) * 3 + case.offset
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    target = torch.randint(0, CLASSES, tshape, generator=g)
    if target.dim():
        target.view(-1)[::4] = case.ignore   # every fourth target ignored
    if case.masked:   # the last quarter of the classes masked out in every other row; no target there
        rows = torch.arange(shape[0]) % 2 == 0
        logits[rows, -CLASSES // 4:] = float("-inf")
        target[rows] = torch.where(target[rows] >= CLASSES - CLASSES // 4, 0, target[rows])
    if ops.VOCAB_LOSSES[case.loss].form == "nll":
        logits = logits.log_softmax(1 if len(shape) > 1 else 0)
    out_shape = tshape if case.reduction == "none" else ()
    return dict(logits=logits, target=target, grad=torch.randn(out_shape, generator=g))


def arguments(case: Case, logits: torch.Tensor, target: torch.Tensor) -> tuple:
    """The case's aten op and its arguments by schema name, as the lowering binds them."""
    op = getattr(torch.ops.aten, case.loss).default
    given = {"self": logits, "target": target, "reduction": REDUCTIONS[case.reduction], "ignore_index": case.ignore,
             "label_smoothing": case.smoothing}
    return op, {a.name: given[a.name] for a in op._schema.arguments if a.name in given}


def reference(case: Case, inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x = inp["logits"].clone().requires_grad_()
    op, args = arguments(case, x, inp["target"])
    out = op(x, inp["target"], **{k: v for k, v in args.items() if k not in ("self", "target")})
    out.backward(inp["grad"])
    return out.detach(), x.grad


def parallel(case: Case, inp: dict, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    dim = 1 if inp["logits"].dim() > 1 else 0
    x = inp["logits"].chunk(world, dim)[rank].clone().requires_grad_()
    fn, rest = shard_ops.VOCAB_LOSS_FORMS[ops.VOCAB_LOSSES[case.loss].form]
    _, args = arguments(case, x, inp["target"])
    out = fn(x, inp["target"], None, *(args[k] for k in rest))
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


def test_every_vocab_loss_of_the_table_has_cases():
    assert {c.loss for c in CASES} == set(ops.VOCAB_LOSSES)
