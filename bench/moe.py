"""Expert parallelism: a Mixtral-8x7B-shaped model on 8 x 8 x H100-SXM (64 GPUs).

Two routings of the same shape (8 experts of ffn 14336, top-2, h 4096, 32 layers, sequence 4096):
- ``capacity 1.0``: autopar.models.moe (the registry's mixtral-8x7b): each expert takes at most
  ``T k / E`` rows of a micro-batch (the overflow is dropped), so a rank never receives more
  than its share;
- ``dropless``: Hugging Face's MixtralForCausalLM (transformers v5, grouped_mm experts): every
  routed row is computed (Mixtral's own maths), so the busiest expert rank sets the pace (the cost model's load imbalance: ``1 + 0.15 mu_ep / sqrt(E / ep)``,
  cost_model/expert_parallel.py).
For global batches of 128, 256 and 512 sequences, autopar's search is run free and with
``fixed={"ep": 1}`` (the best without expert parallelism: FSDP / ZeRO-3 gathering every
expert's weights for every micro-batch, tensor or pipeline parallelism). Printed: each
winner's configuration, step time, peak memory, and where expert parallelism's time goes
(all-to-alls, data-parallel exposure). Cost-model predictions; no GPU ran.

Target (exit status 1 on a miss; moved here from the unit suite, where the 32-layer capture and
the 64-device search took half a minute): with capacity routing the search picks ep > 1 at every
batch, and ``plan.explain()`` names expert parallelism, its all-to-all and the plan without it.

Run: .venv/bin/python bench/moe.py
"""

from __future__ import annotations

import sys
import time

from autopar import Cluster
from autopar.capture import capture
from autopar.models.hf import build_hf_mixtral
from autopar.models.moe import build_mixtral
from autopar.models.registry import spec
from autopar.solver import solve

CLUSTER = "8x8xH100-SXM"
BATCHES = (128, 256, 512)


def row(label: str, plan) -> str:
    b = plan.breakdown
    return (f"  {label:<6} {plan.config.short():<62} {plan.step_time:7.3f} s {plan.peak_memory / 1e9:6.1f} GB  "
            f"all-to-all {b.ep_comm * 1e3:6.1f} ms  DP/ZeRO exposed {b.dp_comm * 1e3:6.1f} ms  "
            f"compute {b.compute:6.3f} s")


def main() -> int:
    cluster = Cluster.from_spec(CLUSTER)
    base = spec("mixtral-8x7b").config
    print(f"Mixtral-8x7B shape on {cluster.describe()} (cost-model predictions)")
    hf = dict(layers=base.layers, hidden=base.hidden, heads=base.heads, kv_heads=base.kv_heads,
              ffn_hidden=base.ffn_hidden, num_experts=base.num_experts, top_k=base.top_k, vocab=base.vocab_size,
              seq_len=base.seq_len, batch_size=1, device="meta")
    ok = True
    for routing, build in (("capacity 1.0", lambda: build_mixtral(base, batch_size=1, device="meta")),
                           ("dropless", lambda: build_hf_mixtral(**hf))):
        model, inputs = build()
        graph = capture(model, inputs)
        for gbs in BATCHES:
            t0 = time.perf_counter()
            best, _ = solve(graph, cluster, gbs)
            plain, _ = solve(graph, cluster, gbs, fixed={"ep": 1})
            print(f"{routing}, global batch {gbs} x {base.seq_len} tokens: expert parallelism "
                  f"{plain.step_time / best.step_time:.3f}x [{time.perf_counter() - t0:.0f} s]")
            print(row("best", best))
            print(row("no ep", plain))
            if routing == "capacity 1.0":
                text = best.explain()
                ok = ok and best.config.ep > 1 and best.fits and all(
                    part in text for part in (f"expert parallel {best.config.ep}", "all-to-all", "without it"))
    print("target (capacity routing picks ep and explains it at every batch):", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
