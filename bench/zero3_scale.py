"""ZeRO-3 (FSDP2 full shard) without model parallelism from 64 to 2,240 A100 (issue 50, item 4).

For GPT models of 1.3B, 13B and 101B parameters (sequence 2048, micro-batch 1, full recomputation,
one micro-batch per step: the global batch is one sequence per GPU) at tp = pp = 1 on DGX A100 nodes
(8 GPUs, 8 x HDR 200 Gb/s NICs, the A100 preset), prints per data-parallel degree:

- the predicted step time at zero=3 and at zero=1 (what the planner weighs ZeRO-3 against);
- the decomposition at zero=3: compute (forward, backward, recomputation), the all-gathers' and
  reduce-scatters' un-hidden time (every call of the step, summed), the exposed data-parallel
  communication (what compute does not hide, net of the compute the overlap slows down), and the
  latency share: the part of the collectives' time that is per-call and per-ring-step latency rather
  than bytes over bandwidth;
- the all-gather's bus-bandwidth efficiency on one unit: bytes moved at the NICs' full ring
  bandwidth over the time the cost model prices (1.0: bandwidth-bound).

Asserts the properties the mechanism must have (cost_model/comm.py): the latency of one unit's
all-gather grows with the ranks, the efficiency at 2,240 GPUs is below that at 384, and ZeRO-3's
exposed communication per step does not shrink as the group grows. Exits 1 when one does not hold.
Nothing here is compared with a published run: the planner's own prices only.

Run: .venv/bin/python bench/zero3_scale.py [--models 1.3B,13B,101B] [--dp 64,384,768,1536,2240]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

import autopar
from autopar.capture import capture
from autopar.config import ParallelConfig, Precision
from autopar.cost_model import estimate_plan
from autopar.cost_model.comm import Collective
from autopar.cost_model.estimator import Estimator
from autopar.models import GPTConfig, build_gpt

MODELS = {"1.3B": (2048, 16, 24), "13B": (5120, 40, 40), "101B": (10240, 80, 80)}   # hidden, heads, layers
SEQ, VOCAB = 2048, 51200
PRECISION = Precision(compute="bf16", grads="bf16", kernels="fused")


def graph(name: str):
    hidden, heads, layers = MODELS[name]
    cfg = GPTConfig(vocab_size=VOCAB, hidden=hidden, heads=heads, layers=layers, seq_len=SEQ, attention="sdpa")
    model, inputs = build_gpt(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    return capture(model, inputs)


def decompose(g, dp: int) -> dict[str, float]:
    cluster = autopar.Cluster.from_spec(f"{dp // 8}x8xA100-80GB")
    est = Estimator(g, cluster, PRECISION)
    out = {}
    for zero in (1, 3):
        cfg = ParallelConfig(dp=dp, zero=zero, recompute="full")
        plan = estimate_plan(g, cluster, cfg, dp, PRECISION, estimator=est)
        out[f"step{zero}"] = plan.step_time
        out[f"dp{zero}"] = plan.breakdown.dp_comm
        if zero == 3:
            out["compute"] = plan.breakdown.compute + plan.breakdown.recompute
    cfg = ParallelConfig(dp=dp, zero=3, recompute="full")
    group = est.placements(cfg)["dp"]
    tail = est.tail
    units = est.shard_units(range(len(g.layers)), cfg)
    sizes = [sum(est.local_numel(n, 1) for i in u for n in g.layers[i].params + g.layers[i].shared_params
                 if n in g.params) for u in units.units]
    kept = {tuple(u) for u in units.kept}
    w, gb = PRECISION.weight_bytes, PRECISION.grad_bytes
    ag = rs = lat = 0.0
    for u, p in zip(units.units, sizes):
        for kind, nbytes, calls in ((Collective.ALL_GATHER, p * w, 1 if tuple(u) in kept else 2),
                                    (Collective.REDUCE_SCATTER, p * gb, 1)):
            t = float(tail.collective(kind, nbytes, group)) * calls
            lat += float(tail.collective(kind, 1.0, group)) * calls   # one byte: the latency alone
            if kind is Collective.ALL_GATHER:
                ag += t
            else:
                rs += t
    layer = float(np.median(sizes)) * w   # a repeated block's unit (the root unit holds the embeddings)
    t_unit = float(tail.collective(Collective.ALL_GATHER, layer, group))
    ideal = float(tail.collective(Collective.ALL_GATHER, layer * 1024, group)) / 1024   # bandwidth-bound rate
    out.update(ag=ag, rs=rs, latency_share=lat / (ag + rs), unit_mb=layer / 1e6,
               unit_latency=float(tail.collective(Collective.ALL_GATHER, 1.0, group)), efficiency=ideal / t_unit)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dp", default="64,384,768,1536,2240")
    args = parser.parse_args()
    dps = [int(x) for x in args.dp.split(",")]
    ok = True
    for name in args.models.split(","):
        g = graph(name)
        print(f"\nGPT {name} (hidden {MODELS[name][0]}, {MODELS[name][2]} layers), seq {SEQ}, micro-batch 1, "
              f"one micro-batch per step, tp = pp = 1, A100 DGX nodes")
        print(f"{'dp':>5} {'step z3 s':>10} {'step z1 s':>10} {'z3/z1':>6} | {'compute':>8} {'AG sum':>8} "
              f"{'RS sum':>8} {'exposed':>8} {'lat.share':>9} | {'unit MB':>7} {'AG lat us':>9} {'AG eff':>6}")
        rows = {}
        for dp in dps:
            r = rows[dp] = decompose(g, dp)
            print(f"{dp:>5} {r['step3']:>10.3f} {r['step1']:>10.3f} {r['step3'] / r['step1']:>6.2f} | "
                  f"{r['compute']:>8.3f} {r['ag']:>8.3f} {r['rs']:>8.3f} {r['dp3']:>8.3f} "
                  f"{r['latency_share'] * 100:>8.1f}% | {r['unit_mb']:>7.1f} {r['unit_latency'] * 1e6:>9.0f} "
                  f"{r['efficiency']:>6.2f}")
        lat = [rows[d]["unit_latency"] for d in dps]
        checks = [("the all-gather's latency grows with the ranks", all(np.diff(lat) > 0))]
        if 384 in rows and 2240 in rows:
            checks.append(("all-gather efficiency at 2240 below that at 384",
                           rows[2240]["efficiency"] < rows[384]["efficiency"]))
        exposed = [rows[d]["dp3"] for d in dps]
        checks.append(("ZeRO-3's exposed communication does not shrink with the group",
                       all(np.diff(exposed) >= -1e-9 * max(exposed))))
        for what, held in checks:
            print(f"  {'ok  ' if held else 'FAIL'} {what}")
            ok &= held
    print(f"\nmechanism properties hold: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
