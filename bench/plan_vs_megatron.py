"""Solver quality: for every row of Megatron-LM SC21 Table 1, ``autopar`` plans the same model on
the same devices with the same global batch, and its predicted step time must be no worse than
its prediction of the published configuration (TP / PP / DP as published, full recompute, the
fastest micro-batch size and interleaving that fit: bench/published.py), and the plan must fit in
80 GB. Same precision as Megatron (bf16, fp32 main gradients: 18 bytes/parameter).

Both sides are the cost model's predictions: this compares the cost model with itself (the
search finds what the model prices fastest), not autopar's plans with measured runs; how far
the cost model is from measured runs is bench/fidelity_published.py.

Prints both configurations side by side. Run: .venv/bin/python bench/plan_vs_megatron.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

from autopar.solver import solve
from published import TABLE1, cluster_of, graph_of, plan_row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first four rows")
    args = parser.parse_args()
    rows = TABLE1[:4] if args.quick else TABLE1
    print(f"{'params':>7} {'GPUs':>5} {'batch':>5} | {'published config (estimated)':<52} {'step s':>7} | "
          f"{'autopar plan':<62} {'step s':>7} {'gain':>6} {'peak GB':>7} {'solve s':>7}")
    ok = True
    t0 = time.perf_counter()
    for row in rows:
        published = plan_row(row)
        params, gpus, batch = row.name.split()[-1], published.cluster.devices, row.global_batch
        t1 = time.perf_counter()
        plan, _ = solve(graph_of(row.model), cluster_of(row), batch, precision=row.precision)
        t2 = time.perf_counter()
        gain = published.step_time / plan.step_time - 1
        good = plan.fits and plan.step_time <= published.step_time * (1 + 1e-9)
        ok &= good
        print(f"{params:>7} {gpus:>5} {batch:>5} | {published.config.short():<52} {published.step_time:>7.2f} | "
              f"{plan.config.short():<62} {plan.step_time:>7.2f} {gain * 100:>+5.1f}% "
              f"{plan.peak_memory / 1e9:>7.1f} {t2 - t1:>7.1f}{'' if good else '  WORSE'}")
    print(f"every plan fits and is no slower than the published configuration: {ok} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
