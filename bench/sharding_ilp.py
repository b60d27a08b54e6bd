"""Sharding ILP: solve time and size per model, tensor-parallel degree and variant.

The ILP is solved once per layer signature, so two blocks of GPT-3 175B (h=12288, s=2048)
and of Llama-3-70B (h=8192, GQA 64/8, s=8192) stand for the whole models. Models are
captured in bf16 on the meta device, one sample, on 1 node of 8 x A100-80GB. For each
(tp, variant) the table lists every layer group's ops, ILP variables and constraints,
seconds (build + both solves), and how its per-sample time compares with Megatron's rules
priced by the same ILP (``= megatron`` when the ILP picks exactly Megatron's strategies). The
target: each variant at least as good as the rules by its own first criterion (``fast``: time;
``lean``: memory, which it minimises before time).
Run: .venv/bin/python bench/sharding_ilp.py
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch

from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.config import Precision
from autopar.cost_model.tensor_parallel import megatron_layout
from autopar.models import GPTConfig, build_gpt, build_llama, registry
from autopar.solver.sharding import lp_solvers
from autopar.solver.sharding_layout import evaluate_layout
from autopar.solver.sharding_solver import ShardingSolver


def main() -> int:
    cluster = Cluster.from_spec("1x8xA100-80GB")
    print(f"solver: {lp_solvers()[0][0]}; cluster {cluster.describe()}")
    print(f"{'model':>11} {'tp':>2} {'variant':>7} {'group':>9} {'ops':>4} {'vars':>5} {'cons':>5} "
          f"{'ILP s':>6} {'ILP us':>9} {'rules us':>9}  layout")
    total, solves, ok = 0.0, 0, True
    for name in ("gpt3-175b", "llama3-70b"):
        cfg = replace(registry.spec(name).config, layers=2)
        build = build_gpt if isinstance(cfg, GPTConfig) else build_llama
        model, inputs = build(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
        graph = capture(model, inputs)
        solver = ShardingSolver(graph, cluster, Precision())
        for tp in (2, 4, 8):
            rules = megatron_layout(graph, tp)
            for variant in ("fast", "lean"):
                start = time.perf_counter()
                solver.layout(tp, variant)
                total += time.perf_counter() - start
                for sol in solver.solutions(tp, variant):
                    ref = evaluate_layout(sol, rules)
                    kind = "block" if graph.layers[sol.group.solved[0]].is_block else "non-block"
                    same = "= megatron" if ref.choice == sol.result.choice else "differs"
                    # each variant's own first criterion: "fast" no slower than the rules, "lean" no larger
                    worse = (sol.result.time + sol.result.step > (ref.time + ref.step) * (1 + 1e-9)
                             if variant == "fast" else sol.result.memory > ref.memory * (1 + 1e-9))
                    if worse:
                        ok, same = False, same + ("  SLOWER" if variant == "fast" else "  LARGER") + " THAN MEGATRON'S"
                    st = sol.stats
                    print(f"{name:>11} {tp:>2} {variant:>7} {kind:>9} {st['ops']:>4} {st['variables']:>5} "
                          f"{st['constraints']:>5} {st['seconds']:>6.3f} {(sol.result.time + sol.result.step) * 1e6:>9.1f} "
                          f"{(ref.time + ref.step) * 1e6:>9.1f}  {same}")
        solves += solver.solves
    print(f"total ILP seconds {total:.2f} over {solves} group ILPs (two solver calls each)")
    print("target: no fast layout slower and no lean layout larger in memory than Megatron's on the same group: "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
