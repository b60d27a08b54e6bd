"""Cost-model fidelity on a real cluster: predicted (profile=True) vs measured step time, gloo ranks on this CPU.

The cluster is ``autopar.Cluster.local(nprocs=R, threads_per_rank=1)``: this machine's device
and links, profiled (or loaded from the profile cache). The model is a GPT-NeoX-style decoder
(Hugging Face ``GPTNeoXForCausalLM``: parallel attention + MLP residual, partial rotary
embeddings, untied head) with 4 layers, hidden 256, 4 heads, vocabulary 4096, sequence 128,
global batch 16, fp32, AdamW. For every configuration below the script

- predicts: ``autopar.plan(model, cluster, ..., fixed=<every field>, profile=True).step_time``
  (the plan is what the program runs: per-op sharding from the ILP, stages from the DP);
- measures: the ``train_step`` of ``autopar.parallelize(model, plan)`` on R gloo ranks with one
  thread each: 2 warm-up steps, then the median of 5 (each step between two barriers), the
  configurations' steps taken round robin so that the VM's slow spells (its speed drifts by
  10-20% over minutes) fall on all of them alike;

and ``autopar.plan(..., profile=True)`` with nothing pinned picks a configuration, which is
measured too when it is not in the list. Targets (issue: profiler): median |error| <= 10%,
none over 25%, and the pick measures within 5% of the fastest measured configuration.
Prints the table, writes bench/results/fidelity_cpu_<R>ranks.{json,png}.

Run: .venv/bin/python bench/fidelity_cpu.py [--ranks 2|4] [--db PATH] [--plot-only]
     (--db reuses a profile cache; by default a fresh one, so the profiling is part of the run)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, GBS = 4, 256, 4, 4096, 128, 16
WARMUP, STEPS = 2, 5
RESULTS = Path(__file__).resolve().parent / "results"
BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=GBS, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
CONFIGS = {
    2: {"dp=2": dict(BASE, dp=2, micro_batch_size=8),
        "tp=2": dict(BASE, tp=2),
        "pp=2 1F1B (4 mb)": dict(BASE, pp=2, micro_batch_size=4),
        "pp=2 GPipe (4 mb)": dict(BASE, pp=2, micro_batch_size=4, schedule="gpipe"),
        "dp=2 ZeRO-3": dict(BASE, dp=2, zero=3, micro_batch_size=8),
        "dp=2, 2 micro-batches": dict(BASE, dp=2, micro_batch_size=4)},
    4: {"dp=4": dict(BASE, dp=4, micro_batch_size=4),
        "tp=2 dp=2": dict(BASE, tp=2, dp=2, micro_batch_size=8),
        "pp=2 dp=2 1F1B (4 mb)": dict(BASE, pp=2, dp=2, micro_batch_size=2),
        "pp=4 1F1B (8 mb)": dict(BASE, pp=4, micro_batch_size=2),
        "pp=4 GPipe (8 mb)": dict(BASE, pp=4, micro_batch_size=2, schedule="gpipe"),
        "dp=4 ZeRO-3": dict(BASE, dp=4, zero=3, micro_batch_size=4),
        "tp=4": dict(BASE, tp=4)},
}


def model():
    from autopar.models import build_hf_gpt_neox
    torch.manual_seed(0)
    m, _ = build_hf_gpt_neox(layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq_len=SEQ, batch_size=1,
                             dropout=0.0)
    return m


def batch(size: int = GBS) -> dict:
    from autopar.models import build_hf_gpt_neox
    return build_hf_gpt_neox(layers=1, hidden=8, heads=1, vocab=VOCAB, seq_len=SEQ, batch_size=size, dropout=0.0)[1]


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-4)


def predict(ranks: int, db: str) -> tuple[dict, dict, str, dict]:
    """Profile this machine, plan every configuration and the free pick; returns plans, predictions,
    the pick's name and timings of the profiling."""
    import autopar
    t0 = time.perf_counter()
    cluster = autopar.Cluster.local(nprocs=ranks, threads_per_rank=1, profile_db=db)
    t1 = time.perf_counter()
    m, example = model(), batch(1)
    plans, predicted = {}, {}
    for name, cfg in CONFIGS[ranks].items():
        plan = autopar.plan(m, cluster, example, global_batch_size=GBS, fixed=cfg, profile=True, profile_db=db)
        plans[name], predicted[name] = plan.to_dict(), plan.step_time
    t2 = time.perf_counter()
    free = autopar.plan(m, cluster, example, global_batch_size=GBS, profile=True, profile_db=db)
    t3 = time.perf_counter()
    pick = next((name for name, cfg in CONFIGS[ranks].items()
                 if all(getattr(free.config, k) == v for k, v in cfg.items())), None)
    if pick is None:
        pick = f"plan's pick: {free.config.short()}"
        plans[pick], predicted[pick] = free.to_dict(), free.step_time
    timings = {"cluster_local_s": t1 - t0, "plans_s": t2 - t1, "free_plan_s": t3 - t2,
               "cluster": cluster.describe(), "notes": list(free.notes)}
    return plans, predicted, pick, timings


