"""Peak memory per rank of training steps against the plan's priced peak (``Plan.peak_memory``).

The plans' memory is otherwise checked against formulas (bench/activation_memory.py: Korthikanti et
al.'s activations, ZeRO's model states); this runs the programs. 2 gloo ranks on this CPU (one thread
each), one spawn per measurement. Model: the hand-written GPT, hidden 512, 8 layers, 8 heads,
vocabulary 4096, sequence 64 (27 M parameters, 104 MiB in fp32), built on the meta device (each rank
materialises its shards), AdamW; global batch 8 in micro-batches of 2 (of 1 where the plan says).

After ``parallelize``, each rank sets its malloc to serve every block of 64 KiB or more with a mapping
of its own, unmapped when freed, and to trim its heap of all it frees (the drivers set the opposite to
keep a step's buffers: runtime/host_heap.py), so that its resident set is what it holds; then clears its
peak RSS counter (``/proc/self/clear_refs``) and runs 4 training steps (AdamW's states exist from the
first). Measured peak: ``VmHWM`` above the RSS at that point, plus the parameters it held there, the
largest over the ranks, the least over 2 spawns (what the allocation order and the collectives' timing
leave resident moves a spawn's peak up by as much as 5%). The runtime's own memory (exported graph,
generated code, DTensor / FSDP2 and process-group state, the libraries' buffers) is not priced: the
same plan of the same architecture at hidden 64 (the same ops, parameters of a few MB) is measured
alike, and its measured and priced peaks are taken off. Target: measured / priced within 0.9-1.1 for
every plan. Exits 1 on a miss.

Run: .venv/bin/python bench/step_memory.py [--plans dp2,dp2-zero1,...]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import sys

import torch
import torch.distributed as dist

import rank_memory

WORLD = 2
BIG = dict(vocab_size=4096, hidden=512, heads=8, layers=8, seq_len=64, dropout=0.0)
GLOBAL_BATCH, STEPS, REPEATS = 8, 4, 2
PLANS = {"dp2": dict(dp=2), "dp2-zero1": dict(dp=2, zero=1), "dp2-zero2": dict(dp=2, zero=2),
         "dp2-zero3": dict(dp=2, zero=3), "tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True),
         "pp2": dict(pp=2), "pp2-mb1": dict(pp=2, micro_batch_size=1), "dp2-recompute": dict(dp=2, recompute="full"),
         "tp2-selective": dict(tp=2, recompute="selective")}
LOW, HIGH = 0.9, 1.1
MMAP_THRESHOLD = 64 << 10
SMALL = {**BIG, "hidden": 64}


def _rank(rank: int, port: int, sizes: dict, plan_dict: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import autopar
    from autopar.models import GPTConfig, build_gpt
    from autopar.runtime import host_heap
    from autopar.runtime.data_parallel import local
    plan = autopar.Plan.from_dict(plan_dict)
    torch.manual_seed(0)
    model, _ = build_gpt(GPTConfig(**sizes), batch_size=1, device="meta")
    program = autopar.parallelize(model, plan, lambda params: torch.optim.AdamW(params, lr=1e-4))
    held = sum(local(p).numel() * local(p).element_size() for p in program.parameters())
    # every block of 64 KiB or more its own mapping, unmapped when freed, and the heap trimmed of all it frees:
    # the resident set is then what is held (parallelize set the opposite: runtime/host_heap.py)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    assert libc.mallopt(host_heap.M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(host_heap.M_TRIM_THRESHOLD, 0)
    libc.malloc_trim(0)
    dist.barrier()
    start = rank_memory.reset_peak()
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, sizes["vocab_size"], (GLOBAL_BATCH, sizes["seq_len"]), generator=g)
        program.train_step(dict(input_ids=ids, labels=ids))
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"peak": rank_memory.kib("VmHWM") - start + held}, f)
    dist.barrier()
    dist.destroy_process_group()


def _plan(sizes: dict, config: dict):
    import autopar
    from autopar.models import GPTConfig, build_gpt
    model, inputs = build_gpt(GPTConfig(**sizes), batch_size=1, device="meta")
    fixed = {**dict(dp=1, tp=1, pp=1, micro_batch_size=2, zero=0, recompute="none", schedule="1f1b",
                    virtual_stages=1, sequence_parallel=False), **config}
    return autopar.plan(model, autopar.Cluster.from_spec(f"1x{WORLD}xcpu"), inputs,
                        global_batch_size=GLOBAL_BATCH, fixed=fixed)


def run(sizes: dict, plan) -> int:
    """The largest peak over the ranks of one spawn, bytes: the least over ``REPEATS`` spawns (what a step's
    allocation order and the collectives' timing leave resident moves a spawn's peak by up to 5% here, always
    upward)."""
    return min(_spawn(sizes, plan) for _ in range(REPEATS))


def _spawn(sizes: dict, plan) -> int:
    return max(got["peak"] for got in rank_memory.spawn(_rank, (sizes, plan.to_dict()), WORLD))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated: " + ", ".join(PLANS))
    names = parser.parse_args().plans.split(",")
    mb = 2 ** 20
    print(f"GPT hidden {BIG['hidden']}, {BIG['layers']} layers, vocabulary {BIG['vocab_size']}, AdamW, "
          f"global batch {GLOBAL_BATCH} in micro-batches of 2: {WORLD} gloo ranks; MiB per rank (the largest)\n")
    print("| plan | priced peak | measured peak | hidden 64: priced / measured | priced, less hidden 64's "
          "| measured, less hidden 64's | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name in names:
        plan, small = _plan(BIG, PLANS[name]), _plan(SMALL, PLANS[name])
        peak, base = run(BIG, plan), run(SMALL, small)
        priced, measured = plan.peak_memory - small.peak_memory, peak - base
        ratio = measured / priced
        ok &= LOW <= ratio <= HIGH
        print(f"| {name} ({plan.config.short()}) | {plan.peak_memory / mb:.1f} | {peak / mb:.1f} "
              f"| {small.peak_memory / mb:.1f} / {base / mb:.1f} | {priced / mb:.1f} | {measured / mb:.1f} "
              f"| {ratio:.3f} |", flush=True)
    print(f"\ntarget: every ratio within {LOW}-{HIGH}: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
