"""Plan.summary / explain / compare / _repr_html_: what they state is the plan's own numbers."""

from __future__ import annotations

import re
from dataclasses import fields, replace

import pytest

import autopar
from autopar.plan import TimeBreakdown
from autopar.report.format import BREAKDOWN_LABELS, OPTIONAL_BREAKDOWN, flops_rate, seconds


@pytest.fixture(scope="module")
def cluster():
    return autopar.Cluster.from_spec("2x8xA100-80GB")


@pytest.fixture(scope="module")
def searched(plan_gpt, cluster, tmp_path_factory):
    """A searched plan (with runners-up and sharding) and its JSON reload."""
    model, inputs, _ = plan_gpt
    plan = autopar.plan(model, cluster, inputs, global_batch_size=64, fixed={"tp": 2}, verbose=False,
                        tie_tolerance=0)   # the fastest plan (near-ties: tests/unit/solver/test_ties.py)
    path = tmp_path_factory.mktemp("plans") / "p.json"
    plan.save(path)
    return plan, autopar.load_plan(path)


@pytest.fixture(scope="module")
def pipelined(plan_gpt, cluster):
    model, inputs, _ = plan_gpt
    cfg = autopar.ParallelConfig(dp=2, tp=2, pp=4, micro_batch_size=2, schedule="interleaved", virtual_stages=2,
                                 recompute="full", zero=1)
    return autopar.estimate(model, cluster, inputs, cfg, global_batch_size=64)


def test_summary_table(pipelined):
    text = pipelined.summary()
    assert f"configuration  {pipelined.config.short()}" in text
    assert f"MFU {pipelined.mfu * 100:.1f}%" in text
    for name in TimeBreakdown.__annotations__:        # every part, with its share of the step
        value = getattr(pipelined.breakdown, name)
        if name in OPTIONAL_BREAKDOWN and not value:   # context/expert parallel parts: only when present
            assert BREAKDOWN_LABELS[name] not in text
            continue
        row = re.search(rf"^  {re.escape(BREAKDOWN_LABELS[name])} +(\S+(?: [a-zA-Z]+)?) +([0-9.]+)%", text, re.M)
        assert row and row.group(1) == seconds(value)
        assert float(row.group(2)) == pytest.approx(value / pipelined.step_time * 100, abs=0.051)
    stage_rows = [line for line in text.splitlines() if re.match(r"^ +\d+ +[0-9.]+ +[0-9.]+", line)]
    assert len(stage_rows) == pipelined.config.pp
    for stage, line in zip(pipelined.stages, stage_rows):
        cells = line.split()
        assert float(cells[6]) == pytest.approx(stage.memory.total / 1e9, abs=0.006)
        assert cells[7] == f"{stage.memory.total / pipelined.cluster.device.memory:.0%}"
    assert "search         none" in text        # an estimate says it was not searched
    assert text.startswith(f"autopar estimate for {pipelined.model_name} on ")   # not "autopar plan"
    assert f"{pipelined.tflops_per_device * 1e3:.4g} GFLOP/s per device" in text   # a tiny GPT: 0.2 TFLOP/s


def test_flops_rate():
    assert [flops_rate(v) for v in (1.483e14, 5.261e10, 8.12e8, 2.5e15, 0.0)] == [
        "148.3 TFLOP/s", "52.61 GFLOP/s", "812 MFLOP/s", "2.5 PFLOP/s", "0 FLOP/s"]


def test_summary_heading_and_flops_in_the_unit_that_fits(searched, plan_gpt):
    plan, _ = searched
    assert plan.summary().startswith(f"autopar plan for {plan.model_name} on ")
    model, inputs, _ = plan_gpt
    cpu = autopar.estimate(model, autopar.Cluster.from_spec("1x2xcpu"), inputs, autopar.ParallelConfig(dp=2),
                           global_batch_size=8)
    rate = cpu.tflops_per_device * 1e12
    assert 1e9 <= rate < 1e12, rate        # a CPU: GFLOP/s, which "TFLOP/s" printed as 0.0
    text = cpu.summary()
    assert f"{rate / 1e9:.4g} GFLOP/s per device" in text and "TFLOP/s" not in text
    # a plan at 100 TFLOP/s per device beside the CPU's GFLOP/s: each row in its own unit
    gpu = replace(plan, step_time=plan.hardware_flops / (plan.devices * 100e12))
    row = [line for line in str(gpu.compare(cpu)).splitlines() if "FLOP/s per device" in line]
    assert len(row) == 1 and "TFLOP/s" in row[0] and "GFLOP/s" in row[0], row


def test_summary_marks_a_plan_that_does_not_fit(pipelined):
    small = replace(pipelined.cluster, device=replace(pipelined.cluster.device, memory=pipelined.peak_memory / 2))
    over = replace(pipelined, cluster=small, fits=False)
    text = over.summary()
    assert "DOES NOT FIT" in text and "OVER" in text


