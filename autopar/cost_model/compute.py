"""Compute time of one op: a roofline with an achieved-efficiency model, or a measured time.

For an op with ``F`` FLOPs moving ``Q`` bytes on a device with peak ``P`` (for the
training dtype) and memory bandwidth ``W``::

    t = max(F / (P * e_mm(m, n, k)), Q / (W * e_mem)) + t_launch        (matmul, conv, attention)
    t = Q / (W * e_mem) + t_launch                                      (everything else)
    e_mm(m, n, k) = e_max * g(m) * g(n) * g(k),   g(d) = d / (d + d_half)

``e_max``, ``d_half``, ``e_mem`` and ``t_launch`` are the device's constants (one set per
device, in cluster.py). ``g`` captures that thin GEMMs (small hidden per tensor-parallel
rank, a micro-batch of one short sequence) cannot fill the tensor cores.

Element-wise chains (softmax included) are assumed fused, as Megatron-LM's fused kernels and
torch.compile do: an element-wise op whose only consumer is another element-wise op
of the same size writes nothing to memory, and its consumer does not read it back,
unless autograd saves it.
Backward moves about twice the forward bytes (read the output gradient and the saved
tensors, write the input gradient). Views cost nothing.

The batch and tensor-parallel scaling: costs of batch-dependent ops scale by
``micro_batch / captured_batch``; split ops divide by the tensor-parallel degree, with
the split GEMM dimension divided before the efficiency is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Protocol

from ..capture.opgraph import FLOAT_DTYPES, Gemm, OpGraph, OpKind, OpNode, dtype_bytes
from ..cluster import Device

_GEMM_KINDS = (OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION)
_FUSABLE = (OpKind.ELEMENTWISE, OpKind.DROPOUT, OpKind.SOFTMAX)
_FREE = (OpKind.VIEW,)


class MeasuredTimes(Protocol):
    """Measured (forward, backward) seconds of an op at a given micro-batch scale, split ``shard`` ways
    along the GEMM dimension ``split_dim`` ("" when not a split GEMM), or None (profiler/ops.py)."""

    def lookup(self, node: OpNode, batch_scale: float, shard: int, split_dim: str, dtype: str
               ) -> tuple[float, float] | None: ...

    def optimizer_seconds_per_param(self) -> float | None:
        """Measured seconds of one optimizer step per parameter, or None."""


@dataclass(frozen=True)
class OpTime:
    fwd: float
    bwd: float


def gemm_efficiency(device: Device, gemm: Gemm) -> float:
    """Achieved fraction of peak for a GEMM of these dimensions."""
    half = device.matmul_half_dim
    factor = 1.0
    for d in (gemm.m, gemm.n, gemm.k):
        factor *= d / (d + half)
    return device.matmul_efficiency * factor


def scaled_gemm(gemm: Gemm, batch_scale: float, split_dim: str, tp: int) -> Gemm:
    """The GEMM at another micro-batch size and split ``tp`` ways along ``split_dim``."""
    g = gemm
    if g.scaled == "batch":
        g = replace(g, batch=max(1, round(g.batch * batch_scale)))
    elif g.scaled == "m":
        g = replace(g, m=max(1, round(g.m * batch_scale)))
    if tp > 1 and split_dim:
        g = replace(g, **{split_dim: max(1, getattr(g, split_dim) // tp)})
    return g


def fused_away(graph: OpGraph) -> frozenset[str]:
    """Element-wise ops whose output is consumed only by one same-sized element-wise op and is
    not kept for backward (a saved tensor must be written, fused kernel or not)."""
    consumers: dict[str, list[OpNode]] = {}
    for n in graph.nodes:
        for src in n.inputs:
            consumers.setdefault(src, []).append(n)
    saved = {st.root for n in graph.nodes for st in n.saved}
    fused = set()
    for n in graph.nodes:
        users = consumers.get(n.name, [])
        if (n.kind in _FUSABLE and n.name not in saved and len(users) == 1 and users[0].kind in _FUSABLE
                and users[0].outputs[0].numel == n.outputs[0].numel):
            fused.add(n.name)
    return frozenset(fused)


@dataclass(frozen=True)
class ComputeModel:
    """Times ops of one graph on one device in one dtype. ``split_dims`` maps a node to the
    GEMM dimension tensor parallelism splits ("n" column, "k" row, "batch" heads)."""

    graph: OpGraph
    device: Device
    dtype: str                      # "bf16" | "fp16" | "fp32"
    measured: MeasuredTimes | None = None

    @property
    def peak(self) -> float:
        return self.device.peak(self.dtype)

    @property
    def bandwidth(self) -> float:
        return self.device.memory_bandwidth * self.device.memory_efficiency

    def op_time(self, node: OpNode, batch_scale: float, shard: int, split_dim: str,
                fused: frozenset[str] | Mapping[str, bool] = frozenset()) -> OpTime:
        """Forward and backward seconds of ``node`` for one micro-batch."""
        if node.kind in _FREE:
            return OpTime(0.0, 0.0)
        if self.measured is not None:
            hit = self.measured.lookup(node, batch_scale, shard, split_dim, self.dtype)
            if hit is not None:
                return OpTime(*hit)
        scale = (batch_scale if node.batch_dependent else 1.0) / shard
        moved = node.bytes_fwd * scale * self._byte_ratio(node)
        if node.name in fused:
            moved -= node.output_bytes * scale * self._byte_ratio(node) * 2  # neither written nor re-read
            moved = max(moved, 0.0)
        launch = self.device.kernel_overhead
        mem_fwd, mem_bwd = moved / self.bandwidth, 2.0 * moved / self.bandwidth
        if node.kind in _GEMM_KINDS and node.gemm is not None:
            eff = gemm_efficiency(self.device, scaled_gemm(node.gemm, batch_scale if node.batch_dependent else 1.0,
                                                           split_dim, shard))
            fwd = max(node.flops_fwd * scale / (self.peak * eff), mem_fwd)
            bwd = max(node.flops_bwd * scale / (self.peak * eff), mem_bwd) if node.flops_bwd else 0.0
        else:
            fwd, bwd = mem_fwd, (mem_bwd if node.requires_grad else 0.0)
        fused_launch = 0.0 if node.name in fused else launch
        return OpTime(fwd + fused_launch, bwd + (fused_launch * 2 if node.requires_grad else 0.0))

    def _byte_ratio(self, node: OpNode) -> float:
        """Captured bytes -> training-dtype bytes for floating tensors (a fp32 capture trained in bf16)."""
        out = node.outputs[0].dtype
        if out in FLOAT_DTYPES:
            return {"bf16": 2, "fp16": 2, "fp32": 4}[self.dtype] / dtype_bytes(out)
        return 1.0
