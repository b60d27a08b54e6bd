r"""Context parallelism: each sequence split across ``c`` ranks, keys and values passed around a ring.

Layout (Megatron-LM / torchtitan "head-tail" load balancing): the ``S`` tokens are cut into
``2c`` chunks and rank ``r`` holds chunks ``r`` and ``2c - 1 - r``. Under a causal mask query
``i`` attends to ``i + 1`` keys, so chunk ``j`` of size ``S/2c`` carries work proportional to
``2j + 1``; rank ``r`` gets ``(2r + 1) + (2(2c - 1 - r) + 1) = 4c`` units whatever ``r`` is, an
exactly balanced ``1/c`` of the attention.

Compute and memory. Every other op is token-wise along the sequence (projections, norms,
MLPs, the loss of each token), so on a rank it costs what ``1/c`` of the tokens cost, as a
micro-batch ``c`` times smaller would (batch-independent constants a layer saves, such as rotary
tables, are counted whole: the runtime slices them, so this slightly overestimates); the attention of ``S/c`` queries against all ``S`` keys
is ``1/c`` of the whole too (balanced above). Activations divide by ``c`` likewise. The cost
model therefore prices a layer under context parallelism at the micro-batch scale divided
by ``c`` (layer_cost.py), and adds the ring's communication here.

Ring (Liu et al. 2023, Ring Attention; Megatron-Core's ``cp_comm_type="p2p"``): an attention op
runs in ``c`` steps; at each, the rank computes its queries against the key/value block in
hand (``A / c`` of the op's time ``A``) while it sends that block on and receives the next
(``K`` bytes: ``k`` and ``v`` of ``S/c`` tokens). ``c - 1`` transfers, each hidden behind one
block's compute up to the link's overlap ``o`` (1 for NCCL, measured for gloo, whose threads
share the cores); the hidden part still slows that compute by ``k`` per second
(``Device.overlap_slowdown``)::

    exposed_fwd = (c - 1) (t(K) - (1 - k) min(t(K), o A_f / c))
    exposed_bwd = (c - 1) (t(2K) - (1 - k) min(t(2K), o A_b / c))

The backward passes the blocks again together with their accumulating gradients (twice the
bytes) under the backward's attention work ``A_b``.

The attention itself runs as ``c`` block kernels of ``S/c`` queries by ``S/c`` keys (each
``1/c^2`` of the whole op's FLOPs and ``1/c`` of its bytes), priced by the compute model at
that size, so short sequences pay for blocks too small to fill the device and for ``c``
launches; and ``c - 1`` merges of the running output with each block's (log-sum-exp
rescaling: read both, write one, ``3 |out|`` bytes; twice that backward, for ``dq`` and the
travelling ``dk, dv``). ``t`` is the p2p time over the context-
parallel group's link (comm.py). Ops that are not token-wise along the sequence and are not
attention (a pooled classifier, a shifted label) are gathered whole by the runtime; the
cost model does not price those rare small gathers.
"""

from __future__ import annotations

from dataclasses import replace

from ..capture.opgraph import OpGraph, OpNode
from ..cluster import Cluster
from .comm import Collective, GroupPlacement, collective_time
from .compute import ComputeModel, OpTime


def sequence_length(graph: OpGraph) -> int | None:
    """The sequence length attention runs over (the query's dim -2), or None without fused attention."""
    nodes = graph.fused_attention
    if not nodes:
        return None
    shape = nodes[0].outputs[0].shape
    return shape[-2] if len(shape) >= 2 else None


