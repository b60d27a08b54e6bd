"""autopar.sweep: one model on several cluster sizes; the arithmetic of every row, the table, the exports.

The sizes are gpt-tiny (32 tokens a sample) on 1, 2 and 4 nodes of 2 A100s with dp pinned to 4, so
one node (2 devices) has no plan and its row must say why. llama3-70b on 1-16 nodes of H100 is
bench/sweep.py's (a minute).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import importlib

import pytest

import autopar
from autopar import Cluster, ConfigError, Plan, Sweep, SweepRow
from autopar.models import registry
from autopar.report.format import quantity
from autopar.report.sweep import duration, money

NODE = Cluster.from_spec("1x2xA100-80GB")
BATCH, SEQ, TOKENS, PRICE = 8, 32, 1e9, 2.0
SWEEP = importlib.import_module("autopar.sweep")   # the module (autopar.sweep is the function)


@pytest.fixture(scope="module")
def tiny():
    return registry.build("gpt-tiny", device="meta")


@pytest.fixture(scope="module")
def swept(tiny) -> Sweep:
    model, inputs = tiny
    return autopar.sweep(model, NODE, inputs, nodes=[4, 1, 2], global_batch_size=BATCH, fixed={"dp": 4},
                         tokens=TOKENS, price_per_gpu_hour=PRICE, workers=1, verbose=False)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12)


def test_rows_are_sorted_and_hold_plans(swept) -> None:
    assert [r.nodes for r in swept] == [1, 2, 4] and len(swept) == 3
    assert [r.ok for r in swept.rows] == [False, True, True]
    assert swept.plans == tuple(r.plan for r in swept.rows)
    for r in swept.rows[1:]:
        assert isinstance(r.plan, Plan) and r.plan.cluster.nodes == r.nodes and r.plan.devices == r.gpus == 2 * r.nodes
        assert r.plan.global_batch_size == BATCH and r.plan.config.dp == 4    # the same batch on every size
    assert swept.row(2) is swept.rows[1]
    with pytest.raises(ConfigError, match=r"no row of 3 node"):
        swept.row(3)
    assert swept.tokens_per_sample == SEQ and swept.global_batch_size == BATCH and swept.device == "A100-80GB"


def test_every_row_is_arithmetic(swept) -> None:
    peak = NODE.device.peak("bf16")
    assert swept.peak_flops == peak
    for r in swept.rows:
        if not r.ok:
            continue
        hours = r.train_seconds / 3600
        assert close(r.tokens_per_second, BATCH * SEQ / r.step_time)          # tokens/s = batch x seq / step
        assert close(r.tokens_per_second * r.train_seconds, TOKENS)            # tokens/s x time = tokens
        assert close(r.gpu_hours, r.gpus * hours)
        assert close(r.cost, r.gpus * hours * PRICE)                           # GPUs x hours x price
        assert close(r.samples_per_second, BATCH / r.step_time)
        assert close(r.mfu, r.plan.model_flops / (r.step_time * r.gpus * peak))
        assert r.step_time == r.plan.step_time and r.mfu == r.plan.mfu and r.peak_memory == r.plan.peak_memory
        assert close(r.plan.tokens_per_second, r.tokens_per_second) and r.plan.tokens_per_sample == SEQ


def test_a_size_without_plan_says_why(swept) -> None:
    row = swept.row(1)
    assert row.plan is None and row.gpus == 2 and "dp=4" in row.error
    assert all(getattr(row, f) is None for f in ("step_time", "tokens_per_second", "mfu", "train_seconds", "cost"))
    text = swept.table()
    assert "no plan, see (1)" in text and f"(1) 1 node: {row.error}" in text
    with pytest.raises(ConfigError, match="a plan or an error"):
        SweepRow(nodes=1, gpus=2, plan=None)


def test_table_shows_each_rows_numbers_and_defines_them(swept) -> None:
    text = str(swept)
    lines = text.splitlines()
    assert lines[0].startswith("autopar sweep of GPT on nodes of 2 x A100-80GB: global batch 8 x 32 tokens")
    assert "training 1B tokens at $2 per GPU-hour" in lines[0]
    for head in ("nodes", "GPUs", "plan", "step", "tokens/s", "MFU", "mem/GPU", "time to train", "GPU-hours", "cost"):
        assert head in lines[1]
    for r in swept.rows[1:]:
        line = next(x for x in lines if x.split()[:2] == [str(r.nodes), str(r.gpus)])
        for cell in (r.plan.config.short(), quantity(r.tokens_per_second), duration(r.train_seconds),
                     quantity(r.gpu_hours), money(r.cost), f"{r.mfu * 100:.1f}%"):
            assert cell in line, (cell, line)
    assert any(x.startswith("MFU = model FLOPs per step") and "312 TFLOP/s" in x for x in lines)
    assert any("time to train = 1B tokens / tokens/s" in x and "cost = GPU-hours x $2" in x for x in lines)


def test_csv_and_dict(swept, tmp_path) -> None:
    text = swept.to_csv(tmp_path / "sweep.csv")
    assert (tmp_path / "sweep.csv").read_text() == text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [int(r["nodes"]) for r in rows] == [1, 2, 4]
    assert rows[0]["config"] == "" and rows[0]["cost"] == "" and "dp=4" in rows[0]["error"]
    for r in rows[1:]:       # the arithmetic holds on the exported numbers too
        tps, train, gpus = float(r["tokens_per_s"]), float(r["train_s"]), int(r["gpus"])
        assert close(tps * train, TOKENS) and close(float(r["cost"]), gpus * train / 3600 * PRICE)
        assert close(tps, BATCH * SEQ / float(r["step_time_s"])) and r["error"] == ""
    data = json.loads(json.dumps(swept.to_dict()))
    assert data["tokens"] == TOKENS and data["price_per_gpu_hour"] == PRICE and data["tokens_per_sample"] == SEQ
    assert [r["cost"] for r in data["rows"]] == [r.cost for r in swept.rows]
    full = swept.to_dict(plans=True)["rows"]
    assert full[0]["plan"] is None and Plan.from_dict(full[2]["plan"]) == swept.row(4).plan


def test_results_are_immutable(swept) -> None:
    assert isinstance(swept.rows, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        swept.tokens = 2e9
    with pytest.raises(dataclasses.FrozenInstanceError):
        swept.rows[1].cost = 0.0
    assert "print() it" in repr(swept) and swept._repr_html_().startswith("<pre>")


def test_row_is_the_plan_of_that_size(swept, tiny) -> None:
    model, inputs = tiny
    alone = autopar.plan(model, Cluster.from_spec("4x2xA100-80GB"), inputs, global_batch_size=BATCH,
                         fixed={"dp": 4}, verbose=False)
    assert swept.row(4).plan == alone


def test_captures_once_and_workers_give_the_same_plans(swept, tiny, monkeypatch) -> None:
    model, inputs = tiny
    calls = []
    real = SWEEP.capture
    monkeypatch.setattr(SWEEP, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    parallel = autopar.sweep(model, NODE, inputs, nodes=[1, 2, 4], global_batch_size=BATCH, fixed={"dp": 4},
                             tokens=TOKENS, price_per_gpu_hour=PRICE, workers=2, verbose=False)
    assert len(calls) == 1
    assert parallel == swept


def test_global_batch_in_tokens(tiny) -> None:
    model, inputs = tiny
    by_tokens = autopar.sweep(model, NODE, inputs, nodes=[1], global_batch_tokens=BATCH * SEQ, workers=1, verbose=False)
    assert by_tokens.global_batch_size == BATCH and by_tokens.rows[0].plan.global_batch_size == BATCH
    assert by_tokens.tokens is None and by_tokens.rows[0].train_seconds is None and by_tokens.rows[0].cost is None
    assert "time to train" not in by_tokens.table() and "cost" not in by_tokens.table()
    with pytest.raises(ConfigError, match=r"use 224 \(7 x 32\) or 256 \(8 x 32\)"):
        autopar.sweep(model, NODE, inputs, nodes=[1], global_batch_tokens=250)


@pytest.mark.parametrize("kwargs, message", [
    ({"nodes": []}, "non-empty list"), ({"nodes": [1, 1]}, "repeats a size"), ({"nodes": [0, 2]}, "not a positive"),
    ({"nodes": "1,2"}, "list of node counts"), ({"nodes": [1.5]}, "not a positive"),
    ({"nodes": [1], "global_batch_tokens": 256}, "got both"), ({"nodes": [1], "global_batch_size": None}, "neither"),
    ({"nodes": [1], "tokens": -1.0}, "tokens=-1.0 must be a positive"),
    ({"nodes": [1], "price_per_gpu_hour": 2.0}, "give tokens too"),
    ({"nodes": [1], "workers": 0}, "workers=0"), ({"nodes": [1], "tokens_per_sample": 0}, "tokens_per_sample=0"),
    ({"nodes": [1], "fixed": {"tq": 2}}, "unknown field"), ({"nodes": [1], "tie_tolerance": 1.5}, "tie_tolerance"),
    ({"nodes": [1], "time_limit": 0}, "time_limit=0"), ({"nodes": [1], "ilp_node_limit": 0}, "ilp_node_limit=0"),
])
def test_bad_arguments_are_refused_before_any_work(tiny, kwargs, message) -> None:
    model, inputs = tiny
    args = {"global_batch_size": BATCH, **kwargs}
    with pytest.raises(ConfigError, match=message):
        autopar.sweep(model, NODE, inputs, **args)


def test_cluster_must_be_a_cluster(tiny) -> None:
    model, inputs = tiny
    with pytest.raises(ConfigError, match="must be an autopar.Cluster"):
        autopar.sweep(model, "1x2xA100-80GB", inputs, nodes=[1], global_batch_size=BATCH)


def test_a_model_without_tokens(tmp_path) -> None:
    model, inputs = registry.build("mlp-small", device="meta")
    with pytest.raises(ConfigError, match="pass tokens_per_sample="):
        autopar.sweep(model, NODE, inputs, nodes=[1], global_batch_size=BATCH, tokens=TOKENS)
    plain = autopar.sweep(model, NODE, inputs, nodes=[1, 2], global_batch_size=BATCH, workers=1, verbose=False)
    assert plain.tokens_per_sample is None and plain.rows[0].tokens_per_second is None
    assert "samples/s" in plain.table() and "tokens/s" not in plain.table()
    fig = plain.plot(tmp_path / "plain.png")
    assert (tmp_path / "plain.png").stat().st_size > 0
    assert len(fig.axes) == 3 and fig.axes[2].get_ylabel() == "seconds per step"
    given = autopar.sweep(model, NODE, inputs, nodes=[1], global_batch_size=BATCH, tokens=TOKENS, tokens_per_sample=32,
                          workers=1, verbose=False)
    assert close(given.rows[0].tokens_per_second * given.rows[0].train_seconds, TOKENS)


def test_plot(swept, tmp_path) -> None:
    fig = swept.plot(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert len(fig.axes) == 4           # throughput, MFU, time to train and its cost on a twin axis
    assert fig.axes[0].get_ylabel() == "tokens/s" and fig.axes[2].get_ylabel() in ("minutes", "hours", "days")
    assert "no plan on 1 node" in fig._suptitle.get_text()


def test_formats() -> None:
    assert duration(30) == "30 s" and duration(90) == "1.5 min" and duration(5 * 3600) == "5 h"
    assert duration(10 * 86400) == "10 days" and duration(1234 * 86400) == "1234 days"
    assert money(1.0123e6) == "$1.01M" and money(512_300) == "$512k" and money(950) == "$950"
    assert quantity(108_812) == "108.8k" and quantity(1e12) == "1T" and quantity(13.281) == "13.28"
