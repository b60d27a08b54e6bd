"""Plan exports (autopar/exports): golden files per stack, every field traced to the plan, each file valid
for its stack, and what a stack cannot express said rather than dropped.

The goldens are GPT-3 175B on 128 x 8 A100 (Megatron-LM's published recipe) and Llama 3 70B on 8 x 8
H100 (torchtitan's), made from the two plans stored in data/; regenerate them with
``python tests/unit/exports/make_goldens.py`` (make_goldens.py says where each recipe comes from).
Every file is checked against a schema written from its stack's source (export_schemas.py); the
stacks' own loaders read them in test_loaders.py. The plans beyond the goldens are cases.py's.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import json

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

import pytest

import autopar
from autopar import ConfigError
from autopar.cli import main
from autopar.exports import STACKS, export

import export_schemas as schemas
from cases import CASES, PLANS, RECIPES, VARIANTS, case_plan, even_chunks, variant_plan, with_partition
from make_goldens import STACK_FILES, golden_path, plan_path

CONSTANTS = {("accelerate", "compute_environment"), ("accelerate", "fsdp_config.fsdp_version")}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _resolve(data, path: str) -> list:
    """The values at a dotted path of Plan.to_dict() ("stages[].chunks", "extra.inputs.kwargs.x.shape[1]")."""
    values = [data]
    for part in path.split("."):
        name, _, index = part.partition("[")
        nxt = []
        for v in values:
            assert isinstance(v, dict) and name in v, f"plan has no field {path!r} (at {name!r})"
            v = v[name]
            if index == "]":
                nxt.extend(v)
            elif index:
                nxt.append(v[int(index.rstrip("]"))])
            else:
                nxt.append(v)
        values = nxt
    return values


def _yaml(text: str) -> dict:
    """The exports' YAML (two levels of `key: scalar`), read without PyYAML; checked against it below."""
    out: dict = {}
    section = None
    for line in text.splitlines():
        body = line.split("  #", 1)[0].rstrip()
        if not body or body.startswith("#"):
            continue
        key, _, value = body.strip().partition(":")
        value = value.strip()
        if not value:
            section = out.setdefault(key, {})
            continue
        scalar = (True if value == "true" else False if value == "false" else int(value) if value.isdigit()
                  else value.strip("'"))
        (section if line.startswith("  ") else out)[key] = scalar
    return out


def parsed(result, tmp_path) -> dict:
    """The exported file read back as its stack reads it, flattened to the exporter's field keys."""
    if result.stack == "torchtitan":
        return _flat(tomllib.loads(result.text))
    if result.stack == "DeepSpeed":
        return _flat(json.loads(result.text))
    if result.stack == "accelerate":
        data = _yaml(result.text)
        yaml = _optional("yaml")
        if yaml is not None:
            assert yaml.safe_load(result.text) == data
        return _flat(data)
    path = tmp_path / "args.sh"
    path.write_text(result.text)
    arrays = schemas.bash_arrays(str(path))
    out = {"env CUDA_DEVICE_MAX_CONNECTIONS": arrays["E"][0]} if arrays["E"][0] else {}
    for prefix, tokens in (("torchrun ", arrays["T"]), ("", arrays["M"])):
        i = 0
        while i < len(tokens):
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                out[prefix + tokens[i]] = tokens[i + 1]
                i += 2
            else:
                out[prefix + tokens[i]] = True
                i += 1
    return out


def _optional(name: str):
    return importlib.import_module(name) if importlib.util.find_spec(name) else None


# --- goldens ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("name", PLANS)
def test_export_matches_golden(plans, name, stack):
    text = export(plans[name], stack).text
    golden = golden_path(name, stack).read_text()
    if text != golden:
        diff = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True), "golden", "export"))
        pytest.fail(f"{stack} export of {name} differs from {golden_path(name, stack).name}; if the change is "
                    f"intended, run python tests/unit/exports/make_goldens.py and review the diff:\n{diff}")


def test_stored_plans_are_the_published_recipes(plans):
    for name, recipe in RECIPES.items():
        plan = plans[name]
        assert plan.model_name == recipe["model"] and plan.global_batch_size == recipe["global_batch"]
        assert plan.cluster.devices == autopar.Cluster.from_spec(recipe["cluster"]).devices
        for field, value in {**recipe["config"], **recipe["precision"]}.items():
            assert getattr(plan.config if field in recipe["config"] else plan.precision, field) == value, field
        assert plan.fits, f"{name} does not fit: the recipe is a published, running one"


# --- every field traced -------------------------------------------------------------------------------
def check_export(plan: autopar.Plan, stack: str, tmp_path) -> "autopar.exports.Export":
    """The export of ``plan``: each field cites its documentation and resolves to plan fields (or is one
    of the formats' few constants), the file read back holds exactly the fields, each field's comment
    is in the file where the format has comments, and the file passes its stack's schema."""
    result = export(plan, stack)
    data = plan.to_dict()
    for f in result.fields:
        assert f.doc, f"{f.key} cites no documentation"
        if not f.sources:
            assert (stack, f.key) in CONSTANTS, f"{stack} {f.key} comes from no plan field"
        for source in f.sources:
            assert _resolve(data, source), f"{f.key}: source {source} is empty"
    keys = [f.key for f in result.fields]
    assert len(keys) == len(set(keys)), "a key written twice"
    expected = {f.key: f.value for f in result.fields}
    if stack == "megatron":   # bash gives strings
        expected = {k: v if v is True else str(v) for k, v in expected.items()}
    assert parsed(result, tmp_path) == expected
    if stack != "deepspeed":   # the formats with comments name each value's source, and what is lost
        for f in result.fields:
            assert f.comment() in result.text, f.key
        flat = " ".join(line.lstrip("# ").strip() for line in result.text.splitlines() if line.startswith("#"))
        for w in result.warnings:
            assert " ".join(w.split()) in flat, w
    if stack == "torchtitan":
        schemas.check_torchtitan(tomllib.loads(result.text), plan.devices)
    elif stack == "megatron":
        result.write(tmp_path / "args.sh")
        schemas.check_megatron(schemas.bash_arrays(str(tmp_path / "args.sh")), plan.devices)
    elif stack == "deepspeed":
        schemas.check_deepspeed(json.loads(result.text), plan.devices, plan.config.pp, plan.precision.optimizer)
    else:
        schemas.check_accelerate(_yaml(result.text))
    return result


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("name", PLANS)
def test_every_field_is_traced_and_the_file_holds_exactly_the_fields(plans, name, stack, tmp_path):
    check_export(plans[name], stack, tmp_path)


