"""How a plan's loss was made (:class:`LossSource`), recorded in the plan and checked where it trains.

Capture exports the model down to a scalar loss (export.py's LossWrapper), made one of three ways:

- ``"model"``: the model's own loss (``output.loss``: a Hugging Face model given ``labels``), or a
  scalar the model returns;
- ``"loss_fn"``: ``loss_fn(output, inputs)``, named by its qualified name ``module:qualname``;
- ``"stand-in"``: the mean of the model's (first) floating output, when it returns no loss and no
  ``loss_fn`` was given. It costs about what a loss costs, so planning with it is fine; training on
  it is not (it minimises the output).

The plan records which (``Plan.loss``; null in plans written before it was). :func:`check_loss` is
the one check of it, made where a program would train: ``parallelize`` (against the loss the rank's
own export made) and ``codegen.emit`` (against the ``loss_fn`` it is given; the standalone folder
also against its export's). A stand-in, a missing ``loss_fn`` or another one is a
PlanMismatchError saying what to pass.
"""

from __future__ import annotations

from ..errors import PlanMismatchError
from ..plan.loss import EMIT, HOW_TO_PLAN, LOSS_FN, MODEL, STAND_IN, LossSource


def importable(name: str) -> bool:
    """Whether ``module:qualname`` is a module-level function a generated script can import."""
    module, _, qualname = name.partition(":")
    return module != "__main__" and qualname.isidentifier()


def check_loss(planned: LossSource | None, used: LossSource | None, *, to: str) -> None:
    """Refuse to train on a stand-in loss, or on a loss that is not the one the plan was made with.

    ``planned``: the plan's record (None: a plan written before it was recorded, where only a stand-in
    can be seen). ``used``: what training would use: ``LossSource.of(loss_fn)`` for a given loss_fn,
    the loss a program's export made (export.loss_source: it shows a stand-in), or None before export
    when no loss_fn was given (the model's output decides). ``to``: PARALLELIZE or EMIT, where the user
    passes the loss_fn, for the message."""
    fn = used.name if used is not None and used.kind == LOSS_FN else None   # the loss_fn given, if any
    if planned is not None and planned.kind == STAND_IN:
        fix = f"re-plan with loss_fn={fn}" if fn else HOW_TO_PLAN
        raise PlanMismatchError(f"the plan was priced with {planned.describe()}, which cannot train: {fix}, then "
                                f"{_pass('that loss_fn', to)}")
    if planned is not None and planned.kind == LOSS_FN:
        if fn == planned.name and (to != EMIT or importable(fn)):
            return
        fix = _pass(planned.name, to) + ", as the plan was made with it"
        if to == EMIT and not importable(planned.name):
            fix = (f"{planned.name} cannot be imported by the generated script: define it as a function at the top "
                   "level of an importable module, re-plan with it, and pass its 'pkg.mod:fn' to autopar.codegen.emit")
        elif fn:
            fix += f" (a function of another name is another loss to autopar: to train with {fn}, re-plan with it)"
        given = f"loss_fn={fn}" if fn else "no loss_fn"
        raise PlanMismatchError(f"the plan was made with loss_fn={planned.name}, but {_where(to)} was given {given}: "
                                f"{fix}")
    if planned is not None and planned.kind == MODEL and fn:
        raise PlanMismatchError(f"the plan was made with the model's own loss, but {_where(to)} was given "
                                f"loss_fn={fn}: pass no loss_fn to {_where(to)}, or re-plan with loss_fn={fn}")
    if used is not None and used.kind == STAND_IN:
        if planned is not None:   # MODEL: the model computed its own loss when planned, and none here
            raise PlanMismatchError(f"the plan was made with the model's own loss, but the model returns no loss "
                                    f"here, so {_where(to)} would train on {used.describe()}: pass the model the "
                                    "plan was made for (one that computes its loss from the plan's inputs), or "
                                    f"re-plan with loss_fn=pkg.mod:fn and {_pass('that loss_fn', to)}")
        raise PlanMismatchError(f"the model returns no loss and {_where(to)} was given no loss_fn, so it would train "
                                f"on {used.describe()}: {_pass('the loss_fn the plan was made with', to)} (a plan "
                                f"made with none priced a stand-in: {HOW_TO_PLAN})")


def _where(to: str) -> str:
    return "autopar.codegen.emit" if to == EMIT else "autopar.parallelize"


def _pass(what: str, to: str) -> str:
    """"pass loss_fn=pkg.mod:fn to ..." for a name, "pass <what> to ..." for a description."""
    what = f"loss_fn={what}" if ":" in what else what
    if to == EMIT:
        return f"pass {what} to autopar.codegen.emit (autopar codegen --loss-fn)"
    return f"pass {what} to autopar.parallelize"
