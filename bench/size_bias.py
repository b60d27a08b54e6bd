"""Where a small and a large model's step time goes, side by side (issue 50, item 2).

For each pair (a Megatron-LM GPT 3.6B and 175B on A100, as the Megatron-LM papers run them: full
recomputation, 1F1B, fused kernels, no sequence parallelism; the Megatron-Core H100 1.7B and 177B
weak-scaling rows), the configuration is priced with every field pinned (``price``) and its step
decomposed:

- the step terms of the plan's TimeBreakdown (compute, recompute, tensor-parallel collectives, p2p,
  bubble, data-parallel all-reduce, optimizer), in seconds and share of the step;
- the compute term by op class on the slowest pipeline device: each GEMM shape (m x n x k per
  tensor-parallel rank, batched products as b x), with the achieved efficiency the cost model gives
  it, the fused attention, element-wise ops (norms, activations, dropout, residual adds), and the
  loss (logits' softmax and cross entropy), each forward + backward over the step's micro-batches.

The A100 pair are not published rows: the 3.6B is SC21 Table 1's model on its 64 GPUs at tp 2 (its
calibration row leaves the micro-batch to the planner; here 4), the 175B GPT-3's shape at tp 8, pp 8,
dp 8 on 512 GPUs, micro-batch 1, global batch 1536. No measured time is compared for them. The H100
pair are validation rows (megatron-readme-h100), shown with their published step time and error.

Exits 1 when the op-class sum misses the plan's compute term by more than 2% (the decomposition
would not be the model's). Run: .venv/bin/python bench/size_bias.py
"""

from __future__ import annotations

import sys
from collections import defaultdict

from autopar.capture.opgraph import OpKind
from autopar.config import ParallelConfig
from autopar.cost_model.compute import gemm_efficiency, scaled_gemm
from autopar.cost_model.layer_cost import LayerCostModel, compute_shard, split_dim
from autopar.solver import price
from autopar.solver.sharding_solver import ShardingSolver
from fidelity_split import fully_pinned
from published import Model, Row, cluster_of, graph_of, load_rows, plan_row

_MEGATRON = dict(cp=1, ep=1, zero=0, recompute="full", sequence_parallel=False, schedule="1f1b")
A100_36B = Row(name="GPT 3.6B, 64 A100, tp2 dp32 mb4, full recompute", source="", cluster="8x8xA100-80GB",
               model=Model("gpt", hidden=3072, heads=32, layers=30, seq=2048, vocab=51200), global_batch=512,
               fixed=dict(tp=2, pp=1, dp=32, micro_batch_size=4, **_MEGATRON), metric="seconds", published=0.0)
A100_175B = Row(name="GPT 175B, 512 A100, tp8 pp8 dp8 mb1, full recompute", source="",
                cluster="64x8xA100-80GB", model=Model("gpt", hidden=12288, heads=96, layers=96, seq=2048,
                                                      vocab=51200),
                global_batch=1536, fixed=dict(tp=8, pp=8, dp=8, micro_batch_size=1, **_MEGATRON), metric="seconds",
                published=0.0)
PAIRS = (("A100, Megatron-LM configurations (no published time)", A100_36B, A100_175B),
         ("H100, Megatron-Core (validation rows)", "Megatron-Core H100 1.7B 48 GPUs",
          "Megatron-Core H100 177B 2304 GPUs"))
TERMS = ("compute", "recompute", "tp_comm", "p2p", "bubble", "dp_comm", "optimizer")
_ELEMENTWISE = (OpKind.ELEMENTWISE, OpKind.NORM, OpKind.SOFTMAX, OpKind.DROPOUT, OpKind.REDUCTION,
                OpKind.EMBEDDING, OpKind.CREATION, OpKind.OTHER)
TOLERANCE = 0.02


def plan_of(row: Row):
    if fully_pinned(row):
        return price(graph_of(row.model), cluster_of(row), ParallelConfig(**row.fixed), row.global_batch,
                     precision=row.precision)
    return plan_row(row)


def op_classes(row: Row, plan) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per step of the slowest pipeline device's compute, by op class; GEMM class -> efficiency."""
    graph, cluster, cfg = graph_of(row.model), cluster_of(row), plan.config
    sharding = ShardingSolver(graph, cluster, plan.precision)
    model = LayerCostModel(graph, cluster, plan.precision, layout_fn=sharding.layout_fn("fast"))
    stage = max(plan.stages, key=lambda s: s.fwd_time + s.bwd_time)
    names = set(stage.layers)
    layout, fused, compute = model.layout(cfg.tp), model.fused, model.compute
    scale = cfg.micro_batch_size / model.graph.batch_size
    seconds: dict[str, float] = defaultdict(float)
    efficiency: dict[str, float] = {}
    for layer in model.graph.layers:
        if layer.name not in names:
            continue
        for node in model.graph.layer_nodes(layer):
            shard, dim = compute_shard(node, layout, cfg.sequence_parallel), split_dim(node, layout)
            t = compute.op_time(node, scale, shard, dim, fused)
            if node.kind is OpKind.MATMUL and node.gemm is not None:
                g = scaled_gemm(node.gemm, scale if node.batch_dependent else 1.0, dim, shard)
                key = f"GEMM {g.batch}x {g.m}x{g.n}x{g.k}" if g.batch > 1 else f"GEMM {g.m}x{g.n}x{g.k}"
                efficiency[key] = gemm_efficiency(cluster.device, g)
            elif node.kind is OpKind.ATTENTION:
                key = "attention (fused)"
            elif node.kind is OpKind.LOSS or "cross_entropy" in node.target or "log_softmax" in node.target:
                key = "loss"
            elif node.kind in _ELEMENTWISE:
                key = "element-wise"
            else:
                key = node.kind.value
            seconds[key] += (t.fwd + t.bwd) * plan.micro_batches
    return seconds, efficiency


def show(row: Row) -> bool:
    plan = plan_of(row)
    cluster = cluster_of(row)
    b = plan.breakdown
    print(f"\n{row.name}: {plan.config.short()}, {plan.micro_batches} micro-batches")
    if row.published:
        measured = row.step_time_of(row.published, cluster)
        print(f"  step predicted {plan.step_time:8.3f} s, measured {measured:8.3f} s, error "
              f"{plan.step_time / measured - 1:+.1%}")
    else:
        print(f"  step predicted {plan.step_time:8.3f} s (no published time)")
    for term in TERMS:
        v = getattr(b, term)
        print(f"  {term:<12} {v:9.4f} s  {v / b.total:6.1%}")
    seconds, efficiency = op_classes(row, plan)
    total = sum(seconds.values())
    print(f"  compute by op class (slowest device, all micro-batches): {total:.4f} s")
    for key, v in sorted(seconds.items(), key=lambda kv: -kv[1]):
        eff = f"  e_mm {efficiency[key]:.3f}" if key in efficiency else ""
        print(f"    {key:<34} {v:9.4f} s  {v / b.total:6.1%} of step{eff}")
    ok = abs(total / b.compute - 1) <= TOLERANCE
    if not ok:
        print(f"  op classes sum to {total:.4f} s, the plan's compute is {b.compute:.4f} s: the decomposition "
              f"misses by more than {TOLERANCE:.0%}")
    return ok


def main() -> int:
    rows = {r.name: r for r in load_rows()}
    ok = True
    for title, small, large in PAIRS:
        print(f"\n=== {title} ===")
        for row in (small, large):
            ok &= show(rows[row] if isinstance(row, str) else row)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
