"""How a plan's loss was made (capture/loss.py): recorded by capture, carried to the plan and its JSON
(an older file without it loads), noted when a stand-in was priced, and checked by check_loss, the one
check parallelize and codegen.emit make. Example inputs may carry keys forward does not take: they
reach loss_fn alone (capture/export.py)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import autopar
from autopar import CaptureError, Cluster, ParallelConfig, Plan, PlanFormatError, PlanMismatchError
from autopar.capture import capture
from autopar.capture.export import LossWrapper, forward_keys, normalize_inputs
from autopar.capture.loss import check_loss
from autopar.plan.loss import EMIT, LOSS_FN, MODEL, PARALLELIZE, STAND_IN, LossSource

CPU2 = Cluster.from_spec("1x2xcpu")


class Regressor(nn.Module):
    """Returns predictions, no loss; forward takes ``x`` alone (another keyword is a TypeError)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class OwnLoss(Regressor):
    """Returns a scalar: its own loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).pow(2).mean()


def module_loss(out, inputs):
    return out.float().pow(2).mean()


def target_loss(out, inputs):
    return (out - inputs["targets"]).pow(2).mean()


NAME = f"{module_loss.__module__}:module_loss"
X = (torch.randn(2, 8),)
BATCH = {"x": torch.randn(2, 8), "targets": torch.randn(2, 4)}


def raises(*fragments: str):
    return pytest.raises(PlanMismatchError, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# --- the record ---------------------------------------------------------------------------------
def test_capture_records_how_the_loss_was_made(plan_graph) -> None:
    assert plan_graph.loss == LossSource(MODEL)                      # built-in GPT given labels: out.loss
    assert capture(OwnLoss(), X).loss == LossSource(MODEL)           # a scalar the model returns
    assert capture(Regressor(), X).loss == LossSource(STAND_IN)      # no loss, no loss_fn: the mean
    assert capture(Regressor(), X, module_loss).loss == LossSource(LOSS_FN, NAME)
    lam = lambda out, inputs: out.mean()  # noqa: E731
    assert capture(Regressor(), X, lam).loss.name == f"{__name__}:test_capture_records_how_the_loss_was_made." \
                                                     "<locals>.<lambda>"


def test_a_scripts_loss_has_one_name_in_the_processes_spawned_from_it() -> None:
    """A script plans with its ``loss_fn`` (``__main__``'s) and spawns the ranks that run the plan, where
    multiprocessing re-imports the script as ``__mp_main__``: the same function, the same name."""
    def mine(out, inputs):
        return out.pow(2).mean()
    for module in ("__main__", "__mp_main__"):
        mine.__module__ = module
        assert LossSource.of(mine) == LossSource(LOSS_FN, f"__main__:{mine.__qualname__}")


def test_the_record_is_validated() -> None:
    for kind, name in (("mean", None), (LOSS_FN, None), (LOSS_FN, ""), (MODEL, "pkg:fn"), (STAND_IN, "pkg:fn")):
        with pytest.raises(ValueError, match="loss"):
            LossSource(kind, name)


# --- the plan and its JSON ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def with_fn() -> Plan:
    return autopar.estimate(Regressor(), CPU2, X, ParallelConfig(dp=2), global_batch_size=4, loss_fn=module_loss)


def test_the_plan_and_its_json_carry_it(with_fn, tmp_path) -> None:
    assert with_fn.loss == LossSource(LOSS_FN, NAME)
    assert with_fn.to_dict()["loss"] == {"kind": LOSS_FN, "name": NAME}
    with_fn.save(tmp_path / "p.json")
    assert autopar.load_plan(tmp_path / "p.json") == with_fn
    old = with_fn.to_dict()
    del old["loss"]   # a plan written before the loss was recorded
    assert Plan.from_dict(old).loss is None
    for bad in ({"kind": "mean", "name": None}, {"kind": LOSS_FN, "name": None}, {"kind": MODEL},
                {"kind": MODEL, "name": None, "fn": 1}, "model"):
        with pytest.raises(PlanFormatError, match="plan field loss"):
            Plan.from_dict({**with_fn.to_dict(), "loss": bad})


def test_a_stand_in_is_noted_by_estimate_plan_and_sweep(with_fn) -> None:
    def noted(plan: Plan) -> list[str]:
        return [n for n in plan.notes if "stand-in" in n]

    assert not noted(with_fn)
    sweep = autopar.sweep(Regressor(), CPU2, X, nodes=[1], global_batch_size=4, workers=1, verbose=False)
    made = [autopar.estimate(Regressor(), CPU2, X, ParallelConfig(dp=2), global_batch_size=4),
            autopar.plan(Regressor(), CPU2, X, global_batch_size=4, verbose=False), sweep.rows[0].plan]
    for plan in made:
        assert plan.loss == LossSource(STAND_IN)
        [note] = noted(plan)
        assert "cannot train" in note and "labels in example_inputs" in note and "loss_fn=" in note, note
        assert f"note: {note}" in plan.summary()   # what `autopar plan` / `estimate` print
    assert f"note: {note}" in sweep.table()         # and `autopar sweep`


# --- the check -----------------------------------------------------------------------------------
FN, OTHER = LossSource(LOSS_FN, "pkg.losses:mine"), LossSource(LOSS_FN, "pkg.losses:other")


@pytest.mark.parametrize("planned, used, to, fragments", [
    (LossSource(STAND_IN), None, PARALLELIZE, ("stand-in", "cannot train", "labels", "loss_fn=pkg.mod:fn",
                                                "autopar.parallelize")),
    (LossSource(STAND_IN), LossSource(STAND_IN), PARALLELIZE, ("stand-in", "labels")),
    (LossSource(STAND_IN), OTHER, EMIT, ("re-plan with loss_fn=pkg.losses:other", "autopar.codegen.emit")),
    (FN, None, PARALLELIZE, ("given no loss_fn", "pass loss_fn=pkg.losses:mine to autopar.parallelize")),
    (FN, LossSource(STAND_IN), PARALLELIZE, ("pass loss_fn=pkg.losses:mine to autopar.parallelize",)),
    (FN, LossSource(MODEL), PARALLELIZE, ("pass loss_fn=pkg.losses:mine to autopar.parallelize",)),
    (FN, OTHER, PARALLELIZE, ("given loss_fn=pkg.losses:other", "pass loss_fn=pkg.losses:mine",
                              "re-plan with it")),
    (FN, None, EMIT, ("pass loss_fn=pkg.losses:mine to autopar.codegen.emit", "--loss-fn")),
    (LossSource(LOSS_FN, "__main__:mine"), None, EMIT, ("cannot be imported", "top level")),
    (LossSource(LOSS_FN, "pkg:f.<locals>.<lambda>"), LossSource(LOSS_FN, "pkg:f.<locals>.<lambda>"), EMIT,
     ("cannot be imported",)),
    (LossSource(MODEL), OTHER, PARALLELIZE, ("model's own loss", "pass no loss_fn", "re-plan with "
                                             "loss_fn=pkg.losses:other")),
    (LossSource(MODEL), LossSource(STAND_IN), PARALLELIZE, ("model's own loss", "returns no loss here")),
    (None, LossSource(STAND_IN), PARALLELIZE, ("returns no loss", "pass the loss_fn the plan was made with",
                                               "autopar.parallelize")),
    (None, LossSource(STAND_IN), EMIT, ("returns no loss", "autopar.codegen.emit")),
])
def test_check_refuses_what_would_train_another_loss(planned, used, to, fragments) -> None:
    with raises(*fragments):
        check_loss(planned, used, to=to)


@pytest.mark.parametrize("planned, used", [
    (FN, FN), (LossSource(LOSS_FN, "__main__:mine"), LossSource(LOSS_FN, "__main__:mine")),
    (LossSource(MODEL), None), (LossSource(MODEL), LossSource(MODEL)),
    (None, None), (None, FN), (None, LossSource(MODEL)),
])
def test_check_accepts_the_plans_loss(planned, used) -> None:
    for to in (PARALLELIZE, EMIT if planned is None or planned.name != "__main__:mine" else PARALLELIZE):
        check_loss(planned, used, to=to)


# --- keys forward does not take --------------------------------------------------------------------
def test_keys_forward_does_not_take_reach_loss_fn_alone() -> None:
    graph = capture(Regressor(), BATCH, target_loss)
    assert {i.name for i in graph.inputs} >= {"x", "targets"}, graph.inputs
    args, kwargs = normalize_inputs(BATCH)
    model = Regressor()
    loss = LossWrapper(model, target_loss, BATCH)(*args, **kwargs)   # forward(x) alone: no TypeError
    assert torch.equal(loss, target_loss(model(BATCH["x"]), BATCH))


def test_a_key_forward_does_not_take_needs_a_loss_fn() -> None:
    with pytest.raises(CaptureError, match=r"(?s)(?=.*'targets')(?=.*go to loss_fn alone)(?=.*loss_fn\(output, "
                                           r"inputs\) that reads them)"):
        capture(Regressor(), BATCH)
    with pytest.raises(CaptureError, match=r"(?s)(?=.*missing a required argument: 'x')(?=.*'y'.*a misspelling)"):
        capture(Regressor(), {"y": BATCH["x"], "targets": BATCH["targets"]}, target_loss)


def test_which_keys_forward_takes() -> None:
    class Untyped(Regressor):
        def forward(self, x, **kwargs):
            return self.fc(x)

    assert forward_keys(Regressor()) == {"x"}
    assert forward_keys(Untyped()) is None    # an untyped **kwargs takes every key
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32))
    keys = forward_keys(llama)   # its named parameters and those of its typed **kwargs (TransformersKwargs)
    assert {"input_ids", "labels", "attention_mask", "position_ids"} <= keys and "targets" not in keys
