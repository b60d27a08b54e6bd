"""DeepSpeed: the plan as a DeepSpeed config JSON (``deepspeed.initialize(config=...)``).

Keys and meanings are DeepSpeed's configuration reference (https://www.deepspeed.ai/docs/config-json/)
and its source, release 0.19: ``deepspeed/runtime/config.py`` (``DeepSpeedConfig``: the batch triple
must satisfy ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps *
data-parallel world size``, that world size read from the ``mpu`` given to ``deepspeed.initialize``
and, without one, every rank), ``deepspeed/runtime/zero/config.py`` (``zero_optimization.stage``),
``deepspeed/runtime/engine.py`` (``_do_optimizer_sanity_check``: ZeRO runs an optimizer outside
``ZERO_SUPPORTED_OPTIMIZERS``, such as SGD, only with ``zero_allow_untested_optimizer``),
``deepspeed/runtime/zero/offload_config.py`` (``zero_optimization.offload_param`` and ``offload_optimizer``:
``device`` "cpu" and ``pin_memory``; ``config.offload = "all"`` is both, parameters only under stage 3,
``"optimizer"`` is ``offload_optimizer`` alone, which DeepSpeed runs under ZeRO stage 1, 2 or 3 only),
``deepspeed/runtime/tensor_parallel/config.py`` (``tensor_parallel.autotp_size``, AutoTP training),
``deepspeed/module_inject/auto_ep_config.py`` (``parse_autoep_config``: ``expert_parallel.enabled``,
false unless written, and ``autoep_size``) and ``get_pipeline_config``
(``pipeline.activation_checkpoint_interval``, read by the pipeline engine).

JSON has no comments: every field's source is in :attr:`Export.fields` (``autopar export --trace``
prints them) and what DeepSpeed cannot express is in :attr:`Export.warnings`, which ``autopar export``
prints (on standard error when the file goes to standard output).

What DeepSpeed takes in code rather than in its config, and so is reported, not written: the pipeline
(``PipelineModule(layers, num_stages=pp, partition_method=...)``: its degree, its partition, which
``partition_method`` cannot give layer by layer, and its one schedule, 1F1B without interleaving), the
optimizer (``deepspeed.initialize(optimizer=...)``), the ``mpu`` that makes the batch arithmetic hold
under AutoTP and, without a pipeline, which layers are checkpointed. Not in DeepSpeed at all:
Megatron's sequence parallelism (AutoTP shards the layers only), ring-attention context parallelism
(DeepSpeed's Ulysses ``sequence_parallel_size`` all-to-alls the heads instead, another algorithm: the
plan's context-parallel ranks become data-parallel ranks that take whole sequences, with the
accumulation steps divided to keep the batch), tensor-parallel experts (AutoEP's
``expert_tensor_parallel_size`` must be 1) and ZeRO-2/3 with a pipeline (``PipelineEngine``: "ZeRO-2 and
ZeRO-3 are incompatible with pipeline parallelism"), written as ZeRO-1 with the memory that adds.
The data-parallel reduction is hidden by compute as the plan prices it only with ZeRO 1-2's ``overlap_comm``
(written) and stage 3's default; the pipeline engine reduces after the pipeline and stage 0 after the backward,
each said, as is a plan that priced ZeRO-1's gather of the updated weights overlapped (DeepSpeed gathers after
the step, the plan's default "after_step").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..config import SPLIT_BACKWARD
from .common import (RECOMPUTE_PART, Export, Field, Fields, accumulated_by_autograd, base_warnings, chunks_in_order,
                     gb, recompute_mode, unsharded_memory, zero1_for_offload, zero_bubble_substitute)

if TYPE_CHECKING:
    from ..plan import Plan

CONFIG_JSON = "https://www.deepspeed.ai/docs/config-json/"
ZERO = "deepspeed/runtime/zero/config.py DeepSpeedZeroConfig.stage"
AUTOTP = "deepspeed/runtime/tensor_parallel/config.py TPTrainingConfig.autotp_size (AutoTP training tutorial)"
AUTOEP = "deepspeed/module_inject/auto_ep_config.py parse_autoep_config"
FOLDING = "deepspeed/module_inject/auto_ep_folding.py validate_folding_global"
UNTESTED = ("deepspeed/runtime/engine.py DeepSpeedEngine._do_optimizer_sanity_check; deepspeed/runtime/zero/utils.py "
            "ZERO_SUPPORTED_OPTIMIZERS")
PIPELINE = ("deepspeed/runtime/config.py get_pipeline_config: activation_checkpoint_interval "
            "(deepspeed/runtime/pipe/engine.py sets PipelineModule.activation_checkpoint_interval)")
DTYPES = "deepspeed/runtime/constants.py DATA_TYPES: grad_accum_dtype"
OFFLOAD_PARAM = ("deepspeed/runtime/zero/config.py DeepSpeedZeroConfig.offload_param (valid only with stage 3); "
                 "deepspeed/runtime/zero/offload_config.py DeepSpeedZeroOffloadParamConfig")
OFFLOAD_OPTIMIZER = ("deepspeed/runtime/zero/config.py DeepSpeedZeroConfig.offload_optimizer (stage 1, 2 and 3); "
                     "deepspeed/runtime/zero/offload_config.py DeepSpeedZeroOffloadOptimizerConfig")
CPU_OPTIMIZER = ("deepspeed/runtime/engine.py DeepSpeedEngine._configure_optimizer: zero_force_ds_cpu_optimizer "
                 "(deepspeed/runtime/constants.py ZERO_FORCE_DS_CPU_OPTIMIZER, default true)")


def export(plan: "Plan") -> Export:
    cfg, prec = plan.config, plan.precision
    fields = Fields()
    add = fields.add
    warnings = base_warnings(plan) + accumulated_by_autograd(plan, "DeepSpeed")

    # DeepSpeed's data-parallel world is every rank outside tensor and pipeline parallelism; without
    # context parallelism the plan's cp ranks are among them, each taking whole sequences.
    ranks = cfg.dp * cfg.cp
    accumulation, global_batch = plan.micro_batches, plan.global_batch_size
    batch_sources: tuple[str, ...] = ("global_batch_size",)
    if cfg.cp > 1:
        if plan.micro_batches % cfg.cp == 0:
            accumulation //= cfg.cp
        else:
            global_batch = cfg.micro_batch_size * accumulation * ranks
            batch_sources += ("config.cp",)
        warnings.append(f"config.cp = {cfg.cp} (ring-attention context parallelism): DeepSpeed has none (its Ulysses "
                        "sequence_parallel_size splits the heads with all-to-alls, another algorithm with other limits); "
                        f"the {cfg.cp} context-parallel ranks become data-parallel ranks ({ranks}) that each take whole "
                        f"sequences: {accumulation} accumulation steps"
                        + (f" and a global batch of {global_batch} instead of {plan.global_batch_size}"
                           if global_batch != plan.global_batch_size else "")
                        + f", a plan autopar did not price (price it with --config dp={ranks},cp=1)")
    add("train_batch_size", global_batch, batch_sources, CONFIG_JSON + " train_batch_size")
    add("train_micro_batch_size_per_gpu", cfg.micro_batch_size, ("config.micro_batch_size",),
        CONFIG_JSON + " train_micro_batch_size_per_gpu")
    add("gradient_accumulation_steps", accumulation, ("micro_batches", "config.cp") if cfg.cp > 1 else ("micro_batches",),
        CONFIG_JSON + " gradient_accumulation_steps",
        "the context-parallel ranks take whole sequences" if cfg.cp > 1 else "")

    zero = cfg.zero
    if cfg.pp > 1 and zero >= 2:
        peak, fits = unsharded_memory(plan, 1)
        warnings.append(f"config.zero = {zero} with pp = {cfg.pp}: DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 "
                        "(\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\", runtime/pipe/engine.py); "
                        f"written as stage 1, which keeps gradients{' and parameters' if zero == 3 else ''} whole: "
                        f"about {gb(peak)} per device at the peak instead of {gb(plan.peak_memory)}, which "
                        f"{'still fits' if fits else 'does not fit'} the {gb(plan.cluster.device.memory)} device")
        zero = 1
    sources, note = ("config.zero", "config.pp"), "the pipeline engine's highest stage"
    if zero == 0 and prec.grads != prec.storage:
        warnings.append(f"config.zero = 0 with {prec.storage} weights and {prec.grads} gradients: DeepSpeed accumulates "
                        "gradients in another dtype than the weights only under ZeRO (DeepSpeedEngine."
                        "_do_optimizer_sanity_check: \"unsupported mix\"); written as stage 1, which also shards the "
                        "optimizer state: less memory than the plan, the same bytes on the network")
        zero, sources, note = 1, ("config.zero", "precision.grads", "precision.compute"), \
            f"ZeRO keeps {prec.grads} gradients of {prec.storage} weights"
    if zero == 0 and cfg.offload == "optimizer":
        warnings.append("config.zero = 0 with config.offload = \"optimizer\": DeepSpeed needs ZeRO stage 1 or higher "
                        "for offload_optimizer (its ZeRO optimizers run the offload; stage 0 builds none, and the "
                        f"optimizer states would stay on the GPU); written as stage 1, {zero1_for_offload(ranks)}")
        zero, sources, note = 1, ("config.zero", "config.offload"), "DeepSpeed offloads the optimizer under ZeRO only"
    zero_sources = sources if zero != cfg.zero else ("config.zero",)
    add("zero_optimization.stage", zero, zero_sources, CONFIG_JSON + " zero_optimization.stage; " + ZERO,
        "" if zero == cfg.zero else note)
    if cfg.offload != "none":
        _offload(plan, zero, add, warnings)
    _optimizer(plan, zero, zero_sources, add, warnings)
    if ranks > 1:
        _overlap(plan, zero, ranks, add, warnings)

    _precision(plan, add, warnings)
    if cfg.tp > 1:
        _tensor_parallel(plan, global_batch, accumulation, add, warnings)
    if cfg.ep > 1:
        _expert_parallel(plan, add, warnings)
    if cfg.pp > 1:
        _pipeline(plan, add, warnings)
    else:
        _recompute_in_code(plan, warnings)
    text = json.dumps(_nest(fields), indent=2) + "\n"
    return Export("DeepSpeed", text, tuple(fields), tuple(warnings), "ds_config.json")


def _overlap(plan: "Plan", zero: int, ranks: int, add, warnings: list[str]) -> None:
    """The data-parallel reduction hidden by compute, as the plan prices it (cost_model/step_tail.py: buckets under
    the last micro-batch's backward): ``overlap_comm`` where DeepSpeed can (ZeRO stages 1 and 2 without a pipeline;
    stage 3 overlaps by default); said where it cannot, and where the plan hid ZeRO-1's gather of the updated
    weights (``Precision.param_gather`` "overlapped"), which DeepSpeed runs after the step."""
    hidden = "which the plan prices hidden under the last micro-batch's backward"
    if plan.config.pp > 1:
        warnings.append(f"data parallelism over {ranks} ranks with pp = {plan.config.pp}: DeepSpeed's pipeline engine "
                        "reduces the gradients after the whole pipeline (its ReduceGrads instruction follows the last "
                        f"backward pass, runtime/pipe/schedule.py TrainSchedule), {hidden}: that reduction adds to the "
                        "step in DeepSpeed")
        return
    if zero == 0:
        warnings.append(f"data parallelism over {ranks} ranks at ZeRO stage 0: DeepSpeed's engine all-reduces the "
                        "gradients after the backward (DeepSpeedEngine.allreduce_gradients), " + hidden + ": that "
                        "all-reduce adds to the step in DeepSpeed; stages 1 and 2 overlap it (overlap_comm), a plan "
                        "priced with --config zero=1")
        return
    if zero in (1, 2):
        add("zero_optimization.overlap_comm", True, ("config.dp", "config.cp"),
            CONFIG_JSON + " zero_optimization.overlap_comm; deepspeed/runtime/zero/config.py "
            "DeepSpeedZeroConfig.overlap_comm (false by default below stage 3)",
            "the gradients reduced under the backward, as the plan prices them")
        if plan.precision.param_gather == "overlapped" and plan.config.zero == 1:
            warnings.append("precision.param_gather = 'overlapped': DeepSpeed all-gathers the updated weights after the "
                            "optimizer step (runtime/zero/stage_1_and_2.py step), which the plan prices hidden under the "
                            "next forward as Megatron-Core's --overlap-param-gather runs it: that gather adds to the step "
                            "in DeepSpeed (re-plan with Precision(param_gather='after_step'))")


def _offload(plan: "Plan", zero: int, add, warnings: list[str]) -> None:
    """config.offload: "all" (the plan's offloaded ZeRO-3) is DeepSpeed's offload_param (the parameter shards;
    stage 3 only) with offload_optimizer; "optimizer" is offload_optimizer alone (the optimizer states, fp32
    master weights and gradient shards in host memory, the step on the CPU); both in pinned host memory."""
    src = ("config.offload",)
    if plan.config.offload == "all" and zero == 3:
        add("zero_optimization.offload_param.device", "cpu", src, OFFLOAD_PARAM + ".device",
            "each rank's parameter shards in host memory")
        add("zero_optimization.offload_param.pin_memory", True, src, OFFLOAD_PARAM + ".pin_memory",
            "page-locked: asynchronous copies at the host link's full bandwidth")
    add("zero_optimization.offload_optimizer.device", "cpu", src, OFFLOAD_OPTIMIZER + ".device",
        "optimizer states and gradient shards in host memory, the step on the CPU")
    add("zero_optimization.offload_optimizer.pin_memory", True, src, OFFLOAD_OPTIMIZER + ".pin_memory",
        "page-locked: asynchronous copies at the host link's full bandwidth")
    if plan.config.offload == "all" and zero != 3:
        warnings.append(f"config.offload = \"all\" with pp = {plan.config.pp}: DeepSpeed offloads parameters only "
                        "under ZeRO-3 (offload_param: \"Valid only with stage 3\"), which its pipeline engine refuses; "
                        f"only offload_optimizer is written, valid with stage {zero} (the optimizer states and the "
                        "step on the CPU), and the parameters stay on the GPU, whole (the memory said above)")


def _optimizer(plan: "Plan", zero: int, zero_sources: tuple[str, ...], add, warnings: list[str]) -> None:
    """The optimizer is built in code; ZeRO runs SGD only when the config allows an untested optimizer, and
    with offloaded optimizer states anything but DeepSpeed's CPU optimizers only when the config forces it."""
    sgd = plan.precision.optimizer == "sgd"
    offload = plan.config.offload != "none"   # offload_optimizer written, under both modes
    optimizer = "torch.optim.SGD" if sgd else "DeepSpeedCPUAdam" if offload else "torch.optim.AdamW"
    allowed = sgd and zero >= 1
    if allowed:
        add("zero_allow_untested_optimizer", True, ("precision.optimizer",) + zero_sources, UNTESTED,
            f"ZeRO-{zero} with {optimizer}, which is not among ZeRO's tested optimizers")
    if offload and sgd:
        add("zero_force_ds_cpu_optimizer", False, ("precision.optimizer", "config.offload"), CPU_OPTIMIZER,
            "DeepSpeed has no CPU SGD: torch.optim.SGD steps the offloaded shards")
    if plan.config.ep > 1:   # AutoEP replaces the expert layers inside initialize: build the optimizer after it
        build = (f"optimizer=lambda params: {optimizer}(configure_moe_param_groups(list(params)), lr=...) (from "
                 "deepspeed.moe.utils: the replaced experts' parameters in their own groups, which ZeRO-1/2 requires: "
                 "\"None of the param groups are marked as MoE\")")
    else:
        build = f"optimizer={optimizer}(model.parameters(), lr=...)"
    warnings.append(f"precision.optimizer = {plan.precision.optimizer!r}: DeepSpeed takes the optimizer from the code, "
                    f"deepspeed.initialize({build}), or from an \"optimizer\" section with its learning rate, which the "
                    "plan does not hold"
                    + ("; with offload_optimizer DeepSpeed refuses a client optimizer other than its CPU ones "
                       "(\"You are using ZeRO-Offload with a client provided optimizer\"): DeepSpeedCPUAdam, from "
                       "deepspeed.ops.adam, is AdamW on the CPU (adamw_mode=True), its C++ kernel built on first use"
                       if offload and not sgd else "")
                    + ("; with offload_optimizer DeepSpeed refuses an optimizer other than DeepSpeedCPUAdam and "
                       "DeepSpeedCPULion unless zero_force_ds_cpu_optimizer is false, as written here: "
                       "torch.optim.SGD then steps the host shards, which DeepSpeed warns \"in most cases will yield poor performance\""
                       if offload and sgd else "")
                    + ("; ZeRO refuses SGD (\"You are using an untested ZeRO Optimizer\") unless "
                       "zero_allow_untested_optimizer is true, as written here, and then logs \"proceed with caution\""
                       if allowed else ""))


def _tensor_parallel(plan: "Plan", global_batch: int, accumulation: int, add, warnings: list[str]) -> None:
    cfg = plan.config
    ranks = cfg.dp * cfg.cp
    add("tensor_parallel.autotp_size", cfg.tp, ("config.tp",), AUTOTP)
    if cfg.pp > 1:
        warnings.append("config.tp > 1 with a pipeline: AutoTP shards a Hugging Face model's layers, while a "
                        "PipelineModule takes its tensor parallelism from the model code (Megatron-DeepSpeed's "
                        "mpu); autotp_size is written for the former. DeepSpeedConfig counts the data-parallel ranks "
                        "of train_batch_size from the PipelineModule's topology: build it with topology="
                        f"PipeModelDataParallelTopology(num_pp={cfg.pp}, num_mp={cfg.tp}, num_dp={ranks}) (the default "
                        f"topology counts {ranks * cfg.tp} and refuses this file's train_batch_size)")
    else:
        warnings.append(f"config.tp = {cfg.tp} (AutoTP): DeepSpeedConfig checks train_batch_size = "
                        "train_micro_batch_size_per_gpu x gradient_accumulation_steps x the data-parallel ranks, "
                        "which it counts from the mpu given to deepspeed.initialize; without one (as in DeepSpeed's "
                        f"AutoTP tutorial) it counts all {plan.devices} ranks and refuses this file (\"Check batch "
                        f"related parameters\": {global_batch} != {cfg.micro_batch_size} * {accumulation} * "
                        f"{plan.devices}). Pass one that counts {ranks}: deepspeed.init_distributed(); from "
                        "deepspeed.utils import groups; groups._init_tp_mesh_device(tensor_model_parallel_size="
                        f"{cfg.tp}); deepspeed.initialize(..., mpu=groups)")
    if cfg.sequence_parallel:
        warnings.append("config.sequence_parallel = true: DeepSpeed's AutoTP shards the linear layers only; the "
                        "norms and dropout stay whole on every tensor-parallel rank (more activation memory than "
                        "the plan). Megatron-DeepSpeed's --sequence-parallel is a model-code argument")


def _expert_parallel(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    add("expert_parallel.enabled", True, ("config.ep",), AUTOEP + ": enabled (false when absent: every other "
        "expert_parallel key is then ignored)")
    add("expert_parallel.autoep_size", cfg.ep, ("config.ep",), AUTOEP + ": autoep_size")
    warnings.append(f"config.ep = {cfg.ep}: DeepSpeed's AutoEP replaces the mixture-of-experts blocks of the models it "
                    "has presets for (deepspeed/module_inject/auto_ep_presets: Mixtral, Qwen3-MoE, DeepSeek-V2/V3 and "
                    "others) or that expert_parallel.moe_layer_pattern, expert_pattern and router_pattern name; in "
                    "another model it replaces none, without a warning, and every rank holds every expert (more "
                    "memory than the plan): add those keys for such a model")
    if cfg.tp > 1:
        warnings.append(f"config.ep = {cfg.ep} with config.tp = {cfg.tp}: AutoEP does not split experts with tensor "
                        f"parallelism (expert_parallel.expert_tensor_parallel_size must be 1, {FOLDING}); its expert "
                        f"groups are {cfg.ep} consecutive ranks across the tensor-parallel lanes, each holding whole "
                        f"experts: {cfg.tp} x the expert weights per rank of the plan, which splits each expert "
                        f"{cfg.tp} ways. For the plan's expert memory write autoep_size = {cfg.ep * cfg.tp}, a layout "
                        "autopar did not price")
        if cfg.pp > 1:
            warnings.append(f"config.ep = {cfg.ep} with tp = {cfg.tp} and pp = {cfg.pp}: DeepSpeed refuses AutoEP with "
                            f"tensor parallelism under a pipeline ({FOLDING}: \"AutoEP+AutoTP folding currently "
                            "supports pp_size=1 only\"; AutoEP also refuses an mpu's tensor parallelism): "
                            "deepspeed.initialize raises ValueError with this file. For DeepSpeed, plan with "
                            "`autopar plan ... --fixed tp=1` or `--fixed pp=1`")


def _precision(plan: "Plan", add, warnings: list[str]) -> None:
    prec = plan.precision
    add("bf16.enabled", prec.storage == "bf16", ("precision.compute",), CONFIG_JSON + " bf16.enabled")
    add("fp16.enabled", prec.storage == "fp16", ("precision.compute",), CONFIG_JSON + " fp16.enabled",
        "dynamic loss scaling" if prec.storage == "fp16" else "")
    if prec.compute == "fp8":
        warnings.append(f"precision.compute = 'fp8' (recipe {prec.recipe!r}): DeepSpeed's config has no fp8 training "
                        "switch (deepspeed/runtime/config.py: fp16, bf16, torch_autocast only); convert the model's "
                        "linear layers in the script before deepspeed.initialize (torchao.float8."
                        "convert_to_float8_training with Float8LinearConfig.from_recipe_name, or Transformer Engine's "
                        "te.Linear under te.fp8_autocast), else it trains in bf16, slower than the plan predicts"
                        + ("; the plan also gathers the linear weights in fp8 under ZeRO-3 (torchao's FSDP2 fp8 "
                           "all-gather), which DeepSpeed's ZeRO-3 does not: its gathers move bf16, slower still"
                           if prec.gathers_fp8(plan.config) else ""))
    add("data_types.grad_accum_dtype", prec.grads, ("precision.grads",), CONFIG_JSON + " data_types; " + DTYPES)
    add("communication_data_type", prec.grads, ("precision.grads",), CONFIG_JSON + " communication_data_type")
    if prec.grad_reduce == "all_reduce" and plan.config.zero == 1:
        warnings.append("precision.grad_reduce = 'all_reduce': the plan prices the gradients all-reduced, as "
                        "DeepSpeed 0.4.4-0.12's stage 1 ran them; from 0.13 DeepSpeed reduces each shard to its "
                        "owner, half the bytes: faster than the plan predicts (re-plan with "
                        "Precision(grad_reduce='reduce_scatter'))")
    if prec.storage != "fp32" and not prec.master_weights:
        warnings.append("precision.master_weights = false: DeepSpeed's 16-bit optimizers keep fp32 master weights "
                        "(4 more bytes per parameter than the plan)")
    if prec.kernels == "compiled":
        warnings.append("precision.kernels = 'compiled': DeepSpeed compiles in code (engine.compile()); the config "
                        "does not say it")
    elif prec.kernels == "fused":
        warnings.append("precision.kernels = 'fused' (hand-fused kernels): DeepSpeed runs the model's own kernels "
                        "(eager unless the model fuses them), which move more bytes: slower than the plan predicts")


def _pipeline(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    mode, lost = recompute_mode(plan, "DeepSpeed")
    warnings.extend(lost)
    interval = 0 if mode == "none" else 1
    add("pipeline.activation_checkpoint_interval", interval,
        ("config.stage_recompute",) if cfg.stage_recompute else ("config.recompute",), PIPELINE,
        "every layer checkpointed" if interval else "no checkpointing")
    if mode in ("selective", "op"):
        warnings.append(f"config.recompute = {mode!r} ({RECOMPUTE_PART[mode]}): DeepSpeed's pipeline checkpoints whole "
                        "layers; written as activation_checkpoint_interval 1 (full), which keeps less and recomputes "
                        "more")
    elif cfg.recompute_layers:
        warnings.append(f"config.recompute_layers = {cfg.recompute_layers} (the first blocks of each chunk): DeepSpeed "
                        "checkpoints every layer or none; written as activation_checkpoint_interval 1 (every layer)")
    starts = ", ".join(chunk[0] for chunk in chunks_in_order(plan))
    warnings.append(f"config.pp = {cfg.pp}: DeepSpeed's pipeline is built in code, PipelineModule(layers, "
                    f"num_stages={cfg.pp}, partition_method=...), and partition_method ('parameters', 'uniform', "
                    f"'type:regex') cannot give the plan's stage boundaries, which start at: {starts}")
    if cfg.schedule == "interleaved":
        warnings.append(f"config.schedule = 'interleaved' ({cfg.virtual_stages} model chunks per device): DeepSpeed's "
                        "pipeline runs its own 1F1B schedule (TrainSchedule) with one chunk per device, which has a "
                        "larger bubble than the plan's")
    elif cfg.schedule in SPLIT_BACKWARD:
        warnings.append(zero_bubble_substitute(plan, "DeepSpeed's pipeline (TrainSchedule)",
                                               "1f1b with one chunk per device"))
    elif cfg.schedule == "gpipe":
        warnings.append("config.schedule = 'gpipe': DeepSpeed's pipeline runs 1F1B (TrainSchedule), which holds fewer "
                        "micro-batches' activations and has the same bubble")


def _recompute_in_code(plan: "Plan", warnings: list[str]) -> None:
    mode, lost = recompute_mode(plan, "DeepSpeed")
    if mode == "none":
        return
    warnings.extend(lost)
    what = {"full": "each transformer block" + (f" (the first {plan.config.recompute_layers} of each chunk)"
                                                  if plan.config.recompute_layers else ""),
            "selective": "attention's core (selective)", "op": "each transformer block (full: DeepSpeed has no "
                                                                      "per-op policy)"}[mode]
    warnings.append(f"config.recompute = {mode!r}: without a pipeline DeepSpeed checkpoints what the model code "
                    f"wraps: {what} in deepspeed.checkpointing.checkpoint, or model.gradient_checkpointing_enable() "
                    "for a Hugging Face model (every block, full)")


def _nest(fields: list[Field]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields:
        *path, last = f.key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = f.value
    return out
