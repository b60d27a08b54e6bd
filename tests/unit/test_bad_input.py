"""Every bad input raises an AutoparError subclass whose message names the culprit."""

from __future__ import annotations

import copy
import inspect
import json
import re
import sys

import pytest
import torch
from torch import nn

import autopar
from autopar import (AutoparError, CaptureError, Cluster, ConfigError, InfeasiblePlanError, ParallelConfig,
                     PlanFormatError, PlanMismatchError, RuntimeFailure, load_plan)
from autopar.capture import capture
from autopar.cost_model import estimate_plan
from autopar.models import build_mlp

ONE_NODE = Cluster.from_spec("1x8xA100-80GB")


def raises(kind: type[AutoparError], *fragments: str):
    """pytest.raises for ``kind`` whose message contains every fragment (literally)."""
    assert issubclass(kind, AutoparError)
    return pytest.raises(kind, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def line_of(func, marker: str) -> str:
    """``file:line`` of the line of ``func``'s source that contains ``marker``."""
    lines, start = inspect.getsourcelines(func)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{inspect.getsourcefile(func)}:{start + offset}"


# --- the hierarchy -----------------------------------------------------------------------------
def test_error_hierarchy() -> None:
    kinds = (ConfigError, CaptureError, InfeasiblePlanError, PlanFormatError, PlanMismatchError, RuntimeFailure)
    for kind in kinds:
        assert issubclass(kind, AutoparError) and getattr(autopar, kind.__name__) is kind
    assert issubclass(ConfigError, ValueError)   # callers that catch ValueError keep working
    assert autopar.AutoparError is AutoparError


# --- ParallelConfig ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, fragments", [
    (dict(dp=0), ("dp=0", ">= 1")),
    (dict(tp=-1), ("tp=-1", ">= 1")),
    (dict(pp=2.0), ("pp", "integer")),
    (dict(zero=4), ("zero=4", "0..3")),
    (dict(schedule="foo"), ("schedule='foo'", "'gpipe'", "'1f1b'", "'interleaved'")),
    (dict(recompute="some"), ("recompute='some'", "'selective'")),
    (dict(virtual_stages=2), ("virtual_stages=2", "interleaved")),
    (dict(schedule="interleaved", pp=1, virtual_stages=2), ("interleaved", "pp")),
    (dict(sequence_parallel=True), ("sequence_parallel", "tp")),
    (dict(sequence_parallel=1, tp=2), ("sequence_parallel", "True or False")),
], ids=str)
def test_parallel_config(kwargs, fragments) -> None:
    with raises(ConfigError, *fragments) as info:
        ParallelConfig(**kwargs)
    assert isinstance(info.value, ValueError)  # ConfigError is also a ValueError


def test_parallel_config_from_dict_unknown_field() -> None:
    with raises(ConfigError, "'ddp'"):
        ParallelConfig.from_dict({"ddp": 2})


# --- Cluster -----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, fragments", [
    ("abc", ("'abc'", "128x8xA100-80GB")),
    ("0x8xA100-80GB", ("'0'", ">= 1")),
    ("2x8xTPUv5", ("'TPUv5'", "A100-80GB", "H100-SXM", "cpu")),  # the known names are listed
    ("2x8x", ("no device name",)),
    (128, ("128", "string")),
])
def test_cluster_spec(spec, fragments) -> None:
    with raises(ConfigError, *fragments):
        Cluster.from_spec(spec)


@pytest.mark.parametrize("override", ["inter_node_bandwidth", "intra_node_bandwidth", "inter_node_latency"])
def test_cluster_negative_override(override) -> None:
    with raises(ConfigError, override, "-1"):
        Cluster.from_spec("2x8xA100-80GB", **{override: -1.0})


@pytest.mark.parametrize("memory", [0, -8e9, float("nan"), "80GB"])
def test_cluster_bad_device_memory(memory) -> None:
    with raises(ConfigError, "device_memory", repr(memory)):
        Cluster.from_spec("1x8xA100-80GB", device_memory=memory)


