"""How long ``autopar sweep`` takes on Llama-3 70B over 1-16 nodes of H100, end to end, and its table.

Runs, as a user would from a shell (a new Python process each time: imports, model build on the
meta device, one capture, one search per cluster size in worker processes, the table):

    autopar sweep llama3-70b --nodes 1,2,4,8,16 --device H100-SXM --global-batch 1024 \\
        --tokens 1e12 --price-per-gpu-hour 2.5 -q

and prints its wall time (median of ``--repeats`` runs), the table it printed, and whether the
issue-21 target holds: the table in under 60 s on this 2-core machine. It also checks the table's
arithmetic on the CSV the same run wrote (tokens/s x time to train = tokens; cost = GPUs x hours x
price; tokens/s = global batch x sequence / step time). Nothing else should run meanwhile: the
times are wall-clock.

Run: .venv/bin/python bench/sweep.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile

from cli_plan_time import timed   # a fresh `autopar` process, timed

TARGET_SECONDS = 60.0
TOKENS, PRICE, BATCH, SEQ = 1e12, 2.5, 1024, 8192
ARGS = ["sweep", "llama3-70b", "--nodes", "1,2,4,8,16", "--device", "H100-SXM", "--global-batch", str(BATCH),
        "--tokens", "1e12", "--price-per-gpu-hour", f"{PRICE:g}", "-q"]


def check_arithmetic(path: str) -> int:
    """The rows of the CSV that have a plan, after checking each one's arithmetic."""
    rows = [r for r in csv.DictReader(open(path)) if r["config"]]
    for r in rows:
        tps, train, step, gpus = float(r["tokens_per_s"]), float(r["train_s"]), float(r["step_time_s"]), int(r["gpus"])
        assert math.isclose(tps * train, TOKENS, rel_tol=1e-9), r
        assert math.isclose(float(r["cost"]), gpus * train / 3600 * PRICE, rel_tol=1e-9), r
        assert math.isclose(tps, BATCH * SEQ / step, rel_tol=1e-9), r
    return len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    repeats = parser.parse_args().repeats
    with tempfile.TemporaryDirectory() as tmp:
        runs = [timed(ARGS + ["--csv", "sweep.csv"], tmp) for _ in range(repeats)]
        planned = check_arithmetic(os.path.join(tmp, "sweep.csv"))
    times = [t for t, _ in runs]
    print(f"$ autopar {' '.join(ARGS)}")
    print("\n".join(line for line in runs[0][1].splitlines() if not line.startswith("table written to")))
    median = statistics.median(times)
    verdict = "met" if median < TARGET_SECONDS else "NOT met"
    print(f"\nwall time: median {median:.1f} s over {repeats} run(s) (min {min(times):.1f}, max {max(times):.1f}); "
          f"arithmetic checked on {planned} planned rows")
    print(f"target: the llama3-70b sweep's table in under {TARGET_SECONDS:.0f} s: {verdict} ({os.cpu_count()} cores)")
    return 0 if median < TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
