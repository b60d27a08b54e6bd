"""accelerate: the plan as an ``accelerate launch --config_file`` YAML with FSDP2.

Keys and meanings are accelerate's (release 1.10 or later, the first with ``parallelism_config``):
``accelerate/commands/config/config_args.py`` (``ClusterConfig``: the top-level keys, unknown ones
refused), ``accelerate/commands/launch.py`` (the ``--fsdp_*`` and ``--parallelism_config_*`` arguments
that the ``fsdp_config`` and ``parallelism_config`` entries become) and
``accelerate/parallelism_config.py`` (``ParallelismConfig``: ``dp_replicate_size x dp_shard_size x
tp_size x cp_size`` processes, tensor and context parallelism only with FSDP2, DDP not composed with
tensor parallelism). The FSDP guide is https://huggingface.co/docs/accelerate/usage_guides/fsdp.

How the plan maps: ZeRO-3 is FSDP2 with ``fsdp_reshard_after_forward: true``, ZeRO-2 with ``false``
(parameters whole from forward to backward); ZeRO-0 without other parallelism is plain DDP
(``distributed_type: MULTI_GPU``); ZeRO-0 with tensor or context parallelism and ZeRO-1 have no
accelerate equivalent and are written as the ZeRO-2-like FSDP2, which holds less memory. Tensor and
context parallelism are ``parallelism_config_tp_size`` / ``_cp_size``. Recomputation is
``fsdp_activation_checkpointing`` (every transformer block, full). An offloaded ZeRO-3 (``config.offload =
"all"``) is ``fsdp_offload_params: true``: launch.py passes it on as ``FSDP_OFFLOAD_PARAMS``, from which
``FullyShardedDataParallelPlugin`` (utils/dataclasses.py ``set_cpu_offload``) builds FSDP2's
``CPUOffloadPolicy``: parameter and gradient shards in host memory, and so the optimizer's states and step.
accelerate's FSDP (and DDP) has no optimizer-only offload (``config.offload = "optimizer"``): nothing is
written, the optimizer states stay on the GPU, and the memory that adds is said (accelerate offloads the
optimizer alone only through its DeepSpeed plugin, ``deepspeed_config.offload_optimizer_device``, which
this FSDP file does not use).

Not in accelerate's FSDP config, and so reported: pipeline parallelism (the pipeline ranks become FSDP
ranks: another plan, which the warning says how to price), expert parallelism, Megatron's sequence
parallelism (the tensor-parallel layout is the model's ``tp_plan``), selective, per-op and partial
recomputation, the batch (``DataLoader(batch_size=...)`` and ``Accelerator(gradient_accumulation_steps=
...)`` in code), an fp32 gradient reduction under bf16 (``FullyShardedDataParallelPlugin(
mixed_precision_policy=...)`` in code), the optimizer (built in the script and passed to
``accelerator.prepare`` with the model, which FSDP2 requires) and 16-bit weights without fp32 master
weights (FSDP2 upcasts trainable parameters to fp32 under mixed precision).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common import (RECOMPUTE_PART, Export, Field, Fields, accumulated_by_autograd, base_warnings, header,
                     layers_of, optimizer_on_device, peak_instead, recompute_mode, seq_len)

if TYPE_CHECKING:
    from ..plan import Plan

CONFIG_ARGS = "accelerate/commands/config/config_args.py ClusterConfig"
LAUNCH = "accelerate/commands/launch.py"
PARALLELISM = "accelerate/parallelism_config.py ParallelismConfig"
FSDP_GUIDE = "https://huggingface.co/docs/accelerate/usage_guides/fsdp"
OFFLOAD_PLUGIN = ("accelerate/utils/dataclasses.py FullyShardedDataParallelPlugin.cpu_offload (set_cpu_offload: "
                  "CPUOffloadPolicy under fsdp_version 2)")


def export(plan: "Plan") -> Export:
    cfg, prec = plan.config, plan.precision
    fields = Fields()
    add = fields.add
    warnings = base_warnings(plan) + accumulated_by_autograd(plan, "accelerate")

    ddp = cfg.zero == 0 and cfg.tp == cfg.cp == 1      # (a pipeline is folded into the data parallelism)
    degrees = ("config.zero", "config.tp", "config.pp", "config.cp")
    add("compute_environment", "LOCAL_MACHINE", (), CONFIG_ARGS + ".compute_environment")
    if plan.devices == 1:
        kind = "NO"
    else:
        kind = "MULTI_GPU" if ddp else "FSDP"
    add("distributed_type", kind, degrees, CONFIG_ARGS + ".distributed_type",
        "DDP" if kind == "MULTI_GPU" else "one process" if kind == "NO" else "")
    mixed = {"bf16": "bf16", "fp16": "fp16", "fp32": "no", "fp8": "fp8"}[prec.compute]
    add("mixed_precision", mixed, ("precision.compute",), CONFIG_ARGS + ".mixed_precision; " + LAUNCH
        + " --mixed_precision")
    if prec.compute == "fp8":
        _fp8(plan, add, warnings)
    host = ("cluster.devices_per_host",) if plan.cluster.devices_per_host else ()   # an NVLink domain of machines
    add("num_machines", plan.cluster.hosts, ("cluster.nodes",) + host, CONFIG_ARGS + ".num_machines")
    add("num_processes", plan.devices, ("cluster.nodes", "cluster.devices_per_node"), CONFIG_ARGS + ".num_processes",
        "every process of every machine")
    if prec.kernels == "compiled":
        add("dynamo_config.dynamo_backend", "INDUCTOR", ("precision.kernels",),
            CONFIG_ARGS + ".dynamo_config; " + LAUNCH + " --dynamo_backend")
    elif prec.kernels == "fused":
        warnings.append("precision.kernels = 'fused' (hand-fused kernels): accelerate runs the model's own kernels, "
                        "which move more bytes: slower than the plan predicts")
    if kind == "FSDP":
        _fsdp(plan, add, warnings)
        if cfg.tp > 1 or cfg.cp > 1 or cfg.pp > 1:
            _parallelism(plan, add, warnings)
    else:
        _recompute(plan, None, warnings)
        if cfg.offload == "all":
            warnings.append("config.offload = \"all\" on one device: accelerate's CPU offload is an FSDP setting "
                            "(fsdp_config.fsdp_offload_params) and one process runs without FSDP; the parameters, "
                            "gradients and optimizer states stay on the GPU, more memory than the plan")
    if cfg.offload == "optimizer":
        _optimizer_offload(plan, kind, warnings)
    if cfg.pp > 1:
        how = "FSDP sharding (dp_shard_size" if kind == "FSDP" else "DDP replicas (num_processes"
        warnings.append(f"config.pp = {cfg.pp}: accelerate's config has no pipeline parallelism; the {cfg.pp} pipeline "
                        f"stages are folded into {how} = dp {cfg.dp} x pp {cfg.pp} = {cfg.dp * cfg.pp}), a plan "
                        f"autopar did not price: price it before training with `{_folded_estimate(plan, kind)}`")
    if cfg.ep > 1:
        warnings.append(f"config.ep = {cfg.ep}: accelerate's config has no expert parallelism; every rank holds every "
                        "expert (more memory than the plan)")
    _optimizer(plan, kind, warnings)
    _batch(plan, warnings)
    return Export("accelerate", render(plan, fields, warnings), tuple(fields), tuple(warnings),
                  "accelerate_config.yaml")


def _fsdp(plan: "Plan", add, warnings: list[str]) -> None:
    cfg, prec = plan.config, plan.precision
    add("fsdp_config.fsdp_version", 2, (), LAUNCH + " --fsdp_version; " + FSDP_GUIDE,
        "FSDP2, which parallelism_config needs")
    add("fsdp_config.fsdp_reshard_after_forward", cfg.zero == 3, ("config.zero",),
        LAUNCH + " --fsdp_reshard_after_forward (FSDP2: a boolean)",
        "ZeRO-3: parameters gathered again for backward" if cfg.zero == 3 else
        "ZeRO-2: parameters whole from forward to backward" if cfg.zero == 2 else
        f"ZeRO-2-like, the nearest to the plan's ZeRO-{cfg.zero}")
    if cfg.offload == "all":
        add("fsdp_config.fsdp_offload_params", True, ("config.offload",),
            LAUNCH + " --fsdp_offload_params (FSDP_OFFLOAD_PARAMS); " + OFFLOAD_PLUGIN,
            "FSDP2's CPUOffloadPolicy: parameter and gradient shards in host memory, the optimizer's states and "
            "step with them on the CPU")
    if cfg.zero in (0, 1):
        why = ("accelerate composes tensor and context parallelism only with FSDP2 (ParallelismConfig: "
               "\"composing DDP + TP is currently not supported\")" if cfg.zero == 0
               else "accelerate's FSDP has no ZeRO-1 (optimizer state sharded, gradients whole)")
        warnings.append(f"config.zero = {cfg.zero}: {why}; written as FSDP2 without resharding after forward "
                        "(ZeRO-2-like), which holds less memory and reduce-scatters gradients instead of all-reducing")
    layers = layers_of(plan)
    add("fsdp_config.fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", (layers.source,),
        LAUNCH + " --fsdp_auto_wrap_policy", f"one FSDP unit per transformer block ({len(layers.blocks)})")
    _recompute(plan, add, warnings)
    if prec.compute != "fp32" and prec.grads != prec.compute:
        warnings.append(f"precision.grads = {prec.grads!r}: accelerate's mixed_precision {prec.compute} reduces gradients "
                        f"in {prec.compute} (FullyShardedDataParallelPlugin.set_mixed_precision); reduce in "
                        f"{prec.grads} in code: FullyShardedDataParallelPlugin(mixed_precision_policy={{'param_dtype': "
                        f"'{prec.compute}', 'reduce_dtype': '{prec.grads}', 'output_dtype': '{prec.compute}'}})")


def _optimizer_offload(plan: "Plan", kind: str, warnings: list[str]) -> None:
    """config.offload = "optimizer": accelerate's FSDP plugin offloads with CPUOffloadPolicy only
    (fsdp_offload_params: the parameter and gradient shards too), its DDP not at all; nothing is written."""
    cfg = plan.config
    sharded = kind == "FSDP" and cfg.dp * cfg.pp * cfg.cp > 1     # (a pipeline is folded into the sharding)
    held = "sharded by FSDP over the data-parallel ranks" if sharded else "whole on each rank"
    if cfg.pp > 1:   # another layout than the plan's: its memory is the folded plan's (the config.pp warning)
        memory = "more memory than the plan (price the folded plan as the config.pp warning says)"
    else:
        memory = peak_instead(plan, *optimizer_on_device(plan, sharded))
    if kind == "FSDP":
        how = ("its one CPU offload, fsdp_config.fsdp_offload_params, is FSDP2's CPUOffloadPolicy, which keeps the "
               "parameter and gradient shards in host memory too (copied over the host link at every all-gather "
               "and reduce-scatter), a plan autopar prices as offload = \"all\" with zero = 3")
    else:
        how = (f"this file runs {'DDP' if kind == 'MULTI_GPU' else 'one process'} without FSDP, and FSDP's one CPU "
               "offload, fsdp_offload_params, moves the parameters and gradients too")
    warnings.append(f"config.offload = \"optimizer\": accelerate's FSDP has no optimizer-only CPU offload: {how}; "
                    "only accelerate's DeepSpeed plugin offloads the optimizer alone (distributed_type: DEEPSPEED "
                    "with deepspeed_config.offload_optimizer_device: cpu; `autopar export --to deepspeed` writes "
                    "DeepSpeed's own config). Nothing is written here: the optimizer states and the optimizer step "
                    f"stay on the GPU, {held}: {memory}")


def _recompute(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    mode, lost = recompute_mode(plan, "accelerate")
    if add is None:             # DDP: no fsdp_config to say it in
        if mode != "none":
            warnings.append(f"config.recompute = {mode!r}: accelerate's DDP has no checkpointing setting; call "
                            "model.gradient_checkpointing_enable() (every block, full) in code")
        return
    warnings.extend(lost)
    add("fsdp_config.fsdp_activation_checkpointing", mode != "none",
        ("config.stage_recompute",) if cfg.stage_recompute else ("config.recompute",),
        LAUNCH + " --fsdp_activation_checkpointing", "every transformer block, full" if mode != "none" else "")
    if mode in ("selective", "op"):
        warnings.append(f"config.recompute = {mode!r} ({RECOMPUTE_PART[mode]}): accelerate checkpoints whole "
                        "blocks; written as full, which keeps less and recomputes more")
    elif mode == "full" and cfg.recompute_layers:
        warnings.append(f"config.recompute_layers = {cfg.recompute_layers} (the first blocks of each chunk): accelerate "
                        "checkpoints every block; written as full for all of them")


def _parallelism(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    prefix = "parallelism_config.parallelism_config_"
    shard = cfg.dp * cfg.pp
    add(prefix + "dp_replicate_size", 1, ("config.dp", "config.zero"),
        PARALLELISM + ".dp_replicate_size; " + LAUNCH + " --parallelism_config_dp_replicate_size",
        "ZeRO shards over every data-parallel rank")
    add(prefix + "dp_shard_size", shard, ("config.dp", "config.pp") if cfg.pp > 1 else ("config.dp",),
        PARALLELISM + ".dp_shard_size; " + LAUNCH + " --parallelism_config_dp_shard_size",
        f"dp {cfg.dp} x pp {cfg.pp}: the pipeline ranks shard too" if cfg.pp > 1 else "")
    add(prefix + "tp_size", cfg.tp, ("config.tp",), PARALLELISM + ".tp_size; " + LAUNCH + " --parallelism_config_tp_size")
    add(prefix + "cp_size", cfg.cp, ("config.cp",), PARALLELISM + ".cp_size; " + LAUNCH + " --parallelism_config_cp_size")
    if cfg.tp > 1 and cfg.sequence_parallel:
        warnings.append("config.sequence_parallel = true: accelerate's tensor parallelism is the model's tp_plan "
                        "(transformers); whether its norms are split along the sequence is the model's choice, not "
                        "this config's")


def _folded_estimate(plan: "Plan", kind: str) -> str:
    """The `autopar estimate` command that prices what this file runs when the plan had a pipeline."""
    cfg, cluster = plan.config, plan.cluster
    mode, _ = recompute_mode(plan, "accelerate")
    model = plan.extra.get("model", {}).get("model") if isinstance(plan.extra.get("model"), dict) else None
    spec = (f"{cluster.nodes}x{cluster.devices_per_node}x{cluster.device.name}" if " " not in cluster.device.name
            else "local")
    zero = 0 if kind != "FSDP" else 3 if cfg.zero == 3 else 2
    offload = ",offload=all" if kind == "FSDP" and cfg.offload == "all" else ""   # what fsdp_offload_params runs
    fields = (f"dp={cfg.dp * cfg.pp},tp={cfg.tp},cp={cfg.cp},pp=1,zero={zero}{offload},"
              f"mbs={cfg.micro_batch_size}" + (",sp=true" if cfg.sequence_parallel else "")
              + f",recompute={'none' if mode == 'none' else 'full'}")
    return (f"autopar estimate {model or 'MODEL'} --cluster {spec} --global-batch {plan.global_batch_size} "
            f"--config {fields}")


FP8_CONFIG = ("accelerate/commands/config/config_args.py ClusterConfig.fp8_config (commands/launch.py passes each "
              "key as ACCELERATE_FP8_<KEY>, read by utils/dataclasses.py's recipe kwargs)")


def _fp8(plan: "Plan", add, warnings: list[str]) -> None:
    """fp8_config: torchao's float8 (backend AO) for the tensor- and row-wise recipes, Transformer Engine's MXFP8
    block scaling (backend TE) for mxfp8."""
    recipe, srcs = plan.precision.recipe, ("precision.recipe",)
    if recipe == "mxfp8":
        add("fp8_config.backend", "TE", srcs, FP8_CONFIG, "Transformer Engine")
        add("fp8_config.fp8_format", "HYBRID", ("precision.compute",), FP8_CONFIG, "e4m3 forward, e5m2 gradients")
        add("fp8_config.use_mxfp8_block_scaling", True, srcs, FP8_CONFIG, "MXFP8, 32-element block scales")
        return
    add("fp8_config.backend", "AO", srcs, FP8_CONFIG, "torchao's float8 training")
    gathers = plan.precision.gathers_fp8(plan.config)
    add("fp8_config.enable_fsdp_float8_all_gather", gathers, srcs + ("config.zero",), FP8_CONFIG,
        "FSDP2 gathers the linear weights in fp8 (accelerate refreshes their scales after each optimizer step), as "
        "priced" if gathers else "the plan gathers in bf16, as priced")
    if recipe != "tensorwise":
        warnings.append(f"precision.recipe = {recipe!r}: accelerate's AO backend builds torchao's default "
                        "Float8LinearConfig (tensor-wise) from this file; pass AORecipeKwargs(config=Float8LinearConfig."
                        f"from_recipe_name({recipe!r})) to Accelerator(kwargs_handlers=[...]) in the script for the "
                        "plan's recipe")


def _optimizer(plan: "Plan", kind: str, warnings: list[str]) -> None:
    """accelerate's config has no optimizer (nor a setting for its master weights): the script builds it."""
    prec = plan.precision
    optimizer = "torch.optim.AdamW" if prec.optimizer == "adam" else "torch.optim.SGD"
    together = (": FSDP2 moves it onto the sharded parameters and refuses a model or an optimizer prepared alone "
                "(\"a model and optimizer must be passed together\")" if kind == "FSDP" else "")
    warnings.append(f"precision.optimizer = {prec.optimizer!r}: accelerate's config has no optimizer; build "
                    f"{optimizer}(model.parameters(), lr=...) in the training script and pass it with the model in "
                    f"one accelerator.prepare(model, optimizer){together}")
    if prec.storage == "fp32" or prec.master_weights:
        return
    if kind == "FSDP":
        warnings.append(f"precision.master_weights = false: accelerate's FSDP2 with mixed_precision {prec.storage} "
                        "upcasts every trainable parameter to fp32 (utils/fsdp_utils.py fsdp2_prepare_model) and so "
                        "keeps fp32 master weights, 2 more bytes per parameter (sharded) than the plan, which has "
                        "no setting to turn it off")
    else:
        warnings.append(f"precision.master_weights = false: accelerate's mixed_precision {prec.storage} autocasts and "
                        f"keeps the weights in the dtype the model is loaded in; load it in {prec.storage} "
                        "(from_pretrained(torch_dtype=...), or model.to(...)) for the plan's weights without fp32 masters")


