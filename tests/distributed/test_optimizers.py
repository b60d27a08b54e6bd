"""An optimizer that is not element-wise (Adafactor, whose second moment of a matrix is factored) trains as one process
where every rank steps whole parameters (plain data parallelism, ZeRO-1), and is refused, saying what to
change, where ranks would step parts of them (tensor parallelism, ZeRO-3): each part's update would differ from
the whole's, with no error (runtime/optim.py's probe, driver/assembly.py's check). The probe itself is tested
in tests/unit/runtime/test_optim_elementwise.py."""

from __future__ import annotations

import os
import sys

import pytest
sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, check_matches, reference, run_cases  # noqa: E402

BASE = dict(dp=1, tp=1, pp=1, cp=1, ep=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b",
            virtual_stages=1, sequence_parallel=False)
WHOLE = [Case("adafactor-dp2", "mlp", {**BASE, "dp": 2}, 2, optimizer="adafactor"),
         Case("adafactor-dp2_zero1", "mlp", {**BASE, "dp": 2, "zero": 1}, 2, optimizer="adafactor"),
         Case("adafactor-pp2", "mlp", {**BASE, "pp": 2}, 2, optimizer="adafactor")]
PARTS = {"adafactor-tp2": ({**BASE, "tp": 2, "micro_batch_size": 2}, "tensor parallelism (tp=2) splits"),
         "adafactor-dp2_zero3": ({**BASE, "dp": 2, "zero": 3}, "ZeRO-3 shards every parameter over its 2 data-parallel")}
REFUSED = [Case(name, "mlp", fields, 2, optimizer="adafactor") for name, (fields, _) in PARTS.items()]


@pytest.fixture(scope="module")
def results():
    return run_cases(WHOLE + REFUSED, 2)


@pytest.mark.parametrize("case", WHOLE, ids=lambda c: c.name)
def test_whole_parameters_step_as_one_process(results, case):
    ref = reference(case)
    for rank, got in enumerate(results):
        check_matches(got[case.name], ref, rank)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_parts_of_parameters_are_refused_saying_why(results, case):
    for rank, got in enumerate(results):
        error = got[case.name].get("error", "")
        assert "ConfigError: the optimizer does not step each element on its own" in error, (rank, error[:500])
        assert PARTS[case.name][1] in error and "fixed=dict(tp=1, zero=1)" in error, (rank, error[:500])
