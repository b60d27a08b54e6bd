r"""Expert parallelism: the experts of each mixture-of-experts layer split across ``e`` ranks.

The ``e`` ranks are data-parallel replicas (config.py): each routes its own ``T`` tokens,
sends every token's ``k`` assignments to the ranks holding their experts (dispatch
all-to-all), the experts run on what they receive, and the results come back (combine
all-to-all), the reverse pair in backward (GShard, Lepikhin et al. 2021; Megatron-Core's
all-to-all token dispatcher). Per MoE layer and micro-batch, with ``h`` the hidden size
(divided by what tensor/sequence parallelism shards the tokens by) and ``w`` bytes per
element, each all-to-all moves a send buffer of ``T k h w`` bytes per rank, of which
``(e - 1)/e`` leaves the rank (comm.py prices the pairwise exchange)::

    t_fwd = 2 t_a2a(lambda T k h w),      t_bwd = 2 t_a2a(lambda T k h w)

Load imbalance ``lambda`` (max over ranks of the rows received, over the mean): routing is not
uniform, and the busiest rank sets the pace of both the all-to-alls and the experts' compute,
whose time (the routed FLOPs, capture/moe.py) is multiplied by ``lambda`` too. A rank holds
``n = E / e`` experts; if each expert's share of the rows deviates from the mean with
coefficient of variation ``c`` (independently), a rank's load has ``c / sqrt(n)`` and the
busiest of ``e`` ranks is expected at::

    lambda(e) = 1 + c mu_e / sqrt(E / e),      mu_e = E[max of e standard normals]

(``mu_2 = 0.56``, ``mu_4 = 1.03``, ``mu_8 = 1.42``), so splitting experts finely costs more
imbalance than splitting them coarsely. ``DEFAULT_LOAD_CV = 0.15``: the per-domain expert
shares of Mixtral's routers (Jiang et al. 2024, Fig. 7) lie mostly within 0.10-0.16 of a
uniform 0.125. A model that caps each expert at ``C`` slots (dropping the overflow) never
exceeds its capacity factor ``C E / (T k)``. Without expert parallelism every rank runs all
experts on its own rows, which costs the same whatever the routing (``lambda = 1``).

Compute: a rank runs its ``E / e`` experts on the rows every rank routed to them, so each
expert GEMM multiplies ``e`` times more rows than without expert parallelism (the same FLOPs
in fewer, larger GEMMs, which the compute model's efficiency curve rewards:
:func:`local_experts`).

Memory: a rank holds ``E / e`` experts of each layer; their weights' gradients already sum
every rank's tokens (the all-to-all's backward brings them), so they are reduced (and ZeRO
sharded) only over the ``dp cp / e`` ranks holding the same experts (step_tail.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import numpy as np

from ..capture.opgraph import OpGraph, OpNode
from ..cluster import Cluster
from .comm import Collective, GroupPlacement, collective_time
from .tensor_parallel import TPLayout

DEFAULT_LOAD_CV = 0.15


def expert_params(graph: OpGraph) -> frozenset[str]:
    """Parameters stacked per expert (what expert parallelism divides by ``ep``)."""
    return frozenset(p for r in graph.moe for p in (r.gate_up, r.down))


def region_nodes(graph: OpGraph, layer: int) -> frozenset[str]:
    """The ops computed inside the experts of ``layer``'s MoE regions."""
    return frozenset(n for r in graph.moe if r.layer == layer for n in r.nodes)


def unsupported(graph: OpGraph, ep: int) -> str | None:
    """Why the graph cannot run with expert-parallel degree ``ep`` (None when it can)."""
    if ep == 1:
        return None
    if not graph.moe:
        return (f"ep={ep} splits the experts of mixture-of-experts layers, but the model has none "
                "(no experts module taking tokens, top-k ids and top-k weights was found): use ep=1")
    unknown = next((r for r in graph.moe if not r.activation), None)
    if unknown is not None:
        return (f"ep={ep} runs {unknown.module} as one expert-parallel call, but capture did not recognise the "
                "activation between its two products (a Hugging Face hidden_act at its default parameters): use ep=1")
    counts = sorted({r.num_experts for r in graph.moe})
    bad = [e for e in counts if e % ep]
    if bad:
        return (f"ep={ep} must divide every MoE layer's expert count, but {bad[0]} experts do not divide by {ep}: "
                f"choose ep among the divisors of {bad[0]}")
    return None


def dispatch_time(graph: OpGraph, layer: int, layout: TPLayout, sp: bool, scale: float, per: int,
                  imbalance: float, group: GroupPlacement | None, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of ``layer``'s dispatch and combine all-to-alls per micro-batch.

    ``scale``: the micro-batch over the captured batch (already divided by cp); ``per``: bytes
    per activation element."""
    if group is None or group.size == 1:
        return 0.0, 0.0
    fwd = 0.0
    for r in graph.moe:
        if r.layer != layer:
            continue
        tokens = r.tokens * scale / layout.shard(r.hidden_input, sp)
        nbytes = imbalance * tokens * r.top_k * r.hidden * per
        fwd += 2 * collective_time(Collective.ALL_TO_ALL, nbytes, group, cluster)
    return fwd, fwd


def local_experts(node: OpNode, ep: int) -> OpNode:
    """An expert op as one rank runs it under expert parallelism: ``E / ep`` experts, each on ``ep``
    times the rows (the same FLOPs; capture/moe.py gives region products their routed GEMM shape)."""
    g = node.gemm
    if g is None or ep == 1:
        return node
    return replace(node, gemm=replace(g, batch=max(1, g.batch // ep), m=g.m * ep))


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by quadrature of
    ``x n phi(x) Phi(x)^(n-1)``."""
    if n <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    phi = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))
    return float(np.trapezoid(x * n * phi * cdf ** (n - 1), x))


def imbalance(graph: OpGraph, layer: int, ep: int, load_cv: float) -> float:
    """Expected busiest expert rank's rows over the mean for ``layer``'s MoE regions (module docstring)."""
    worst = 1.0
    for r in graph.moe:
        if r.layer != layer or ep == 1:
            continue
        lam = 1.0 + load_cv * expected_max_normal(ep) / math.sqrt(r.num_experts / ep)
        if r.capacity is not None:
            lam = min(lam, max(1.0, r.capacity * r.num_experts / (r.tokens * r.top_k)))
        worst = max(worst, lam)
    return worst
