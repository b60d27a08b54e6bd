"""Regenerate the export goldens: ``python tests/unit/exports/make_goldens.py`` (a second or two).

The tests compare each exporter's output byte for byte with ``data/golden/<plan>.<file>``, made from the
two plans stored in ``data/`` (so that the tests need no capture and do not change when the search's
picks change). ``--plans`` makes those plans again first with ``autopar.estimate`` of the pinned
published recipes below (captures GPT-3 175B and Llama 3 70B on the meta device: minutes);
only needed when the plan format or the cost model changes what a plan holds. Review the diff of the
goldens before committing them: each change is a change of what a user's stack would run.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data"
GOLDEN = DATA / "golden"

# The recipes, every field pinned (an estimate: no search), named as `autopar estimate MODEL` names them.
RECIPES = {
    # Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh: --tensor-model-parallel-size 8
    # --pipeline-model-parallel-size 16 --micro-batch-size 1 --global-batch-size 1536 --seq-length 2048
    # --fp16 (fp16 gradients: no --accumulate-allreduce-grads-in-fp32), Megatron's fused kernels; on 128
    # DGX A100 nodes that leaves data parallelism 8. Sequence parallelism and selective recomputation
    # as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") run
    # GPT-3 175B, and an interleaved schedule with 2 chunks per device (Narayanan et al. 2021, section
    # 2.2), which the script leaves at its default of none.
    "gpt3-175b_128x8xA100": dict(
        model="gpt3-175b", cluster="128x8xA100-80GB", global_batch=1536,
        config=dict(dp=8, tp=8, pp=16, micro_batch_size=1, schedule="interleaved", virtual_stages=2,
                    recompute="selective", sequence_parallel=True),
        precision=dict(compute="fp16", grads="fp16", kernels="fused")),
    # torchtitan's torchtitan/models/llama3/train_configs/llama3_70b.toml, "a preset for 64 GPUs":
    # data_parallel_shard_degree = -1 (FSDP over the 8 ranks left), tensor_parallel_degree = 8 (which
    # always shards the norms along the sequence), local_batch_size = 8, seq_len = 8192,
    # activation_checkpoint mode = "full", compile off; FSDP2's mixed precision (bf16 parameters, fp32
    # reduction: training.mixed_precision_param / _reduce). The same FSDP + TP 8 with full
    # checkpointing is torchtitan's published H100 run of Llama 3.1 70B
    # (benchmarks/llama3_h100_202412_torchtitan.md, Table 4, there on 256 GPUs).
    "llama3-70b_8x8xH100": dict(
        model="llama3-70b", cluster="8x8xH100-SXM", global_batch=64,
        config=dict(dp=8, tp=8, pp=1, micro_batch_size=8, zero=3, recompute="full", sequence_parallel=True),
        precision=dict(compute="bf16", grads="fp32", kernels="eager")),
}
STACK_FILES = {"torchtitan": "torchtitan.toml", "megatron": "megatron_args.sh", "deepspeed": "ds_config.json",
               "accelerate": "accelerate_config.yaml"}


def plan_path(name: str) -> pathlib.Path:
    return DATA / f"{name}.plan.json"


def golden_path(name: str, stack: str) -> pathlib.Path:
    return GOLDEN / f"{name}.{STACK_FILES[stack]}"


def make_plan(name: str):
    """The recipe's estimate, named and sourced as the command line names it (so that exports see it as
    `autopar estimate` would write it)."""
    import torch

    import autopar
    from autopar.models import registry
    recipe = RECIPES[name]
    model, inputs = registry.build(recipe["model"], device="meta", dtype=torch.bfloat16)
    plan = autopar.estimate(model, autopar.Cluster.from_spec(recipe["cluster"]), inputs,
                            autopar.ParallelConfig(**recipe["config"]), global_batch_size=recipe["global_batch"],
                            precision=autopar.Precision(**recipe["precision"]))
    return dataclasses.replace(plan, model_name=recipe["model"], extra={
        **plan.extra, "model": {"model": recipe["model"], "seq_len": None, "dtype": "bf16"}})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", action="store_true", help="make the two plans again first (slow)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parents[2]))
    import autopar
    from autopar.exports import export
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in RECIPES:
        if args.plans:
            make_plan(name).save(plan_path(name))
            print(f"wrote {plan_path(name)}")
        plan = autopar.load_plan(plan_path(name))
        for stack in STACK_FILES:
            export(plan, stack, golden_path(name, stack))
            print(f"wrote {golden_path(name, stack)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
