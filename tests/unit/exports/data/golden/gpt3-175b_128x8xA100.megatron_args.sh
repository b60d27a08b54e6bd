#!/usr/bin/env bash
# Megatron-LM configuration written by `autopar export --to megatron` from the plan of gpt3-175b on
#   128 x 8 x A100-80GB: dp=8 tp=8 sp pp=16 mb=1 interleaved(v=2) zero=0 recompute=selective, global
#   batch 1536.
# Each value's comment names the plan field it came from (docs/plan-format.md).
# Megatron-LM expresses every field of the plan that it reads.
#
# Use: source megatron_args.sh; torchrun "${AUTOPAR_TORCHRUN[@]}" --node-rank N --master-addr HOST \
#        pretrain_gpt.py "${AUTOPAR_MEGATRON_ARGS[@]}" <model, data and optimizer arguments>
# Data parallelism is the rest of the world: 1024 ranks / (tp x pp x cp) = 8 (config.dp).

export CUDA_DEVICE_MAX_CONNECTIONS=1  # config.tp, config.cp: tensor or context parallelism without Megatron FSDP
AUTOPAR_TORCHRUN=(
    --nnodes 128  # cluster.nodes
    --nproc-per-node 8  # cluster.devices_per_node
)
AUTOPAR_MEGATRON_ARGS=(
    --tensor-model-parallel-size 8  # config.tp
    --pipeline-model-parallel-size 16  # config.pp
    --context-parallel-size 1  # config.cp
    --expert-model-parallel-size 1  # config.ep
    --sequence-parallel  # config.sequence_parallel
    --num-layers 96  # structure.layers: the transformer blocks
    --num-layers-per-virtual-pipeline-stage 3  # config.virtual_stages, stages[].chunks: interleaved: 2 chunks per device, Megatron's even split
    --micro-batch-size 1  # config.micro_batch_size
    --global-batch-size 1536  # global_batch_size: 192 micro-batches per step
    --seq-length 2048  # extra.inputs.kwargs.input_ids.shape[1]
    --recompute-granularity selective  # config.recompute: attention's core (--recompute-modules core_attn, the default)
    --fp16  # precision.compute
    --optimizer adam  # precision.optimizer
    --overlap-grad-reduce  # config.dp, config.cp: the gradients reduced in buckets under the last micro-batch's backward, as the plan prices them
)
