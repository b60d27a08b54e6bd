"""Each stack's configuration schema, written from its own source and documentation, for the export tests.

These run whether or not the stacks are installed (test_loaders.py also loads the files with
torchtitan's, accelerate's and DeepSpeed's own loaders where those are installed). Each check raises
AssertionError naming the key and the rule, and each rule names where the stack states it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from typing import Any

# --- torchtitan: torchtitan/config/job_config.py (release 0.2.2) --------------------------------------
INT = int
TORCHTITAN = {
    "model": {"name": str, "flavor": str},
    "training": {"local_batch_size": INT, "global_batch_size": INT, "seq_len": INT,
                 "mixed_precision_param": ("bfloat16", "float32"),      # Literal["bfloat16", "float32"]
                 "mixed_precision_reduce": ("float32",),                # Literal["float32"]
                 "dtype": ("bfloat16", "float32"), "enable_cpu_offload": bool},
    "optimizer": {"name": ("Adam", "AdamW")},                           # components/optimizer.py
    "parallelism": {"data_parallel_replicate_degree": INT, "data_parallel_shard_degree": INT,
                    "fsdp_reshard_after_forward": ("default", "always", "never"),
                    "tensor_parallel_degree": INT, "pipeline_parallel_degree": INT,
                    "module_fqns_per_model_part": list, "pipeline_parallel_schedule": str,
                    "pipeline_parallel_microbatch_size": INT, "pipeline_parallel_expert_parallel_overlap": bool,
                    "context_parallel_degree": INT,
                    "expert_parallel_degree": INT, "expert_tensor_parallel_degree": INT},
    "activation_checkpoint": {"mode": ("selective", "full", "memory_budget", "none"), "selective_ac_option": str},
    "compile": {"enable": bool},
    "quantize": {"linear": dict},
}
TORCHTITAN["model"]["converters"] = list        # Model.converters: registered converter names
# job_config.py Quantize.linear: QuantizedLinear.float8 (Float8Linear) and .mx (MXLinear); the converters that
# read them (components/quantization/float8.py and mx.py register_model_converter)
TORCHTITAN_QUANTIZE = {
    "float8": {"enable_fsdp_float8_all_gather": bool, "precompute_float8_dynamic_scale_for_fsdp": bool,
               "recipe_name": ("tensorwise", "rowwise", "rowwise_with_gw_hp"), "filter_fqns": list, "emulate": bool},
    "mx": {"mxfp8_dim1_cast_kernel_choice": ("triton", "cuda", "torch"), "recipe_name": str, "filter_fqns": list},
}
TORCHTITAN_CONVERTERS = {"quantize.linear.float8": "float8", "quantize.linear.mx": "mx"}
# torch.distributed.pipelining.schedules: schedules of one stage per rank (the rest loop over several)
SINGLE_STAGE_SCHEDULES = {"GPipe", "1F1B"}


def check_torchtitan(config: dict[str, Any], devices: int) -> None:
    _check_sections(config, TORCHTITAN, "torchtitan")
    linear = config.get("quantize", {}).get("linear", {})
    for name, values in linear.items():
        assert name in TORCHTITAN_QUANTIZE, f"torchtitan: unknown section [quantize.linear.{name}]"
        for key, value in values.items():
            assert key in TORCHTITAN_QUANTIZE[name], f"torchtitan: unknown key quantize.linear.{name}.{key}"
            _check_type(f"quantize.linear.{name}.{key}", value, TORCHTITAN_QUANTIZE[name][key])
    converters = config.get("model", {}).get("converters", [])
    for converter in converters:
        # protocols/model_converter.py looks each name up in its registry (KeyError on another)
        assert converter in TORCHTITAN_CONVERTERS, f"torchtitan: unregistered converter {converter!r}"
        assert TORCHTITAN_CONVERTERS[converter] in linear, f"torchtitan: {converter} without its section"
    assert set(linear) <= {TORCHTITAN_CONVERTERS[c] for c in converters}, "a [quantize.linear.*] no converter reads"
    par, train = config["parallelism"], config["training"]
    dims = [par.get(k, 1) for k in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                                    "context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree")]
    # distributed/parallel_dims.py ParallelDims._validate: the degrees multiply to the world size
    assert all(d >= 1 for d in dims), dims
    product = dims[0] * dims[1] * dims[2] * dims[3] * dims[4]
    assert product == devices, f"torchtitan: dp_replicate*dp_shard*cp*tp*pp = {product} != {devices} ranks"
    if par.get("expert_parallel_degree", 1) > 1:   # ParallelDims: "Currently we only support ETP=TP or ETP=1"
        assert par.get("expert_tensor_parallel_degree", 1) in (1, par.get("tensor_parallel_degree", 1))
    if train.get("enable_cpu_offload"):   # CPUOffloadPolicy is applied by apply_fsdp, run only when
        # ParallelDims.fsdp_enabled (dp_shard or cp > 1); else train.py initialises the model on the CPU and leaves it
        assert dims[1] > 1 or dims[2] > 1, "torchtitan: enable_cpu_offload without FSDP (dp_shard or cp > 1)"
    dp = dims[0] * dims[1]
    # train.py: gradient_accumulation_steps = global_batch_size // (local_batch_size * dp_degree)
    assert train["global_batch_size"] % (train["local_batch_size"] * dp) == 0, train
    ac = config.get("activation_checkpoint", {})
    if ac.get("mode") == "selective":   # distributed/activation_checkpoint.py: "op" or an integer
        assert ac["selective_ac_option"] == "op" or ac["selective_ac_option"].isdigit(), ac
    pp = par.get("pipeline_parallel_degree", 1)
    if pp > 1:
        from torch.distributed.pipelining.schedules import get_schedule_class
        get_schedule_class(par["pipeline_parallel_schedule"])    # raises on an unknown schedule name
        # distributed/pipeline_parallel.py build_pipeline_schedule: local batch / microbatch = n_microbatches
        assert train["local_batch_size"] % par["pipeline_parallel_microbatch_size"] == 0, train
        parts = par["module_fqns_per_model_part"]
        assert all(isinstance(p, list) and p and all(isinstance(n, str) for n in p) for p in parts), parts
        assert len(parts) % pp == 0, f"{len(parts)} model parts over pp={pp}"
        per_rank = len(parts) // pp
        single = par["pipeline_parallel_schedule"] in SINGLE_STAGE_SCHEDULES
        assert (per_rank == 1) if single else (per_rank >= 2), (par["pipeline_parallel_schedule"], per_rank)
        names = [n for p in parts for n in p]
        assert len(names) == len(set(names)), "a module in two model parts"
        blocks = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
        assert blocks == list(range(len(blocks))), "transformer blocks out of order or missing"
        assert names[0] == "tok_embeddings" and names[-2:] == ["norm", "output"], names


def _check_sections(config: dict[str, Any], schema: dict[str, dict[str, Any]], stack: str) -> None:
    for section, values in config.items():
        assert section in schema, f"{stack}: unknown section [{section}]"
        for key, value in values.items():
            assert key in schema[section], f"{stack}: unknown key {section}.{key}"
            _check_type(f"{section}.{key}", value, schema[section][key])


def _check_type(where: str, value: Any, kind: Any) -> None:
    if isinstance(kind, tuple):
        assert value in kind, f"{where} = {value!r} is not one of {kind}"
    elif kind is int:
        assert isinstance(value, int) and not isinstance(value, bool), f"{where} = {value!r} is not an integer"
    else:
        assert isinstance(value, kind), f"{where} = {value!r} is not a {kind.__name__}"


# --- Megatron-LM: megatron/training/arguments.py ------------------------------------------------------
FLAG = "flag"
MEGATRON = {   # flag: int, str, FLAG (store_true) or the choices
    "--tensor-model-parallel-size": int, "--pipeline-model-parallel-size": int, "--context-parallel-size": int,
    "--expert-model-parallel-size": int, "--sequence-parallel": FLAG, "--num-layers": int,
    "--num-layers-per-virtual-pipeline-stage": int, "--num-virtual-stages-per-pipeline-rank": int,
    "--pipeline-model-parallel-layout": str, "--decoder-first-pipeline-num-layers": int,
    "--decoder-last-pipeline-num-layers": int, "--micro-batch-size": int, "--global-batch-size": int,
    "--seq-length": int, "--recompute-granularity": ("full", "selective"), "--recompute-method": ("uniform", "block"),
    "--recompute-num-layers": int, "--use-distributed-optimizer": FLAG, "--use-megatron-fsdp": FLAG,
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "--no-gradient-accumulation-fusion": FLAG,
    "--no-masked-softmax-fusion": FLAG,
    "--ckpt-format": ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
    "--fp16": FLAG, "--bf16": FLAG, "--accumulate-allreduce-grads-in-fp32": FLAG, "--grad-reduce-in-bf16": FLAG,
    "--optimizer": ("adam", "sgd", "muon", "dist_muon"),
    # TransformerConfig.fp8 / fp8_recipe (megatron/core/transformer/transformer_config.py), made flags by
    # arguments.py's ArgumentGroupFactory (a Literal becomes the choices)
    "--fp8-format": ("e4m3", "hybrid"), "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    # _add_training_args (optimizer CPU offload) and _add_experimental_args (the precision-aware optimizer)
    "--optimizer-cpu-offload": FLAG, "--optimizer-offload-fraction": float, "--overlap-cpu-optimizer-d2h-h2d": FLAG,
    "--use-precision-aware-optimizer": FLAG,
    # _add_distributed_args: DistributedDataParallelConfig.overlap_grad_reduce, overlap_param_gather
    "--overlap-grad-reduce": FLAG, "--overlap-param-gather": FLAG,
}
TORCHRUN = {"--nnodes": int, "--nproc-per-node": int}
DEFAULTS = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
            "--expert-model-parallel-size": 1}   # arguments.py: default=1


def parser_of(schema: dict[str, Any]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, kind in schema.items():
        if kind == FLAG:
            parser.add_argument(flag, action="store_true")
        elif isinstance(kind, tuple):
            parser.add_argument(flag, choices=kind)
        else:
            parser.add_argument(flag, type=kind, default=DEFAULTS.get(flag))
    return parser


def bash_arrays(path: str) -> dict[str, list[str]]:
    """The file's two arrays, as bash itself reads them (``source``)."""
    out = subprocess.run(["bash", "-c", f"set -eu; source {shlex.quote(path)}; "
                                        "printf 'T\\t%s\\n' \"${AUTOPAR_TORCHRUN[@]}\"; "
                                        "printf 'M\\t%s\\n' \"${AUTOPAR_MEGATRON_ARGS[@]}\"; "
                                        "printf 'E\\t%s\\n' \"${CUDA_DEVICE_MAX_CONNECTIONS:-}\""],
                         check=True, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}).stdout
    arrays: dict[str, list[str]] = {"T": [], "M": [], "E": []}
    for line in out.splitlines():
        which, _, token = line.partition("\t")
        arrays[which].append(token)
    return arrays


