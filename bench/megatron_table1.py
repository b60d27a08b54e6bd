"""Megatron-LM (Narayanan et al., SC21) Table 1 and the Megatron README TP-scaling table,
predicted by autopar.estimate with ONE set of A100 constants.

Each published row is rebuilt on the meta device (hand-written Megatron GPT, eager
attention as in Megatron's 2021 kernels, vocabulary 51,200), captured once, and estimated
with the published TP / PP / DP / global batch, full recomputation, bf16 with fp32 main
gradients (Megatron's non-distributed optimizer: 18 bytes of model state per parameter).
The micro-batch size and the number of interleaved chunks are not published: the bench
takes the fastest, among micro-batch sizes 1, 2, 4, 8 and every valid chunk count, that
fits in 80 GB (as the authors tuned them), and prints which it took.

Predicted TFLOP/s per GPU = F / (predicted step time x GPUs), with the paper's FLOP
formula F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), the same formula the published
numbers use. Run: .venv/bin/python bench/megatron_table1.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

import autopar
from autopar.capture import capture
from autopar.cost_model import Estimator, estimate_plan
from autopar.errors import ConfigError
from autopar.models import GPTConfig, build_gpt

VOCAB = 51200
# params(B), heads, hidden, layers, TP, PP, GPUs, global batch, published TFLOP/s per GPU
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Megatron README, TP weak scaling on one DGX A100, seq 1024, batch 16:
# name, hidden, heads, layers, TP = GPUs, published iteration ms, published TFLOP/s
README_TP = [
    ("1.2B", 1920, 15, 24, 1, 1076, 149.8),
    ("2.0B", 2304, 18, 30, 2, 1026, 136.8),
    ("4.2B", 3072, 24, 36, 4, 1162, 124.7),
    ("8.7B", 4096, 32, 42, 8, 1343, 109.3),
]
PRECISION = autopar.Precision(compute="bf16", grads="fp32")


def megatron_flops(batch: int, seq: int, layers: int, hidden: int) -> float:
    """Narayanan et al. eq. (3): FLOPs per iteration with full recomputation."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + VOCAB / (16 * layers * hidden))


def candidates(layers: int, tp: int, pp: int, dp: int, batch: int):
    """Unpublished knobs: micro-batch size and interleaving degree."""
    for mb in (1, 2, 4, 8):
        if batch % (dp * mb):
            continue
        if pp == 1:
            yield autopar.ParallelConfig(dp=dp, tp=tp, pp=1, micro_batch_size=mb, recompute="full")
            continue
        for v in range(1, layers // pp + 1):
            if layers % (pp * v):
                continue
            sched = "interleaved" if v > 1 else "1f1b"
            yield autopar.ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=mb, schedule=sched,
                                         virtual_stages=v, recompute="full")


def best_plan(graph, cluster, configs, batch):
    est = Estimator(graph, cluster, PRECISION)
    best = None
    for cfg in configs:
        try:
            plan = estimate_plan(graph, cluster, cfg, batch, PRECISION, est)
        except ConfigError:
            continue
        if plan.fits and (best is None or plan.step_time < best.step_time):
            best = plan
    return best


def published_plan(heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int):
    """(graph, cluster, estimate of the published configuration) of one Table 1 row."""
    cfg = GPTConfig(vocab_size=VOCAB, hidden=hidden, heads=heads, layers=layers, seq_len=2048)
    model, inputs = build_gpt(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    graph = capture(model, inputs)
    cluster = autopar.Cluster.from_spec(f"{gpus // 8}x8xA100-80GB")
    dp = gpus // (tp * pp)
    return graph, cluster, best_plan(graph, cluster, candidates(layers, tp, pp, dp, batch), batch)


def run_table1(rows) -> list[float]:
    print("Megatron-LM SC21 Table 1 (DGX A100 80GB; full recompute; interleaved 1F1B)")
    print(f"{'params':>7} {'TP':>3} {'PP':>3} {'DP':>3} {'GPUs':>5} {'batch':>5} | {'published':>9} {'predicted':>9} "
          f"{'error':>7} | {'iter s pub':>10} {'iter s pred':>11} | chosen (mb, schedule)  peak GB")
    errors = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, published in rows:
        graph, cluster, plan = published_plan(heads, hidden, layers, tp, pp, gpus, batch)
        dp = plan.config.dp
        flops = megatron_flops(batch, 2048, layers, hidden)
        predicted = flops / (plan.step_time * gpus) / 1e12
        err = (predicted - published) / published
        errors.append(err)
        c = plan.config
        sched = c.schedule if c.virtual_stages == 1 else f"interleaved v={c.virtual_stages}"
        print(f"{params:>6}B {tp:>3} {pp:>3} {dp:>3} {gpus:>5} {batch:>5} | {published:>9.0f} {predicted:>9.1f} "
              f"{err * 100:>+6.1f}% | {flops / (published * 1e12 * gpus):>10.2f} {plan.step_time:>11.2f} | "
              f"mb={c.micro_batch_size}, {sched}  {plan.peak_memory / 1e9:.1f}")
    return errors


def run_readme_tp() -> list[float]:
    print("\nMegatron-LM README: TP weak scaling on one DGX A100 (seq 1024, batch 16, full recompute)")
    print(f"{'case':>5} {'TP':>3} | {'pub ms':>7} {'pred ms':>8} | {'pub TF':>7} {'pred TF':>8} {'error':>7} | chosen mb")
    errors = []
    for name, hidden, heads, layers, tp, ms, published in README_TP:
        cfg = GPTConfig(vocab_size=VOCAB, hidden=hidden, heads=heads, layers=layers, seq_len=1024)
        model, inputs = build_gpt(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
        graph = capture(model, inputs)
        cluster = autopar.Cluster.from_spec(f"1x{tp}xA100-80GB")
        configs = [autopar.ParallelConfig(tp=tp, micro_batch_size=mb, recompute="full") for mb in (1, 2, 4, 8, 16)]
        plan = best_plan(graph, cluster, configs, 16)
        flops = 96 * 16 * 1024 * layers * hidden ** 2 * (1 + 1024 / (6 * hidden) + VOCAB / (16 * layers * hidden))
        predicted = flops / (plan.step_time * tp) / 1e12
        err = (predicted - published) / published
        errors.append(err)
        print(f"{name:>5} {tp:>3} | {ms:>7.0f} {plan.step_time * 1e3:>8.0f} | {published:>7.1f} {predicted:>8.1f} "
              f"{err * 100:>+6.1f}% | mb={plan.config.micro_batch_size}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first four Table 1 rows")
    args = parser.parse_args()
    t0 = time.perf_counter()
    errs = run_table1(TABLE1[:4] if args.quick else TABLE1)
    errs_tp = run_readme_tp()
    worst = max(abs(e) for e in errs + errs_tp)
    print(f"\nTable 1: mean |error| {sum(map(abs, errs)) / len(errs) * 100:.1f}%, worst {max(map(abs, errs)) * 100:.1f}%;"
          f" README TP: worst {max(map(abs, errs_tp)) * 100:.1f}%  (target: every row within 15%)")
    print(f"A100 constants: {autopar.Cluster.from_spec('1x8xA100-80GB').device}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
