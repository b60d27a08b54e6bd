"""Tokens/s for sequence models: the sequence length read from the plan's recorded inputs
(Plan.tokens_per_sample), and every report that prints throughput printing it."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import registry
from autopar.plan import sequence_tokens

CLUSTER = autopar.Cluster.from_spec("1x2xA100-80GB")


def ids(*shape, dtype="int64"):
    return {"shape": list(shape), "dtype": dtype}


@pytest.mark.parametrize("record, tokens", [
    ({"kind": "kwargs", "kwargs": {"input_ids": ids(1, 32), "labels": ids(1, 32)}}, 32),
    # encoder-decoder: the encoder's input_ids, wherever they are listed
    ({"kind": "kwargs", "kwargs": {"decoder_input_ids": ids(1, 16), "input_ids": ids(1, 512)}}, 512),
    ({"kind": "kwargs", "kwargs": {"tokens": ids(4, 128, dtype="int32")}}, 128),
    ({"kind": "args", "args": [ids(2, 3, 224, 224, dtype="float32"), ids(2, 77)]}, 77),
    ({"kind": "tensor", "args": [ids(1, 2048)]}, 2048),
    ({"kind": "args", "args": [ids(1, 32, dtype="float32")]}, None),          # features, not token ids
    ({"kind": "kwargs", "kwargs": {"mask": ids(1, 32, dtype="bool")}}, None),  # a mask
    ({"kind": "args", "args": [ids(1, 3, 32, 32, dtype="int64")]}, None),      # not [batch, sequence]
    ({"kind": "args", "args": [None, ids(8)]}, None),
    ({"kind": "kwargs", "kwargs": {}}, None), (None, None), ("garbage", None),
])
def test_sequence_tokens(record, tokens) -> None:
    assert sequence_tokens(record) == tokens


@pytest.fixture(scope="module")
def tiny_plans():
    model, inputs = registry.build("gpt-tiny", device="meta")
    a = autopar.estimate(model, CLUSTER, inputs, autopar.ParallelConfig(dp=2), global_batch_size=8)
    b = autopar.estimate(model, CLUSTER, inputs, autopar.ParallelConfig(tp=2), global_batch_size=8)
    return a, b


def test_plan_tokens_per_second(tiny_plans, tmp_path) -> None:
    plan = tiny_plans[0]
    assert plan.tokens_per_sample == 32 and plan.tokens_per_second == plan.throughput * 32
    plan.save(tmp_path / "p.json")
    assert autopar.load_plan(tmp_path / "p.json").tokens_per_second == plan.tokens_per_second   # saved plans too


def test_reports_print_tokens_per_second(tiny_plans) -> None:
    a, b = tiny_plans
    rate = f"{a.throughput:.4g} samples/s ({a.tokens_per_second / 1e3:.4g}k tokens/s)"
    assert f"throughput {rate}" in a.summary()
    assert rate in a.explain() and rate in a._repr_html_()
    rows = {r.label: r for r in a.compare(b).rows}
    assert rows["throughput (tokens/s)"].a == f"{a.tokens_per_second / 1e3:.4g}k"


def test_models_without_tokens_stay_in_samples() -> None:
    model, inputs = registry.build("small-cnn", device="meta")
    plan = autopar.estimate(model, CLUSTER, inputs, autopar.ParallelConfig(dp=2), global_batch_size=8)
    assert plan.tokens_per_sample is None and plan.tokens_per_second is None
    assert "samples/s" in plan.summary() and "tokens/s" not in plan.summary()
    assert all("tokens" not in r.label for r in plan.compare(plan).rows)
