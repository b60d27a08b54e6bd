"""Paired timing of two step functions on the same ranks: ours and a torch-native program alternate
step by step, and the ratio is taken over pairs of (ours / theirs beside it), which cancels most of
a shared VM's drift (the runtime and host overhead benches). Which of the two runs first in a pair
alternates, so that neither always pays for what the other leaves behind (its garbage, the caches
it evicts, a peer's late wake-up), and the ratio is the geometric mean of the two orders' median
ratios: the step that runs second pays up to 15% on this VM at tiny sizes (zero=3, 60 pairs: 0.91
with ours first, 1.14 second), so the ratios of all pairs have two modes, and their median falls
on either side of the gap between them from one run to the next; each order's median is taken
within one mode, and the geometric mean cancels the order's factor, which is the same either way."""

from __future__ import annotations

import math
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
    """``{"ours", "native"}``: median seconds per step of each; ``"ratio"``: the paired ratio, the geometric
    mean of the median ratio with ours first and with theirs first (``"first"``, ``"second"``); ``steps``
    pairs, an even number."""
    if steps < 2 or steps % 2:
        raise ValueError(f"steps={steps}: an even number of pairs, half with each program first")
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
    ratios = [x / y for x, y in zip(a, b)]
    first, second = statistics.median(ratios[0::2]), statistics.median(ratios[1::2])
    return {"ours": statistics.median(a), "native": statistics.median(b), "ratio": math.sqrt(first * second),
            "first": first, "second": second}
