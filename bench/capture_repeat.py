"""Capture time with repeated blocks copied against tracing every block, at the sizes users plan.

Hugging Face's ``GPT2LMHeadModel`` at GPT-3 175B's shape (96 layers, n_embd 12288, sequence 2048) and
``LlamaForCausalLM`` at Llama-3 405B's (126 layers, hidden 16384, sequence 8192), as
bench/solver_scaling.py builds them (meta device, bf16, SDPA attention), captured by
``autopar.capture.capture`` twice, each in a fresh process: as planning does (capture/repeat.py:
three blocks traced, the rest copied) and with ``AUTOPAR_TRACE_EVERY_BLOCK=1`` (every block traced).
Building the model is not counted. The two OpGraphs must be equal (every field: ops, names, shapes,
parameters in order, layers, structure and fingerprint, warnings), and the copied capture must say
it copied.

Target: the copied capture takes at most 0.3 of the CPU time of tracing every block (measured on the
shared 2-core machine: 0.19-0.25, e.g. GPT-2 3.4 s against 17.4 s, Llama 6.1 s against 27.5 s; what
remains is the walk of every op into the OpGraph, which both do, torch.export's fixed cost and the
expansion). CPU time, not wall time, is compared: the machine is shared and wall times swing with
its load; both are printed, with the peak RSS of each process. Exits 1 on a difference, a capture
that did not copy, or a missed target.
Run: .venv/bin/python bench/capture_repeat.py [--only gpt2|llama]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile

TARGET = 0.3       # copied CPU time / every-block CPU time (measured 0.19-0.25)
MODELS = ("gpt2", "llama")

CHILD = r"""
import json, os, pickle, resource, sys, time
import torch
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import autopar.capture as package
from autopar.capture import capture, repeat
which, out, bench = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, bench)
import hf_shapes
model, inputs = hf_shapes.build(which)
outcomes = []   # how the blocks were captured (capture() keeps it to itself)
def export_program(*args, **kwargs):
    program, outcome = repeat.export_program(*args, **kwargs)
    outcomes.append(outcome)
    return program, outcome
package.export_program = export_program
wall, cpu = time.perf_counter(), time.process_time()
graph = capture(model, inputs)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
with open(out, "wb") as f:
    pickle.dump(graph, f)
print(json.dumps({"wall": wall, "cpu": cpu, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "nodes": len(graph.nodes), "layers": len(graph.layers), "copied": list(outcomes[0].copied),
                  "fallback": outcomes[0].fallback}))
"""


def run(which: str, every_block: bool, out: str) -> dict:
    env = dict(os.environ, AUTOPAR_TRACE_EVERY_BLOCK="1" if every_block else "")
    done = subprocess.run([sys.executable, "-c", CHILD, which, out, os.path.dirname(os.path.abspath(__file__))], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{which} ({'every block' if every_block else 'copied'}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def difference(a, b) -> str:
    """The first field of two OpGraphs that differs, "" when they are equal (parameter order included)."""
    if list(a.params) != list(b.params):
        return "params (order)"
    for field in a.__dataclass_fields__:
        x, y = getattr(a, field), getattr(b, field)
        if x != y:
            if field == "nodes":
                i = next((i for i, (m, n) in enumerate(zip(x, y)) if m != n), min(len(x), len(y)))
                return f"nodes[{i}] {x[i].name if i < len(x) else '-'} / {y[i].name if i < len(y) else '-'}"
            return field
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=MODELS)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'model':>14} {'layers':>6} {'ops':>6} | {'copied cpu':>10} {'wall':>6} {'RSS':>6} | "
          f"{'every block cpu':>15} {'wall':>6} {'RSS':>6} | {'ratio':>5}  equal  blocks")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for which in [args.only] if args.only else MODELS:
            copied = run(which, False, os.path.join(tmp, "copied.pkl"))
            whole = run(which, True, os.path.join(tmp, "whole.pkl"))
            with open(os.path.join(tmp, "copied.pkl"), "rb") as f, open(os.path.join(tmp, "whole.pkl"), "rb") as g:
                diff = difference(pickle.load(f), pickle.load(g))
            ratio = copied["cpu"] / whole["cpu"]
            hit = not diff and bool(copied["copied"]) and ratio <= TARGET
            ok &= hit
            name = {"gpt2": "HF GPT-2 175B", "llama": "HF Llama 405B"}[which]
            print(f"{name:>14} {copied['layers']:>6} {copied['nodes']:>6} | {copied['cpu']:>9.1f}s "
                  f"{copied['wall']:>5.1f}s {copied['rss'] / 1e9:>4.1f}GB | {whole['cpu']:>14.1f}s "
                  f"{whole['wall']:>5.1f}s {whole['rss'] / 1e9:>4.1f}GB | {ratio:>5.2f}  "
                  f"{'yes' if not diff else 'NO: ' + diff}  {'; '.join(copied['copied']) or copied['fallback']}"
                  f"{'' if hit else '  MISSED'}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(f"copied capture equal and at most {TARGET:.2f} of every block's CPU time: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
