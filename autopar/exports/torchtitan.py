"""torchtitan: the plan as a JobConfig TOML file (``--job.config_file``) of torchtitan 0.1 and 0.2.

The keys and their meanings are torchtitan's ``torchtitan/config/job_config.py`` (release 0.2.2): the
``[parallelism]``, ``[activation_checkpoint]``, ``[training]``, ``[optimizer]``, ``[compile]`` and
``[model]`` sections. (torchtitan 0.3 replaced TOML files with Python ``config_registry`` functions; the
``[parallelism]`` names there are the same, set in the function or as ``--parallelism.<key>`` flags.)

How the plan maps:

- data parallelism: ``data_parallel_shard_degree = dp`` (FSDP2 over the data-parallel ranks) with
  ``fsdp_reshard_after_forward = "always"`` for ZeRO-3 (parameters gathered again for backward) and
  ``"never"`` for ZeRO-2 (kept whole from forward to backward, gradients and optimizer state sharded).
  An offloaded ZeRO-3 (``config.offload = "all"``) is ``training.enable_cpu_offload = true``: FSDP2's
  ``CPUOffloadPolicy`` (``apply_fsdp`` in models/llama3/infra/parallelize.py), which keeps the parameter,
  gradient and optimizer-state shards in host memory and steps the optimizer on the CPU; torchtitan
  applies FSDP only over more than one data- or context-parallel rank, and then only is it written.
  torchtitan has no optimizer-only offload (``config.offload = "optimizer"``): that switch is the only
  one, and it moves the parameters and gradients too; nothing is written, the optimizer states stay on
  the GPU, and the memory that adds is said.
  ZeRO-0 is ``data_parallel_replicate_degree = dp`` (DDP), which torchtitan runs only without any other
  parallelism ("DDP has not supported > 1D parallelism", models/llama3/infra/parallelize.py); with
  tensor, pipeline, context or expert parallelism, ZeRO-0 and ZeRO-1 are written as the ZeRO-2-like
  FSDP2 above, which holds less memory, and said so.
- ``tensor_parallel_degree = tp``; torchtitan's tensor parallelism always shards the norms along the
  sequence (``SequenceParallel`` in ``apply_tp``), so a plan without sequence parallelism is said so.
- ``pipeline_parallel_degree = pp``, the schedule by torch.distributed.pipelining's name ("GPipe",
  "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"; ZB-H1 as "1F1B", said so: torchtitan's multi-stage
  schedules need two stages a rank), ``pipeline_parallel_microbatch_size = micro_batch_size`` and the
  plan's exact partition as ``module_fqns_per_model_part`` (one list per model chunk, in model order;
  torchtitan places chunk ``c`` on pipeline rank ``c % pp`` for looped schedules and as a V for ZB-V
  and DualPipeV, as the plan does), named as
  torchtitan's decoder models name their modules (``tok_embeddings``, ``layers.N``, ``norm``,
  ``output``).
- batch: with a pipeline, one step runs every micro-batch of a replica, so ``local_batch_size =
  micro_batch_size x micro_batches``; without one, ``local_batch_size = micro_batch_size`` and
  ``global_batch_size`` makes torchtitan accumulate ``micro_batches`` gradients (``train.py``:
  ``global_batch_size // (local_batch_size * dp_degree)``).
- recomputation: ``mode = "none" | "full"``; the plan's "op" is torchtitan's per-op
  ``mode = "selective"``, ``selective_ac_option = "op"`` (the same policy: runtime/recompute.py);
  "selective" (the plan's: attention's core) becomes that per-op policy too (keeps the attention
  outputs and every other matmul output, recomputes the rest: no more memory, other work), and said so.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .common import (Export, Field, Fields, accumulated_by_autograd, base_warnings, chunks_in_order, header,
                     layers_of, optimizer_on_device, peak_instead, recompute_mode, seq_len, zero_bubble_substitute)

if TYPE_CHECKING:
    from ..plan import Plan

JOB_CONFIG = "torchtitan/config/job_config.py (0.2.2)"
# get_schedule_class's names; torchtitan runs its multi-stage schedules (InterleavedZeroBubble, the ZB-H1 order) only
# with two stages or more per rank (distributed/pipeline_parallel.py), so a one-chunk ZB-H1 plan is written as 1F1B
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zbh1": "1F1B", "zbv": "ZBVZeroBubble",
             "dualpipev": "DualPipeV"}
# Built-in models that torchtitan ships (torchtitan/models/llama3/__init__.py llama3_configs)
FLAVORS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3-405b": ("llama3", "405B")}


def _doc(name: str) -> str:
    return f"{JOB_CONFIG} {name}"


def export(plan: "Plan") -> Export:
    cfg, prec = plan.config, plan.precision
    fields = Fields()
    add = fields.add
    warnings = base_warnings(plan) + accumulated_by_autograd(plan, "torchtitan")

    model = plan.extra.get("model")
    name = model.get("model") if isinstance(model, dict) else None
    if name in FLAVORS:
        add("model.name", FLAVORS[name][0], ("extra.model.model",), _doc("Model.name"))
        add("model.flavor", FLAVORS[name][1], ("extra.model.model",), _doc("Model.flavor"))
    _fp8_converter(plan, add)

    # [training]
    if cfg.pp > 1:
        add("training.local_batch_size", cfg.micro_batch_size * plan.micro_batches,
            ("config.micro_batch_size", "micro_batches"), _doc("Training.local_batch_size"),
            "one pipeline step runs every micro-batch of a replica")
    else:
        add("training.local_batch_size", cfg.micro_batch_size, ("config.micro_batch_size",),
            _doc("Training.local_batch_size"))
    add("training.global_batch_size", plan.global_batch_size, ("global_batch_size",),
        _doc("Training.global_batch_size"),
        f"{plan.micro_batches} gradient-accumulation steps" if cfg.pp == 1 and plan.micro_batches > 1 else "")
    seq, where = seq_len(plan)
    if seq is None:
        warnings.append(f"training.seq_len: {where}; set it to the sequence length the plan was made for")
    else:
        add("training.seq_len", seq, (where,), _doc("Training.seq_len"))
    if cfg.offload != "none":
        _offload(plan, add, warnings)
    _precision(plan, add, warnings)

    # [parallelism]
    _data_parallel(plan, add, warnings)
    add("parallelism.tensor_parallel_degree", cfg.tp, ("config.tp",), _doc("Parallelism.tensor_parallel_degree"))
    if cfg.tp > 1 and not cfg.sequence_parallel:
        warnings.append("config.sequence_parallel = false: torchtitan's tensor parallelism always splits the norms "
                        "along the sequence (SequenceParallel in apply_tp), which keeps less activation memory than "
                        "the plan and moves the same bytes")
    add("parallelism.pipeline_parallel_degree", cfg.pp, ("config.pp",), _doc("Parallelism.pipeline_parallel_degree"))
    if cfg.pp > 1:
        _pipeline(plan, add, warnings)
    add("parallelism.context_parallel_degree", cfg.cp, ("config.cp",), _doc("Parallelism.context_parallel_degree"))
    add("parallelism.expert_parallel_degree", cfg.ep, ("config.ep",), _doc("Parallelism.expert_parallel_degree"))
    if cfg.ep > 1 and cfg.tp > 1:
        add("parallelism.expert_tensor_parallel_degree", cfg.tp, ("config.tp", "config.ep"),
            _doc("Parallelism.expert_tensor_parallel_degree"), "experts split over the tensor-parallel ranks too")

    # [activation_checkpoint]
    mode, lost = recompute_mode(plan, "torchtitan")
    warnings.extend(lost)
    sources = ("config.stage_recompute",) if cfg.stage_recompute else ("config.recompute",)
    if mode == "full" and cfg.recompute_layers:
        _partial_full(plan, add, warnings)
    elif mode == "op":
        add("activation_checkpoint.mode", "selective", sources, _doc("ActivationCheckpoint.mode"))
        add("activation_checkpoint.selective_ac_option", "op", sources,
            _doc("ActivationCheckpoint.selective_ac_option"),
            "per-op selective checkpointing: the plan's recompute 'op'")
    elif mode == "selective":
        add("activation_checkpoint.mode", "selective", sources, _doc("ActivationCheckpoint.mode"))
        add("activation_checkpoint.selective_ac_option", "op", sources,
            _doc("ActivationCheckpoint.selective_ac_option"), "per-op selective checkpointing")
        warnings.append("config.recompute = 'selective' recomputes attention's core (Korthikanti et al.); torchtitan's "
                        "selective checkpointing is per op (selective_ac_option = \"op\": it keeps the attention "
                        "outputs and every other matmul output and recomputes the rest: the plan's recompute = 'op'), "
                        "which keeps no more activations than the plan and recomputes more")
    else:
        add("activation_checkpoint.mode", mode, sources, _doc("ActivationCheckpoint.mode"))

    # [compile]
    add("compile.enable", prec.kernels == "compiled", ("precision.kernels",), _doc("Compile.enable"))
    if prec.kernels == "fused":
        warnings.append("precision.kernels = 'fused' (hand-fused kernels): torchtitan has none; written as eager "
                        "(compile.enable = false), which keeps the same activations and moves more bytes: slower "
                        "than the plan predicts")
    _fp8(plan, add, warnings)
    return Export("torchtitan", render(plan, fields, warnings), tuple(fields), tuple(warnings), "torchtitan.toml")


def _precision(plan: "Plan", add, warnings: list[str]) -> None:
    prec = plan.precision
    param = {"bf16": "bfloat16", "fp32": "float32"}.get(prec.storage)   # fp8 compute: its fp8_storage
    if param is None:
        param = "bfloat16"
        warnings.append("precision.compute = 'fp16': torchtitan's mixed precision is bfloat16 or float32 "
                        "(Training.mixed_precision_param); written as bfloat16, which has the same bytes and "
                        "needs no loss scaling")
    add("training.mixed_precision_param", param, ("precision.compute",), _doc("Training.mixed_precision_param"))
    add("training.mixed_precision_reduce", "float32", ("precision.grads",), _doc("Training.mixed_precision_reduce"),
        "" if prec.grads == "fp32" else "torchtitan's only choice")
    if prec.grads != "fp32":
        warnings.append(f"precision.grads = {prec.grads!r}: torchtitan reduces gradients in float32 only "
                        "(Training.mixed_precision_reduce), twice the bytes the plan priced")
    keeps_fp32 = prec.master_weights or prec.compute == "fp32"
    add("training.dtype", "float32" if keeps_fp32 else "bfloat16", ("precision.master_weights", "precision.compute"),
        _doc("Training.dtype"), "fp32 master weights and optimizer state" if keeps_fp32 else "no fp32 master weights")
    if prec.optimizer == "adam":
        add("optimizer.name", "AdamW", ("precision.optimizer",), _doc("Optimizer.name"),
            "Adam's two fp32 states per parameter")
    else:
        warnings.append("precision.optimizer = 'sgd': torchtitan builds Adam or AdamW only "
                        "(components/optimizer.py build_optimizers), each with two states per parameter where SGD "
                        "keeps one; [optimizer] is left out")


# torchtitan 0.2.2's fp8 converters (components/quantization/float8.py, mx.py: register_model_converter)
FP8_CONVERTERS = {"tensorwise": "quantize.linear.float8", "rowwise": "quantize.linear.float8",
                  "rowwise_with_gw_hp": "quantize.linear.float8", "mxfp8": "quantize.linear.mx"}


def _fp8_converter(plan: "Plan", add) -> None:
    if plan.precision.compute == "fp8":
        add("model.converters", [FP8_CONVERTERS[plan.precision.recipe]], ("precision.compute", "precision.recipe"),
            _doc("Model.converters"), "the linear layers' GEMMs in fp8")


def _fp8(plan: "Plan", add, warnings: list[str]) -> None:
    """[quantize.linear.float8] or [quantize.linear.mx]: the plan's recipe on every linear layer it priced in fp8."""
    prec = plan.precision
    if prec.compute != "fp8":
        return
    srcs = ("precision.recipe",)
    if prec.recipe == "mxfp8":
        add("quantize.linear.mx.recipe_name", "mxfp8_cublas", srcs, _doc("MXLinear.recipe_name"),
            "MXFP8, 32-element block scales")
        add("quantize.linear.mx.filter_fqns", [], srcs, _doc("MXLinear.filter_fqns"),
            "the plan priced the output head in fp8 too (torchtitan's default skips it)")
        return
    add("quantize.linear.float8.recipe_name", prec.recipe, srcs, _doc("Float8Linear.recipe_name"))
    cfg = plan.config
    if prec.gathers_fp8(cfg):   # FSDP2 gathers the linear weights in fp8, their scales from one all-reduce a step
        add("quantize.linear.float8.enable_fsdp_float8_all_gather", True, srcs + ("config.zero",),
            _doc("Float8Linear.enable_fsdp_float8_all_gather"), "the plan's weights gathered in fp8, as priced")
        add("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", True, srcs + ("config.zero",),
            _doc("Float8Linear.precompute_float8_dynamic_scale_for_fsdp"), "the scales from one all-reduce a step")
    elif prec.recipe == "tensorwise" and cfg.zero >= 2:
        add("quantize.linear.float8.enable_fsdp_float8_all_gather", False, srcs + ("config.zero", "config.tp"),
            _doc("Float8Linear.enable_fsdp_float8_all_gather"),
            "the plan gathers in bf16 (with tensor parallelism, or on one replica), as priced")


