"""The ZeRO-3 coverage constant comes from the validation split, and a plan that rests on ZeRO-3 beyond it
says so (cost_model/coverage.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from autopar import Cluster, ParallelConfig
from autopar.cost_model.coverage import (LARGEST_VALIDATED_ZERO3_GROUP, VALIDATED_ZERO3_ROWS,
                                         zero3_scaling_note)
from autopar.plan import Alternative
from autopar.solver import price

DATA = Path(__file__).resolve().parents[3] / "bench" / "data"


def test_constant_is_the_validation_rows():
    split = json.loads((DATA / "split.json").read_text())
    rows = json.loads((DATA / "published_runs.json").read_text())["rows"]
    validated = sorted((r["id"], r["config"].get("dp", 1) * r["config"].get("cp", 1)) for r in rows
                       if r["source"] in split["validation"] and r["config"].get("zero", 0) == 3)
    assert validated == sorted(VALIDATED_ZERO3_ROWS)
    assert LARGEST_VALIDATED_ZERO3_GROUP == max(g for _, g in validated) == 32


def _alt(cfg: ParallelConfig, step: float, fits: bool = True) -> Alternative:
    return Alternative(config=cfg, step_time=step, peak_memory=1e9, fits=fits, reason="slower")


def test_note_when_zero3_beyond_validation_beats_zero1(plan_graph):
    cluster = Cluster.from_spec("8x8xA100-80GB")
    plan = price(plan_graph, cluster, ParallelConfig(dp=64, zero=3), 64)
    zero1 = ParallelConfig(dp=64, zero=1)
    noted = zero3_scaling_note(replace(plan, alternatives=(_alt(zero1, plan.step_time * 1.05),)))
    assert noted is not None and "64 ranks" in noted and "5.0%" in noted and "fsdp32 tp8" in noted
    # no note: the rival is faster, does not fit, or is ZeRO-3 too; no alternatives (an estimate)
    assert zero3_scaling_note(replace(plan, alternatives=(_alt(zero1, plan.step_time * 0.99),))) is None
    assert zero3_scaling_note(replace(plan, alternatives=(_alt(zero1, plan.step_time * 2, fits=False),))) is None
    other = ParallelConfig(dp=32, tp=2, zero=3)
    assert zero3_scaling_note(replace(plan, alternatives=(_alt(other, plan.step_time * 2),))) is None
    assert zero3_scaling_note(plan) is None


def test_no_note_within_the_validated_group(plan_graph):
    cluster = Cluster.from_spec("4x8xA100-80GB")
    plan = price(plan_graph, cluster, ParallelConfig(dp=32, zero=3), 64)
    zero1 = ParallelConfig(dp=32, zero=1)
    assert zero3_scaling_note(replace(plan, alternatives=(_alt(zero1, plan.step_time * 2),))) is None


def test_searched_plan_carries_the_note(plan_graph):
    """The search's choice (solver/choice.py): a ZeRO-3 plan lists the best plan without ZeRO-3 among its
    alternatives even when faster ZeRO-3 variants fill the top ones, and its notes say what it rests on."""
    from types import SimpleNamespace

    from autopar.solver.choice import TOP_ALTERNATIVES, alternatives, with_search_results
    cluster = Cluster.from_spec("8x8xA100-80GB")
    best = price(plan_graph, cluster, ParallelConfig(dp=64, zero=3), 64)
    variants = [replace(best, config=ParallelConfig(dp=64, zero=3, micro_batch_size=1 + k % 2,
                                                    recompute=("none", "full", "selective", "op")[k // 2]),
                        step_time=best.step_time * (1.01 + 0.01 * k)) for k in range(1, TOP_ALTERNATIVES + 2)]
    zero1 = replace(best, config=ParallelConfig(dp=64, zero=1), step_time=best.step_time * 1.2)
    seen = [(p.step_time, None, p) for p in [best, *variants, zero1]]
    alts = alternatives(best, seen, cluster.device.memory, 0.0)
    assert [a.reason for a in alts if a.config == zero1.config] == ["slower by 20.0% (the best without ZeRO-3)"]
    stats = SimpleNamespace(timed_out=False, ilp_stopped_early=0, gap=None, ilp_fallbacks=(), counts=lambda: {})
    chosen = with_search_results(best, stats, alts, (), "even", seen, 0.0)
    assert any("ZeRO-3 group of 64 ranks" in n and "20.0% lead" in n for n in chosen.notes)
