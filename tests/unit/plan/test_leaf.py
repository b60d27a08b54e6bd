"""The plan package is a leaf: reading a plan file, and reading the plan (its summary, explanation,
exports), loads no torch, no capture, no cost model, no solver, compiler or runtime (issue 49)."""

from __future__ import annotations

import json
import subprocess
import sys

import autopar
from autopar.models import GPTConfig, build_gpt

HEAVY = ("torch", "autopar.capture", "autopar.cost_model", "autopar.solver", "autopar.codegen", "autopar.runtime",
         "autopar.profiler", "autopar.api", "autopar.sweep")

_CHILD = """
import json, sys
import autopar
plan = autopar.load_plan(sys.argv[1])
plan.summary(); plan.explain(); plan.to_dict()
for stack in ("torchtitan", "megatron", "deepspeed", "accelerate"):
    plan.export(stack)
print(json.dumps(sorted(sys.modules)))
"""


def test_reading_a_plan_loads_nothing_that_captures_prices_or_runs(tmp_path) -> None:
    model, inputs = build_gpt(GPTConfig(vocab_size=256, hidden=128, heads=4, layers=4, seq_len=64), batch_size=1,
                              device="meta")
    plan = autopar.estimate(model, autopar.Cluster.from_spec("1x4xA100-80GB"), inputs,
                            autopar.ParallelConfig(dp=1, tp=2, pp=2, micro_batch_size=1), global_batch_size=8)
    path = tmp_path / "plan.json"
    plan.save(path)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = [m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == [], f"reading a plan imported {heavy}"