def _batch(plan: "Plan", warnings: list[str]) -> None:
    """The batch goes in the training script: per process and per step, over the data-parallel ranks
    accelerate has (with a pipeline folded into sharding, dp x pp of them)."""
    cfg = plan.config
    seq, _ = seq_len(plan)
    ranks = cfg.dp * cfg.pp
    tokens = f" of {seq} tokens" if seq else ""
    if plan.global_batch_size % (cfg.micro_batch_size * ranks):
        warnings.append(f"the batch is set in code, not in this file: {plan.global_batch_size} samples per step "
                        f"(global_batch_size){tokens} do not divide over {ranks} data-parallel processes x "
                        f"{cfg.micro_batch_size} per process (config.micro_batch_size); choose the accumulation in code")
        return
    accum = plan.global_batch_size // (cfg.micro_batch_size * ranks)
    warnings.append(f"the batch is set in code, not in this file: DataLoader(batch_size={cfg.micro_batch_size}) per "
                    f"process (config.micro_batch_size) and Accelerator(gradient_accumulation_steps={accum}) "
                    f"({'micro_batches' if cfg.pp == 1 else 'micro_batches / pp'}), {plan.global_batch_size} samples "
                    f"per step (global_batch_size){tokens}")


# --- YAML -------------------------------------------------------------------------------------------
def render(plan: "Plan", fields: list[Field], warnings: list[str]) -> str:
    lines = header(plan, "accelerate", warnings)
    lines += ["# Use: accelerate launch --config_file accelerate_config.yaml --machine_rank N "
              "--main_process_ip HOST train.py"]
    section = None
    for f in fields:
        top, _, key = f.key.partition(".")
        if not key:
            section = None
            lines.append(f"{top}: {_yaml_value(f.value)}  # {f.comment()}")
            continue
        if top != section:
            lines.append(f"{top}:")
            section = top
        lines.append(f"  {key}: {_yaml_value(f.value)}  # {f.comment()}")
    return "\n".join(lines) + "\n"


YAML_WORDS = {"yes", "no", "on", "off", "true", "false", "null", "y", "n", "~"}   # YAML 1.1 would not read as text


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if text.lower() in YAML_WORDS or not text.replace("_", "").isalnum() or text[0].isdigit():
        return "'" + text.replace("'", "''") + "'"
    return text