# What each stack's core fields must be, computed from the plan here, independently of the exporters.
def _expected(plan: autopar.Plan, stack: str) -> dict:
    cfg, seq = plan.config, plan.extra["inputs"]["kwargs"]["input_ids"]["shape"][1]
    if stack == "torchtitan":
        return {"parallelism.tensor_parallel_degree": cfg.tp, "parallelism.pipeline_parallel_degree": cfg.pp,
                "parallelism.context_parallel_degree": cfg.cp, "parallelism.data_parallel_shard_degree": cfg.dp,
                "training.seq_len": seq, "training.global_batch_size": plan.global_batch_size,
                "training.local_batch_size": cfg.micro_batch_size * (plan.micro_batches if cfg.pp > 1 else 1)}
    if stack == "megatron":
        return {"--tensor-model-parallel-size": cfg.tp, "--pipeline-model-parallel-size": cfg.pp,
                "--micro-batch-size": cfg.micro_batch_size, "--global-batch-size": plan.global_batch_size,
                "--seq-length": seq, f"--{plan.precision.compute}": True,
                "--recompute-granularity": cfg.recompute, "torchrun --nnodes": plan.cluster.nodes}
    if stack == "deepspeed":
        return {"train_batch_size": plan.global_batch_size, "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
                "gradient_accumulation_steps": plan.micro_batches, "tensor_parallel.autotp_size": cfg.tp,
                f"{plan.precision.compute}.enabled": True}
    return {"num_processes": plan.devices, "num_machines": plan.cluster.nodes,
            "mixed_precision": plan.precision.compute, "parallelism_config.parallelism_config_tp_size": cfg.tp,
            "fsdp_config.fsdp_activation_checkpointing": cfg.recompute != "none"}


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("name", PLANS)
def test_core_fields_carry_the_plan_values(plans, name, stack):
    result = export(plans[name], stack)
    for key, value in _expected(plans[name], stack).items():
        assert result.field(key).value == value, key


# --- valid for each stack: schema from its documentation, and its own loader where it imports ---------
@pytest.mark.parametrize("name", PLANS)
def test_files_follow_the_stacks_schemas(plans, name, tmp_path):
    plan = plans[name]
    schemas.check_torchtitan(tomllib.loads(export(plan, "torchtitan").text), plan.devices)
    export(plan, "megatron", tmp_path / "args.sh")
    schemas.check_megatron(schemas.bash_arrays(str(tmp_path / "args.sh")), plan.devices)
    schemas.check_deepspeed(json.loads(export(plan, "deepspeed").text), plan.devices, plan.config.pp)
    schemas.check_accelerate(_yaml(export(plan, "accelerate").text))


def test_schemas_refuse_what_the_stacks_refuse(plans, tmp_path):
    """The schema checks can fail: a misspelt key, a bad degree product, a bad layout."""
    plan = plans["gpt3-175b_128x8xA100"]
    titan = tomllib.loads(export(plan, "torchtitan").text)
    with pytest.raises(AssertionError, match="unknown key"):
        schemas.check_torchtitan({**titan, "parallelism": {**titan["parallelism"], "tensor_parallel_degre": 8}},
                                 plan.devices)
    with pytest.raises(AssertionError, match="!= 1024"):
        schemas.check_torchtitan({**titan, "parallelism": {**titan["parallelism"], "tensor_parallel_degree": 4}},
                                 plan.devices)
    megatron = {"T": ["--nnodes", "128", "--nproc-per-node", "8"], "E": ["1"],
                "M": ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--num-layers", "96",
                      "--pipeline-model-parallel-layout", "Et*47|t*49L", "--micro-batch-size", "1",
                      "--global-batch-size", "1536"]}
    with pytest.raises(AssertionError, match="not divisible by pp"):
        schemas.check_megatron(megatron, plan.devices)
    megatron["M"][-5] = "|".join(["t*6"] * 16) + "L"
    with pytest.raises(AssertionError, match="the embedding"):
        schemas.check_megatron(megatron, plan.devices)
    megatron["M"][-5] = "E" + "|".join(["t*6"] * 16) + "L"
    schemas.check_megatron(megatron, plan.devices)      # a valid layout passes
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        schemas.check_megatron({**megatron, "E": [""]}, plan.devices)
    ds = json.loads(export(plan, "deepspeed").text)
    with pytest.raises(AssertionError, match="incompatible|< 2"):
        schemas.check_deepspeed({**ds, "zero_optimization": {"stage": 3}}, plan.devices, plan.config.pp)
    with pytest.raises(AssertionError, match="unsupported mix"):
        schemas.check_deepspeed({**ds, "data_types": {"grad_accum_dtype": "fp32"}}, plan.devices, plan.config.pp)
    with pytest.raises(AssertionError, match="untested ZeRO Optimizer"):
        schemas.check_deepspeed({**ds, "zero_optimization": {"stage": 1}}, plan.devices, plan.config.pp, "sgd")
    with pytest.raises(AssertionError, match="without enabled: true is ignored"):
        schemas.check_deepspeed({**ds, "expert_parallel": {"autoep_size": 2}}, plan.devices, plan.config.pp)
    with pytest.raises(AssertionError, match="unknown key"):
        schemas.check_accelerate({**_yaml(export(plan, "accelerate").text), "fsdp_sharding": 1})
    offload = {"device": "cpu", "pin_memory": True}
    with pytest.raises(AssertionError, match="valid only with ZeRO stage 3"):
        schemas.check_deepspeed({**ds, "zero_optimization": {"stage": 1, "offload_param": offload}}, plan.devices,
                                plan.config.pp)
    with pytest.raises(AssertionError, match="zero_force_ds_cpu_optimizer must be false"):
        schemas.check_deepspeed({**ds, "zero_optimization": {"stage": 1, "offload_optimizer": offload},
                                 "zero_allow_untested_optimizer": True}, plan.devices, plan.config.pp, "sgd")
    with pytest.raises(AssertionError, match="unknown key zero_optimization.offload_param.devic"):
        schemas.check_deepspeed({**ds, "zero_optimization": {"stage": 1, "offload_param": {"devic": "cpu"}}},
                                plan.devices, plan.config.pp)
    with pytest.raises(AssertionError, match="precision-aware-optimizer"):
        schemas.check_megatron({**megatron, "M": megatron["M"] + ["--optimizer-cpu-offload"]}, plan.devices)
    with pytest.raises(AssertionError, match="only supported with adam"):
        schemas.check_megatron({**megatron, "M": megatron["M"] + ["--use-precision-aware-optimizer",
                                                                  "--use-distributed-optimizer", "--optimizer", "sgd"]},
                               plan.devices)
    with pytest.raises(AssertionError, match="enable_cpu_offload without FSDP"):
        schemas.check_torchtitan({**titan, "training": {**titan["training"], "enable_cpu_offload": True},
                                  "parallelism": {**titan["parallelism"], "data_parallel_shard_degree": 1,
                                                  "data_parallel_replicate_degree": titan["parallelism"][
                                                      "data_parallel_shard_degree"]}}, plan.devices)