def test_tensor_parallel_degree_that_does_not_divide_heads() -> None:
    """3 heads and hidden 45 on tp=2: the plan keeps those weights whole and says which."""
    from autopar.models import GPTConfig, build_gpt
    model, inputs = build_gpt(GPTConfig(vocab_size=63, hidden=45, heads=3, layers=2, seq_len=8), batch_size=1,
                              device="meta")
    plan = autopar.plan(model, Cluster.from_spec("1x2xA100-80GB"), inputs, global_batch_size=4, fixed={"tp": 2},
                        verbose=False)
    assert plan.config.tp == 2 and plan.fits
    whole = [n for n in plan.notes if "left" in n and "whole" in n]
    assert any("blocks.*.attn.qkv.weight (2 layers)" in n and "tp=2 does not divide" in n for n in whole), plan.notes


# --- estimate: config against cluster and batch ------------------------------------------------
def test_device_count_mismatch(plan_graph) -> None:
    with raises(ConfigError, "dp*cp*tp*pp", "= 4 devices", "has 8"):
        estimate_plan(plan_graph, ONE_NODE, ParallelConfig(dp=2, tp=2), 64)


def test_device_count_mismatch_through_api(plan_gpt) -> None:
    model, inputs, _ = plan_gpt
    with raises(ConfigError, "16 devices", "has 8"):
        autopar.estimate(model, ONE_NODE, inputs, ParallelConfig(dp=16), global_batch_size=64)


def test_batch_not_divisible(plan_graph) -> None:
    with raises(ConfigError, "global_batch_size=100", "dp=8", "micro_batch_size=3", "24"):
        estimate_plan(plan_graph, ONE_NODE, ParallelConfig(dp=8, micro_batch_size=3), 100)


@pytest.mark.parametrize("gbs", [0, -8, 8.0, True])
def test_batch_not_positive_integer(plan_graph, gbs) -> None:
    with raises(ConfigError, f"global_batch_size={gbs!r}", "positive integer"):
        estimate_plan(plan_graph, ONE_NODE, ParallelConfig(dp=8), gbs)


def test_interleaved_chunks_need_a_block_each(plan_graph) -> None:
    # 8 blocks over pp=2 x virtual_stages=6 = 12 chunks; 6 chunks (v=3) are fine, balanced by cost.
    cfg = ParallelConfig(dp=4, pp=2, schedule="interleaved", virtual_stages=6)
    with raises(ConfigError, "pp=2", "virtual_stages=6", "only 8 repeated layers", "at most 4"):
        estimate_plan(plan_graph, ONE_NODE, cfg, 64)
    uneven = estimate_plan(plan_graph, ONE_NODE, ParallelConfig(dp=4, pp=2, schedule="interleaved", virtual_stages=3), 64)
    sizes = sorted(len(chunk) for stage in uneven.stages for chunk in stage.chunks)
    assert len(sizes) == 6 and sum(sizes) == len(plan_graph.layers) and sizes[0] < sizes[-1]


def test_more_stages_than_layers(plan_graph) -> None:
    cluster = Cluster.from_spec("2x8xA100-80GB")
    with raises(ConfigError, "16", f"only {len(plan_graph.layers)} layers"):
        estimate_plan(plan_graph, cluster, ParallelConfig(pp=16), 64)


@pytest.mark.parametrize("cluster, config, fragments", [
    ("1x8xA100-80GB", ParallelConfig(dp=8), ("cluster", "autopar.Cluster", "str")),
    (ONE_NODE, {"dp": 8}, ("config", "ParallelConfig", "dict")),
], ids=["cluster-str", "config-dict"])
def test_estimate_wrong_types(plan_gpt, cluster, config, fragments) -> None:
    model, inputs, _ = plan_gpt
    with raises(ConfigError, *fragments):
        autopar.estimate(model, cluster, inputs, config, global_batch_size=64)


