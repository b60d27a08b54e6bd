"""Paired timing of two step functions on the same ranks: ours and a torch-native program alternate
step by step, and the ratio is the median over pairs of (ours / theirs beside it), which cancels
most of a shared VM's drift (the runtime and host overhead benches). Which of the two runs first in
a pair alternates, so that neither always pays for what the other leaves behind (its garbage, the
caches it evicts)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch.distributed as dist


def timed(step: Callable[[], object]) -> float:
    """Seconds of one step, between barriers when there are several ranks (the slowest rank's time)."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    if several:
        dist.barrier()
    start = time.perf_counter()
    step()
    if several:
        dist.barrier()
    return time.perf_counter() - start


def paired(mine: Callable[[], object], theirs: Callable[[], object], steps: int, warmup: int) -> dict[str, float]:
    """``{"ours", "native"}``: median seconds per step of each; ``"ratio"``: the median paired ratio."""
    for _ in range(warmup):
        mine()
        theirs()
    a, b = [], []
    for k in range(steps):
        if k % 2:
            b.append(timed(theirs))
            a.append(timed(mine))
        else:
            a.append(timed(mine))
            b.append(timed(theirs))
    return {"ours": statistics.median(a), "native": statistics.median(b),
            "ratio": statistics.median(x / y for x, y in zip(a, b))}
