"""runtime/host_heap.py: a CPU rank that keeps its freed heap memory reuses a step's buffers instead of
faulting their pages in again every step (counted in a fresh process, then with glibc's default thresholds
back: malloc's settings are per process, and a test process may have set them already)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autopar.runtime import host_heap

STEPS = r"""
import ctypes, resource, torch
from autopar.runtime import host_heap
assert host_heap.keep_freed_memory() and host_heap.keep_freed_memory()   # set, and once
torch.set_num_threads(1)
torch.manual_seed(0)
h = 256
model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(4, 64, h)
def step():
    model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
def faults_per_step():
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
# the fewest of three counts: this VM's memory reclaim (DAMON) now and then pages a kept buffer out, and its
# refault is the kernel's, not the heap's
kept = min(faults_per_step() for _ in range(3))
libc = ctypes.CDLL("libc.so.6")   # glibc's defaults back: 128 KiB for both thresholds
libc.mallopt(host_heap.M_MMAP_THRESHOLD, 128 << 10)
libc.mallopt(host_heap.M_TRIM_THRESHOLD, 128 << 10)
print(faults_per_step(), kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_heap.platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
def test_a_step_reuses_its_buffers_where_the_default_heap_faults_them_in_again():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=root), timeout=300)
    plain, kept = map(float, out.stdout.split()[-2:])
    assert plain > 100, f"the default heap faulted only {plain} pages a step: the test no longer shows the effect"
    assert kept <= plain / 10, (kept, plain)
