"""Context parallelism for long sequences: Llama-3-8B on 1 x 8 x H100-SXM, sequence 8k to 128k.

For each sequence length the global batch holds 2^20 tokens (128 sequences of 8k ... 8 of
128k). autopar.plan's search is run twice on the same captured model: free (cp allowed) and
with ``fixed={"cp": 1}`` (the best plan without context parallelism: tensor, pipeline and
data parallelism, ZeRO and recompute still free). Printed per length: each winner's
configuration, step time, tokens/s and peak memory; the attention's share of the forward
FLOPs (it grows linearly with the sequence while the rest stays per token); the best plan's
recompute and ring exposure. Nothing is run on a GPU: these are the cost model's predictions
(H100 preset, calibration.md).

Run: .venv/bin/python bench/long_context.py
"""

from __future__ import annotations

import time

from autopar import Cluster, InfeasiblePlanError
from autopar.capture import capture
from autopar.capture.opgraph import OpKind
from autopar.models.registry import build
from autopar.solver import solve

TOKENS = 2 ** 20
SEQS = (8192, 16384, 32768, 65536, 131072)
CLUSTER = "1x8xH100-SXM"


def attention_share(graph) -> float:
    total = sum(n.flops_fwd for n in graph.nodes)
    return sum(n.flops_fwd for n in graph.nodes if n.kind is OpKind.ATTENTION) / total


def row(label: str, plan) -> str:
    if plan is None:
        return f"  {label:<10} does not fit"
    b = plan.breakdown
    return (f"  {label:<10} {plan.config.short():<58} {plan.step_time:8.2f} s {TOKENS / plan.step_time:9.0f} tok/s "
            f"{plan.peak_memory / 1e9:6.1f} GB  recompute {b.recompute / plan.step_time:5.1%}  "
            f"ring exposed {b.cp_comm * 1e3:7.1f} ms  TP comm {b.tp_comm / plan.step_time:5.1%}")


def main() -> None:
    cluster = Cluster.from_spec(CLUSTER)
    print(f"Llama-3-8B, {TOKENS} tokens per step, on {cluster.describe()} (cost-model predictions)")
    for seq in SEQS:
        t0 = time.perf_counter()
        model, inputs = build("llama3-8b", seq_len=seq, device="meta")
        graph = capture(model, inputs)
        gbs = TOKENS // seq
        best, _ = solve(graph, cluster, gbs)
        try:
            plain, _ = solve(graph, cluster, gbs, fixed={"cp": 1})
        except InfeasiblePlanError:
            plain = None
        gain = f"{plain.step_time / best.step_time:.2f}x" if plain is not None else "only cp fits"
        print(f"seq {seq:>6} (global batch {gbs:>3}): attention {attention_share(graph):5.1%} of forward FLOPs; "
              f"cp gain {gain} [{time.perf_counter() - t0:.0f} s]")
        print(row("best", best))
        print(row("no cp", plain))


if __name__ == "__main__":
    main()
