"""The search's ``time_limit``: how long ``solve`` takes against the limit it was given, what plan it
returns and what it claims about it (optimal, gap), on the two largest planning problems of
bench/solver_scaling.py.

Each row solves the captured graph (capture time excluded: the limit is the search's) in a fresh
process, so no layout or cost cache carries over. Columns: the limit, the wall-clock seconds of
``solve``, the plan's step time and how much slower it is than the unlimited plan's, ``optimal``,
``gap`` (null when a layout the search used is not an ILP optimum), and how many layer groups were
sharded greedily because the limit had passed. Target: every limited solve returns within its limit
plus OVERRUN seconds (exit 1 otherwise).
Run: .venv/bin/python bench/time_limit.py
"""

from __future__ import annotations

import json
import subprocess
import sys

CASES = [("GPT-3 175B", "gpt3-175b", "128x8xA100-80GB", 1536),
         ("Llama-3 405B", "llama3-405b", "2048x8xH100-SXM", 16384)]
LIMITS = [None, 0.5, 1.0, 2.0, 5.0, 10.0]

CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import autopar
from autopar.capture import capture
from autopar.models import registry
from autopar.solver import solve
name, spec, gbs, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
model, inputs = registry.build(name, batch_size=1, device="meta")
graph = capture(model, inputs)
t = time.perf_counter()
plan, stats = solve(graph, autopar.Cluster.from_spec(spec), gbs, time_limit=limit)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "step_time": plan.step_time, "config": plan.config.short(),
                  "optimal": plan.optimal, "gap": plan.gap, "greedy": stats.ilp_greedy}))
"""


def run(name: str, spec: str, gbs: int, limit: float | None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, spec, str(gbs), json.dumps(limit)], check=True,
                         capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    return json.loads(out.stdout.strip().splitlines()[-1])


OVERRUN = 1.0   # seconds past the limit a limited solve may return (the search checks the clock between steps)


def main() -> int:
    ok = True
    print("| model | cluster | time_limit | solve s | step time s | vs unlimited | optimal | gap | greedy groups "
          "| plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, name, spec, gbs in CASES:
        best = None
        for limit in LIMITS:
            r = run(name, spec, gbs, limit)
            best = best or r["step_time"]
            gap = "null" if r["gap"] is None else f"{100 * r['gap']:.1f}%"
            print(f"| {label} | {spec} | {'none' if limit is None else limit} | {r['seconds']:.1f} | "
                  f"{r['step_time']:.2f} | {100 * (r['step_time'] / best - 1):+.1f}% | {r['optimal']} | {gap} | "
                  f"{r['greedy']} | {r['config']} |", flush=True)
            ok &= limit is None or r["seconds"] <= limit + OVERRUN
    print(f"target: every limited solve returns within its limit + {OVERRUN:.0f} s: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
