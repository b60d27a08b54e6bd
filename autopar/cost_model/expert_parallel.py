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

Load imbalance ``lambda`` (max over ranks of the tokens received, over the mean): routing is
not uniform, and the busiest rank sets the pace of both the all-to-alls and the experts'
compute, whose time (the routed FLOPs, capture/moe.py) is multiplied by ``lambda`` too.
The default ``DEFAULT_IMBALANCE = 1.2`` is the load a router trained with an auxiliary
balancing loss keeps its busiest expert within: Switch Transformer (Fedus et al. 2022)
trains at capacity factor 1.25 dropping under 1% of tokens, i.e. the busiest expert rarely
receives more than ~1.2x the mean. A model that caps experts at capacity ``C`` (it drops the
rest) never exceeds ``C E / (T k)``; set the imbalance accordingly
(``autopar.plan(..., expert_imbalance=)``).

Compute: a rank runs its ``E / e`` experts on the rows every rank routed to them, so each
expert GEMM multiplies ``e`` times more rows than without expert parallelism (the same FLOPs
in fewer, larger GEMMs, which the compute model's efficiency curve rewards:
:func:`local_experts`).

Memory: a rank holds ``E / e`` experts of each layer; their weights' gradients already sum
every rank's tokens (the all-to-all's backward brings them), so they are reduced (and ZeRO
sharded) only over the ``dp cp / e`` ranks holding the same experts (estimator.py).
"""

from __future__ import annotations

from dataclasses import replace

from ..capture.opgraph import OpGraph, OpNode
from ..cluster import Cluster
from .comm import Collective, GroupPlacement, collective_time
from .tensor_parallel import TPLayout

DEFAULT_IMBALANCE = 1.2


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