def unsupported(graph: OpGraph, cp: int) -> str | None:
    """Why the graph cannot run with context-parallel degree ``cp`` (None when it can)."""
    if cp == 1:
        return None
    eager = next(iter(graph.unfused_attention), None)
    if eager is not None:
        return (f"context parallelism needs fused attention (F.scaled_dot_product_attention), but the model "
                f"computes attention with explicit ops ({eager.name} in {eager.module_path or 'the model'}): "
                "switch it to SDPA (Hugging Face: attn_implementation='sdpa') or use cp=1")
    dropping = next((r for r in graph.moe if r.capacity is not None), None)
    if dropping is not None:
        return (f"context parallelism cannot run {dropping.module}: its experts drop what overflows a capacity of "
                f"{dropping.capacity} slots, which depends on the whole sequence, not on one rank's part: use cp=1 "
                "or a dropless MoE (capacity_factor=None)")
    unknown = next((r for r in graph.moe if not r.activation), None)
    if unknown is not None:
        return (f"context parallelism runs {unknown.module} as one call on each rank's tokens, but capture did not "
                "recognise the activation between its two products (a Hugging Face hidden_act at its default "
                "parameters): use cp=1")
    seq = sequence_length(graph)
    if seq is None:
        return "context parallelism splits the sequence attention runs over, but the model has no attention: use cp=1"
    if seq % (2 * cp):
        return (f"cp={cp} splits the sequence into 2*cp = {2 * cp} chunks, but the sequence length {seq} does not "
                f"divide by {2 * cp}: use a sequence length that is a multiple of {2 * cp}, or a cp that fits")
    return None


def kv_numel(node: OpNode, graph: OpGraph) -> int:
    """Elements of the key and value tensors an attention op reads, at the captured batch."""
    total = 0
    for name in node.inputs[1:3]:
        if name in graph.node_index:
            total += graph.node(name).outputs[0].numel
        else:
            total += next((g.meta.numel for g in graph.inputs if g.name == name), 0)
    return total


def ring_exposed(kv_bytes: float, attn_fwd: float, attn_bwd: float, cp: int, group: GroupPlacement,
                 cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of one attention op's ring that compute does not hide.

    ``kv_bytes``: this rank's key and value block (already divided by ``cp``); ``attn_fwd`` /
    ``attn_bwd``: the op's time on this rank (its ``1/cp`` share)."""
    if cp == 1 or kv_bytes <= 0:
        return 0.0, 0.0
    link = cluster.intra_node if group.nodes == 1 else cluster.inter_node
    o, kept = link.overlap, 1.0 - cluster.device.overlap_slowdown
    fwd = collective_time(Collective.P2P, kv_bytes, group, cluster)
    bwd = collective_time(Collective.P2P, 2 * kv_bytes, group, cluster)
    steps = cp - 1
    # the hidden share of each transfer still slows the attention beside it by overlap_slowdown
    return (steps * (fwd - kept * min(fwd, o * attn_fwd / cp)),
            steps * (bwd - kept * min(bwd, o * attn_bwd / cp)))


def ring_attention_time(model: ComputeModel, node: OpNode, batch_scale: float, shard: int, split_dim: str,
                        cp: int) -> OpTime:
    """Seconds of one attention op on one rank under context parallelism: ``cp`` blocks of ``S/cp``
    queries by ``S/cp`` keys, and ``cp - 1`` output merges (module docstring).

    ``batch_scale``: the micro-batch over the captured batch (not divided by cp). A profiled op
    (``model.measured``) is looked up at ``1/cp`` of the micro-batch instead."""
    if model.measured is not None or node.gemm is None:
        return model.op_time(node, batch_scale / cp, shard, split_dim)
    g = node.gemm
    block = replace(node, gemm=replace(g, m=max(1, g.m // cp), n=max(1, g.n // cp)),
                    flops_fwd=node.flops_fwd / cp ** 2, flops_bwd=node.flops_bwd / cp ** 2,
                    bytes_fwd=node.bytes_fwd / cp)
    t = model.op_time(block, batch_scale, shard, split_dim)
    out = node.outputs[0].numel * batch_scale / (cp * shard) * 4   # the running output, kept in fp32
    merge = (cp - 1) * 3 * out / model.bandwidth
    return OpTime(cp * t.fwd + merge, cp * t.bwd + 2 * merge)
