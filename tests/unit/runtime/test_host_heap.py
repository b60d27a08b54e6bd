"""runtime/host_heap.py: a CPU rank that keeps its freed heap memory reuses a step's buffers instead of
faulting their pages in again every step (counted in fresh processes: malloc's settings are per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autopar.runtime import host_heap

STEPS = r"""
import resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    from autopar.runtime.host_heap import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()   # set, and once
torch.manual_seed(0)
h = 256
model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(4, 64, h)
def step():
    model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_step(mode: str) -> float:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=root), timeout=120)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_heap.platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
def test_a_step_reuses_its_buffers_where_the_default_heap_faults_them_in_again():
    plain, kept = _faults_per_step("plain"), _faults_per_step("keep")
    assert plain > 100, f"the default heap faulted only {plain} pages a step: the test no longer shows the effect"
    assert kept <= plain / 10, (kept, plain)

