"""Device fit: how well the fitted compute model predicts this CPU's matmuls, on the measured shapes
and on shapes it never saw.

Measures this CPU with ``autopar.profiler.device.measure_device`` (1 thread, fp32, the ``quick``
and the ``normal`` budget), fits it with ``fit_device`` and prints, per budget:

- the fit's own median / max relative error on the measured matmuls, convolutions and attention;
- the relative error on held-out matmuls: 8 (m, n, k) shapes none of the budgets measures, from
  skinny to square, timed with ``median_time`` (7 repeats) and predicted with the cost model's
  ``gemm_efficiency`` exactly as the planner prices a Gemm node.

Target: held-out median within 25%, max within 2x, with the quick budget (what ``autopar profile
--quick`` runs). These are timings of a shared VM: run it on an otherwise idle machine; it prints
how much CPU other processes used while it measured (the profile's conditions, autopar/conditions.py). (The unit tests check the fit on synthetic
profiles, where the answer is known, and only the structure of a real measurement: a test must not
pass or fail with the machine's speed.)

Run: .venv/bin/python bench/device_fit.py [--budgets quick,normal]   (about 10 s)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autopar.capture.opgraph import Gemm  # noqa: E402
from autopar.cost_model.compute import gemm_efficiency  # noqa: E402
from autopar.profiler.device import measure_device  # noqa: E402
from autopar.profiler.device_fit import fit_device  # noqa: E402
from autopar.profiler.host import median_time, torch_threads  # noqa: E402

HELD_OUT = [(448, 320, 576), (96, 1024, 160), (1536, 64, 512), (200, 200, 200),
            (768, 768, 96), (64, 2048, 2048), (1000, 1000, 24), (352, 1408, 704)]


def held_out(device) -> list[tuple[tuple[int, int, int], float, float]]:
    rows = []
    for m, n, k in HELD_OUT:
        a, b = torch.randn(m, k), torch.randn(k, n)
        with torch_threads(1):
            measured = median_time(lambda: a @ b, torch.device("cpu"), warmup=2, repeats=7)
        predicted = 2.0 * m * n * k / (device.peak("fp32") * gemm_efficiency(device, Gemm(1, m, n, k))) \
            + device.kernel_overhead
        rows.append(((m, n, k), measured, predicted))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="quick,normal")
    args = parser.parse_args()
    print("| budget | measure (s) | fit: median / max rel. err. (n) | conv median | attention median "
          "| held-out median / max rel. err. | other CPU used |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    detail = []
    for budget in args.budgets.split(","):
        start = time.perf_counter()
        profile = measure_device(torch.device("cpu"), threads=1, dtypes=("fp32",), budget=budget, progress=False)
        seconds = time.perf_counter() - start
        device, report = fit_device(profile)
        rows = held_out(device)
        conditions = profile.conditions     # what the measurement ran under (autopar/conditions.py)
        errs = [abs(p - m) / m for _, m, p in rows]
        print(f"| {budget} | {seconds:.1f} | {report.median_relative_error:.1%} / {report.max_relative_error:.1%} "
              f"({report.samples}) | {report.conv.median:.1%} | {report.attention.median:.1%} "
              f"| {statistics.median(errs):.1%} / {max(errs):.1%} | {conditions.other_load:.2f} cores"
              f"{' (noisy)' if conditions.noisy else ''} |")
        detail.append((budget, device, rows))
    for budget, device, rows in detail:
        print(f"\n{budget}: peak fp32 {device.peak('fp32') / 1e9:.1f} GFLOP/s, e_max {device.matmul_efficiency:.3f}, "
              f"d_half {device.matmul_half_dim:.1f}, kernel overhead {device.kernel_overhead * 1e6:.1f} us")
        for (m, n, k), measured, predicted in rows:
            print(f"  {m:>5} x {n:>5} x {k:>5}: measured {measured * 1e3:8.3f} ms, predicted {predicted * 1e3:8.3f} ms "
                  f"({predicted / measured - 1:+.0%})")


if __name__ == "__main__":
    main()
