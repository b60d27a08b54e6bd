"""Pipeline schedule time and the layer-to-stage split used to estimate a given configuration.

Pipeline time per optimizer step, ``m`` micro-batches, ``p`` devices along the pipeline,
``x_i`` the work of device ``i`` per micro-batch (forward + backward + recompute +
tensor-parallel collectives + its p2p sends/receives), ``X = max_i x_i``:

- GPipe and 1F1B (Narayanan et al. 2021, section 2.2; both flush every step)::

      T = (m - 1) X + sum_i x_i        (= (m + p - 1) X when balanced: bubble (p-1)/m)

- interleaved 1F1B with ``v`` model chunks per device::

      T = (m + (p - 1) / v) X          (bubble (p-1)/(v m), p2p traffic v times larger)

The bubble reported is ``T - m X``: time the slowest device is not working.

Checked against an action-level simulation of each schedule (runtime/schedules.py, zero-time
p2p, forward : backward = 1 : 2): exact for balanced stages (every schedule) and for GPipe /
1F1B whenever the slowest stage is the last; otherwise an upper bound (a slow early stage lets
later stages catch up: stages of work (2, 1) with two micro-batches take 4.33, not 5).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..capture.opgraph import OpGraph
from ..errors import ConfigError


@dataclass(frozen=True)
class PipelineTime:
    total: float
    bubble: float


def pipeline_time(work: Sequence[float], micro_batches: int, schedule: str, virtual_stages: int) -> PipelineTime:
    """Seconds for ``micro_batches`` through devices doing ``work[i]`` seconds per micro-batch each."""
    if not work:
        raise ConfigError("a pipeline needs at least one stage")
    m, p, slowest = micro_batches, len(work), max(work)
    if p == 1:
        return PipelineTime(m * slowest, 0.0)
    if schedule == "interleaved":
        total = (m + (p - 1) / virtual_stages) * slowest
    else:
        total = (m - 1) * slowest + sum(work)
    return PipelineTime(total, total - m * slowest)


def even_partition(graph: OpGraph, chunks: int, layer_cost: Sequence[float]) -> list[list[int]]:
    """Megatron's split: the repeated blocks evenly over ``chunks`` model chunks, the layers
    before the first block on the first chunk and those after the last block on the last.

    When the blocks do not divide evenly, the contiguous split that minimises the most
    expensive chunk (by ``layer_cost``) is used instead.
    """
    n = len(graph.layers)
    if chunks > n:
        raise ConfigError(f"{chunks} pipeline chunks (pp x virtual_stages) but the model has only {n} layers "
                          f"({', '.join(l.name for l in graph.layers[:6])}{'...' if n > 6 else ''}): lower pp or "
                          "virtual_stages")
    blocks = [l.index for l in graph.layers if l.is_block]
    if chunks == 1:
        return [list(range(n))]
    if blocks and len(blocks) % chunks == 0 and blocks == list(range(blocks[0], blocks[-1] + 1)):
        per = len(blocks) // chunks
        parts = [blocks[i * per:(i + 1) * per] for i in range(chunks)]
        parts[0] = list(range(0, blocks[0])) + parts[0]
        parts[-1] = parts[-1] + list(range(blocks[-1] + 1, n))
        return parts
    return balanced_partition(layer_cost, chunks)


def balanced_partition(cost: Sequence[float], parts: int) -> list[list[int]]:
    """Contiguous split of ``cost`` into ``parts`` non-empty runs minimising the largest run sum
    (the classic linear-partition DP, O(n^2 parts)): ``best[k][j]``, the least largest run of the
    first ``j`` layers in ``k`` runs, is ``min_i max(best[k-1][i], prefix[j] - prefix[i])``, the
    first minimising ``i`` kept. Each ``k`` is one numpy reduction over the (i, j) matrix (the
    search asks for many splits: a Python triple loop was half the plan time of a 96-layer model)."""
    return [list(run) for run in _partition(tuple(float(c) for c in cost), parts)]


@functools.lru_cache(maxsize=4096)
def _partition(cost: tuple[float, ...], parts: int) -> tuple[range, ...]:
    n = len(cost)
    pre = np.concatenate([[0.0], np.cumsum(cost)])
    across = pre[:, None] - pre[None, :]           # across[j, i] = prefix[j] - prefix[i], a run i..j-1
    across[_not_after(n + 1)] = np.inf             # a run is non-empty: i < j
    width = n - parts + 1                          # the ends (and starts) the k-th run may take
    best = np.full(width, np.inf)                  # best[k - 1] at its possible starts k - 1 ...
    best[0] = 0.0
    firsts = []
    for k in range(1, parts + 1):
        # the k-th run ends at j in [k, n - (parts - k)] and starts at i in [k - 1, j): rows j, columns i
        cand = np.maximum(best[None, :], across[k:k + width, k - 1:k - 1 + width])
        firsts.append(cand.argmin(axis=1))        # the first i reaching the least value
        best = cand.min(axis=1)                   # best[k] at its ends k ..., the next run's starts
    bounds, j = [], n
    for k in range(parts, 0, -1):
        i = int(firsts[k - 1][j - k]) + k - 1
        bounds.append(range(i, j))
        j = i
    return tuple(bounds[::-1])


@functools.lru_cache(maxsize=None)
def _not_after(n: int) -> np.ndarray:
    """``mask[j, i]``: ``i >= j`` (read-only)."""
    mask = np.triu(np.ones((n, n), dtype=bool))
    mask.setflags(write=False)
    return mask
