"""`make demo` / `python -m autopar.demo`: estimate GPT-3 175B on 128 DGX A100 nodes.

The configuration is Megatron-LM's for this model size (tensor parallel 8 inside a
node, pipeline 8 interleaved, data parallel 16, full recomputation).
"""

from __future__ import annotations

import time

import torch

import autopar
from autopar.models import registry


def main() -> None:
    t0 = time.perf_counter()
    model, inputs = registry.build("gpt3-175b", batch_size=1, device="meta", dtype=torch.bfloat16)
    cluster = autopar.Cluster.from_spec("128x8xA100-80GB")
    config = autopar.ParallelConfig(dp=16, tp=8, pp=8, micro_batch_size=1, schedule="interleaved",
                                    virtual_stages=2, recompute="full")
    plan = autopar.estimate(model, cluster, inputs, config, global_batch_size=1536)
    print(plan.summary())
    print(f"(built, captured and estimated in {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
