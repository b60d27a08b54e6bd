"""Quickstart: plan a Hugging Face Llama, compare with a hand-written configuration, plot, emit code.

    python examples/quickstart.py [--out examples/out]

Nothing is downloaded and nothing is allocated: the model is a TinyLlama-1.1B-shaped
``LlamaForCausalLM`` built from its config on the meta device. The planner only needs its
graph; the emitted training script builds it for real on every rank (``build_model``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autopar
import autopar.codegen

SEQ_LEN = 2048


def build_model(device: str = "cpu") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model and one example batch (any batch size: the batch is dim 0). ``device="meta"`` for planning."""
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=SEQ_LEN, use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        tokens = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    return model, {"input_ids": tokens, "labels": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)

    # 1. Plan: 4 nodes of 8 H100s, 512 sequences of 2048 tokens per optimizer step.
    model, inputs = build_model("meta")
    cluster = autopar.Cluster.from_spec("4x8xH100-SXM")
    best = autopar.plan(model, cluster, inputs, global_batch_size=512)
    print(best.summary(), end="\n\n")
    print(best.explain(), end="\n\n")

    # 2. What we run today, written by hand: tp=8 inside each node, data parallel across nodes.
    today = autopar.ParallelConfig(dp=4, tp=8, micro_batch_size=4, recompute="full")
    ours = autopar.estimate(model, cluster, inputs, today, global_batch_size=512)
    print(ours.compare(best), end="\n\n")

    # 3. Pictures: the pipeline timeline, memory per stage, layers per stage.
    for name, draw in (("timeline", best.plot_timeline), ("memory", best.plot_memory),
                       ("partition", best.plot_partition)):
        draw(os.path.join(out, f"{name}.png"))

    # 4. Keep the plan, and write the training script every rank runs.
    best.save(os.path.join(out, "plan.json"))
    script = autopar.codegen.emit(best, os.path.join(out, "run"), model_factory="quickstart:build_model")
    print(f"plots, plan.json and {script} are in {out}; on each node run (examples/ on PYTHONPATH):\n"
          f"  torchrun --nnodes {cluster.nodes} --nproc-per-node {cluster.devices_per_node} "
          f"--rdzv-backend c10d --rdzv-endpoint HOST:29500 {script} --steps 100")


if __name__ == "__main__":
    main()