def _offload(plan: "Plan", add, warnings: list[str]) -> None:
    """config.offload = "all": training.enable_cpu_offload, FSDP2's CPUOffloadPolicy on every FSDP unit
    (apply_fsdp). torchtitan applies FSDP only when ParallelDims.fsdp_enabled (data_parallel_shard_degree or
    context_parallel_degree > 1); without it the switch would leave the model where it initialises it with the
    switch on, the CPU (train.py). config.offload = "optimizer": torchtitan has no such switch (said, not written)."""
    cfg = plan.config
    if cfg.offload == "optimizer":
        _optimizer_offload(plan, warnings)
        return
    if cfg.dp * cfg.cp > 1:
        add("training.enable_cpu_offload", True, ("config.offload",), _doc("Training.enable_cpu_offload")
            + "; models/llama3/infra/parallelize.py apply_fsdp (CPUOffloadPolicy)",
            "FSDP2's CPUOffloadPolicy: parameter, gradient and optimizer-state shards in host memory, the "
            "optimizer step on the CPU")
        return
    warnings.append("config.offload = \"all\" with dp = 1 and cp = 1: torchtitan's CPU offload is FSDP2's "
                    "CPUOffloadPolicy, and torchtitan applies FSDP only over more than one data- or "
                    "context-parallel rank (ParallelDims.fsdp_enabled); with none, training.enable_cpu_offload "
                    "would initialise the model on the CPU and leave it there. It is left out: the parameters, "
                    "gradients and optimizer states stay on the GPU, more memory than the plan")


