"""Context parallelism for long sequences: Llama-3-8B on 1 x 8 x H100-SXM, sequence 8k to 128k.

For each sequence length the global batch holds 2^20 tokens (128 sequences of 8k ... 8 of
128k). autopar.plan's search is run twice on the same captured model: free (cp allowed) and
with ``fixed={"cp": 1}`` (the best plan without context parallelism: tensor, pipeline and
data parallelism, ZeRO and recompute still free). Printed per length: each winner's
configuration, step time, tokens/s and peak memory; the attention's share of the forward
FLOPs (it grows linearly with the sequence while the rest stays per token); the best plan's
recompute and ring exposure. Then Llama-3-70B at 128k on 4 x 8 x H100-SXM (global batch 8), free and
with ``fixed={"tp": 1}`` and ``{"cp": 1}``: where the states need tensor parallelism as well, the search
puts it inside each cp rank (tp x cp, as NVIDIA's Llama 3.1 recipes run). Exits 1 when the 128k 8B
plan does not use cp, is not at least 1.1x faster than the best plan without it, or its
``explain()`` does not name cp and the plan without it, or when the 70B plan does not combine tp
and cp (the unit suite checks the search's cp x tp space on small graphs; these real-size choices
are checked here). Nothing is run on a GPU: these are the cost model's predictions
(H100 preset: datasheet peaks, bench/sources.md section 6).

Run: .venv/bin/python bench/long_context.py
"""

from __future__ import annotations

import sys
import time

from autopar import Cluster, InfeasiblePlanError
from autopar.capture import capture
from autopar.capture.opgraph import OpKind
from autopar.models.registry import build
from autopar.solver import solve

TOKENS = 2 ** 20
SEQS = (8192, 16384, 32768, 65536, 131072)
CLUSTER = "1x8xH100-SXM"
BIG, BIG_CLUSTER, BIG_SEQ, BIG_BATCH = "llama3-70b", "4x8xH100-SXM", 131072, 8


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


def main() -> int:
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
    text = best.explain()
    ok = (best.config.cp > 1 and best.fits and plain is not None and plain.step_time > 1.1 * best.step_time
          and f"context parallel {best.config.cp}" in text and "without it" in text)
    t0 = time.perf_counter()
    model, inputs = build(BIG, seq_len=BIG_SEQ, device="meta")
    graph = capture(model, inputs)
    big = Cluster.from_spec(BIG_CLUSTER)
    best, _ = solve(graph, big, BIG_BATCH)
    print(f"Llama-3-70B, sequence {BIG_SEQ}, global batch {BIG_BATCH}, on {big.describe()} "
          f"[{time.perf_counter() - t0:.0f} s]")
    print(row("best", best))
    for pin in ("tp", "cp"):
        try:
            pinned, _ = solve(graph, big, BIG_BATCH, fixed={pin: 1})
        except InfeasiblePlanError:
            pinned = None
        print(row(f"{pin}=1", pinned))
    ok = ok and best.config.cp > 1 and best.config.tp > 1
    print("target (cp at 128k on 8B; tp x cp on 70B):", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