# --- other configurations: the same checks on plans the goldens do not cover ----------------------
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_other_configurations_export_traced_and_valid(plans, variant, stack, tmp_path):
    """Configurations the goldens do not have (every schedule, ZeRO stage, partial and per-stage
    recomputation, an uneven partition, context and expert parallelism, other precisions): each export
    is traced, holds its fields and passes its stack's schema."""
    plan = variant_plan(plans, variant)
    result = check_export(plan, stack, tmp_path)
    if plan.config.stage_recompute:
        assert any("config.stage_recompute" in w for w in result.warnings)
    if plan.config.recompute == "op":   # torchtitan's own per-op policy; the others say what they write instead
        if stack == "torchtitan":
            assert result.field("activation_checkpoint.selective_ac_option").value == "op"
        else:
            assert any("config.recompute = 'op'" in w for w in result.warnings)


# --- what a stack cannot express is said ------------------------------------------------------------
def _held(plan: autopar.Plan) -> list[str]:
    """The plan fields an export must write (a field's source) or name (a warning) when the stack's default
    does not already hold them: the optimizer, the batch, the ZeRO stage, the parallel degrees, 16-bit
    compute and the master-weight choice."""
    cfg, prec = plan.config, plan.precision
    paths = ["precision.optimizer", "global_batch_size", "config.micro_batch_size"]
    paths += [f"config.{k}" for k in ("zero", "tp", "pp", "cp", "ep") if getattr(cfg, k) > (0 if k == "zero" else 1)]
    if cfg.offload != "none":
        paths.append("config.offload")
    if prec.compute != "fp32":
        paths.append("precision.compute")
        if not prec.master_weights:
            paths.append("precision.master_weights")
    return paths


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("name", CASES)
def test_nothing_the_plan_holds_is_dropped_without_a_word(plans, name, stack):
    plan = case_plan(plans, name)
    result = export(plan, stack)
    for path in _held(plan):
        assert any(path in f.sources for f in result.fields) or any(path in w for w in result.warnings), \
            f"the {stack} export of {name} neither writes nor names {path}"


def test_uneven_partition_is_a_megatron_layout_and_torchtitan_module_lists(plans, tmp_path):
    plan = plans["gpt3-175b_128x8xA100"]
    order = [n for c in autopar.exports.common.chunks_in_order(plan) for n in c]
    # 8 stages, 1F1B: the first holds the embeddings and 10 blocks, the last 14 blocks and the head
    sizes = [12, 12, 12, 12, 12, 12, 12, 16]
    chunks, i = [], 0
    for size in sizes:
        chunks.append(order[i:i + size])
        i += size
    uneven = with_partition(plan, chunks, dp=16, pp=8, schedule="1f1b", virtual_stages=1)
    uneven = dataclasses.replace(uneven, micro_batches=96)
    meg = export(uneven, "megatron", tmp_path / "m.sh")
    layout = meg.field("--pipeline-model-parallel-layout").value
    assert layout == "Et*10|" + "|".join(["t*12"] * 6) + "|t*14L"
    schemas.check_megatron(schemas.bash_arrays(str(tmp_path / "m.sh")), uneven.devices)
    titan = export(uneven, "torchtitan").field("parallelism.module_fqns_per_model_part").value
    assert [len(p) for p in titan] == [11, 12, 12, 12, 12, 12, 12, 16]
    assert titan[0][:2] == ["tok_embeddings", "layers.0"] and titan[-1][-2:] == ["norm", "output"]
    ds = export(uneven, "deepspeed")
    assert any("stage boundaries" in w and "blocks.10" in w for w in ds.warnings)


def test_per_stage_recompute_is_said_by_every_stack(plans):
    plan = plans["gpt3-175b_128x8xA100"]
    order = [n for c in autopar.exports.common.chunks_in_order(plan) for n in c]
    chunks = [order[i * 25:(i + 1) * 25] for i in range(3)] + [order[75:]]
    mixed = with_partition(plan, chunks, dp=32, pp=4, schedule="1f1b", virtual_stages=1, recompute="none",
                           stage_recompute=("full", "full", "selective", "none"))
    mixed = dataclasses.replace(mixed, micro_batches=48)
    for stack in STACKS:
        result = export(mixed, stack)
        assert any("config.stage_recompute" in w and "'full' everywhere" in w for w in result.warnings), stack
        if stack != "deepspeed":
            assert "config.stage_recompute" in result.text    # in the file's comments too
    assert export(mixed, "megatron").field("--recompute-granularity").value == "full"
    assert export(mixed, "torchtitan").field("activation_checkpoint.mode").value == "full"
    assert export(mixed, "deepspeed").field("pipeline.activation_checkpoint_interval").value == 1


def test_zero3_with_a_pipeline_falls_back_where_stacks_forbid_it(plans):
    plan = plans["gpt3-175b_128x8xA100"]
    zero3 = dataclasses.replace(plan, config=dataclasses.replace(plan.config, zero=3))
    ds = export(zero3, "deepspeed")
    assert ds.field("zero_optimization.stage").value == 1
    [warning] = [w for w in ds.warnings if "config.zero = 3" in w]
    assert "incompatible with pipeline parallelism" in warning and "GB per device" in warning
    meg = export(zero3, "megatron")
    assert meg.field("--use-distributed-optimizer").value is True
    assert not any(f.key == "--use-megatron-fsdp" for f in meg.fields)
    assert any("Megatron FSDP" in w for w in meg.warnings)
    assert export(zero3, "torchtitan").field("parallelism.fsdp_reshard_after_forward").value == "always"


def test_context_and_expert_parallelism_where_a_stack_has_none(plans):
    plan = plans["llama3-70b_8x8xH100"]
    cp = dataclasses.replace(plan, config=dataclasses.replace(plan.config, dp=4, cp=2))
    ds = export(cp, "deepspeed")
    assert any("config.cp = 2" in w and "Ulysses" in w for w in ds.warnings)
    assert not any("sequence_parallel_size" == f.key for f in ds.fields)
    assert export(cp, "megatron").field("--context-parallel-size").value == 2
    assert export(cp, "torchtitan").field("parallelism.context_parallel_degree").value == 2
    assert export(cp, "accelerate").field("parallelism_config.parallelism_config_cp_size").value == 2
    ep = dataclasses.replace(plan, config=dataclasses.replace(plan.config, ep=2))
    assert any("config.ep = 2" in w for w in export(ep, "accelerate").warnings)
    ds = export(ep, "deepspeed")
    assert ds.field("expert_parallel.enabled").value is True and ds.field("expert_parallel.autoep_size").value == 2
    assert any("AutoEP replaces" in w and "moe_layer_pattern" in w for w in ds.warnings)
    [split] = [w for w in ds.warnings if "does not split experts with tensor parallelism" in w]
    assert "8 x the expert weights" in split and "autoep_size = 16" in split
    assert any("configure_moe_param_groups" in w for w in ds.warnings)
    assert export(ep, "torchtitan").field("parallelism.expert_tensor_parallel_degree").value == 8