def parse_layout(layout: str) -> list[list[str]]:
    """megatron/core/transformer/pipeline_parallel_layer_layout.py parse_str_to_list: commas are
    cosmetic, "(...)*n" and "x*n" repeat, "|" splits model chunks, E/L/t/m are the layer types."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    bad = {c for s in stages for c in s} - set("ELtm")
    assert not bad, f"layout {layout!r}: unknown layer characters {bad}"
    return stages


def check_megatron(arrays: dict[str, list[str]], devices: int) -> argparse.Namespace:
    launch = parser_of(TORCHRUN).parse_args(arrays["T"])
    assert launch.nnodes * launch.nproc_per_node == devices, launch
    args = parser_of(MEGATRON).parse_args(arrays["M"])    # an unknown flag or value raises
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    # validate_args: world size divisible by tp * pp * cp; data parallel is the quotient
    assert devices % (tp * pp * cp) == 0, (devices, tp, pp, cp)
    dp = devices // (tp * pp * cp)
    assert args.global_batch_size % (args.micro_batch_size * dp) == 0, "global batch not micro-batch x dp x n"
    vpp_flags = [args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank,
                 args.pipeline_model_parallel_layout]
    assert sum(v is not None for v in vpp_flags) <= 1, "more than one of the virtual-pipeline flags"
    if args.pipeline_model_parallel_layout is not None:
        stages = parse_layout(args.pipeline_model_parallel_layout)
        assert len(stages) % pp == 0, "layout stages not divisible by pp"
        flat = [c for s in stages for c in s]          # validate_layer_layout
        assert flat[0] == "E" and flat[-1] == "L" and flat.count("E") == 1 and flat.count("L") == 1, \
            f"layout {args.pipeline_model_parallel_layout!r}: the embedding (E) first and the loss (L) last, once each"
        assert flat.count("t") == args.num_layers, (flat.count("t"), args.num_layers)
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        assert args.num_layers % pp == 0 and (args.num_layers // pp) % args.num_layers_per_virtual_pipeline_stage == 0
    elif args.num_layers is not None:
        assert args.num_layers % pp == 0, "Number of layers should be divisible by the pipeline-model-parallel size"
    if args.recompute_granularity == "selective":
        assert args.recompute_method is None, "recompute method is not yet supported for selective recomputing"
    if args.sequence_parallel:
        assert tp > 1, "sequence parallelism needs tensor parallelism"
    if cp > 1 and args.seq_length is not None:
        assert args.seq_length % (2 * cp) == 0, "seq-length should be a multiple of 2 * context-parallel-size"
    assert not (args.fp16 and args.bf16)
    if args.fp8_recipe is not None:   # the recipe only acts with a format (fp8 None: no fp8)
        assert args.fp8_format is not None and (args.bf16 or args.fp16), "--fp8-recipe without --fp8-format"
    if args.optimizer_cpu_offload:   # validate_args
        assert args.use_precision_aware_optimizer, \
            "The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`"
        assert 0.0 <= args.optimizer_offload_fraction <= 1.0, args.optimizer_offload_fraction
    if args.use_precision_aware_optimizer:   # core/optimizer/optimizer_config.py and core/optimizer/__init__.py
        assert args.optimizer in (None, "adam"), "--use-precision-aware-optimizer only supported with adam"
        assert args.use_distributed_optimizer, \
            "--use-precision-aware-optimizer only supported with distributed optimizer"
    if args.overlap_param_gather:   # validate_args
        assert args.use_distributed_optimizer or args.use_megatron_fsdp, \
            "--overlap-param-gather only supported with distributed optimizer or megatron fsdp"
        assert args.overlap_grad_reduce, "Must use --overlap-param-gather with --overlap-grad-reduce"
    connections = arrays.get("E", [""])[0]
    if args.use_megatron_fsdp:
        assert args.ckpt_format == "fsdp_dtensor", "Megatron FSDP only supports fsdp_dtensor checkpoint format"
        assert pp == 1, "Megatron FSDP: tensor, context and expert parallelism, no pipeline"
        assert connections != "1", "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one"
    elif tp > 1 or cp > 1:
        assert connections == "1", "tensor or context parallelism require CUDA_DEVICE_MAX_CONNECTIONS=1"
    return args


# --- DeepSpeed: https://www.deepspeed.ai/docs/config-json/ and deepspeed/runtime/config.py (0.19) ------
DTYPE_NAMES = ("fp32", "fp16", "bf16")
DEEPSPEED = {
    "train_batch_size": int, "train_micro_batch_size_per_gpu": int, "gradient_accumulation_steps": int,
    "zero_optimization": {"stage": (0, 1, 2, 3), "overlap_comm": bool,   # runtime/zero/offload_config.py: OffloadDeviceEnum, pin_memory
                          "offload_param": {"device": ("none", "cpu", "nvme"), "pin_memory": bool},
                          "offload_optimizer": {"device": ("none", "cpu", "nvme"), "pin_memory": bool}},
    "zero_allow_untested_optimizer": bool, "zero_force_ds_cpu_optimizer": bool,
    "bf16": {"enabled": bool}, "fp16": {"enabled": bool},
    "data_types": {"grad_accum_dtype": DTYPE_NAMES}, "communication_data_type": DTYPE_NAMES,
    "tensor_parallel": {"autotp_size": int}, "expert_parallel": {"enabled": bool, "autoep_size": int},
    "pipeline": {"activation_checkpoint_interval": int},
}
ZERO_TESTED = ("adam",)   # runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS: torch.optim.Adam/AdamW, Adagrad, ...


def check_deepspeed(config: dict[str, Any], devices: int, pp: int, optimizer: str = "adam") -> None:
    """``config`` against DeepSpeed's rules; ``optimizer`` is the plan's (the config names none: code builds it)."""
    _check_nested(config, DEEPSPEED, "")
    # DeepSpeedConfig._batch_assertion: train = micro * accumulation * data-parallel world size (the mpu's)
    tp = config.get("tensor_parallel", {}).get("autotp_size", 1)
    dp = devices // (tp * pp)
    assert config["train_batch_size"] == (config["train_micro_batch_size_per_gpu"]
                                          * config["gradient_accumulation_steps"] * dp), (config, dp)
    assert not (config["bf16"]["enabled"] and config["fp16"]["enabled"]), "bf16 and fp16 together"
    stage = config["zero_optimization"]["stage"]
    if stage == 0:   # runtime/engine.py _do_optimizer_sanity_check
        weights = "bf16" if config["bf16"]["enabled"] else "fp16" if config["fp16"]["enabled"] else "fp32"
        assert config["data_types"]["grad_accum_dtype"] == weights, "unsupported mix of model and grad_accum dtypes"
    elif optimizer not in ZERO_TESTED:   # the same check: ZeRO asserts on an optimizer it has not tested
        assert config.get("zero_allow_untested_optimizer") is True, \
            f"You are using an untested ZeRO Optimizer ({optimizer}): zero_allow_untested_optimizer must be true"
    if pp > 1:   # runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
        assert stage < 2, "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
    zero = config["zero_optimization"]
    if "offload_param" in zero:   # runtime/zero/config.py offload_param: "Valid only with stage 3"
        assert stage == 3, "offload_param is valid only with ZeRO stage 3"
    if zero.get("offload_optimizer", {}).get("device", "none") != "none":
        assert stage >= 1, "offload_optimizer needs ZeRO (stage 1, 2 or 3)"
        # runtime/engine.py _configure_optimizer: with ZeRO-Offload a client optimizer other than DeepSpeedCPUAdam or
        # DeepSpeedCPULion raises unless zero_force_ds_cpu_optimizer is false (Adam's is DeepSpeedCPUAdam, in code)
        if optimizer not in ZERO_TESTED:
            assert config.get("zero_force_ds_cpu_optimizer") is False, \
                "You are using ZeRO-Offload with a client provided optimizer: zero_force_ds_cpu_optimizer must be false"
    if "expert_parallel" in config:   # module_inject/auto_ep_config.py parse_autoep_config: enabled defaults to
        # false, and then runtime/engine.py _configure_expert_parallel ignores every other key without a word
        assert config["expert_parallel"].get("enabled") is True, "expert_parallel without enabled: true is ignored"


def _check_nested(config: dict[str, Any], schema: dict[str, Any], prefix: str) -> None:
    for key, value in config.items():
        assert key in schema, f"DeepSpeed: unknown key {prefix}{key}"
        if isinstance(schema[key], dict):
            assert isinstance(value, dict), f"{prefix}{key} = {value!r} is not an object"
            _check_nested(value, schema[key], f"{prefix}{key}.")
        else:
            _check_type(prefix + key, value, schema[key])


# --- accelerate: accelerate/commands/config/config_args.py, commands/launch.py ------------------------
ACCELERATE_TOP = {   # ClusterConfig's (and BaseConfig's) fields; from_yaml_file refuses any other key
    "compute_environment": ("LOCAL_MACHINE", "AMAZON_SAGEMAKER"),
    "distributed_type": ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA",
                         "MEGATRON_LM"),
    "mixed_precision": ("no", "fp16", "bf16", "fp8"), "use_cpu": bool, "debug": bool, "num_processes": int,
    "machine_rank": int, "num_machines": int, "gpu_ids": str, "main_process_ip": str, "main_process_port": int,
    "rdzv_backend": str, "same_network": bool, "main_training_function": str, "enable_cpu_affinity": bool,
    "fp8_config": dict, "deepspeed_config": dict, "fsdp_config": dict, "parallelism_config": dict,
    "megatron_lm_config": dict, "mpirun_config": dict, "downcast_bf16": bool, "dynamo_config": dict,
}
ACCELERATE_NESTED = {   # launch.py's --fsdp_* / --parallelism_config_* / --dynamo_* arguments
    "fsdp_config": {"fsdp_version": (1, 2), "fsdp_reshard_after_forward": bool,
                    "fsdp_auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
                    "fsdp_activation_checkpointing": bool, "fsdp_offload_params": bool,
                    "fsdp_transformer_layer_cls_to_wrap": str, "fsdp_state_dict_type": str},
    "parallelism_config": {f"parallelism_config_{k}_size": int for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")},
    "dynamo_config": {"dynamo_backend": ("NO", "EAGER", "AOT_EAGER", "INDUCTOR")},
    # launch.py prefixes each key with fp8_ into ACCELERATE_FP8_<KEY>; utils/dataclasses.py reads these
    # (FP8BackendType: TE, MSAMP, AO, in capitals)
    "fp8_config": {"backend": ("TE", "MSAMP", "AO"), "fp8_format": ("HYBRID", "E4M3", "E5M2"),
                   "use_mxfp8_block_scaling": bool, "enable_fsdp_float8_all_gather": bool, "pad_inner_dim": bool,
                   "amax_history_len": int, "amax_compute_algo": ("max", "most_recent"), "margin": int,
                   "interval": int, "use_autocast_during_eval": bool, "opt_level": ("O1", "O2")},
}


def check_accelerate(config: dict[str, Any]) -> None:
    for key, value in config.items():
        assert key in ACCELERATE_TOP, f"accelerate: unknown key {key} (ClusterConfig refuses it)"
        _check_type(key, value, ACCELERATE_TOP[key])
        for sub, v in (value.items() if isinstance(value, dict) else ()):
            assert sub in ACCELERATE_NESTED[key], f"accelerate: unknown key {key}.{sub}"
            _check_type(f"{key}.{sub}", v, ACCELERATE_NESTED[key][sub])
    par = config.get("parallelism_config")
    if par:   # launch.py: parallelism config only with FSDP version 2; sizes multiply to the processes
        assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
        product = 1
        for v in par.values():
            product *= v
        assert product == config["num_processes"], (par, config["num_processes"])
        # ParallelismConfig: "composing DDP + TP is currently not supported"
        if par.get("parallelism_config_dp_replicate_size", 1) > 1 and par.get("parallelism_config_tp_size", 1) > 1:
            assert par.get("parallelism_config_dp_shard_size", 1) > 1
    if config["distributed_type"] == "FSDP":
        assert "fsdp_config" in config
    assert (config.get("mixed_precision") == "fp8") == ("fp8_config" in config), "fp8_config goes with fp8 only"
