"""codegen.emit refuses, before writing anything, a plan it would train on another loss than the plan's:
a stand-in (the model returns no loss and the plan was made without loss_fn), a missing or another
loss_fn, for the torchrun script, the standalone folder (which trains with torch alone, so nothing
checks later) and `autopar codegen`. The script's own parallelize checks again on every rank
(tests/unit/test_bad_input_runtime.py)."""

from __future__ import annotations


import pytest

import autopar
import autopar.codegen
from autopar import Cluster, ParallelConfig, Plan, PlanMismatchError
from autopar.cli import main
from autopar.models import build_mlp

FACTORY = "autopar.models.mlp:build_mlp"   # the model of the plans below, on the CPU


def module_loss(out, inputs):
    return out.float().pow(2).mean()


NAME = f"{module_loss.__module__}:module_loss"


def _plan(loss_fn=None) -> Plan:
    model, inputs = build_mlp(device="meta")
    return autopar.estimate(model, Cluster.from_spec("1x2xcpu"), inputs, ParallelConfig(dp=2), global_batch_size=8,
                            loss_fn=loss_fn)


@pytest.fixture(scope="module")
def stand_in() -> Plan:
    return _plan()


@pytest.fixture(scope="module")
def with_fn() -> Plan:
    return _plan(module_loss)


@pytest.mark.parametrize("standalone", [False, True])
def test_a_stand_in_is_refused_at_emit_time(stand_in, tmp_path, standalone) -> None:
    with pytest.raises(PlanMismatchError, match=r"stand-in loss.*cannot train.*loss_fn=pkg\.mod:fn.*codegen\.emit"):
        autopar.codegen.emit(stand_in, tmp_path / "run", FACTORY, standalone=standalone)
    assert not (tmp_path / "run").exists(), "nothing is written for a refused plan"


@pytest.mark.parametrize("standalone", [False, True])
def test_a_missing_or_another_loss_fn_is_refused_at_emit_time(with_fn, tmp_path, standalone) -> None:
    with pytest.raises(PlanMismatchError, match=f"given no loss_fn: pass loss_fn={NAME} to autopar.codegen.emit"):
        autopar.codegen.emit(with_fn, tmp_path / "run", FACTORY, standalone=standalone)
    with pytest.raises(PlanMismatchError, match=f"given loss_fn=pkg.mod:other: pass loss_fn={NAME}"):
        autopar.codegen.emit(with_fn, tmp_path / "run", FACTORY, loss_fn="pkg.mod:other", standalone=standalone)
    assert not (tmp_path / "run").exists()
    path = autopar.codegen.emit(with_fn, tmp_path / "run", FACTORY, loss_fn=NAME, standalone=standalone)
    module, fn = NAME.split(":")
    if not standalone:
        assert f"from {module} import {fn} as loss_fn" in open(path).read()


def test_a_plan_without_its_loss_record_shows_a_stand_in_to_the_standalone_export(with_fn, tmp_path) -> None:
    """A plan written before the loss was recorded: the standalone emit exports the model and sees the
    stand-in its output would be without a loss_fn."""
    data = with_fn.to_dict()
    data.pop("loss", None)
    old = Plan.from_dict(data)
    with pytest.raises(PlanMismatchError, match=r"returns no loss.*pass the loss_fn the plan was made with"):
        autopar.codegen.emit(old, tmp_path / "alone", FACTORY, standalone=True)
    autopar.codegen.emit(old, tmp_path / "alone", FACTORY, loss_fn=NAME, standalone=True)


def test_autopar_codegen_refuses_a_stand_in(stand_in, tmp_path, capsys) -> None:
    stand_in.save(tmp_path / "p.json")
    assert main(["codegen", str(tmp_path / "p.json"), "-o", str(tmp_path / "run"), "--model-factory", FACTORY]) == 2
    err = capsys.readouterr().err
    assert "stand-in loss" in err and "--loss-fn" in err, err
