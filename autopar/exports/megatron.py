"""Megatron-LM: the plan as command-line arguments of ``pretrain_gpt.py``, in a bash file that defines
two arrays (``AUTOPAR_TORCHRUN`` and ``AUTOPAR_MEGATRON_ARGS``), the way Megatron-LM's own example
scripts hold theirs (examples/gpt3/train_gpt3_175b_distributed.sh).

Every flag is one of ``megatron/training/arguments.py`` (its argument groups ``_add_distributed_args``,
``_add_training_args``, ``_add_mixed_precision_args``, ``_add_data_args``, ``_add_network_size_args``,
``_add_moe_args``, ``_add_experimental_args``) with the meaning its help gives, checked against ``validate_args`` there:

- degrees: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
  ``--context-parallel-size``, ``--expert-model-parallel-size``; the data-parallel degree is what is
  left of the world (``data_parallel_size = world_size // (tp * pp * cp)``), so the torchrun array
  carries the plan's nodes and devices per node. ``--sequence-parallel`` is Megatron's own (Korthikanti
  et al.), the plan's ``sequence_parallel``.
- the pipeline: Megatron's default split (transformer layers evenly over the ``pp x v`` model chunks,
  the embedding in the first, the output layer and loss in the last) when the plan's partition is that
  one, with ``--num-layers-per-virtual-pipeline-stage`` for interleaving; any other partition exactly as
  ``--pipeline-model-parallel-layout`` ("E" embedding, "t" transformer layer, "L" loss, "|" between model
  chunks in model order: megatron/core/transformer/pipeline_parallel_layer_layout.py). Megatron has
  no GPipe schedule: its non-interleaved schedule is 1F1B.
- recomputation: "selective" is ``--recompute-granularity selective`` (attention's core, the default
  ``--recompute-modules core_attn``: the plan's selective); "full" is ``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1`` (every layer's input kept, the layer
  recomputed), and with ``recompute_layers = k`` ``--recompute-method block --recompute-num-layers k``
  (the first k blocks of each chunk, which is where the plan's field comes from). "op" (per-op) has no
  Megatron-LM equivalent: written as full, and said so.
- ZeRO: 1 is ``--use-distributed-optimizer`` (optimizer state sharded over the data-parallel ranks);
  2 and 3 are Megatron FSDP (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`` or
  ``optim_grads_params``, with the flags its user guide lists), which works with tensor, context and
  expert parallelism and not with a pipeline: there they fall back to the distributed optimizer, and the
  memory that adds is said.
- offload: Megatron-LM offloads the optimizer only, ``--optimizer-cpu-offload --optimizer-offload-fraction
  1.0`` with ``--use-precision-aware-optimizer`` (which ``validate_args`` requires with it, and which runs
  Adam only, under the distributed optimizer) and ``--overlap-cpu-optimizer-d2h-h2d``, as its guide
  (megatron/core/optimizer/cpu_offloading/README.md) lists: the optimizer states and step on the CPU.
  That is the plan's ``offload = "optimizer"`` (ZeRO-0 written as the distributed optimizer, which the
  precision-aware optimizer needs, and said so); for ``"all"`` (the offloaded ZeRO-3) the parameters and
  their gradients stay on the GPU, and the memory that adds is said.
- data-parallel overlap: ``--overlap-grad-reduce`` whenever gradients have replicas, since the plan prices
  the reduction hidden by the backward (Megatron-Core's default runs it after); with the distributed optimizer
  and ``precision.param_gather = "overlapped"``, ``--overlap-param-gather`` (the updated weights gathered under
  the next forward; "after_step", the default, is Megatron-Core's default).
- precision: ``--bf16`` / ``--fp16``, gradients reduced in fp32 (``--accumulate-allreduce-grads-in-fp32``)
  or bf16 (``--grad-reduce-in-bf16``), ``--optimizer adam|sgd``; ``--no-gradient-accumulation-fusion`` when the
  plan priced the micro-batches' gradients added by autograd (``precision.grad_accumulation``);
  ``--no-masked-softmax-fusion`` when it priced the attention softmax as Megatron's PyTorch fallback
  (``precision.fused_softmax`` false).

With tensor or context parallelism (and not Megatron FSDP) the file exports
``CUDA_DEVICE_MAX_CONNECTIONS=1``, which ``validate_args`` requires before Blackwell GPUs.

Model shape, data and learning-rate arguments are the user's; ``--num-layers`` and ``--seq-length`` are
written because the partition and the batch depend on them.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from .common import (RECOMPUTE_PART, Export, Field, Fields, base_warnings, chunks_in_order, gb, header, layers_of,
                     recompute_mode, seq_len, unsharded_memory, zero1_for_offload, zero_bubble_substitute)

if TYPE_CHECKING:
    from ..plan import Plan

ARGS = "megatron/training/arguments.py"
FSDP_GUIDE = "Megatron-Core developer guide, Megatron FSDP (user-guide/features/custom_fsdp.html)"
LAYOUT = "megatron/core/transformer/pipeline_parallel_layer_layout.py"
CPU_OFFLOAD_GUIDE = "megatron/core/optimizer/cpu_offloading/README.md (Megatron-Core guide: optimizer CPU offload)"
TORCHRUN = "torchrun --help (torch.distributed.run)"


def _doc(group: str, flag: str) -> str:
    return f"{ARGS} {group}: {flag}"


def export(plan: "Plan") -> Export:
    cfg, prec = plan.config, plan.precision
    fields = Fields()
    add = fields.add
    warnings = base_warnings(plan)

    host = ("cluster.devices_per_host",) if plan.cluster.devices_per_host else ()   # an NVLink domain of machines
    add("torchrun --nnodes", plan.cluster.hosts, ("cluster.nodes",) + host, TORCHRUN)
    add("torchrun --nproc-per-node", plan.cluster.host_devices, host or ("cluster.devices_per_node",), TORCHRUN)

    dist = "_add_distributed_args"
    add("--tensor-model-parallel-size", cfg.tp, ("config.tp",), _doc(dist, "--tensor-model-parallel-size"))
    add("--pipeline-model-parallel-size", cfg.pp, ("config.pp",), _doc(dist, "--pipeline-model-parallel-size"))
    add("--context-parallel-size", cfg.cp, ("config.cp",), _doc(dist, "--context-parallel-size"))
    add("--expert-model-parallel-size", cfg.ep, ("config.ep",), _doc("_add_moe_args", "--expert-model-parallel-size"))
    if cfg.sequence_parallel:
        add("--sequence-parallel", True, ("config.sequence_parallel",), _doc("_add_training_args", "--sequence-parallel"))
    if (cfg.tp > 1 or cfg.cp > 1) and not (cfg.zero >= 2 and cfg.pp == 1):
        add("env CUDA_DEVICE_MAX_CONNECTIONS", 1, ("config.tp", "config.cp"),
            f"{ARGS} validate_args: \"Using tensor model parallelism or context parallelism require setting the "
            "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1\" (before Blackwell; Megatron FSDP wants it unset)",
            "tensor or context parallelism without Megatron FSDP")
    if cfg.ep > 1 and prec.compute == "fp16":
        warnings.append("config.ep > 1 with fp16: Megatron-LM refuses expert parallelism with fp16 (validate_args: "
                        "\"Expert parallelism is not supported with fp16 training\"); use --bf16")

    layers = layers_of(plan)
    if layers.blocks:
        add("--num-layers", len(layers.blocks), (layers.source,), _doc("_add_network_size_args", "--num-layers"),
            "the transformer blocks")
    if cfg.pp > 1:
        _pipeline(plan, layers, add, warnings)

    add("--micro-batch-size", cfg.micro_batch_size, ("config.micro_batch_size",),
        _doc("_add_training_args", "--micro-batch-size"))
    add("--global-batch-size", plan.global_batch_size, ("global_batch_size",),
        _doc("_add_training_args", "--global-batch-size"),
        f"{plan.micro_batches} micro-batches per step" if plan.micro_batches > 1 else "")
    seq, where = seq_len(plan)
    if seq is None:
        warnings.append(f"--seq-length: {where}; set it to the sequence length the plan was made for")
    else:
        add("--seq-length", seq, (where,), _doc("_add_data_args", "--seq-length"))

    _recompute(plan, add, warnings)
    _zero(plan, add, warnings)
    _precision(plan, add, warnings)
    if cfg.offload != "none":
        _offload(plan, add, warnings)
    _overlap(plan, fields)
    return Export("Megatron-LM", render(plan, fields, warnings), tuple(fields), tuple(warnings), "megatron_args.sh")


def _pipeline(plan: "Plan", layers, add, warnings: list[str]) -> None:
    cfg = plan.config
    if cfg.schedule == "zbh1":
        warnings.append(zero_bubble_substitute(plan, "Megatron-LM", "1f1b with the same stages"))
    elif cfg.v_shaped:
        warnings.append(zero_bubble_substitute(
            plan, "Megatron-LM", "interleaved 1F1B with the same model chunks, two per device, placed looped (chunk "
                                 f"c on pipeline rank c mod pp) rather than as {cfg.schedule}'s V"))
    if cfg.schedule == "gpipe":
        warnings.append("config.schedule = 'gpipe': Megatron-LM's non-interleaved pipeline schedule is 1F1B "
                        "(forward_backward_pipelining_without_interleaving), which holds fewer micro-batches' "
                        "activations and has the same bubble")
    chunks = chunks_in_order(plan)
    per_chunk = [sum(1 for n in chunk if layers.role(n) == "block") for chunk in chunks]
    default = (len(set(per_chunk)) == 1 and not layers.between
               and all(n in chunks[0] for n in layers.pre) and all(n in chunks[-1] for n in layers.post))
    if default:
        if cfg.virtual_stages > 1:
            add("--num-layers-per-virtual-pipeline-stage", per_chunk[0], ("config.virtual_stages", "stages[].chunks"),
                _doc("_add_distributed_args", "--num-layers-per-virtual-pipeline-stage"),
                f"interleaved: {cfg.virtual_stages} chunks per device, Megatron's even split")
        return
    stages = []
    for c, chunk in enumerate(chunks):
        roles = [layers.role(n) for n in chunk]
        n = roles.count("block")
        stages.append(("E" if "pre" in roles else "") + ("t" * n if n < 2 else f"t*{n}")
                      + ("L" if layers.post and layers.post[-1] in chunk else ""))
    layout = "|".join(stages)
    add("--pipeline-model-parallel-layout", layout, ("stages[].chunks", layers.source),
        _doc("_add_distributed_args", "--pipeline-model-parallel-layout") + "; " + LAYOUT,
        f"the plan's partition: {len(chunks)} model chunks" + (f", {cfg.virtual_stages} per device"
                                                                 if cfg.virtual_stages > 1 else ""))
    pre_chunks = {c for c, chunk in enumerate(chunks) for n in chunk if n in layers.pre}
    post_chunks = {c for c, chunk in enumerate(chunks) for n in chunk if n in layers.post}
    if len(pre_chunks) > 1 or len(post_chunks) > 1:
        warnings.append(f"the plan splits the layers before or after the transformer blocks over model chunks "
                        f"({', '.join(layers.pre + layers.post)}): Megatron-LM's layout has one embedding stage "
                        "(\"E\") and one loss stage (\"L\"); they are written where the first embedding and the last "
                        "layer are")
    if layers.between:
        warnings.append(f"layers between the transformer blocks ({', '.join(layers.between)}) have no Megatron-LM "
                        "layer type; the layout leaves them out")


def _recompute(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    train = "_add_training_args"
    mode, lost = recompute_mode(plan, "Megatron-LM")
    warnings.extend(lost)
    src = ("config.stage_recompute",) if cfg.stage_recompute else ("config.recompute",)
    if mode == "none":
        return
    if mode == "op":
        warnings.append(f"config.recompute = 'op' ({RECOMPUTE_PART['op']}): Megatron-LM has no per-op policy; "
                        "written as --recompute-granularity full, which keeps less and "
                        "recomputes more")
        mode = "full"
    add("--recompute-granularity", mode, src, _doc(train, "--recompute-granularity"),
        "attention's core (--recompute-modules core_attn, the default)" if mode == "selective" else "")
    if mode == "full":
        if cfg.recompute_layers:
            add("--recompute-method", "block", ("config.recompute_layers",), _doc(train, "--recompute-method"),
                "the first blocks of each chunk")
            add("--recompute-num-layers", cfg.recompute_layers, ("config.recompute_layers",),
                _doc(train, "--recompute-num-layers"))
        else:
            add("--recompute-method", "uniform", src, _doc(train, "--recompute-method"), "every layer on its own")
            add("--recompute-num-layers", 1, src, _doc(train, "--recompute-num-layers"))


def _zero(plan: "Plan", add, warnings: list[str]) -> None:
    cfg = plan.config
    dist = "_add_distributed_args"
    if cfg.zero == 0:
        return
    if cfg.zero == 1 or cfg.pp > 1:
        add("--use-distributed-optimizer", True, ("config.zero",), _doc(dist, "--use-distributed-optimizer"),
            "ZeRO-1: optimizer state sharded over the data-parallel ranks" if cfg.zero == 1
            else f"the nearest to ZeRO-{cfg.zero} with a pipeline")
        if cfg.zero > 1:
            peak, fits = unsharded_memory(plan, 1)
            warnings.append(f"config.zero = {cfg.zero} with pp = {cfg.pp}: Megatron FSDP, Megatron-LM's ZeRO-2/3, does "
                            "not run with pipeline parallelism (its user guide lists tensor, context and expert "
                            "parallelism); written as --use-distributed-optimizer (ZeRO-1), which keeps gradients"
                            f"{' and parameters' if cfg.zero == 3 else ''} whole: about {gb(peak)} per device at the "
                            f"peak instead of {gb(plan.peak_memory)}, which "
                            f"{'still fits' if fits else 'does not fit'} the {gb(plan.cluster.device.memory)} device")
        return
    strategy = "optim_grads_params" if cfg.zero == 3 else "optim_grads"
    add("--use-megatron-fsdp", True, ("config.zero",), _doc(dist, "--use-megatron-fsdp") + "; " + FSDP_GUIDE,
        f"ZeRO-{cfg.zero}")
    add("--data-parallel-sharding-strategy", strategy, ("config.zero",),
        _doc(dist, "--data-parallel-sharding-strategy"),
        "optimizer state, gradients and parameters sharded" if cfg.zero == 3
        else "optimizer state and gradients sharded")
    add("--use-distributed-optimizer", True, ("config.zero",), _doc(dist, "--use-distributed-optimizer") + "; "
        + FSDP_GUIDE, "Megatron FSDP's documented companion flag")
    add("--no-gradient-accumulation-fusion", True, ("config.zero",),
        _doc("_add_training_args", "--no-gradient-accumulation-fusion") + "; " + FSDP_GUIDE,
        "Megatron FSDP's documented companion flag")
    add("--ckpt-format", "fsdp_dtensor", ("config.zero",), _doc("_add_checkpointing_args", "--ckpt-format")
        + " (validate_args: \"Megatron FSDP only supports fsdp_dtensor checkpoint format\")")


def _overlap(plan: "Plan", fields: Fields) -> None:
    """The data-parallel gradient reduction under the backward pass, as the plan prices it (cost_model/step_tail.py:
    buckets that overlap the last micro-batch's backward), and with ``Precision(param_gather="overlapped")`` the
    distributed optimizer's all-gather of the updated weights under the next forward. Megatron-Core reduces after
    the backward by default (``DistributedDataParallelConfig.overlap_grad_reduce`` False) and gathers after the
    step (the plan's "after_step"), so each is a flag; Megatron FSDP sets both from its sharding strategy."""
    cfg = plan.config
    if cfg.grad_replicas == 1 or any(f.key == "--use-megatron-fsdp" for f in fields):
        return
    dist = "_add_distributed_args"
    fields.add("--overlap-grad-reduce", True, ("config.dp", "config.cp"), _doc(dist, "--overlap-grad-reduce"),
               "the gradients reduced in buckets under the last micro-batch's backward, as the plan prices them")
    if plan.precision.param_gather == "overlapped" and any(f.key == "--use-distributed-optimizer" for f in fields):
        fields.add("--overlap-param-gather", True, ("precision.param_gather",), _doc(dist, "--overlap-param-gather")
                   + " (validate_args: with the distributed optimizer and --overlap-grad-reduce)",
                   "the updated weights' all-gather under the next forward, hidden as the plan prices it")


def _offload(plan: "Plan", add, warnings: list[str]) -> None:
    """config.offload as Megatron-LM's optimizer CPU offload (HybridDeviceOptimizer: the fp32 main parameters,
    the optimizer states and the step on the CPU), which is all Megatron-LM offloads: the plan's "optimizer"
    exactly, its "all" without the parameters and gradients."""
    cfg, prec = plan.config, plan.precision
    train, src = "_add_training_args", ("config.offload",)
    mode = f"config.offload = \"{cfg.offload}\""
    if prec.optimizer != "adam":
        warnings.append(f"{mode} with precision.optimizer = {prec.optimizer!r}: Megatron-LM's optimizer "
                        "CPU offload (--optimizer-cpu-offload) needs --use-precision-aware-optimizer (validate_args: "
                        "\"The optimizer cpu offload must be used in conjunction with `--use-precision-aware-"
                        "optimizer`\"), which runs Adam only (megatron/core/optimizer/optimizer_config.py: "
                        "\"--use-precision-aware-optimizer only supported with adam\"); nothing is offloaded: the "
                        + ("optimizer states stay" if cfg.offload == "optimizer"
                           else "parameters, gradients and optimizer states stay")
                        + " on the GPU, more memory than the plan")
        return
    add("--optimizer-cpu-offload", True, src, _doc(train, "--optimizer-cpu-offload") + "; " + CPU_OFFLOAD_GUIDE,
        "optimizer states and fp32 main parameters in host memory, the step on the CPU")
    add("--optimizer-offload-fraction", 1.0, src, _doc(train, "--optimizer-offload-fraction") + "; "
        + CPU_OFFLOAD_GUIDE, "all of the optimizer on the CPU")
    add("--use-precision-aware-optimizer", True, src, _doc("_add_experimental_args", "--use-precision-aware-optimizer")
        + " (validate_args: \"The optimizer cpu offload must be used in conjunction with "
        "`--use-precision-aware-optimizer`\")", "required with --optimizer-cpu-offload")
    add("--overlap-cpu-optimizer-d2h-h2d", True, src, _doc(train, "--overlap-cpu-optimizer-d2h-h2d") + "; "
        + CPU_OFFLOAD_GUIDE, "gradients to the host, the CPU step and parameters back overlapped, as the guide "
        "recommends")
    if cfg.zero == 0:   # _zero wrote no distributed optimizer, which the precision-aware optimizer needs
        add("--use-distributed-optimizer", True, ("config.zero", "config.offload"),
            _doc("_add_distributed_args", "--use-distributed-optimizer") + "; megatron/core/optimizer/"
            "optimizer_config.py (\"--use-precision-aware-optimizer only supported with distributed optimizer\")",
            "required by the precision-aware optimizer that the CPU offload runs on")
        warnings.append(f"config.zero = 0 with {mode}: Megatron-LM's optimizer CPU offload needs "
                        "--use-precision-aware-optimizer, which runs only under the distributed optimizer "
                        "(megatron/core/optimizer/optimizer_config.py: \"--use-precision-aware-optimizer only "
                        "supported with distributed optimizer\"); written with --use-distributed-optimizer (ZeRO-1), "
                        + zero1_for_offload(cfg.dp * cfg.cp))
    if cfg.offload == "optimizer":   # exactly Megatron-LM's optimizer CPU offload
        return
    if cfg.pp > 1:
        where = "whole under the distributed optimizer (the memory said above)"
    else:
        peak, fits = _shards_on_device(plan)
        if peak <= max(stage.memory.total for stage in plan.stages) * (1 + 1e-6):
            where = f"sharded by Megatron FSDP, which the plan's {gb(plan.peak_memory)} per device already counts"
        else:
            where = (f"sharded by Megatron FSDP: about {gb(peak)} per device at the peak instead of "
                     f"{gb(plan.peak_memory)}, which {'still fits' if fits else 'does not fit'} the "
                     f"{gb(plan.cluster.device.memory)} device")
    warnings.append(f"{mode}: Megatron-LM offloads the optimizer only (--optimizer-cpu-offload: the "
                    "optimizer states, the fp32 main parameters and the step on the CPU); each rank's parameters and "
                    f"gradients stay on the GPU, {where}")


def _shards_on_device(plan: "Plan") -> tuple[float, bool]:
    """The peak bytes per device when the offloaded ZeRO-3 (offload "all") keeps its parameter and gradient shards
    on the device (dense weights sharded over dp x cp, experts over dp x cp / ep), and whether that fits."""
    cfg, prec = plan.config, plan.precision
    peak = 0.0
    for stage in plan.stages:
        mem = stage.memory
        shard = cfg.zero_shard(stage.param_count, stage.expert_param_count)
        params = max(mem.params, shard * prec.weight_bytes)
        grads = max(mem.grads, shard * prec.grad_bytes)
        peak = max(peak, params + grads + mem.optimizer + mem.activations + mem.buffers)
    return peak, peak <= plan.cluster.device.memory


# Megatron-LM's TransformerConfig fields (megatron/core/transformer/transformer_config.py) that arguments.py
# turns into flags: fp8 (--fp8-format: e4m3 | hybrid), fp8_recipe (tensorwise | delayed | mxfp8 | blockwise)
FP8_FLAGS = "TransformerConfig fp8 / fp8_recipe (megatron/core/transformer/transformer_config.py)"


def _fp8(plan: "Plan", add, warnings: list[str]) -> None:
    recipe = plan.precision.recipe
    add("--fp8-format", "hybrid", ("precision.compute",), FP8_FLAGS,
        "e4m3 forward, e5m2 gradients: torchao's and Transformer Engine's training formats")
    if recipe in ("tensorwise", "mxfp8"):
        add("--fp8-recipe", recipe, ("precision.recipe",), FP8_FLAGS)
        if plan.precision.gathers_fp8(plan.config):
            warnings.append("precision.recipe = 'tensorwise' under ZeRO-2/3: the plan gathers the linear layers' "
                            "weights in fp8 (torchao's FSDP2 fp8 all-gather, priced at one byte a weight element); "
                            "written without --fp8-param-gather (Megatron-LM's fp8 parameters, another mechanism), "
                            "so Megatron-LM gathers them in bf16, slower than the plan predicts")
        return
    add("--fp8-recipe", "blockwise", ("precision.recipe",), FP8_FLAGS, "the nearest: Megatron-LM has no row-wise one")
    warnings.append(f"precision.recipe = {recipe!r}: Megatron-LM has no row-wise fp8 recipe; written as "
                    "--fp8-recipe blockwise (1 x 128 activation and 128 x 128 weight blocks), a finer scaling with "
                    "its own casts, whose speed the plan did not price"
                    + ("; the plan's bf16 weight gradient is not kept (Megatron-LM runs it in fp8)"
                       if recipe == "rowwise_with_gw_hp" else ""))


def _precision(plan: "Plan", add, warnings: list[str]) -> None:
    prec = plan.precision
    mixed = "_add_mixed_precision_args"
    if prec.storage in ("bf16", "fp16"):
        flag = f"--{prec.storage}"
        add(flag, True, ("precision.compute",), _doc(mixed, flag))
        if prec.grads == "fp32":
            add("--accumulate-allreduce-grads-in-fp32", True, ("precision.grads",),
                _doc(mixed, "--accumulate-allreduce-grads-in-fp32"))
        elif prec.grads == "bf16" and prec.storage == "bf16":
            add("--grad-reduce-in-bf16", True, ("precision.grads",), _doc(mixed, "--grad-reduce-in-bf16"))
        elif prec.grads != prec.storage:
            warnings.append(f"precision.grads = {prec.grads!r} with {prec.storage} weights: Megatron-LM accumulates and "
                            "reduces gradients in the weights' dtype or in fp32; left at its default")
        if not prec.master_weights:
            warnings.append("precision.master_weights = false: Megatron-LM's optimizer keeps fp32 main parameters for "
                            "16-bit weights (4 more bytes per parameter than the plan, sharded with "
                            "--use-distributed-optimizer)")
    if prec.compute == "fp8":
        _fp8(plan, add, warnings)
    add("--optimizer", prec.optimizer, ("precision.optimizer",), _doc("_add_training_args", "--optimizer"))
    if prec.grad_accumulation == "autograd" and plan.micro_batches > 1 and not (plan.config.zero >= 2
                                                                                and plan.config.pp == 1):
        # (Megatron FSDP's branch, _zero, writes the flag already)
        add("--no-gradient-accumulation-fusion", True, ("precision.grad_accumulation",),
            _doc("_add_training_args", "--no-gradient-accumulation-fusion"),
            "the plan priced the micro-batches' gradients added by autograd, a pass per micro-batch")
    if prec.grad_reduce == "all_reduce" and plan.config.zero == 1:
        warnings.append("precision.grad_reduce = 'all_reduce': Megatron-Core's distributed optimizer reduce-scatters "
                        "the gradients, half the bytes the plan priced: faster than it predicts (re-plan with "
                        "Precision(grad_reduce='reduce_scatter'))")
    if not prec.fused_softmax:
        add("--no-masked-softmax-fusion", True, ("precision.fused_softmax",),
            _doc("_add_training_args", "--no-masked-softmax-fusion"),
            "the plan priced the attention softmax as Megatron-LM's PyTorch fallback, not its fused kernel")
    if prec.kernels == "eager":
        warnings.append("precision.kernels = 'eager': Megatron-LM runs its fused kernels (bias-GeLU, masked softmax, "
                        "bias-dropout), which keep the same activations and move fewer bytes: faster than the plan "
                        "predicts")
    elif prec.kernels == "compiled":
        warnings.append("precision.kernels = 'compiled': the plan counted what a compiled program keeps for backward, "
                        "less than Megatron-LM's fused kernels keep: Megatron-LM may need more activation memory than "
                        "predicted (re-plan with --kernels fused to price its kernels)")


# --- bash -------------------------------------------------------------------------------------------
def render(plan: "Plan", fields: list[Field], warnings: list[str]) -> str:
    lines = ["#!/usr/bin/env bash"] + header(plan, "Megatron-LM", warnings)
    dp = plan.config.dp
    lines += ["#",
              "# Use: source megatron_args.sh; torchrun \"${AUTOPAR_TORCHRUN[@]}\" --node-rank N --master-addr HOST \\",
              "#        pretrain_gpt.py \"${AUTOPAR_MEGATRON_ARGS[@]}\" <model, data and optimizer arguments>",
              f"# Data parallelism is the rest of the world: {plan.cluster.devices} ranks / (tp x pp x cp) = {dp} "
              "(config.dp).", ""]
    lines += [f"export {f.key.split(' ', 1)[1]}={f.value}  # {f.comment()}" for f in fields if f.key.startswith("env ")]
    lines += ["AUTOPAR_TORCHRUN=("]
    lines += [_arg_line(f.key.split(" ", 1)[1], f) for f in fields if f.key.startswith("torchrun ")]
    lines += [")", "AUTOPAR_MEGATRON_ARGS=("]
    lines += [_arg_line(f.key, f) for f in fields if not f.key.startswith(("torchrun ", "env "))]
    return "\n".join(lines + [")"]) + "\n"


def _arg_line(flag: str, f: Field) -> str:
    text = flag if f.value is True else f"{flag} {shlex.quote(str(f.value))}"
    return f"    {text}  # {f.comment()}"
