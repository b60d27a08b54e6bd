"""The reports show the error bars the recorded residuals give (plan/interval.py): summary and explain
the plan's interval, compare both plans' and whether the difference is within the model's error, a
sweep its step, time to train, GPU-hours and cost as ranges in the table, the CSV and the JSON.

Plans are made by hand (no capture, no solve): the reports read nothing else of them."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

import autopar
from autopar.plan import MemoryBreakdown, Plan, Stage, TimeBreakdown, interval
from autopar.plan.sweep import CSV_COLUMNS, Sweep
from autopar.report.format import step_range
from autopar.report.sweep import duration, money
from autopar.sweep import measure

A100 = [-0.30, -0.22, -0.15, -0.1, -0.06, -0.02, 0.0, 0.03, 0.08, 0.15]
SWEEP = {0: "s1", 1: "s1", 2: "s1", 3: "s2", 4: "s2", 5: "s2", 6: "s2"}     # row index -> validation sweep
TOKENS, PRICE, SEQ = 1e12, 2.0, 2048


@pytest.fixture
def residuals(tmp_path, monkeypatch):
    """A residuals file of A100 rows only (two sweeps among them), made the one autopar reads."""
    rows = [dict(id=f"r{i}", source="test", device="A100-80GB", family="A100", sweep=SWEEP.get(i), error=e)
            for i, e in enumerate(A100)]
    path = tmp_path / "residuals.json"
    path.write_text(json.dumps(dict(schema=1, description="test", rows=rows,
                                    families={"A100-80GB": "A100", "H100-SXM": "H100"})))
    monkeypatch.setattr(interval, "RESIDUALS_PATH", path)
    return rows


def handmade(spec: str = "2x8xA100-80GB", step: float = 9.9, tp: int = 2, fingerprint: str = "f0") -> Plan:
    cluster = autopar.Cluster.from_spec(spec)
    memory = MemoryBreakdown(params=1e9, grads=1e9, optimizer=2e9, activations=3e9, buffers=1e8)
    stage = Stage(index=0, layers=("blocks.0", "blocks.1"), chunks=(("blocks.0", "blocks.1"),), param_count=10**9,
                  fwd_time=step / 4, bwd_time=step / 2, recompute_time=0.0, tp_comm_time=step / 10, p2p_time=0.0,
                  in_flight=1, activation_per_microbatch=3e9, memory=memory)
    breakdown = TimeBreakdown(compute=0.8 * step, recompute=0.0, tp_comm=0.1 * step, p2p=0.0, bubble=0.0,
                              dp_comm=0.05 * step, optimizer=0.05 * step)
    return Plan(model_name="gpt", fingerprint=fingerprint, cluster=cluster,
                config=autopar.ParallelConfig(dp=cluster.devices // tp, tp=tp),
                precision=autopar.Precision(compute="bf16"),
                global_batch_size=64, micro_batches=4, step_time=step, peak_memory=memory.total,
                throughput=64 / step, model_flops=1e17, hardware_flops=1.3e17, breakdown=breakdown, stages=(stage,),
                fits=True)


def bounds(step: float) -> tuple[float, float]:
    lo, hi = np.percentile(A100, [10, 90])
    return step / (1 + hi), step / (1 + lo)


def test_summary_and_explain_show_the_interval(residuals) -> None:
    plan = handmade()
    iv = plan.step_time_interval()
    assert (iv.low, iv.high) == pytest.approx(bounds(9.9), rel=1e-12)
    assert f"  error bar      80% interval {step_range(iv)} (A100: 10 published validation runs)" in plan.summary()
    assert f"a run would measure {step_range(iv)} per step, 80% of the time" in plan.explain()
    assert "(A100: 10 published validation runs)" in plan.explain()
    assert f"step 80% interval {step_range(iv)} (A100: 10" in plan._repr_html_()
    cpu = handmade("1x2xcpu", tp=1)
    assert "  error bar      no interval: no published validation run covers 'cpu'" in cpu.summary()
    assert "How sure: no interval." in cpu.explain()


def test_compare_judges_the_difference_against_the_paired_residuals(residuals) -> None:
    a = handmade(step=10.0)
    pairs = [(1 + x["error"]) / (1 + y["error"]) for x in residuals for y in residuals
             if x is not y and x["sweep"] is not None and x["sweep"] == y["sweep"]]
    lo, hi = np.percentile(pairs, [10, 90])        # measured B / A = predicted x (1 + e_a) / (1 + e_b)
    assert lo < 0.95 and hi > 1.05
    close = handmade(step=9.6, tp=4)               # 4% faster: inside the error of configuration pairs
    text = str(a.compare(close))
    assert f"A and B tie: B is predicted 4.2% faster, within the model's error" in text
    assert f"{0.96 * lo:.3f}-{0.96 * hi:.3f} (80% interval; predicted 0.960)" in text
    assert "ordered pairs of configurations measured in one validation sweep (2 sweeps on A100)" in text
    row = next(r for r in a.compare(close).rows if r.label == "  80% interval")
    assert (row.a, row.b) == (step_range(a.step_time_interval()), step_range(close.step_time_interval()))
    far = handmade(step=10.0 * lo * 0.9, tp=4)      # beyond the paired interval: a real difference
    assert a.compare(far).verdict.startswith("B is faster: ") and "beyond the model's error" in a.compare(far).verdict
    other = a.compare(handmade(step=9.6, tp=4, fingerprint="another model"))
    assert "errors assumed independent" in other.verdict
    cpu = handmade("1x2xcpu", step=10.0, tp=1).compare(handmade("1x2xcpu", step=9.6))
    assert cpu.verdict.startswith("B is faster: 4.2% more throughput") and "no error bar: no published" in cpu.verdict


def sweep_of(spec: str) -> Sweep:
    node = autopar.Cluster.from_spec(spec)
    rows = tuple(measure(handmade(f"{n}x{node.devices_per_node}x{node.device.name}", step=20.0 / n, tp=1), n, SEQ,
                         TOKENS, PRICE) for n in (1, 2))
    return Sweep(model_name="gpt", device=node.device.name, devices_per_node=node.devices_per_node, precision="bf16",
                 peak_flops=node.device.peak("bf16"), global_batch_size=64, tokens_per_sample=SEQ, tokens=TOKENS,
                 price_per_gpu_hour=PRICE, rows=rows)


def test_sweep_shows_time_gpu_hours_and_cost_as_ranges(residuals) -> None:
    sweep = sweep_of("1x8xA100-80GB")
    exported = list(csv.DictReader(io.StringIO(sweep.to_csv())))
    assert tuple(exported[0]) == CSV_COLUMNS
    data = json.loads(json.dumps(sweep.to_dict()))["rows"]
    text = sweep.table()
    for row, line, record in zip(sweep.rows, exported, data):
        low, high = bounds(row.step_time)
        for key, value, unit in (("step_time", row.step_time, "_s"), ("train", row.train_seconds, "_s"),
                                 ("gpu_hours", row.gpu_hours, ""), ("cost", row.cost, "")):
            expected = (value * low / row.step_time, value * high / row.step_time)
            assert (float(line[f"{key}_low{unit}"]), float(line[f"{key}_high{unit}"])) == pytest.approx(expected)
            assert (record[f"{key}_low{unit}"], record[f"{key}_high{unit}"]) == pytest.approx(expected)
        assert line["interval"] == "80% interval from A100: 10 published validation runs"
        days = [duration(v * b / row.step_time) for v, b in ((row.train_seconds, low), (row.train_seconds, high))]
        assert f"{duration(row.train_seconds)} ({days[0].split()[0]}-{days[1]})" in text
        costs = [money(row.cost * b / row.step_time) for b in (low, high)]
        assert f"{money(row.cost)} ({costs[0]}-{costs[1]})" in text
    assert "(a-b) = the 80% interval of step, time to train, GPU-hours, cost: measured" in text
    cpu = sweep_of("1x2xcpu")
    assert all(r["cost_low"] == "" and r["interval"].startswith("none: no published validation run covers 'cpu'")
               for r in csv.DictReader(io.StringIO(cpu.to_csv())))
    assert "no ranges: no published validation run covers 'cpu'" in cpu.table()