def test_partial_recompute_maps_to_every_nth_block_in_torchtitan(plans):
    plan = plans["gpt3-175b_128x8xA100"]
    order = [n for c in autopar.exports.common.chunks_in_order(plan) for n in c]
    blocks = [n for n in order if n.startswith("blocks.")]
    chunks = [order[:2] + blocks[:24]] + [blocks[24 * i:24 * (i + 1)] for i in range(1, 3)] + [blocks[72:] + order[-2:]]
    part = with_partition(plan, chunks, dp=32, pp=4, schedule="1f1b", virtual_stages=1, recompute="full",
                          recompute_layers=6)
    part = dataclasses.replace(part, micro_batches=48)
    titan = export(part, "torchtitan")
    assert titan.field("activation_checkpoint.selective_ac_option").value == "4"    # 6 of each 24
    meg = export(part, "megatron")
    assert meg.field("--recompute-method").value == "block" and meg.field("--recompute-num-layers").value == 6


def test_ddp_without_other_parallelism(plans):
    plan = plans["llama3-70b_8x8xH100"]
    ddp = dataclasses.replace(plan, config=dataclasses.replace(plan.config, dp=64, tp=1, zero=0, sequence_parallel=False,
                                                                micro_batch_size=1), micro_batches=1)
    titan = export(ddp, "torchtitan")
    assert titan.field("parallelism.data_parallel_replicate_degree").value == 64
    assert not any("fsdp" in f.key for f in titan.fields)
    acc = export(ddp, "accelerate")
    assert acc.field("distributed_type").value == "MULTI_GPU" and not any("fsdp" in f.key for f in acc.fields)
    assert any("gradient_checkpointing_enable" in w for w in acc.warnings)
    schemas.check_accelerate(_yaml(acc.text))


# --- API and command line ---------------------------------------------------------------------------
def test_plan_export_writes_the_file(plans, tmp_path):
    plan = plans["llama3-70b_8x8xH100"]
    result = plan.export("torchtitan", tmp_path / "sub" / "t.toml")
    assert (tmp_path / "sub" / "t.toml").read_text() == result.text == golden_path(
        "llama3-70b_8x8xH100", "torchtitan").read_text()
    with pytest.raises(ConfigError, match="one of torchtitan, megatron, deepspeed, accelerate"):
        plan.export("nemo")
    with pytest.raises(KeyError, match="has no field"):
        result.field("parallelism.nope")


