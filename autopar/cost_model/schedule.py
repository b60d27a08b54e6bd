"""Pipeline schedule time and the layer-to-stage split used to estimate a given configuration.

Pipeline time per optimizer step, ``m`` micro-batches, ``p`` devices along the pipeline,
``x_i`` the work of device ``i`` per micro-batch (forward + backward + recompute +
tensor-parallel collectives + its p2p sends/receives), ``X = max_i x_i``:

- GPipe and 1F1B (Narayanan et al. 2021, section 2.2; both flush every step)::

      T = (m - 1) X + sum_i x_i        (= (m + p - 1) X when balanced: bubble (p-1)/m)

- interleaved 1F1B with ``v`` model chunks per device::

      T = (m + (p - 1) / v) X          (bubble (p-1)/(v m), p2p traffic v times larger)

- the zero-bubble schedules (Qi et al., ICLR 2024), device ``i``'s micro-batch split into its
  forward ``F_i``, input-gradient ``I_i`` and weight-gradient ``W_i`` passes (``x_i = F_i + I_i + W_i``).
  ZB-H1, for ``m >= p``::

      T = m X + (p - 1) / p sum_i b_i,      b_i = max(F_i + I_i - W_i, F_i, I_i)

  On even stages this is the action-level simulation's makespan exactly, and the published
  ``(p - 1)(F + I - W)`` whenever ``W <= min(F, I)``, as for GEMM-bound layers, whose weight
  gradient costs about their forward (Qi et al. Table 2). On uneven stages it is one of several
  forms that agree on even ones (the slowest device's ``b``, or the sum but the slowest's): the
  mean is the one the stage DP can minimise exactly (solver/stages.py), and it tracks the
  simulation within 2% (median; 16% at worst) on random uneven stages where the slowest
  device's ``b`` misses by 4% (29%).
  ZB-V (two chunks a device, each half of ``F``, ``I``, ``W``) has no closed form for unequal
  passes: its bubble is the simulation's of even stages (runtime/schedules.py) with the slowest
  device's shares (rounded to 0.1%, cached), which for ``m >= 2p`` no longer depends on ``m``
  (simulated at ``min(m, 2p)``). At ``F = I = W`` it is ``(p - 1) F / 2``: the pipeline's fill,
  which each device's own span does not see (the published "zero bubble" counts from each
  device's first pass, as if no step ended on a synchronisation) but the step's gradient
  reduction waits for. ZB-H1 with ``m < p`` is simulated likewise.
  DualPipeV (``m >= 2p``; its steady pairs run a whole backward, so a recomputed forward reruns once
  there, ``x_i`` counting one rerun ``r_i``, and twice in the passes its warm-up and drain split, whose
  ``W`` pays the second) is the simulation of its order likewise: ``T = m X + bubble(2p)``, each
  micro-batch past ``2p`` one more steady pair of exactly ``x``. Its published bubble,
  ``(PP/2 - 1)(F&B + B - 3W)``, prices the F&B pair at the overlapped time DeepSeek's kernels reach;
  torch's runtime, and autopar's, run the pair's two passes one after the other, which is what the
  simulation prices (the overlap that hides one micro-batch's all-to-all under the other's compute
  is neither run nor priced).

The bubble reported is ``T - m X``: time the slowest device is not working.

Checked against an action-level simulation of each schedule (runtime/schedules.py, zero-time
p2p, forward : backward = 1 : 2): exact for balanced stages (every schedule) and for GPipe /
1F1B whenever the slowest stage is the last; otherwise an upper bound (a slow early stage lets
later stages catch up: stages of work (2, 1) with two micro-batches take 4.33, not 5).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..capture.opgraph import OpGraph
from ..config import SPLIT_BACKWARD, V_SHAPED
from ..errors import ConfigError
from ..runtime.schedules import makespan


@dataclass(frozen=True)
class PipelineTime:
    total: float
    bubble: float


def pipeline_time(work: Sequence[float], micro_batches: int, schedule: str, virtual_stages: int,
                  passes: Sequence[tuple[float, float, float]] | None = None,
                  rerun: Sequence[float] | None = None) -> PipelineTime:
    """Seconds for ``micro_batches`` through devices doing ``work[i]`` seconds per micro-batch each.
    ``passes[i]``: device ``i``'s (forward, input-gradient, weight-gradient) seconds of ``work[i]``, which
    the zero-bubble schedules need; without them those are bounded below by ``m X`` (no bubble).
    ``rerun[i]``: DualPipeV's, the seconds of one rerun of device ``i``'s recomputed forward, which a split
    pass pays again (default none)."""
    if not work:
        raise ConfigError("a pipeline needs at least one stage")
    m, p, slowest = micro_batches, len(work), max(work)
    if p == 1:
        return PipelineTime(m * slowest, 0.0)
    if schedule in SPLIT_BACKWARD:
        bubble = 0.0
        if passes is not None and slowest > 0:
            if schedule == "zbh1" and m >= p:
                bubble = (p - 1) / p * sum(zbh1_drain(*x) for x in passes)
            else:
                d = max(range(p), key=lambda d: work[d])
                f, _, w = passes[d]
                again = rerun[d] if rerun is not None and schedule == "dualpipev" else 0.0
                bubble = slowest * split_bubble(schedule, p, min(m, 2 * p), round(f / slowest, 3),
                                                round(w / slowest, 3), round(again / slowest, 3))
        return PipelineTime(m * slowest + bubble, bubble)
    if schedule == "interleaved":
        total = (m + (p - 1) / virtual_stages) * slowest
    else:
        total = (m - 1) * slowest + sum(work)
    return PipelineTime(total, total - m * slowest)


def zbh1_drain(forward: float, input_grad: float, weight_grad: float) -> float:
    """A device's share of ZB-H1's bubble per pipeline stage, ``b`` of the module docstring."""
    return max(forward + input_grad - weight_grad, forward, input_grad)


AFFINE_FROM = {"zbv": 2}
"""From how many devices on a schedule's bubble at ``m = 2p`` is affine in ``p`` (tests/unit/cost_model/
test_zero_bubble.py): two small simulations give it for any ``p``. ZB-V's is; DualPipeV's is not (its
slope grows where the deferred weight passes start to pile into the drain, at some ``p`` that depends on
the shares), so it is simulated at its ``p`` (runtime/schedules.makespan: 6 ms at 64 devices)."""


@functools.lru_cache(maxsize=65536)
def split_bubble(schedule: str, p: int, m: int, forward: float, weight: float, rerun: float = 0.0) -> float:
    """The bubble of zero-bubble ``schedule`` over ``p`` even devices and ``m`` micro-batches, in units of
    one device's work per micro-batch, of which ``forward`` is the forward and ``weight`` the
    weight-gradient share (the rest the input gradient; a V-shaped schedule's chunk does half of each).
    DualPipeV: a whole backward is the input and weight gradients' shares together, and a split pass's
    ``W`` also reruns the recomputed forward, ``rerun`` of the work (the whole backward reruns it once)."""
    start = AFFINE_FROM.get(schedule)
    if start is not None and m == 2 * p and p > start + 1:
        low, high = (split_bubble(schedule, k, 2 * k, forward, weight, rerun) for k in (start, start + 1))
        return low + (p - start) * (high - low)
    v = 2 if schedule in V_SHAPED else 1
    share = {"F": forward / v, "W": (weight + rerun) / v, "I": max(0.0, 1.0 - forward - weight) / v,
             "B": max(0.0, 1.0 - forward) / v}
    return makespan(schedule, p, m, v, share) - m


def even_partition(graph: OpGraph, chunks: int, layer_cost: Sequence[float], v_shape: bool = False
                   ) -> tuple[range, ...]:
    """Megatron's split: the repeated blocks evenly over ``chunks`` model chunks, the layers
    before the first block on the first chunk and those after the last block on the last; each
    chunk a run of layer indices.

    When the blocks do not divide evenly, the contiguous split that minimises the most
    expensive chunk (by ``layer_cost``) is used instead. ``v_shape`` (ZB-V: device ``d`` holds chunks
    ``d`` and ``chunks - 1 - d``, so the layers before the blocks and after them share device 0):
    :func:`v_partition`.
    """
    return even_partitions(graph, chunks, [tuple(map(float, layer_cost))], v_shape)[0]


def even_partitions(graph: OpGraph, chunks: int, layer_costs: Sequence[tuple[float, ...]], v_shape: bool = False
                    ) -> list[tuple[range, ...]]:
    """:func:`even_partition` of each of ``layer_costs`` (the search splits one mesh's layers by each recompute
    mode's costs: the balanced splits of the same length are solved together, :func:`balanced_partitions`)."""
    n = len(graph.layers)
    blocks = [l.index for l in graph.layers if l.is_block]
    run = bool(blocks) and blocks == list(range(blocks[0], blocks[-1] + 1))   # the blocks one contiguous run
    if v_shape:
        if len(blocks) < chunks or not run:
            return balanced_partitions(layer_costs, chunks)
        return [v_partition(n, blocks[0], len(blocks), chunks, cost) for cost in layer_costs]
    if chunks > n:
        raise ConfigError(f"{chunks} pipeline chunks (pp x virtual_stages) but the model has only {n} layers "
                          f"({', '.join(l.name for l in graph.layers[:6])}{'...' if n > 6 else ''}): lower pp or "
                          "virtual_stages")
    if chunks == 1:
        return [(range(n),)] * len(layer_costs)
    if run and len(blocks) % chunks == 0:
        per, first = len(blocks) // chunks, blocks[0]
        starts = [0] + [first + k * per for k in range(1, chunks)] + [n]
        return [tuple(range(a, b) for a, b in zip(starts, starts[1:]))] * len(layer_costs)
    return balanced_partitions(layer_costs, chunks)


def v_partition(layers: int, first: int, blocks: int, chunks: int, layer_cost: Sequence[float]) -> tuple[range, ...]:
    """ZB-V's split of ``layers`` layers whose ``blocks`` repeated blocks run from layer ``first`` into
    ``chunks = 2p`` runs, device ``d`` holding runs ``d`` and ``2p - 1 - d``: the layers before the first
    block on run 0 and those after the last on run ``2p - 1`` (both device 0's), and the blocks dealt so
    that the devices' costs are as even as whole blocks allow: each device gets two blocks, then each
    further block goes to the device with the least cost so far (the blocks' mean cost each; optimal for
    equal blocks; the first such device on a tie), and a device's blocks are split between its two runs,
    the extra one to its second (whose passes it holds fewer of)."""
    p, last = chunks // 2, first + blocks - 1
    mean = sum(layer_cost[i] for i in range(first, last + 1)) / blocks
    edges = sum(layer_cost[i] for i in range(layers) if i < first or i > last)
    held = [2] * p
    load = [(2 * mean + (edges if d == 0 else 0.0), d) for d in range(p)]
    heapq.heapify(load)
    for _ in range(blocks - 2 * p):
        cost, d = heapq.heappop(load)
        held[d] += 1
        heapq.heappush(load, (cost + mean, d))
    count = [0] * chunks
    for d in range(p):
        count[d], count[chunks - 1 - d] = held[d] // 2, held[d] - held[d] // 2
    starts, at = [0], first
    for c in range(chunks - 1):
        at += count[c]
        starts.append(at)
    starts.append(layers)
    return tuple(range(a, b) for a, b in zip(starts, starts[1:]))


_SPLITS: dict[tuple[tuple[float, ...], int], tuple[range, ...]] = {}   # balanced_partitions' answers (the search asks again)


def balanced_partitions(costs: Sequence[tuple[float, ...]], parts: int) -> list[tuple[range, ...]]:
    """The contiguous split of each of ``costs`` (of one length) into ``parts`` non-empty runs that minimises the
    largest run sum (the classic linear-partition DP, O(n^2 parts)): ``best[k][j]``, the least
    largest run of the first ``j`` layers in ``k`` runs, is ``min_i max(best[k-1][i], prefix[j] - prefix[i])``,
    the first minimising ``i`` kept. Each ``k`` is one numpy reduction over the (cost, j, i) array of the splits
    not answered before (a Python triple loop was half the plan time of a 96-layer model), the costs of one
    call (a mesh's recompute modes) solved together."""
    todo = list(dict.fromkeys(c for c in costs if (c, parts) not in _SPLITS))
    if todo:
        n = len(todo[0])
        pre = np.concatenate([np.zeros((len(todo), 1)), np.cumsum(np.array(todo), axis=1)], axis=1)
        across = pre[:, :, None] - pre[:, None, :]     # across[c, j, i] = prefix[j] - prefix[i], a run i..j-1
        across[:, _not_after(n + 1)] = np.inf          # a run is non-empty: i < j
        width = n - parts + 1                          # the ends (and starts) the k-th run may take
        best = np.full((len(todo), width), np.inf)     # best[c, k - 1] at its possible starts k - 1 ...
        best[:, 0] = 0.0
        firsts = []
        for k in range(1, parts + 1):
            # the k-th run ends at j in [k, n - (parts - k)] and starts at i in [k - 1, j): rows j, columns i
            cand = np.maximum(best[:, None, :], across[:, k:k + width, k - 1:k - 1 + width])
            firsts.append(cand.argmin(axis=2))        # the first i reaching the least value
            best = cand.min(axis=2)                   # best[c, k] at its ends k ..., the next run's starts
        for c, cost in enumerate(todo):
            bounds, j = [], n
            for k in range(parts, 0, -1):
                i = int(firsts[k - 1][c, j - k]) + k - 1
                bounds.append(range(i, j))
                j = i
            if len(_SPLITS) >= 65536:
                _SPLITS.clear()
            _SPLITS[(cost, parts)] = tuple(bounds[::-1])
    return [_SPLITS[(c, parts)] for c in costs]


@functools.lru_cache(maxsize=None)
def _not_after(n: int) -> np.ndarray:
    """``mask[j, i]``: ``i >= j`` (read-only)."""
    mask = np.triu(np.ones((n, n), dtype=bool))
    mask.setflags(write=False)
    return mask