def _worker(rank: int, world: int, port: int, plans: dict, out: str) -> None:
    import autopar
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = batch()
    programs = {name: autopar.parallelize(model(), autopar.Plan.from_dict(plan), optimizer)
                for name, plan in plans.items()}
    times: dict[str, list[float]] = {name: [] for name in plans}
    for step in range(WARMUP + STEPS):  # round robin: a slow spell of the VM hits every configuration alike
        for name, program in programs.items():
            dist.barrier()
            start = time.perf_counter()
            program.train_step(x)
            dist.barrier()
            if step >= WARMUP:
                times[name].append(time.perf_counter() - start)
    measured = {name: statistics.median(t) for name, t in times.items()}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(measured, fh)
    dist.barrier()
    dist.destroy_process_group()


def measure(ranks: int, plans: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "measured.json")
        mp.start_processes(_worker, args=(ranks, port, plans, out), nprocs=ranks, join=True, start_method="spawn")
        with open(out) as fh:
            return json.load(fh)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = 1.1 * max(max(r["measured_s"], r["predicted_s"]) for r in rows)
    ax.plot([0, top], [0, top], color="grey", lw=1, label="predicted = measured")
    ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="grey", alpha=0.15, label="within 10%")
    markers = "osD^v<>ph*"
    for i, r in enumerate(rows):
        ax.scatter(r["measured_s"], r["predicted_s"], s=36, marker=markers[i % len(markers)], label=r["config"])
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured train_step (s)")
    ax.set_ylabel("predicted step time, profile=True (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _title(ranks: int, median: float, worst: float) -> str:
    return (f"{ranks} gloo ranks x 1 thread, GPT-NeoX-style 4x256, batch 16\n"
            f"median |error| {median * 100:.1f}%, max {worst * 100:.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=sorted(CONFIGS))
    parser.add_argument("--db", default=None, help="profile cache to use (default: a fresh temporary one)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON")
    args = parser.parse_args()
    stem = RESULTS / f"fidelity_cpu_{args.ranks}ranks"
    if args.plot_only:
        with open(stem.with_suffix(".json")) as fh:
            saved = json.load(fh)
        plot(saved["rows"], stem.with_suffix(".png"), _title(args.ranks, saved["median_error"], saved["max_error"]))
        return 0
    cores = os.cpu_count() or 1
    if cores < args.ranks:
        print(f"SKIPPED: {args.ranks} ranks with 1 thread each need {args.ranks} cores; this machine has {cores}, so "
              "the ranks would share cores and the measurement would time the OS scheduler, not the plan")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or os.path.join(tmp, "profile.json")
        plans, predicted, pick, timings = predict(args.ranks, db)
    measured = measure(args.ranks, plans)
    rows = [{"config": name, "predicted_s": predicted[name], "measured_s": measured[name],
             "error": predicted[name] / measured[name] - 1} for name in plans]
    errors = [abs(r["error"]) for r in rows]
    fastest = min(rows, key=lambda r: r["measured_s"])
    pick_gap = measured[pick] / fastest["measured_s"] - 1
    print(f"cluster: {timings['cluster']} (Cluster.local {timings['cluster_local_s']:.1f} s; "
          f"{len(CONFIGS[args.ranks])} plans {timings['plans_s']:.1f} s; free plan {timings['free_plan_s']:.1f} s)")
    print("| configuration | predicted s | measured s | error |\n|---|---:|---:|---:|")
    for r in rows:
        mark = " (plan's pick)" if r["config"] == pick else ""
        print(f"| {r['config']}{mark} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error'] * 100:+.1f}% |")
    median, worst = statistics.median(errors), max(errors)
    print(f"median |error| {median * 100:.1f}% (target <= 10%), max {worst * 100:.1f}% (target <= 25%); "
          f"plan's pick {pick!r} measures {pick_gap * 100:+.1f}% vs the fastest measured "
          f"({fastest['config']}) (target <= 5%)")
    RESULTS.mkdir(exist_ok=True)
    with open(stem.with_suffix(".json"), "w") as fh:
        json.dump({"rows": rows, "pick": pick, "median_error": median, "max_error": worst, "pick_gap": pick_gap,
                   **timings}, fh, indent=1)
    plot(rows, stem.with_suffix(".png"), _title(args.ranks, median, worst))
    ok = median <= 0.10 and worst <= 0.25 and pick_gap <= 0.05
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
