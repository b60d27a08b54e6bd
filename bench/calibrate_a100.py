"""Fit the A100 preset's GEMM efficiency (ONE constant for every row) on the public calibration set.

Scans ``matmul_efficiency`` and reports, for each value, the mean and worst relative error of
predicted TFLOP/s per GPU over Megatron SC21 Table 1 and the Megatron README TP table
(bench/megatron_table1.py), then the value minimising the mean squared log error. The
chosen value is written by hand into autopar/cluster.py (A100_MATMUL_EFFICIENCY).
Run: .venv/bin/python bench/calibrate_a100.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math

import autopar
import megatron_table1 as mt

_from_spec = autopar.Cluster.from_spec.__func__


def errors_with(efficiency: float) -> list[float]:
    def patched(cls, spec, **kw):
        cluster = _from_spec(cls, spec, **kw)
        return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, matmul_efficiency=efficiency))
    autopar.Cluster.from_spec = classmethod(patched)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return mt.run_table1(mt.TABLE1) + mt.run_readme_tp()
    finally:
        autopar.Cluster.from_spec = classmethod(_from_spec)


def main() -> None:
    print(f"{'matmul_eff':>10} {'mean err':>9} {'worst':>7} {'msle':>9}")
    best = None
    for eff in (0.62, 0.64, 0.66, 0.68, 0.70, 0.72, 0.75):
        errs = errors_with(eff)
        msle = sum(math.log1p(e) ** 2 for e in errs) / len(errs)
        worst = max(errs, key=abs)
        print(f"{eff:>10.2f} {sum(errs) / len(errs) * 100:>+8.1f}% {worst * 100:>+6.1f}% {msle:>9.5f}")
        if best is None or msle < best[1]:
            best = (eff, msle)
    print(f"best matmul_efficiency: {best[0]:.2f}")


if __name__ == "__main__":
    main()