# --- models and inputs -------------------------------------------------------------------------
class TwoLayer(nn.Module):
    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16, device=device)
        self.fc2 = nn.Linear(16, 4, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # <- shape line
        return self.fc2(h)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # <- branch line
            return y * 2
        return y


class DataDependentShape(nn.Module):
    """Rows picked by their values: export succeeds with a symbolic row count, capture cannot plan it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        rows = torch.nonzero(h[:, 0] > 0).squeeze(1)  # <- picking line
        return h.index_select(0, rows).sum()


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, device="meta").requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, device="meta")
        self.b = nn.Linear(8, 8, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def test_model_not_a_module() -> None:
    with raises(ConfigError, "torch.nn.Module", "function"):
        capture(lambda x: x, (meta(2, 8),))


def test_model_without_trainable_parameters() -> None:
    with raises(ConfigError, "Frozen", "no trainable parameters"):
        capture(Frozen(), (meta(2, 8),))


def test_parameters_on_mixed_devices() -> None:
    """Planning takes a model partly on meta as wholly on meta (capture/test_meta_mix.py); an export
    that runs the model (the runtime's, meta_mix off) refuses mixed devices."""
    from autopar.capture.export import check_model
    with raises(ConfigError, "Mixed", "'cpu'", "'meta'"):
        check_model(Mixed())


def test_example_inputs_wrong_key(plan_gpt) -> None:
    model, inputs, _ = plan_gpt
    bad = {"input_idz": inputs["input_ids"], "labels": inputs["labels"]}
    with raises(CaptureError, "'input_idz'", "GPT.forward"):
        capture(model, bad)


def test_example_inputs_wrong_type() -> None:
    model, _ = build_mlp(device="meta")
    with raises(ConfigError, "example_inputs", "str"):
        capture(model, "x")


def test_inputs_of_wrong_shape_name_the_source_line() -> None:
    where = line_of(TwoLayer.forward, "<- shape line")
    assert where.startswith(__file__)
    with raises(CaptureError, "TwoLayer", where, "h = self.fc1(x)", "do not fit the model"):
        capture(TwoLayer(), (meta(2, 5),), lambda out, inputs: out.sum())


def test_inputs_on_another_device_than_the_model_say_so() -> None:
    """A model built on meta with example inputs made outside that block (on the CPU): the error says where
    the model is and where to make the inputs, not that their shapes do not fit."""
    model, inputs = build_mlp(device="meta")
    cpu = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in inputs) if isinstance(inputs, tuple) else \
        {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in inputs.items()}
    with raises(CaptureError, "not on the model's device (meta)", "torch.device('meta')"):
        capture(model, cpu)


def test_data_dependent_control_flow() -> None:
    where = line_of(DataDependent.forward, "<- branch line")
    with raises(CaptureError, "DataDependent", where, "data-dependent control flow", "torch.where"):
        capture(DataDependent(), (meta(2, 8),))


def test_data_dependent_shape_names_the_op_and_line() -> None:
    """A tensor sized by tensor values (Hugging Face's JetMoe experts) is a CaptureError, not torch's
    GuardOnDataDependentSymNode."""
    where = line_of(DataDependentShape.forward, "<- picking line")
    with raises(CaptureError, where, "aten.nonzero", "depends on the values of a tensor", "static shapes"):
        capture(DataDependentShape(), (torch.randn(4, 8),), lambda out, inputs: out)


def test_data_dependent_control_flow_through_estimate() -> None:
    with raises(CaptureError, "data-dependent control flow"):
        autopar.estimate(DataDependent(), ONE_NODE, (meta(2, 8),), ParallelConfig(dp=8), global_batch_size=8)


def test_profile_not_available(plan_gpt) -> None:
    model, inputs, _ = plan_gpt
    with raises(ConfigError, "profile=True"):
        autopar.estimate(model, ONE_NODE, inputs, ParallelConfig(dp=8), global_batch_size=8, profile=True)


# --- plan files --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_dict(plan_graph) -> dict:
    return estimate_plan(plan_graph, ONE_NODE, ParallelConfig(dp=2, pp=4), 64).to_dict()


def _write(tmp_path, text: str):
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


def test_plan_truncated(tmp_path, plan_dict) -> None:
    text = json.dumps(plan_dict)
    with raises(PlanFormatError, "plan.json", "not valid JSON", "truncated"):
        load_plan(_write(tmp_path, text[: len(text) // 2]))


def test_plan_newer_schema(tmp_path, plan_dict) -> None:
    with raises(PlanFormatError, "schema_version 999", "upgrade autopar"):
        load_plan(_write(tmp_path, json.dumps({**plan_dict, "schema_version": 999})))


def test_plan_json_list(tmp_path) -> None:
    with raises(PlanFormatError, "JSON object", "list"):
        load_plan(_write(tmp_path, "[1, 2, 3]"))


def test_plan_missing_stages(tmp_path, plan_dict) -> None:
    data = {k: v for k, v in plan_dict.items() if k != "stages"}
    with raises(PlanFormatError, "'stages'"):
        load_plan(_write(tmp_path, json.dumps(data)))


def test_plan_missing_stage_field(tmp_path, plan_dict) -> None:
    stages = copy.deepcopy(plan_dict["stages"])  # the fixture is shared: never edit it in place
    del stages[2]["memory"]["activations"]
    with raises(PlanFormatError, "stages[2].memory.", "'activations'"):
        load_plan(_write(tmp_path, json.dumps({**plan_dict, "stages": stages})))


def test_plan_bad_config_value(tmp_path, plan_dict) -> None:
    with raises(PlanFormatError, "zero=9"):
        load_plan(_write(tmp_path, json.dumps({**plan_dict, "config": {**plan_dict["config"], "zero": 9}})))


def test_plan_missing_file(tmp_path) -> None:
    with raises(PlanFormatError, "nope.json"):
        load_plan(tmp_path / "nope.json")


def test_valid_plan_file_loads(tmp_path, plan_dict) -> None:
    # The corrupted files above start from this one, which does load.
    assert load_plan(_write(tmp_path, json.dumps(plan_dict))).to_dict() == plan_dict


@pytest.mark.parametrize("edit, fragments", [
    (lambda d: d.update(fits="false"), ("fits", "'false'", "true or false")),
    (lambda d: d.update(step_time=-1.0), ("step_time", "-1.0", ">= 0")),
    (lambda d: d.update(step_time=float("nan")), ("step_time", "nan", "finite")),
    (lambda d: d.update(micro_batches=2.5), ("micro_batches", "2.5", "integer")),
    (lambda d: d.update(notes="a note"), ("notes", "list of strings")),
    (lambda d: d.update(optimal="yes"), ("optimal", "'yes'", "or null")),
    (lambda d: d["stages"][1].update(layers="blocks.0"), ("stages[1].layers", "list of strings")),
    (lambda d: d["stages"][0]["memory"].update(params=None), ("stages[0].memory.params", "None")),
    (lambda d: d["config"].update(dp=4), ("dp*cp*tp*pp = 16", "has 8")),          # devices != cluster's
    (lambda d: d.update(global_batch_size=60), ("global_batch_size=60", "dp=2")),   # batch != dp x mbs x m
    (lambda d: d.update(stages=d["stages"][:3]), ("3 stages", "pp=4")),
    (lambda d: d["stages"][2].update(index=5), ("stages[2].index", "expected 2")),
    (lambda d: d.update(schema_version=0), ("schema_version 0", "re-create the plan")),
    (lambda d: d.update(fingerprint="0123456789abcdef"), ("fingerprint 0123456789abcdef", "structure's")),
    (lambda d: d["structure"]["layers"][0].append(1), ("structure.layers[0]", "[layer name, index of a body]")),
], ids=["fits-string", "negative", "nan", "float-count", "notes-string", "optimal-string", "layers-string",
        "memory-null", "devices", "batch", "stage-count", "stage-index", "old-version", "fingerprint", "structure"])
def test_plan_hand_edited(tmp_path, plan_dict, edit, fragments) -> None:
    data = copy.deepcopy(plan_dict)
    edit(data)
    with raises(PlanFormatError, *fragments):
        load_plan(_write(tmp_path, json.dumps(data)))


def test_plan_save_is_atomic(tmp_path, plan_dict, monkeypatch) -> None:
    """A crash between writing and renaming leaves the previous plan whole and no temporary file."""
    path = tmp_path / "plan.json"
    first = autopar.Plan.from_dict(plan_dict)
    first.save(path)
    second = autopar.Plan.from_dict({**plan_dict, "step_time": plan_dict["step_time"] * 2})

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")
    monkeypatch.setattr(sys.modules["autopar.files"].os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        second.save(path)
    assert load_plan(path) == first
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