def _optimizer_offload(plan: "Plan", warnings: list[str]) -> None:
    """config.offload = "optimizer": torchtitan's one CPU offload, training.enable_cpu_offload ("Whether to apply CPU
    offloading of parameters, gradients, and optimizer states in FSDP"), is FSDP2's CPUOffloadPolicy, which moves
    the parameter and gradient shards to the host too; not written, the optimizer states stay on the GPU."""
    cfg = plan.config
    ddp = cfg.zero == 0 and cfg.tp == cfg.pp == cfg.cp == cfg.ep == 1     # as _data_parallel writes it
    sharded = not ddp and cfg.dp * cfg.cp > 1                                # FSDP shards the optimizer states
    peak, fits = optimizer_on_device(plan, sharded)
    held = (f"sharded by FSDP over the {cfg.dp * cfg.cp} data- and context-parallel ranks" if sharded else
            "whole on each rank")
    warnings.append("config.offload = \"optimizer\": torchtitan has no optimizer-only CPU offload; its one switch, "
                    "training.enable_cpu_offload, is FSDP2's CPUOffloadPolicy, which keeps the parameter and gradient "
                    "shards in host memory too (copied over the host link at every all-gather and reduce-scatter), "
                    "a plan autopar prices as offload = \"all\" (with zero = 3). It is not written: the optimizer "
                    f"states and the optimizer step stay on the GPU, {held}: {peak_instead(plan, peak, fits)}; the "
                    "step then skips the host copies and runs on the GPU, faster than the plan predicts")


