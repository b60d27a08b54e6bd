"""The quickstart on this machine: plan a small Llama for two CPU ranks, then train it with torchrun.

    python examples/quickstart_cpu.py [--out examples/out-cpu]
    torchrun --nproc-per-node 2 examples/out-cpu/run/train.py --steps 5     (examples/ on PYTHONPATH)

The same flow as examples/quickstart.py, at a size a laptop trains: the model is planned on the
meta device from batch-1 example inputs (nothing allocated), and the emitted script builds it
with real weights on every rank (``build_model()``, same seed) and runs the plan with gloo.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autopar
import autopar.codegen

SEQ_LEN = 64


def build_model(device: str = "cpu") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model and one example batch (batch 1: the batch is dim 0, any size). ``device="meta"`` to plan.
    The emitted script seeds torch first (``--seed``), so every rank builds the same weights."""
    config = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=SEQ_LEN, use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM(config)
        tokens = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    return model, {"input_ids": tokens, "labels": tokens}


def batch(step: int, global_batch_size: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s global batch: random tokens (a fixed seed per step), the same on every rank."""
    tokens = torch.randint(0, 512, (global_batch_size, SEQ_LEN), generator=torch.Generator().manual_seed(step))
    return {"input_ids": tokens, "labels": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out-cpu"))
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)

    model, inputs = build_model("meta")
    best = autopar.plan(model, autopar.Cluster.from_spec("1x2xcpu"), inputs, global_batch_size=8)
    print(best.summary(), end="\n\n")
    best.save(os.path.join(out, "plan.json"))
    script = autopar.codegen.emit(best, os.path.join(out, "run"), model_factory="quickstart_cpu:build_model",
                                  batch_factory="quickstart_cpu:batch")
    print(f"plan.json and {script} are in {out}; train it (examples/ on PYTHONPATH):\n"
          f"  torchrun --nproc-per-node {best.devices} {script} --steps 5")


if __name__ == "__main__":
    main()
