"""What the global batch ruled out: the note a plan carries when its batch size, not the model or the
devices, capped data parallelism.

Data parallelism splits the global batch ``B`` into ``dp`` equal parts, so ``dp`` must divide ``B``
(space.py). A batch with few small factors (63 = 3^2 x 7 on 8 devices) leaves only the meshes with a
small ``dp``: more tensor or pipeline parallelism, each slower per device. When the chosen plan's ``dp``
is the largest the batch allows and the devices, the model and the pins allow a larger one, the same
search runs again at the nearest larger batch that allows the largest degree ruled out (a multiple of
it), with ``dp`` pinned to that degree: the sharding layouts are reused and only the meshes of that
``dp`` are searched, a small share of the space (a free search there would repeat the whole search to
answer one question). When that plan moves more samples per second than the chosen one, the batch did
constrain the choice, and the plan's note says so: the batch's factors, the degrees it allowed and
ruled out, and the plan and MFU at the nearby batch. Without that search (under a ``time_limit``), or
when nothing fits with that ``dp``, the note states the constraint alone.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..errors import InfeasiblePlanError
from ..plan import Plan
from .space import data_parallel_degrees


def factors(n: int) -> str:
    """``63 -> "3^2 x 7"``, ``64 -> "2^6"``, ``7 -> "7 (prime)"``, ``1 -> "1"``."""
    out, p, rest = [], 2, n
    while p * p <= rest:
        k = 0
        while rest % p == 0:
            rest, k = rest // p, k + 1
        if k:
            out.append(f"{p}^{k}" if k > 1 else str(p))
        p += 1
    if rest > 1:
        out.append(str(rest))
    if n > 1 and out == [str(n)]:
        return f"{n} (prime)"
    return " x ".join(out) or str(n)


def batch_notes(graph: OpGraph, cluster: Cluster, global_batch_size: int, fixed: Mapping[str, Any], best: Plan,
                solve_at: Callable[[int, int], Plan] | None) -> tuple[str, ...]:
    """The note (none, or one) saying the global batch capped ``best``'s data parallelism. ``solve_at(b, dp)``
    is the same search at global batch ``b`` with ``dp`` pinned (None: do not search again, state the
    constraint only)."""
    if "dp" in fixed:
        return ()    # the user chose dp; a pin the batch rules out is refused before any plan exists
    degrees = data_parallel_degrees(graph, cluster, fixed)
    allowed = sorted(d for d in degrees if global_batch_size % d == 0)
    larger = sorted(d for d in degrees if global_batch_size % d and d > best.config.dp)
    if not allowed or best.config.dp != allowed[-1] or not larger:
        return ()
    most = larger[-1]
    above = (global_batch_size // most + 1) * most
    below = global_batch_size // most * most
    nearby = f"{above} (or {below}; multiples of {most})" if below > 0 else f"{above} (a multiple of {most})"
    fact = (f"global batch {global_batch_size} = {factors(global_batch_size)} allows data parallelism "
            f"dp={', '.join(map(str, allowed))} only (dp must divide the global batch; these {cluster.devices} "
            f"devices also allow dp={', '.join(map(str, larger))}): a global batch of {nearby} allows dp up to "
            f"{most}")
    try:
        other = None if solve_at is None else solve_at(above, most)
    except InfeasiblePlanError:
        other = None
    if other is None:
        return (fact,)
    if other.throughput <= best.throughput:
        return ()    # more data parallelism would not be faster: the batch was not the limit
    return (f"{fact}, and at {above} the plan with dp={most} is {other.config.short()} at {other.mfu * 100:.1f}% "
            f"MFU against {best.mfu * 100:.1f}% here ({other.throughput / best.throughput:.2g}x the samples/s)",)