def test_cli_export(plans, capsys, tmp_path):
    name = "gpt3-175b_128x8xA100"
    assert main(["export", str(plan_path(name)), "--to", "megatron", "-o", str(tmp_path / "m.sh"), "--trace"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "m.sh").read_text() == golden_path(name, "megatron").read_text()
    assert "wrote" in out and "--tensor-model-parallel-size = 8  <- config.tp" in out
    assert main(["export", str(plan_path(name)), "--to", "deepspeed"]) == 0
    captured = capsys.readouterr()
    assert captured.out == golden_path(name, "deepspeed").read_text()       # stdout is the file alone
    assert "DeepSpeed cannot express" in captured.err and "PipelineModule" in captured.err
    assert main(["export", str(tmp_path / "missing.json"), "--to", "accelerate"]) == 2
    assert "cannot read plan file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(plan_path(name)), "--to", "nemo"])
    assert set(STACK_FILES) == set(STACKS)


def test_a_plan_without_structure_is_read_by_its_layer_names(plans):
    """Plans of schema 1 have no structure: the blocks, embeddings, norm and head come from the names."""
    plan = plans["gpt3-175b_128x8xA100"]
    old = dataclasses.replace(plan, structure=None, schema_version=1)
    for stack in ("torchtitan", "megatron"):
        new_fields = {f.key: f.value for f in export(plan, stack).fields}
        assert {f.key: f.value for f in export(old, stack).fields} == new_fields
    assert "stages[].layers" in export(old, "megatron").field("--num-layers").sources


def test_a_plan_that_does_not_fit_says_so_first(plans):
    plan = dataclasses.replace(plans["llama3-70b_8x8xH100"], fits=False)
    for stack in STACKS:
        assert export(plan, stack).warnings[0].startswith("the plan does not fit")


def test_accelerate_folds_a_pipeline_into_ddp_without_tensor_parallelism(plans, tmp_path):
    plan = plans["gpt3-175b_128x8xA100"]
    order = [n for c in autopar.exports.common.chunks_in_order(plan) for n in c]
    chunks = [order[i * 12:(i + 1) * 12] for i in range(7)] + [order[84:]]
    piped = with_partition(plan, chunks, dp=128, tp=1, pp=8, schedule="1f1b", virtual_stages=1,
                           sequence_parallel=False)
    piped = dataclasses.replace(piped, micro_batches=12)
    result = check_export(piped, "accelerate", tmp_path)
    assert result.field("distributed_type").value == "MULTI_GPU"
    [fold] = [w for w in result.warnings if w.startswith("config.pp = 8")]
    assert "DDP replicas" in fold and "--config dp=1024,tp=1,cp=1,pp=1,zero=0" in fold


def test_fp8_plans_carry_each_stacks_fp8_switches(plans):
    fp8 = {v[2].get("recipe"): i for i, v in enumerate(VARIANTS) if v[2].get("compute") == "fp8"}
    tensorwise, rowwise, mx = (variant_plan(plans, fp8[r]) for r in ("tensorwise", "rowwise_with_gw_hp", "mxfp8"))
    titan = tomllib.loads(export(tensorwise, "torchtitan").text)
    assert titan["model"]["converters"] == ["quantize.linear.float8"]
    assert titan["quantize"]["linear"]["float8"] == {"recipe_name": "tensorwise",   # ZeRO-3 at tp = 1: fp8 gathers
                                                     "enable_fsdp_float8_all_gather": True,
                                                     "precompute_float8_dynamic_scale_for_fsdp": True}
    assert titan["training"]["mixed_precision_param"] == "bfloat16"
    titan_mx = tomllib.loads(export(mx, "torchtitan").text)
    assert titan_mx["model"]["converters"] == ["quantize.linear.mx"]
    assert titan_mx["quantize"]["linear"]["mx"] == {"recipe_name": "mxfp8_cublas", "filter_fqns": []}
    args = export(tensorwise, "megatron").text
    assert "--fp8-format hybrid" in args and "--fp8-recipe tensorwise" in args and "--bf16" in args
    rows = export(rowwise, "megatron")
    assert rows.field("--fp8-recipe").value == "blockwise"
    assert any("no row-wise fp8 recipe" in w and "bf16 weight gradient" in w for w in rows.warnings)
    acc = export(tensorwise, "accelerate")
    assert acc.field("mixed_precision").value == "fp8" and acc.field("fp8_config.backend").value == "AO"
    assert export(mx, "accelerate").field("fp8_config.use_mxfp8_block_scaling").value is True
    assert any("AORecipeKwargs" in w and "rowwise_with_gw_hp" in w for w in export(rowwise, "accelerate").warnings)
    ds = export(tensorwise, "deepspeed")
    assert ds.field("bf16.enabled").value is True
    assert any("no fp8 training switch" in w for w in ds.warnings)


def test_fp8_gathers_are_each_stacks_fp8_all_gather(plans, tmp_path):
    """A tensor-wise plan that gathers its linear weights in fp8 (Precision.gathers_fp8: ZeRO-3 over replicas, no
    tensor parallelism): torchtitan's and accelerate's FSDP2 fp8 all-gather switched on with the scales from one
    all-reduce a step (torchtitan's precompute switch; accelerate hooks it to the optimizer step itself); the
    same plan with tensor parallelism gathers in bf16 and says so; Megatron-LM and DeepSpeed say they gather bf16."""
    fp8 = {v[2].get("recipe"): i for i, v in enumerate(VARIANTS) if v[2].get("compute") == "fp8"}
    gathering = variant_plan(plans, fp8["tensorwise"])   # dp=64 tp=1 zero=3
    assert gathering.precision.gathers_fp8(gathering.config)
    titan = check_export(gathering, "torchtitan", tmp_path)
    assert titan.field("quantize.linear.float8.enable_fsdp_float8_all_gather").value is True
    assert titan.field("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp").value is True
    assert check_export(gathering, "accelerate", tmp_path).field("fp8_config.enable_fsdp_float8_all_gather").value
    assert any("--fp8-param-gather" in w for w in check_export(gathering, "megatron", tmp_path).warnings)
    assert any("DeepSpeed's ZeRO-3 does not" in w for w in check_export(gathering, "deepspeed", tmp_path).warnings)
    tp = with_partition(gathering, even_chunks(gathering, 1, 0), dp=8, tp=8)
    assert not tp.precision.gathers_fp8(tp.config)
    assert check_export(tp, "torchtitan", tmp_path).field("quantize.linear.float8.enable_fsdp_float8_all_gather") \
        .value is False
    assert export(tp, "accelerate").field("fp8_config.enable_fsdp_float8_all_gather").value is False


# --- offload (config.offload "all" and "optimizer"): each stack's own switches, and none without it -----
def _offload_plans(offload: str = "all", zero: int = 3) -> tuple[autopar.Plan, autopar.Plan]:
    """A plan of ParallelConfig(dp=2, zero=zero, offload=offload) on two H100s, and the same without offload, made
    by autopar.estimate on a small model (the offloaded one from the plain plan if estimate refuses offload)."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                      torch.nn.Linear(256, 64)) for _ in range(4)])
    cluster, inputs = autopar.Cluster.from_spec("1x2xH100-SXM"), (torch.randn(4, 64),)
    plain = autopar.estimate(model, cluster, inputs, autopar.ParallelConfig(dp=2, zero=zero), global_batch_size=8)
    try:
        offloaded = autopar.estimate(model, cluster, inputs, autopar.ParallelConfig(dp=2, zero=zero, offload=offload),
                                     global_batch_size=8)
    except (ConfigError, NotImplementedError):
        offloaded = dataclasses.replace(plain, config=dataclasses.replace(plain.config, offload=offload))
    assert offloaded.config.offload == offload and plain.config.offload == "none"
    return offloaded, plain


OFFLOAD_KEYS = {
    "deepspeed": {"zero_optimization.offload_param.device": "cpu", "zero_optimization.offload_param.pin_memory": True,
                  "zero_optimization.offload_optimizer.device": "cpu",
                  "zero_optimization.offload_optimizer.pin_memory": True},
    "torchtitan": {"training.enable_cpu_offload": True},
    "accelerate": {"fsdp_config.fsdp_offload_params": True},
    "megatron": {"--optimizer-cpu-offload": True, "--optimizer-offload-fraction": 1.0,
                 "--use-precision-aware-optimizer": True, "--overlap-cpu-optimizer-d2h-h2d": True},
}


def _assert_switches(exported, stack: str, switches: dict) -> None:
    """Each of ``switches`` (key -> value) written by ``exported`` with that value, from config.offload."""
    fields = {f.key: f.value for f in exported.fields}
    for key, value in switches.items():
        assert fields.get(key) == value, (stack, key)
        assert exported.field(key).sources == ("config.offload",), (stack, key)


def test_offload_writes_each_stacks_switches_and_nothing_without_it(tmp_path):
    offloaded, plain = _offload_plans()
    for stack in STACKS:
        on = check_export(offloaded, stack, tmp_path)
        _assert_switches(on, stack, OFFLOAD_KEYS[stack])
        off = check_export(plain, stack, tmp_path)
        assert not set(OFFLOAD_KEYS[stack]) & {f.key for f in off.fields}, stack
        assert not any("offload" in f.key for f in off.fields), stack
        assert not any("config.offload" in w for w in off.warnings), stack
    # in the files as the stacks read them
    ds = json.loads(export(offloaded, "deepspeed").text)["zero_optimization"]
    assert ds == {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                  "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert "offload" not in json.dumps(json.loads(export(plain, "deepspeed").text))
    titan = tomllib.loads(export(offloaded, "torchtitan").text)
    assert titan["training"]["enable_cpu_offload"] is True
    assert titan["parallelism"]["fsdp_reshard_after_forward"] == "always"
    assert "enable_cpu_offload" not in tomllib.loads(export(plain, "torchtitan").text)["training"]
    acc = _yaml(export(offloaded, "accelerate").text)["fsdp_config"]
    assert acc["fsdp_offload_params"] is True and acc["fsdp_reshard_after_forward"] is True
    assert "fsdp_offload_params" not in _yaml(export(plain, "accelerate").text)["fsdp_config"]
    args = export(offloaded, "megatron").text
    for flag in ("--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0", "--use-precision-aware-optimizer",
                 "--overlap-cpu-optimizer-d2h-h2d", "--use-distributed-optimizer", "--use-megatron-fsdp"):
        assert flag in args, flag
    assert "offload" not in export(plain, "megatron").text.split("AUTOPAR_MEGATRON_ARGS=(", 1)[1]
    # what a stack cannot express is said: Megatron keeps the parameters on the GPU; DeepSpeed wants its CPU Adam
    [meg] = [w for w in export(offloaded, "megatron").warnings if w.startswith("config.offload")]
    assert "offloads the optimizer only" in meg and "sharded by Megatron FSDP: about" in meg and "instead of" in meg
    assert any("DeepSpeedCPUAdam(model.parameters(), lr=...)" in w and "ZeRO-Offload" in w
               for w in export(offloaded, "deepspeed").warnings)
    assert not any("DeepSpeedCPUAdam" in w for w in export(plain, "deepspeed").warnings)


def test_offload_where_a_stack_offloads_less(plans, tmp_path):
    """A pipeline (DeepSpeed and Megatron-LM fall back to ZeRO-1: the optimizer only), SGD (Megatron-LM's CPU
    offload runs Adam only; DeepSpeed's needs its CPU optimizer forced off), one data-parallel rank
    (torchtitan applies FSDP, and so its offload, over more than one) and one device (accelerate: no FSDP)."""
    [piped] = [variant_plan(plans, i) for i, v in enumerate(VARIANTS)
               if v[1].get("offload") == "all" and v[1].get("pp", 1) > 1]
    ds = check_export(piped, "deepspeed", tmp_path)
    assert ds.field("zero_optimization.stage").value == 1
    assert ds.field("zero_optimization.offload_optimizer.device").value == "cpu"
    assert not any(f.key.startswith("zero_optimization.offload_param") for f in ds.fields)
    assert any('config.offload = "all" with pp = 8' in w and "only under ZeRO-3" in w for w in ds.warnings)
    meg = check_export(piped, "megatron", tmp_path)
    assert meg.field("--optimizer-cpu-offload").value is True and meg.field("--use-distributed-optimizer").value
    assert not any(f.key == "--use-megatron-fsdp" for f in meg.fields)
    assert any(w.startswith('config.offload = "all":') and "whole under the distributed optimizer" in w
               for w in meg.warnings)
    assert check_export(piped, "torchtitan", tmp_path).field("training.enable_cpu_offload").value is True

    [sgd] = [variant_plan(plans, i) for i, v in enumerate(VARIANTS)
             if v[1].get("offload") == "all" and v[2].get("optimizer")]
    meg = check_export(sgd, "megatron", tmp_path)
    assert not any("offload" in f.key or f.key == "--use-precision-aware-optimizer" for f in meg.fields)
    assert any("config.offload = \"all\" with precision.optimizer = 'sgd'" in w and "Adam only" in w
               for w in meg.warnings)
    ds = check_export(sgd, "deepspeed", tmp_path)
    assert ds.field("zero_force_ds_cpu_optimizer").value is False
    assert ds.field("zero_optimization.offload_param.device").value == "cpu"
    assert any("zero_force_ds_cpu_optimizer is false" in w for w in ds.warnings)

    base = plans["llama3-70b_8x8xH100"]
    one_rank = with_partition(base, [list(c) for c in autopar.exports.common.chunks_in_order(base)], dp=1, tp=8,
                              zero=3, offload="all")
    one_rank = dataclasses.replace(one_rank, cluster=dataclasses.replace(base.cluster, nodes=1),
                                   global_batch_size=base.config.micro_batch_size * 4, micro_batches=4)
    titan = check_export(one_rank, "torchtitan", tmp_path)
    assert not any(f.key == "training.enable_cpu_offload" for f in titan.fields)
    assert any('config.offload = "all" with dp = 1 and cp = 1' in w for w in titan.warnings)
    assert check_export(one_rank, "accelerate", tmp_path).field("fsdp_config.fsdp_offload_params").value is True

    single = with_partition(base, [list(c) for c in autopar.exports.common.chunks_in_order(base)], dp=1, tp=1,
                            zero=3, offload="all", sequence_parallel=False)
    single = dataclasses.replace(single, cluster=dataclasses.replace(base.cluster, nodes=1, devices_per_node=1),
                                 global_batch_size=base.config.micro_batch_size, micro_batches=1)
    acc = check_export(single, "accelerate", tmp_path)
    assert acc.field("distributed_type").value == "NO" and not any("fsdp" in f.key for f in acc.fields)
    assert any('config.offload = "all" on one device' in w for w in acc.warnings)


OPTIMIZER_OFFLOAD_KEYS = {   # offload="optimizer": the optimizer's offload alone, where a stack has one
    "deepspeed": {"zero_optimization.offload_optimizer.device": "cpu",
                  "zero_optimization.offload_optimizer.pin_memory": True},
    "megatron": OFFLOAD_KEYS["megatron"],
    "torchtitan": {},
    "accelerate": {},
}


def test_offload_optimizer_writes_the_optimizers_offload_alone(tmp_path):
    """offload = "optimizer" (the optimizer states and step on the CPU, any ZeRO stage) is DeepSpeed's
    offload_optimizer alone and Megatron-LM's optimizer CPU offload, exactly and without a word; torchtitan and
    accelerate have no optimizer-only offload (their one switch, FSDP2's CPUOffloadPolicy, moves the parameters
    and gradients too): nothing is written, and that is said with the memory the optimizer then takes."""
    offloaded, plain = _offload_plans("optimizer", zero=1)
    for stack in STACKS:
        on = check_export(offloaded, stack, tmp_path)
        _assert_switches(on, stack, OPTIMIZER_OFFLOAD_KEYS[stack])
        assert {f.key for f in on.fields if "config.offload" in f.sources} == set(OPTIMIZER_OFFLOAD_KEYS[stack]), stack
        assert not any(f.key in OFFLOAD_KEYS[stack] for f in on.fields if f.key not in OPTIMIZER_OFFLOAD_KEYS[stack])
        said = [w for w in on.warnings if "config.offload" in w]
        if stack in ("deepspeed", "megatron"):
            assert not said, (stack, said)         # the stack's own optimizer offload: nothing lost
        else:
            [w] = said
            assert w.startswith('config.offload = "optimizer": ') and "no optimizer-only CPU offload" in w, w
            assert "CPUOffloadPolicy" in w and "parameter and gradient shards in host memory too" in w, w
            assert "stay on the GPU, sharded by FSDP" in w and "GB per device" in w, w
        off = check_export(plain, stack, tmp_path)
        assert not any("config.offload" in w for w in off.warnings), stack
    # in the files as the stacks read them
    ds = json.loads(export(offloaded, "deepspeed").text)
    assert ds["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "overlap_comm": True}
    assert "zero_force_ds_cpu_optimizer" not in ds    # Adam: DeepSpeedCPUAdam, which the warning names
    assert any("DeepSpeedCPUAdam(model.parameters(), lr=...)" in w and "ZeRO-Offload" in w
               for w in export(offloaded, "deepspeed").warnings)
    args = export(offloaded, "megatron").text
    for flag in ("--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0", "--use-precision-aware-optimizer",
                 "--overlap-cpu-optimizer-d2h-h2d", "--use-distributed-optimizer"):
        assert flag in args, flag
    assert "--use-megatron-fsdp" not in args
    assert export(offloaded, "megatron").field("--use-distributed-optimizer").sources == ("config.zero",)
    assert "enable_cpu_offload" not in tomllib.loads(export(offloaded, "torchtitan").text)["training"]
    acc = _yaml(export(offloaded, "accelerate").text)
    assert acc["distributed_type"] == "FSDP" and "fsdp_offload_params" not in acc["fsdp_config"]
    assert any("deepspeed_config.offload_optimizer_device: cpu" in w for w in export(offloaded, "accelerate").warnings)


def test_offload_optimizer_where_a_stack_needs_zero_or_adam(plans, tmp_path):
    """ZeRO-0 (DeepSpeed runs offload_optimizer under ZeRO only; Megatron-LM's precision-aware optimizer only
    under the distributed optimizer: both written as ZeRO-1, and said), a pipeline with SGD (DeepSpeed's
    pipeline stage 1 keeps offload_optimizer, with its CPU optimizer forced off; Megatron-LM's CPU offload runs
    Adam only) and one device (ZeRO-1 on one rank is the plan's ZeRO-0; the optimizer whole on the GPU)."""
    [zero0] = [variant_plan(plans, i) for i, v in enumerate(VARIANTS)
               if v[1].get("offload") == "optimizer" and v[1]["zero"] == 0]
    ds = check_export(zero0, "deepspeed", tmp_path)
    stage = ds.field("zero_optimization.stage")
    assert stage.value == 1 and stage.sources == ("config.zero", "config.offload")
    assert ds.field("zero_optimization.offload_optimizer.device").value == "cpu"
    assert not any(f.key.startswith("zero_optimization.offload_param") for f in ds.fields)
    [w] = [w for w in ds.warnings if w.startswith('config.zero = 0 with config.offload = "optimizer"')]
    assert "DeepSpeed needs ZeRO stage 1 or higher for offload_optimizer" in w and "over the 8 data-parallel" in w
    meg = check_export(zero0, "megatron", tmp_path)
    dist = meg.field("--use-distributed-optimizer")
    assert dist.value is True and dist.sources == ("config.zero", "config.offload")
    assert meg.field("--optimizer-cpu-offload").value is True
    [w] = [w for w in meg.warnings if w.startswith('config.zero = 0 with config.offload = "optimizer"')]
    assert "only supported with distributed optimizer" in w and "over the 8 data-parallel" in w
    assert not any(w.startswith('config.offload = "optimizer"') for w in meg.warnings)
    titan = check_export(zero0, "torchtitan", tmp_path)   # ZeRO-0 with tensor parallelism: torchtitan's FSDP
    assert any(w.startswith('config.offload = "optimizer"') and "sharded by FSDP over the 8" in w
               for w in titan.warnings)

    [piped] = [variant_plan(plans, i) for i, v in enumerate(VARIANTS)
               if v[1].get("offload") == "optimizer" and v[1].get("pp", 1) > 1]
    assert piped.precision.optimizer == "sgd"
    ds = check_export(piped, "deepspeed", tmp_path)
    assert ds.field("zero_optimization.stage").value == 1        # the pipeline engine's highest stage
    assert ds.field("zero_optimization.offload_optimizer.device").value == "cpu"
    assert not any(f.key.startswith("zero_optimization.offload_param") for f in ds.fields)
    assert ds.field("zero_force_ds_cpu_optimizer").value is False
    assert ds.field("zero_allow_untested_optimizer").value is True
    assert any(w.startswith("config.zero = 2 with pp = 8") for w in ds.warnings)
    assert not any(w.startswith("config.offload") for w in ds.warnings)
    meg = check_export(piped, "megatron", tmp_path)
    assert not any("offload" in f.key or f.key == "--use-precision-aware-optimizer" for f in meg.fields)
    assert any("config.offload = \"optimizer\" with precision.optimizer = 'sgd'" in w and "Adam only" in w
               and "the optimizer states stay on the GPU" in w for w in meg.warnings)
    acc = check_export(piped, "accelerate", tmp_path)
    assert any(w.startswith('config.offload = "optimizer"') and "folded plan" in w for w in acc.warnings)

    base = plans["llama3-70b_8x8xH100"]
    single = with_partition(base, [list(c) for c in autopar.exports.common.chunks_in_order(base)], dp=1, tp=1,
                            zero=0, offload="optimizer", sequence_parallel=False)
    single = dataclasses.replace(single, cluster=dataclasses.replace(base.cluster, nodes=1, devices_per_node=1),
                                 precision=dataclasses.replace(base.precision, grads="bf16"),
                                 global_batch_size=base.config.micro_batch_size, micro_batches=1)
    ds = check_export(single, "deepspeed", tmp_path)
    assert ds.field("zero_optimization.stage").value == 1
    assert any(w.startswith('config.zero = 0 with config.offload = "optimizer"')
               and "with one data-parallel rank the same as the plan's ZeRO-0" in w for w in ds.warnings)
    meg = check_export(single, "megatron", tmp_path)
    assert meg.field("--use-distributed-optimizer").value is True
    assert any("with one data-parallel rank the same as the plan's ZeRO-0" in w for w in meg.warnings)
    titan = check_export(single, "torchtitan", tmp_path)
    assert not any(f.key == "training.enable_cpu_offload" for f in titan.fields)
    assert any(w.startswith('config.offload = "optimizer"') and "whole on each rank" in w for w in titan.warnings)
    acc = check_export(single, "accelerate", tmp_path)
    assert acc.field("distributed_type").value == "NO" and not any("fsdp" in f.key for f in acc.fields)
    [w] = [w for w in acc.warnings if "config.offload" in w]
    assert "one process without FSDP" in w and "whole on each rank" in w and "offload_optimizer_device" in w


def test_zero_bubble_schedules_as_each_stack_runs_them(plans, tmp_path):
    """ZB-V is torchtitan's ZBVZeroBubble with the chunks in model order (torchtitan places them as a V, as the
    plan does); ZB-H1 (one chunk a device, which torchtitan's multi-stage schedules refuse) and the stacks
    without zero-bubble schedules (Megatron-LM, DeepSpeed) write their nearest schedule and say so."""
    [h1] = [variant_plan(plans, i) for i, v in enumerate(VARIANTS) if v[1].get("schedule") == "zbh1"]
    [zbv] = [variant_plan(plans, i) for i, v in enumerate(VARIANTS) if v[1].get("schedule") == "zbv"]
    titan = check_export(zbv, "torchtitan", tmp_path)
    assert titan.field("parallelism.pipeline_parallel_schedule").value == "ZBVZeroBubble"
    parts = titan.field("parallelism.module_fqns_per_model_part").value
    assert len(parts) == 16 and parts[0][0] == "tok_embeddings" and parts[-1][-1] == "output"
    # in model order (device 0 holds the first part and the last: the V's placement is torchtitan's, not the list's)
    blocks = [int(n.split(".")[1]) for part in parts for n in part if n.startswith("layers.")]
    assert blocks == sorted(blocks) and zbv.stages[0].chunks[1][-1] == zbv.stages[0].layers[-1]
    assert not any("zero bubble" in w for w in titan.warnings)
    titan = check_export(h1, "torchtitan", tmp_path)
    assert titan.field("parallelism.pipeline_parallel_schedule").value == "1F1B"
    assert any(w.startswith("config.schedule = 'zbh1' (zero bubble") and "two or more stages per rank" in w
               for w in titan.warnings)
    for stack, plan in (("megatron", h1), ("megatron", zbv), ("deepspeed", h1), ("deepspeed", zbv)):
        result = check_export(plan, stack, tmp_path)
        assert any(w.startswith(f"config.schedule = {plan.config.schedule!r} (zero bubble") for w in result.warnings), stack
    meg = check_export(zbv, "megatron", tmp_path)
    assert any("placed looped" in w for w in meg.warnings)
    # DualPipeV: torchtitan's own, its pairs run one pass after the other as priced (no expert-parallel overlap)
    [dual] = [variant_plan(plans, i) for i, v in enumerate(VARIANTS) if v[1].get("schedule") == "dualpipev"]
    assert dual.micro_batches >= 2 * dual.config.pp
    titan = check_export(dual, "torchtitan", tmp_path)
    assert titan.field("parallelism.pipeline_parallel_schedule").value == "DualPipeV"
    assert titan.field("parallelism.pipeline_parallel_expert_parallel_overlap").value is False
    assert any("pipeline_parallel_expert_parallel_overlap = false" in w for w in titan.warnings)
    for stack in ("megatron", "deepspeed"):
        result = check_export(dual, stack, tmp_path)
        assert any(w.startswith("config.schedule = 'dualpipev' (zero bubble") for w in result.warnings), stack
    assert any("rather than as dualpipev's V" in w for w in check_export(dual, "megatron", tmp_path).warnings)


def test_megatron_overlaps_the_data_parallel_reduction_the_plan_hides(plans, tmp_path):
    """The plan prices the gradients' reduction (and ZeRO-1's gather of the updated weights) hidden by compute;
    Megatron-Core runs them after the backward unless told: the export tells it, and only where there is
    a data-parallel reduction at all."""
    plan = plans["gpt3-175b_128x8xA100"]

    def keys(config) -> set[str]:
        changed = dataclasses.replace(plan, config=dataclasses.replace(plan.config, **config))
        meg = export(changed, "megatron")
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.sh"
        path.write_text(meg.text)
        schemas.check_megatron(schemas.bash_arrays(str(path)), changed.cluster.devices)
        return {f.key for f in meg.fields}

    zero0, zero1 = keys(dict(zero=0)), keys(dict(zero=1))
    assert "--overlap-grad-reduce" in zero0 and "--overlap-param-gather" not in zero0
    assert {"--overlap-grad-reduce", "--use-distributed-optimizer"} <= zero1 and "--overlap-param-gather" not in zero1
    plan = dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, param_gather="overlapped"))
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"} <= keys(dict(zero=1))
    assert "--overlap-param-gather" not in keys(dict(zero=0))
    # no data-parallel replicas: nothing to reduce, nothing written (8 x 16 x 8 on 1,024 devices: dp 8 -> 1)
    alone = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, nodes=16),
                                config=dataclasses.replace(plan.config, dp=1))
    assert not {f.key for f in export(alone, "megatron").fields} & {"--overlap-grad-reduce", "--overlap-param-gather"}
    bare = {"T": ["--nnodes", "128", "--nproc-per-node", "8"], "E": [""], "M": ["--micro-batch-size", "1", "--global-batch-size", "1024",
                                                                       "--overlap-param-gather"]}
    with pytest.raises(AssertionError, match="only supported with distributed optimizer"):
        schemas.check_megatron(bare, plan.devices)
    bare["M"] += ["--use-distributed-optimizer"]
    with pytest.raises(AssertionError, match="with --overlap-grad-reduce"):
        schemas.check_megatron(bare, plan.devices)