def test_explain_states_the_plans_numbers(searched):
    plan, loaded = searched
    text = plan.explain()
    assert text == loaded.explain(), "a plan loaded from JSON explains itself the same way"
    assert plan.config.short() in text and "fastest configuration that fits" in text
    search = plan.extra["search"]
    assert f"of {search['candidates']} configurations" in text
    assert f"{search['evaluated']} were solved exactly" in text
    assert plan.alternatives, "the fixture must have runners-up"
    for i, alt in enumerate(plan.alternatives, 1):
        line = next(l for l in text.splitlines() if l.startswith(f"  {i}. "))
        prefix = f"  {i}. {alt.config.short()} ("
        tie = alt.fits and alt.step_time <= plan.step_time and "as fast" in line   # explain names an exact tie
        assert line.startswith(prefix) and (alt.reason in line or tie), line
        named = {change.split(" ")[0] for change in line[len(prefix):].split("): ")[0].split(", ")}
        assert named == {f.name for f in fields(autopar.ParallelConfig)        # the changed fields, exactly
                         if getattr(plan.config, f.name) != getattr(alt.config, f.name)}
        if alt.fits:
            assert alt.breakdown is not None
            biggest = max(TimeBreakdown.__annotations__,
                          key=lambda k: abs(getattr(alt.breakdown, k) - getattr(plan.breakdown, k)))
            delta = getattr(alt.breakdown, biggest) - getattr(plan.breakdown, biggest)
            if abs(delta) > 1e-3 * plan.step_time:
                assert f"{BREAKDOWN_LABELS[biggest]} {'+' if delta > 0 else '-'}{seconds(abs(delta))}" in line


def test_explain_an_estimate_and_its_pipeline(pipelined):
    text = pipelined.explain()
    assert "This is an estimate of the configuration you gave" in text
    assert "pipeline 4:" in text and "interleaved with 2 chunks per device" in text
    assert "ZeRO-1 shards the optimizer state over the 2 replicas" in text
    assert f"recomputing costs {seconds(pipelined.breakdown.recompute)}" in text
    states = sum(s.memory.params + s.memory.grads + s.memory.optimizer for s in pipelined.stages)
    assert f"{states / 1e9:.2f} GB for parameters, gradients and optimizer state alone" in text


def test_compare_marks_exactly_the_differences(searched, pipelined):
    plan, _ = searched
    cmp_ = plan.compare(pipelined)
    by_label = {r.label.strip(): r for r in cmp_.rows}
    for f in fields(autopar.ParallelConfig):
        assert by_label[f.name].differs == (getattr(plan.config, f.name) != getattr(pipelined.config, f.name))
    assert not by_label["model"].differs and not by_label["cluster"].differs
    step = by_label["step time"]
    assert step.differs and step.change == f"{(pipelined.step_time / plan.step_time - 1) * 100:+.1f}%"
    text = str(cmp_)
    lines = text.splitlines()[3:-1]             # after A:, B: and the header; before the verdict
    assert len(lines) == len(cmp_.rows)
    assert all(line.startswith("* ") == row.differs and row.label in line for line, row in zip(lines, cmp_.rows))
    faster = "A" if plan.step_time < pipelined.step_time else "B"
    assert cmp_.verdict.startswith(f"{faster} is faster")
    same = plan.compare(plan)
    assert not same.differences and same.verdict.startswith("A and B take the same time")
    html = cmp_._repr_html_()
    assert html.count("background:#fff3b0") == len(cmp_.differences)
    with pytest.raises(autopar.ConfigError):
        plan.compare("plan.json")


def test_compare_warns_on_different_models(searched):
    plan, _ = searched
    other = replace(plan, fingerprint="other", global_batch_size=32)
    warnings = plan.compare(other).warnings
    assert any("different models" in w for w in warnings) and any("global batches differ" in w for w in warnings)


def test_notebook_view(searched):
    plan, _ = searched
    html = plan._repr_html_()
    assert plan.config.short() in html and html.count("<table") == 2
    assert html.startswith(f"<p><b>autopar plan</b> for {plan.model_name}")
    assert html.count("<tr") >= len(TimeBreakdown.__annotations__) + len(plan.stages) + 1
    pytest.importorskip("matplotlib")
    assert "<img alt='pipeline timeline' src='data:image/png;base64," in html


def test_a_plan_on_a_noisy_profile_records_its_conditions_and_says_so(pipelined):
    """A plan keeps the conditions its cluster's profile was measured under; summary() and explain() warn when
    they were noisy, and say nothing of a clean one."""
    from autopar.conditions import ProfileConditions
    clean = ProfileConditions(part="device", device_type="cpu",
                              measured_at="2026-01-02T03:04:05+00:00", torch_version="2.13.0",
                              threads=1, cores=2, load_average=0.1, other_load=0.05, own_load=1.0,
                              wait_fraction=0.002, spread=0.1)
    busy = replace(clean, other_load=1.6, wait_fraction=0.6, attempts=3)
    for conditions, warned in (((clean,), False), ((clean, busy), True)):
        plan = replace(pipelined, cluster=replace(pipelined.cluster, profile_conditions=conditions))
        again = autopar.Plan.from_dict(plan.to_dict())
        assert again.cluster.profile_conditions == conditions
        for text in (again.summary(), again.explain()):
            assert ("autopar profile --refresh" in text and "waited for a core 60%" in text) == warned, text
