"""Each export read by its stack's own loader, where the stack is installed: torchtitan's ConfigManager;
accelerate's load_config_from_file, `accelerate launch`'s argument handling and the plugins Accelerator
builds from the environment it sets; DeepSpeed's DeepSpeedConfig, AutoEP's validation, and
deepspeed.initialize with one training step (one rank, in this process).

The stacks are the `stacks` extra (pyproject.toml says why they are not in `dev`). `make bench`
installs it and runs these with AUTOPAR_REQUIRE_STACKS=1, under which a missing stack fails instead of
skipping; `make test` skips them (the schema checks in test_exports.py run everywhere).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import socket
import sys

import pytest

from autopar.exports import export

from cases import CASES, case_plan, even_chunks, with_partition


def _stack(module: str) -> None:
    """Skip unless ``module`` is installed; under AUTOPAR_REQUIRE_STACKS=1 (make bench) fail instead."""
    if importlib.util.find_spec(module) is None:
        _missing(f"{module} is not installed")


def _missing(reason: str) -> None:
    if os.environ.get("AUTOPAR_REQUIRE_STACKS") == "1":
        pytest.fail(f"{reason}; make bench installs the `stacks` extra (pyproject.toml)")
    pytest.skip(reason)


def _torchtitan_config_manager():
    """torchtitan's ConfigManager without running torchtitan/__init__.py (which imports its MoE kernels and
    so triton, absent on a CPU machine): the config package is plain Python over torch and tyro."""
    _stack("tyro")   # torchtitan's config needs it
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None:
            _missing("torchtitan (0.1-0.2, the TOML JobConfig) is not installed")
        sys.modules["torchtitan"] = importlib.util.module_from_spec(spec)   # the package, its __init__ not run
    try:
        from torchtitan.config import ConfigManager
    except ImportError as exc:
        _missing(f"torchtitan's TOML JobConfig does not import ({exc}): torchtitan 0.3 has no TOML files")
    return ConfigManager


@pytest.mark.parametrize("name", CASES)
def test_torchtitan_loads_the_toml(plans, name, tmp_path):
    ConfigManager = _torchtitan_config_manager()
    from torchtitan.distributed.parallel_dims import ParallelDims
    plan = case_plan(plans, name)
    result = export(plan, "torchtitan", tmp_path / "t.toml")
    config = ConfigManager().parse_args(["--job.config_file", str(tmp_path / "t.toml")])
    for f in result.fields:   # nested tables too (quantize.linear.float8.recipe_name)
        assert functools.reduce(getattr, f.key.split("."), config) == f.value, f.key
    par = config.parallelism
    ParallelDims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
                 cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                 ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree,
                 world_size=plan.devices)
    (tmp_path / "bad.toml").write_text(result.text.replace("tensor_parallel_degree", "tensor_parallel_degre"))
    with pytest.raises(ValueError, match="Invalid field names"):
        ConfigManager().parse_args(["--job.config_file", str(tmp_path / "bad.toml")])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("name", CASES)
def test_accelerate_loads_the_yaml(plans, name, tmp_path, monkeypatch):
    """accelerate's config loader reads the file, `accelerate launch` turns it into the environment each
    process starts with, and the plugins Accelerator builds from that environment hold the plan's values."""
    _stack("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig
    from accelerate.utils.launch import prepare_multi_gpu_env
    plan = case_plan(plans, name)
    path = str(tmp_path / "a.yaml")
    result = export(plan, "accelerate", path)
    config = load_config_from_file(path)
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type.value == result.field("distributed_type").value
    assert config.num_processes == plan.devices and config.mixed_precision == result.field("mixed_precision").value
    # launch copies fsdp_config / parallelism_config entries onto its arguments by name: each must be one
    dests = {a.dest for a in launch_command_parser()._actions}
    for key in ("fsdp_config", "parallelism_config", "dynamo_config"):
        assert set(getattr(config, key)) <= dests, (key, set(getattr(config, key)) - dests)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", path, "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()), "train.py"]))
    assert (args.num_processes, args.num_machines) == (plan.devices, plan.cluster.nodes)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.setenv(key, value)
    assert env["ACCELERATE_MIXED_PRECISION"] == result.field("mixed_precision").value
    assert env["ACCELERATE_DYNAMO_BACKEND"] == ("INDUCTOR" if plan.precision.kernels == "compiled" else "NO")
    fields = {f.key: f.value for f in result.fields}
    if config.distributed_type.value == "FSDP":
        fsdp = FullyShardedDataParallelPlugin()
        assert (fsdp.fsdp_version, fsdp.reshard_after_forward) == (2, plan.config.zero == 3)
        assert fsdp.activation_checkpointing == fields["fsdp_config.fsdp_activation_checkpointing"]
        # fsdp_offload_params -> FSDP_OFFLOAD_PARAMS -> FSDP2's CPUOffloadPolicy (set_cpu_offload), else
        # OffloadPolicy(): offload="all" only (accelerate's FSDP has no optimizer-only offload: "optimizer" is a warning)
        from torch.distributed.fsdp import CPUOffloadPolicy
        assert env["FSDP_OFFLOAD_PARAMS"] == ("true" if plan.config.offload == "all" else "false")
        assert isinstance(fsdp.cpu_offload, CPUOffloadPolicy) == (plan.config.offload == "all")
        assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
        prefix = "parallelism_config.parallelism_config_"
        if any(k.startswith(prefix) for k in fields):
            par = ParallelismConfig()
            assert (par.dp_replicate_size, par.dp_shard_size, par.tp_size, par.cp_size) == tuple(
                fields[prefix + k + "_size"] for k in ("dp_replicate", "dp_shard", "tp", "cp"))
            assert par.total_size == plan.devices
    else:
        assert "ACCELERATE_USE_FSDP" not in env
    (tmp_path / "bad.yaml").write_text(result.text + "fsdp_sharding: 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_from_file(str(tmp_path / "bad.yaml"))


def _deepspeed_config():
    _stack("deepspeed")
    import deepspeed.runtime.config as ds_config
    return ds_config


class _Mpu:
    """What DeepSpeedConfig asks of a model-parallel unit: the data-parallel world size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.mark.parametrize("name", CASES)
def test_deepspeed_loads_the_json(plans, name, tmp_path, monkeypatch):
    """DeepSpeedConfig reads each file as the plan means it: the batch triple over the data-parallel ranks
    (with the mpu the warnings name, and refused without one where they say so), the ZeRO stage, the
    precision, AutoTP, AutoEP enabled at the plan's degree and accepted by AutoEP's own validation, and
    SGD allowed under ZeRO."""
    ds_config = _deepspeed_config()
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
    plan = case_plan(plans, name)
    path = str(tmp_path / "ds.json")
    result = export(plan, "deepspeed", path)
    cfg = plan.config
    dp = plan.devices // (cfg.tp * cfg.pp)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: plan.devices)   # the plan's world
    config = ds_config.DeepSpeedConfig(path, mpu=_Mpu(dp))   # batch assertion included
    assert config.train_batch_size == result.field("train_batch_size").value
    assert config.gradient_accumulation_steps == result.field("gradient_accumulation_steps").value
    if cfg.cp == 1:
        assert (config.train_batch_size, config.gradient_accumulation_steps) == (plan.global_batch_size,
                                                                                plan.micro_batches)
    assert config.zero_optimization_stage == result.field("zero_optimization.stage").value
    # offload="all": both offloads under stage 3, the optimizer's alone under a pipeline's stage 1; "optimizer": the
    # optimizer's alone, under ZeRO (stage 1 or higher: a ZeRO-0 plan is written as stage 1)
    zero = config.zero_config
    def device(offload):   # OffloadDeviceEnum, kept as its value by DeepSpeedConfigModel (use_enum_values)
        return "none" if offload is None else getattr(offload.device, "value", offload.device)
    offload_param, offload_optimizer = device(zero.offload_param), device(zero.offload_optimizer)
    assert offload_optimizer == ("cpu" if cfg.offload != "none" else "none")
    assert offload_param == ("cpu" if cfg.offload == "all" and config.zero_optimization_stage == 3 else "none")
    if cfg.offload != "none":
        assert zero.offload_optimizer.pin_memory and (zero.offload_param is None or zero.offload_param.pin_memory)
        assert config.zero_optimization_stage >= 1
    # runtime/engine.py _configure_optimizer: a client optimizer other than DeepSpeedCPUAdam under ZeRO-Offload
    # raises unless this is false, as the export writes for SGD
    assert config.zero_force_ds_cpu_optimizer == (not (cfg.offload != "none" and plan.precision.optimizer == "sgd"))
    # an fp8 plan's other ops, weights and activations are bf16 (DeepSpeed itself has no fp8 switch: a warning)
    assert config.bfloat16_config.enabled == (plan.precision.compute in ("bf16", "fp8"))
    assert config.float16_config.enabled == (plan.precision.compute == "fp16")
    assert config.tensor_parallel_config.autotp_size == (cfg.tp if cfg.tp > 1 else 0)
    # runtime/engine.py _do_optimizer_sanity_check asserts on SGD under ZeRO unless this is set
    assert config.zero_allow_untested_optimizer == (plan.precision.optimizer == "sgd"
                                                    and config.zero_optimization_stage >= 1)
    ep = config.expert_parallel_config   # runtime/engine.py _configure_expert_parallel returns unless enabled
    assert (ep.enabled, ep.autoep_size) == ((True, cfg.ep) if cfg.ep > 1 else (False, 1))
    if cfg.ep > 1:   # what the engine validates before it builds the expert groups
        def validate():
            validate_autoep_config(ep, world_size=plan.devices, pp_size=cfg.pp, tp_size=cfg.tp, sp_size=1)
        if cfg.tp > 1 and cfg.pp > 1:
            with pytest.raises(ValueError, match="pp_size=1 only"):
                validate()
            assert any("deepspeed.initialize raises ValueError" in w for w in result.warnings)
        else:
            validate()
    # The data-parallel ranks come from an mpu: AutoTP's must be passed (without one DeepSpeed counts every
    # rank), a PipelineModule's is its topology (by default pipeline x data only).
    ranks = cfg.dp * cfg.cp
    if cfg.pp == 1 and cfg.tp == 1:
        ds_config.DeepSpeedConfig(path)
    elif cfg.pp == 1:
        with pytest.raises(AssertionError, match="Check batch related parameters"):
            ds_config.DeepSpeedConfig(path)
        assert any(f"tensor_model_parallel_size={cfg.tp}); deepspeed.initialize(..., mpu=groups)" in w
                   for w in result.warnings)
    else:
        default = PipeDataParallelTopology(num_pp=cfg.pp, num_dp=plan.devices // cfg.pp)  # PipelineModule(num_stages=pp)
        if cfg.tp == 1:
            ds_config.DeepSpeedConfig(path, mpu=_Mpu(default.get_dim("data")))
        else:
            with pytest.raises(AssertionError, match="Check batch related parameters"):
                ds_config.DeepSpeedConfig(path, mpu=_Mpu(default.get_dim("data")))
            named = PipeModelDataParallelTopology(num_pp=cfg.pp, num_mp=cfg.tp, num_dp=ranks)
            ds_config.DeepSpeedConfig(path, mpu=_Mpu(named.get_dim("data")))
            assert any(f"PipeModelDataParallelTopology(num_pp={cfg.pp}, num_mp={cfg.tp}, num_dp={ranks})" in w
                       for w in result.warnings)
    bad = json.loads(result.text)
    bad["train_batch_size"] += 1
    with pytest.raises(AssertionError):
        ds_config.DeepSpeedConfig(bad, mpu=_Mpu(dp))


@pytest.fixture(scope="module")
def one_rank_deepspeed():
    """deepspeed itself in a one-rank gloo world in this process (torn down after the module's tests)."""
    _stack("deepspeed")
    import torch.distributed as dist
    import deepspeed
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.MonkeyPatch.context() as patch:
        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
            patch.setenv(key, value)
        # DeepSpeed's CPU backend compiles a shared-memory all-reduce kernel (C++, minutes) when it starts,
        # an optimisation of collectives that one rank never runs
        patch.setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)
        yield deepspeed
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.modules["deepspeed.comm.comm"].cdb = None


ONE_DEVICE = [   # (config changes, precision changes) of a one-device plan that deepspeed.initialize runs
    (dict(zero=1), dict(compute="fp32", grads="fp32", optimizer="sgd")),    # SGD under ZeRO
    (dict(zero=2), dict(compute="bf16", grads="fp32", optimizer="adam")),   # bf16 weights, fp32 gradients
    (dict(zero=0), dict(compute="bf16", grads="fp32", optimizer="sgd")),    # ZeRO-0 with that mix: written as ZeRO-1
    (dict(zero=3, offload="all"), dict(compute="fp32", grads="fp32", optimizer="sgd")),   # torch's SGD forced
    (dict(zero=3, offload="all"), dict(compute="fp32", grads="fp32", optimizer="adam")),  # DeepSpeedCPUAdam
    # the optimizer alone offloaded: under ZeRO-2 with bf16 weights; under ZeRO-0, written as stage 1; with SGD
    (dict(zero=2, offload="optimizer"), dict(compute="bf16", grads="fp32", optimizer="adam")),
    (dict(zero=0, offload="optimizer"), dict(compute="fp32", grads="fp32", optimizer="adam")),
    (dict(zero=1, offload="optimizer"), dict(compute="fp32", grads="fp32", optimizer="sgd")),
]


@pytest.mark.parametrize("case", range(len(ONE_DEVICE)))
def test_deepspeed_initialize_trains_with_the_export(plans, case, one_rank_deepspeed, tmp_path):
    """deepspeed.initialize with the exported file and the optimizer its warning names (the engine's optimizer
    sanity check, ZeRO and precision wrappers), then one training step, on a one-device plan."""
    import torch
    changes, precision = ONE_DEVICE[case]
    base = plans["llama3-70b_8x8xH100"]
    plan = with_partition(base, even_chunks(base, 1), dp=1, tp=1, pp=1, micro_batch_size=2, sequence_parallel=False,
                          **changes)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(base.cluster, nodes=1, devices_per_node=1),
                               precision=dataclasses.replace(base.precision, **precision), global_batch_size=4,
                               micro_batches=2)
    result = export(plan, "deepspeed", tmp_path / "ds.json")
    optimizer = torch.optim.SGD if plan.precision.optimizer == "sgd" else torch.optim.AdamW
    if plan.config.offload != "none" and optimizer is torch.optim.AdamW:   # ZeRO-Offload's, as the warning says
        from deepspeed.ops.adam import DeepSpeedCPUAdam as optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, *_ = one_rank_deepspeed.initialize(model=model, optimizer=optimizer(model.parameters(), lr=0.01),
                                               config=str(tmp_path / "ds.json"))
    assert engine.zero_optimization_stage() == result.field("zero_optimization.stage").value
    assert engine.zero_cpu_offload() == (plan.config.offload != "none")    # the optimizer states on the CPU
    if plan.config.offload == "all":
        assert engine.zero_offload_param().device == "cpu"
    else:   # "optimizer" (or none): the parameters stay on the device
        assert engine.zero_offload_param() is None
    assert engine.gradient_accumulation_steps() == plan.micro_batches
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    for _ in range(plan.micro_batches):
        x = torch.randn(plan.config.micro_batch_size, 8, dtype=next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    assert engine.global_steps == 1
    assert any(not torch.equal(a, b.detach().float()) for a, b in zip(before, engine.module.parameters()))
    name = optimizer.__name__ if optimizer.__module__.startswith("deepspeed.") else f"torch.optim.{optimizer.__name__}"
    assert any(f"optimizer={name}(model.parameters(), lr=...)" in w for w in result.warnings)