def test_deepspeed_overlaps_the_reduction_where_it_can_and_says_where_it_cannot(plans):
    plan = plans["llama3-70b_8x8xH100"]

    def ds(**config):   # bf16 gradients of bf16 weights: stage 0 stays stage 0 (the fp32 ones need ZeRO there)
        return export(dataclasses.replace(plan, config=dataclasses.replace(plan.config, **config),
                                          precision=dataclasses.replace(plan.precision, grads="bf16")), "deepspeed")

    zero1 = ds(zero=1)
    assert zero1.field("zero_optimization.overlap_comm").value is True
    assert not any("all-gathers the updated weights" in w for w in zero1.warnings)    # after the step, as priced
    overlapped = export(dataclasses.replace(plan, config=dataclasses.replace(plan.config, zero=1),
                                            precision=dataclasses.replace(plan.precision, param_gather="overlapped")),
                        "deepspeed")
    assert any("all-gathers the updated weights after the optimizer step" in w for w in overlapped.warnings)
    schemas.check_deepspeed(json.loads(zero1.text), plan.devices, 1)
    zero0 = ds(zero=0)
    assert not any(f.key == "zero_optimization.overlap_comm" for f in zero0.fields)
    assert any("all-reduces the gradients after the backward" in w for w in zero0.warnings)
    piped = export(plans["gpt3-175b_128x8xA100"], "deepspeed")
    assert any("reduces the gradients after the whole pipeline" in w for w in piped.warnings)
    assert not any(f.key == "zero_optimization.overlap_comm" for f in ds(zero=3).fields)   # stage 3: its default


