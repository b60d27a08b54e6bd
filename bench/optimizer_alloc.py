"""How much a compiled AdamW step gains on a CPU, and how much of that is the C allocator.

torch's AdamW on a CPU is the single-tensor loop: about 8 tensor ops per parameter, some making a
temporary of the parameter's size. glibc serves a block above its mmap threshold as a fresh mapping
whose pages fault in on first touch, and unmaps it on free; a long-lived process that has freed such
blocks raises that threshold (glibc's dynamic threshold) and serves them from the heap. This script
steps the parameters of bench/runtime_overhead.py's DP program (24 tensors, 8.4 M parameters; one
thread) in three fresh processes: eager as the allocator comes, eager with ``MALLOC_MMAP_THRESHOLD_``
raised (every temporary from the heap), and compiled (torch.compile of ``optimizer.step``, inductor),
the median of 10 steps each after a warm-up. No target: it explains the compiled pairs of
runtime_overhead.py (BENCHMARKS.md).

Run: .venv/bin/python bench/optimizer_alloc.py   (about a minute)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

SHAPES = [(2048, 512), (2048,), (512, 2048), (512,), (512,), (512,)] * 4
STEPS = 10


def measure(compiled: bool) -> float:
    import torch
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.02) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(*p.shape, generator=gen) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()                      # the state, made in the first step
    step = torch.compile(opt.step) if compiled else opt.step
    step()
    step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[STEPS // 2]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(measure(sys.argv[2] == "compiled"))
        return 0
    runs = [("eager, allocator as it comes", "eager", {}),
            ("eager, temporaries from the heap", "eager", {"MALLOC_MMAP_THRESHOLD_": str(2 ** 32),
                                                           "MALLOC_TRIM_THRESHOLD_": str(2 ** 32)}),
            ("compiled (inductor), allocator as it comes", "compiled", {})]
    print(f"AdamW step over {sum(1 for _ in SHAPES)} tensors, one thread, median of {STEPS} steps")
    for label, mode, env in runs:
        out = subprocess.run([sys.executable, __file__, "--child", mode], env={**os.environ, **env},
                             capture_output=True, text=True, check=True)
        print(f"  {label:<44} {float(out.stdout.split()[-1]) * 1e3:6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
