"""`make demo` / `python -m autopar.demo`: plan GPT-3 175B on 128 DGX A100 nodes.

Captures the model on the meta device, searches every data x tensor x pipeline
configuration with the stage DP and the sharding ILP, and prints the plan beside the
estimate of Megatron-LM's published configuration for this model size (tensor parallel 8,
pipeline 8 interleaved, data parallel 16, full recomputation).
"""

from __future__ import annotations

import time

import torch

import autopar
from autopar.capture import capture
from autopar.models import registry
from autopar.solver import price, solve


def main() -> None:
    t0 = time.perf_counter()
    model, inputs = registry.build("gpt3-175b", batch_size=1, device="meta", dtype=torch.bfloat16)
    graph = capture(model, inputs)
    t1 = time.perf_counter()
    cluster = autopar.Cluster.from_spec("128x8xA100-80GB")
    plan, stats = solve(graph, cluster, 1536)
    t2 = time.perf_counter()
    print(plan.summary())
    print(f"\nsearch: {stats.candidates} candidates, {stats.evaluated} evaluated, {stats.pruned_bound} pruned by the "
          f"step-time bound, {stats.pruned_memory} by the memory bound; {stats.ilp_solves} sharding ILPs "
          f"({stats.ilp_seconds:.1f} s); capture {t1 - t0:.1f} s, search {t2 - t1:.1f} s")
    megatron = autopar.ParallelConfig(dp=16, tp=8, pp=8, micro_batch_size=1, schedule="interleaved",
                                      virtual_stages=2, recompute="full")
    ref = price(graph, cluster, megatron, 1536)
    print(f"Megatron-LM's configuration ({megatron.short()}): {ref.step_time:.2f} s per step; "
          f"the plan: {plan.step_time:.2f} s ({(ref.step_time / plan.step_time - 1) * 100:+.0f}% throughput)")


if __name__ == "__main__":
    main()