def _data_parallel(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    srcs = ("config.dp", "config.zero")
    if cfg.zero == 0 and cfg.tp == cfg.pp == cfg.cp == cfg.ep == 1:
        add("parallelism.data_parallel_replicate_degree", cfg.dp, srcs,
            _doc("Parallelism.data_parallel_replicate_degree"), "ZeRO-0: DDP")
        add("parallelism.data_parallel_shard_degree", 1, srcs, _doc("Parallelism.data_parallel_shard_degree"))
        return
    add("parallelism.data_parallel_replicate_degree", 1, srcs, _doc("Parallelism.data_parallel_replicate_degree"))
    add("parallelism.data_parallel_shard_degree", cfg.dp, srcs, _doc("Parallelism.data_parallel_shard_degree"),
        "FSDP2 over the data-parallel ranks")
    if cfg.zero == 3:
        add("parallelism.fsdp_reshard_after_forward", "always", ("config.zero",),
            _doc("Parallelism.fsdp_reshard_after_forward"), "ZeRO-3: parameters gathered again for backward")
        return
    add("parallelism.fsdp_reshard_after_forward", "never", ("config.zero",),
        _doc("Parallelism.fsdp_reshard_after_forward"),
        "ZeRO-2: parameters whole from forward to backward" if cfg.zero == 2
        else f"ZeRO-2-like, the nearest to the plan's ZeRO-{cfg.zero}")
    if cfg.zero == 1:
        warnings.append("config.zero = 1 (optimizer state sharded, gradients whole): torchtitan has no ZeRO-1; written "
                        "as FSDP2 without resharding after forward (ZeRO-2-like: gradients sharded too), which holds "
                        "less memory and reduce-scatters gradients instead of all-reducing them")
    elif cfg.zero == 0:
        others = ", ".join(f"{k}={getattr(cfg, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(cfg, k) > 1)
        warnings.append(f"config.zero = 0 (DDP) with {others}: torchtitan runs DDP only without other parallelism "
                        "(\"DDP has not supported > 1D parallelism\"); written as FSDP2 over the data-parallel ranks "
                        "without resharding after forward (ZeRO-2-like), which holds less memory than the plan and "
                        "gathers parameters and reduce-scatters gradients every step")


def _pipeline(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    if cfg.schedule == "zbh1":
        warnings.append(zero_bubble_substitute(plan, "torchtitan (its InterleavedZeroBubble needs two or more stages per "
                                                     "rank)", "1f1b with the same stages"))
    add("parallelism.pipeline_parallel_schedule", SCHEDULES[cfg.schedule], ("config.schedule",),
        _doc("Parallelism.pipeline_parallel_schedule") + "; torch/distributed/pipelining/schedules.py get_schedule_class")
    add("parallelism.pipeline_parallel_microbatch_size", cfg.micro_batch_size, ("config.micro_batch_size",),
        _doc("Parallelism.pipeline_parallel_microbatch_size"))
    if cfg.schedule == "dualpipev":
        # torchtitan overlaps a DualPipeV pair's expert all-to-all with the other pass's compute by default (ep > 1,
        # distributed/dual_pipe_v.py), which the plan does not price (its pairs run one pass after the other)
        add("parallelism.pipeline_parallel_expert_parallel_overlap", False, ("config.schedule",),
            _doc("Parallelism.pipeline_parallel_expert_parallel_overlap"))
        if cfg.ep > 1:
            warnings.append("config.schedule = 'dualpipev' with ep > 1: written with pipeline_parallel_expert_parallel_"
                            "overlap = false, the pairs run one pass after the other as the plan prices them; true "
                            "overlaps one micro-batch's expert all-to-all with the other's compute, which the plan does "
                            "not price (torchtitan refuses it with activation checkpointing)")
    if cfg.schedule == "interleaved":
        rounds = max(1, plan.micro_batches // cfg.pp)
        if plan.micro_batches % rounds:
            warnings.append(f"micro_batches = {plan.micro_batches} with pp = {cfg.pp}: torch's Interleaved1F1B needs "
                            f"the micro-batches in whole rounds of pp ({plan.micro_batches} % {rounds} != 0) and "
                            "refuses this batch; change global_batch_size")
    layers = layers_of(plan)
    parts: list[list[str]] = []
    for chunk in chunks_in_order(plan):
        names: list[str] = []
        for layer in chunk:
            fqn = _fqn(layers, layer)
            if fqn is None:
                warnings.append(f"layer {layer!r} sits between transformer blocks: torchtitan's decoder models have "
                                "no module there; it is left out of module_fqns_per_model_part")
            elif fqn not in names:
                names.append(fqn)
        parts.append(names)
    add("parallelism.module_fqns_per_model_part", parts, ("stages[].chunks", layers.source),
        _doc("Parallelism.module_fqns_per_model_part"), _naming(layers))


def _fqn(layers, name: str) -> str | None:
    role = layers.role(name)
    if role == "block":
        return f"layers.{layers.block_index(name)}"
    if role == "pre":
        return "tok_embeddings"
    if role == "post":
        return "norm" if name in layers.norms else "output"
    return None


def _naming(layers) -> str:
    """How the plan's layer names became torchtitan's module names."""
    def span(names):
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
    parts = []
    if layers.pre:
        parts.append(f"{'+'.join(layers.pre)} -> tok_embeddings")
    if layers.blocks:
        parts.append(f"{span(layers.blocks)} -> layers.0..{len(layers.blocks) - 1}")
    parts.extend(f"{n} -> {'norm' if n in layers.norms else 'output'}" for n in layers.post)
    return "torchtitan's decoder names: " + ", ".join(parts)


def _partial_full(plan: "Plan", add, warnings: list[str]) -> None:
    """recompute_layers = k: the first k blocks of each chunk in full. torchtitan's layer-level selective
    mode checkpoints every n-th transformer block (its counter runs over consecutive blocks); with n =
    L / k over chunks of L blocks each, every chunk recomputes k blocks, the same count as the plan."""
    cfg = plan.config
    layers = layers_of(plan)
    counts = sorted({sum(1 for n in chunk if layers.role(n) == "block") for chunk in chunks_in_order(plan)})
    k = cfg.recompute_layers
    src = ("config.recompute", "config.recompute_layers")
    per = counts[0]
    if len(counts) == 1 and per % k == 0 and per >= k:
        add("activation_checkpoint.mode", "selective", src, _doc("ActivationCheckpoint.mode"))
        add("activation_checkpoint.selective_ac_option", str(per // k), src,
            _doc("ActivationCheckpoint.selective_ac_option"),
            f"every {per // k}th block in full: {k} of each chunk's {per}, as the plan (other positions)")
        return
    add("activation_checkpoint.mode", "full", src, _doc("ActivationCheckpoint.mode"))
    warnings.append(f"config.recompute_layers = {k} (the first {k} blocks of each chunk in full, the rest kept): "
                    "torchtitan checkpoints every block or every n-th block, and the chunks' block counts "
                    f"({', '.join(str(c) for c in counts)}) are not multiples of {k}; written as full, which "
                    "keeps less and recomputes every block")


# --- TOML -------------------------------------------------------------------------------------------
def render(plan: "Plan", fields: list[Field], warnings: list[str]) -> str:
    lines = header(plan, "torchtitan", warnings)
    lines += ["# For torchtitan 0.1-0.2: `--job.config_file torchtitan.toml`. torchtitan 0.3 reads no TOML: set the "
              "same", "# [parallelism] keys in its config_registry function or as --parallelism.<key> flags."]
    if not any(f.key.startswith("model.") for f in fields):
        lines.append(f"# [model] is left to you: torchtitan ships no {plan.model_name} (name and flavor).")
    section = None
    for f in fields:
        sec, key = f.key.split(".", 1)
        if sec != section:
            lines += ["", f"[{sec}]"]
            section = sec
        lines.extend(_toml_line(key, f))
    return "\n".join(lines) + "\n"


def _toml_line(key: str, f: Field) -> list[str]:
    if isinstance(f.value, list) and f.value and all(isinstance(v, list) for v in f.value):
        out = [f"{key} = [  # {f.comment()}"]
        out += ["  [" + ", ".join(json.dumps(s) for s in part) + "]," for part in f.value]
        return out + ["]"]
    return [f"{key} = {_toml_value(f.value)}  # {f.comment()}"]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)   # a TOML basic string (or array of them): the escapes of JSON's strings
