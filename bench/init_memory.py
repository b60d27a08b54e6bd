"""Peak host memory per rank of ``parallelize``: a model built on the meta device (each rank
materialises its shards, runtime/sharded_init.py) against the same model built on the CPU by every
rank (what docs/multinode.md asked for before: one whole model per process).

8 gloo ranks on this CPU (one thread each), one spawn per row. Model: the hand-written GPT,
hidden 1024, 16 layers, 16 heads, vocabulary 4096, sequence 64 (~210 M parameters, 0.85 GB in
fp32): 8x what one rank holds at dp=8 ZeRO-3 or tp=2 x dp=4 ZeRO-3. Each rank clears its peak
RSS counter (``/proc/self/clear_refs``) after importing torch and autopar and joining the process
group, then builds the model and calls ``parallelize``; "peak" is its ``VmHWM`` above the RSS it
had at that point, the largest over the ranks.

The runtime's own baseline is the same configuration on the same architecture at hidden 64 (the same
graph and ops, parameters of a few MB): exporting the graph, DTensor / FSDP2 and process-group
state. The target (issue 21): peak(meta) <= 1.5 x share + baseline, share being the bytes of the
parameters the rank holds. What a rank holds above its share while it materialises is one module's
full values (the largest here: an MLP weight, 16 MiB) and what glibc's allocator keeps of the
freed ones (up to its 32 MiB trim threshold; ``MALLOC_MMAP_THRESHOLD_=1048576`` returns them at
once): a fixed amount, so the ratio to the share falls as models deepen (at 8 layers, a 50 MiB
share, the same run measured 1.6x the share above the baseline, 1.36x with that setting).

Run: .venv/bin/python bench/init_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import rank_memory

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

WORLD = 8
BIG = dict(vocab_size=4096, hidden=1024, heads=16, layers=16, seq_len=64, dropout=0.0)
SMALL = {**BIG, "hidden": 64}
PLANS = {"dp8-zero3": dict(dp=8, zero=3), "tp2-dp4-zero3": dict(tp=2, dp=4, zero=3)}


def _rank(rank: int, port: int, sizes: dict, device: str, plan_dict: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import autopar
    from autopar.models import GPTConfig, build_gpt
    from autopar.runtime.data_parallel import local
    plan = autopar.Plan.from_dict(plan_dict)
    dist.barrier()
    start = rank_memory.reset_peak()
    torch.manual_seed(0)
    model, _ = build_gpt(GPTConfig(**sizes), batch_size=1, device=device)
    program = autopar.parallelize(model, plan)
    peak = rank_memory.kib("VmHWM") - start
    share = sum(local(p).numel() * local(p).element_size() for p in program.parameters())
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"peak": peak, "share": share}, f)
    dist.barrier()
    dist.destroy_process_group()


def _plan(sizes: dict, config: dict) -> "object":
    import autopar
    from autopar.models import GPTConfig, build_gpt
    model, inputs = build_gpt(GPTConfig(**sizes), batch_size=1, device="meta")
    fixed = {**dict(dp=1, tp=1, pp=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b",
                    virtual_stages=1, sequence_parallel=False), **config}
    return autopar.plan(model, autopar.Cluster.from_spec(f"1x{WORLD}xcpu"), inputs, global_batch_size=8,
                        fixed=fixed)


def run(sizes: dict, device: str, plan) -> dict:
    """The largest peak and share over the ranks of one spawn."""
    got = rank_memory.spawn(_rank, (sizes, device, plan.to_dict()), WORLD)
    return {"peak": max(g["peak"] for g in got), "share": max(g["share"] for g in got)}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    mb = 2 ** 20
    rows = []
    for name, config in PLANS.items():
        plan = _plan(BIG, config)
        meta = run(BIG, "meta", plan)
        base = run(SMALL, "meta", _plan(SMALL, config))
        cpu = run(BIG, "cpu", plan) if name == "dp8-zero3" else None
        bound = 1.5 * meta["share"] + base["peak"]
        rows.append((name, meta, base, cpu, bound))
    print(f"GPT hidden {BIG['hidden']}, {BIG['layers']} layers, vocabulary {BIG['vocab_size']}: "
          f"{WORLD} gloo ranks; MiB per rank (the largest over ranks)\n")
    print("| plan | share (params held) | peak, meta model | peak, CPU-built model | runtime baseline "
          "| bound 1.5 x share + baseline | within |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, meta, base, cpu, bound in rows:
        cpu_peak = f"{cpu['peak'] / mb:.0f}" if cpu else "-"
        print(f"| {name} | {meta['share'] / mb:.0f} | {meta['peak'] / mb:.0f} | {cpu_peak} | {base['peak'] / mb:.0f} "
              f"| {bound / mb:.0f} | {'yes' if meta['peak'] <= bound else 'NO'} |")


if __name__ == "__main__":
    main()
