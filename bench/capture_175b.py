"""Capture time and peak memory for GPT-3 175B (96 layers, h=12288) built on the meta device.

Runs in a fresh process so that the reported peak resident set size (RSS, which
includes importing torch) belongs to this capture alone. Target: under 30 s and 4 GB.
Also captures the Llama-3-405B-shaped model (126 layers) and the HF GPT-2 / Llama
classes at small size, to show the time is per-op, not per-parameter.
Run: .venv/bin/python bench/capture_175b.py
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from autopar.capture import capture
from autopar.models import registry


def main() -> int:
    print(f"{'model':>12} {'params':>9} {'ops':>6} {'layers':>6} {'build s':>8} {'capture s':>9} {'peak RSS GB':>11}")
    ok = True
    for name in ("gpt3-175b", "llama3-405b"):
        t0 = time.perf_counter()
        model, inputs = registry.build(name, batch_size=1, device="meta", dtype=torch.bfloat16)
        t1 = time.perf_counter()
        graph = capture(model, inputs)
        t2 = time.perf_counter()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux
        print(f"{name:>12} {graph.param_numel / 1e9:>8.1f}B {len(graph.nodes):>6} {len(graph.layers):>6} "
              f"{t1 - t0:>8.2f} {t2 - t1:>9.2f} {rss:>11.2f}")
        if name == "gpt3-175b":
            ok = (t2 - t1) < 30 and rss < 4
    print("GPT-3 175B capture under 30 s and 4 GB:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