def test_megatron_runs_the_torch_softmax_a_plan_priced(plans, tmp_path):
    """A plan priced with Megatron's PyTorch softmax fallback (Precision(fused_softmax=False)) tells Megatron-LM to
    run it (--no-masked-softmax-fusion), else Megatron would run the fused kernel the plan did not price; the
    default writes nothing."""
    plan = plans["gpt3-175b_128x8xA100"]
    assert plan.precision.kernels == "fused" and plan.precision.fused_softmax
    assert "--no-masked-softmax-fusion" not in {f.key for f in export(plan, "megatron").fields}
    fallback = dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, fused_softmax=False))
    meg = export(fallback, "megatron")
    field = next(f for f in meg.fields if f.key == "--no-masked-softmax-fusion")
    assert field.sources == ("precision.fused_softmax",)
    path = tmp_path / "megatron_args.sh"
    path.write_text(meg.text)
    schemas.check_megatron(schemas.bash_arrays(str(path)), fallback.cluster.devices)


def test_exports_say_a_stack_reduces_zero1_gradients_faster_than_an_all_reduce_plan(plans):
    """A ZeRO-1 plan priced with DeepSpeed 0.4.4-0.12's gradient all-reduce (Precision(grad_reduce='all_reduce')):
    Megatron-Core and today's DeepSpeed reduce each shard to its owner, half the bytes; their exports say so."""
    plan = plans["gpt3-175b_128x8xA100"]
    zero1 = dataclasses.replace(plan, config=dataclasses.replace(plan.config, zero=1),
                                precision=dataclasses.replace(plan.precision, grad_reduce="all_reduce"))
    for stack in ("megatron", "deepspeed"):
        assert any("grad_reduce = 'all_reduce'" in w for w in export(zero1, stack).warnings), stack
        assert not any("grad_reduce" in w for w in export(dataclasses.replace(zero1, precision=plan.precision),
                                                            stack).warnings), stack
