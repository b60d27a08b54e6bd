#!/usr/bin/env bash
# Megatron-LM configuration written by `autopar export --to megatron` from the plan of llama3-70b on
#   8 x 8 x H100-SXM: dp=8 tp=8 sp pp=1 mb=8 1f1b zero=3 recompute=full, global batch 64.
# Each value's comment names the plan field it came from (docs/plan-format.md).
# What Megatron-LM cannot express of the plan (1):
# - precision.kernels = 'eager': Megatron-LM runs its fused kernels (bias-GeLU, masked softmax,
#   bias-dropout), which keep the same activations and move fewer bytes: faster than the plan
#   predicts
#
# Use: source megatron_args.sh; torchrun "${AUTOPAR_TORCHRUN[@]}" --node-rank N --master-addr HOST \
#        pretrain_gpt.py "${AUTOPAR_MEGATRON_ARGS[@]}" <model, data and optimizer arguments>
# Data parallelism is the rest of the world: 64 ranks / (tp x pp x cp) = 8 (config.dp).

AUTOPAR_TORCHRUN=(
    --nnodes 8  # cluster.nodes
    --nproc-per-node 8  # cluster.devices_per_node
)
AUTOPAR_MEGATRON_ARGS=(
    --tensor-model-parallel-size 8  # config.tp
    --pipeline-model-parallel-size 1  # config.pp
    --context-parallel-size 1  # config.cp
    --expert-model-parallel-size 1  # config.ep
    --sequence-parallel  # config.sequence_parallel
    --num-layers 80  # structure.layers: the transformer blocks
    --micro-batch-size 8  # config.micro_batch_size
    --global-batch-size 64  # global_batch_size
    --seq-length 8192  # extra.inputs.kwargs.input_ids.shape[1]
    --recompute-granularity full  # config.recompute
    --recompute-method uniform  # config.recompute: every layer on its own
    --recompute-num-layers 1  # config.recompute
    --use-megatron-fsdp  # config.zero: ZeRO-3
    --data-parallel-sharding-strategy optim_grads_params  # config.zero: optimizer state, gradients and parameters sharded
    --use-distributed-optimizer  # config.zero: Megatron FSDP's documented companion flag
    --no-gradient-accumulation-fusion  # config.zero: Megatron FSDP's documented companion flag
    --ckpt-format fsdp_dtensor  # config.zero
    --bf16  # precision.compute
    --accumulate-allreduce-grads-in-fp32  # precision.grads
    --optimizer adam  # precision.optimizer
)
