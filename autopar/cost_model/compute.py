"""Compute time of one op: a roofline with an achieved-efficiency model, or a measured time.

For an op with ``F`` FLOPs moving ``Q`` bytes on a device with peak ``P`` (for the
training dtype) and memory bandwidth ``W``::

    t = max(rho F / (P * e_mm(m, n, k)), Q / (W * e_mem)) + t_launch    (matmul, conv, attention)
    t = Q / (W * e_mem) + t_launch                                      (everything else)
    e_mm(b, m, n, k) = e_max * max_s g(m) * g(n) * g(k / s) * q(s * b, m, n),   g(d) = d / (d + d_half)
    q(b, m, n) = b m n / (W * S * T_m * T_n),   W = ceil(b * ceil(m / T_m) * ceil(n / T_n) / S)

``rho`` is the GEMM's density (``Gemm.density``: a causal attention kernel skips the masked
half of its tiles). A fused attention kernel keeps no score matrix, so its backward recomputes
the scores and probabilities from q, k and the log-sum-exp before the four products of the
gradients: five ``s_q x s_k`` products where autograd's count has four,
``FUSED_ATTENTION_BACKWARD`` times the counted backward FLOPs (FlashAttention, Dao et al. 2022,
section 3.1; the memory-efficient and cuDNN kernels do the same). ``e_max``, ``d_half``,
``e_mem`` and ``t_launch`` are the device's constants (one set per device family, in presets.py);
a fused attention kernel has its own ``e_max`` where the device says so (``attention_efficiency``:
FlashAttention-2 on an H100 runs without Hopper's new instructions, at a third of peak).
``g`` captures that thin GEMMs (small hidden per tensor-parallel rank, a micro-batch of one
short sequence) cannot fill the tensor cores. ``q`` is tile and wave quantization on a GPU of ``S``
streaming multiprocessors (``Device.sm_count``; q = 1 on a CPU): the library cuts the ``b`` products'
``m x n`` outputs into ``T_m x T_n`` tiles (256 x 128, the largest tile of cuBLAS's sm80/sm90 bf16
kernels), each multiprocessor computes one tile at a time, so the GEMM takes ``W`` full waves however
few tiles the last one holds, and edge tiles compute their padding (NVIDIA's "Matrix Multiplication
Background" guide: tile and wave quantization). A GEMM of fewer tiles than multiprocessors is split
along ``k`` into ``s`` in {2, 4, 8, 16} parts computed as separate tiles and summed (split-K), each
part as thin as ``k / s``; the library's best ``s`` is taken (``s = 1``: no split). The backward's two
products share the forward's efficiency.

Element-wise chains (softmax included) run fused under ``Precision.kernels`` "fused" and
"compiled", as Megatron-LM's fused kernels and torch.compile run them: an element-wise op whose
only consumer is another element-wise op of the same size writes nothing to memory, and its
consumer does not read it back, unless the program keeps it for backward (:func:`fused_ops`; what
each program keeps: capture/fusion.py).
Eager kernels (the default) write and read back every op's output.
Backward moves about twice the forward bytes (read the output gradient and the saved
tensors, write the input gradient). Views cost nothing.

Where Megatron-LM's fused scale-mask-softmax kernel does not run (``Precision(fused_softmax=False)``: its
shape constraints failed, and Megatron ran its PyTorch fallback), the attention softmax is priced as that
fallback runs it, over the chain of element-wise ops the fused kernel would have been (the scale and the mask
before it stay fused away, their bytes counted here): with ``d`` the scores' bytes (2 for fp16/bf16), a cast
to fp32 (``d + 4`` per score), the scale, the mask and the softmax in fp32 (8 each: read, write) and the cast
back (``4 + d``): forward ``2d + 32``, backward ``2d + 36`` (the softmax's backward also reads its output:
12), in :data:`FALLBACK_SOFTMAX_KERNELS` kernels each way; 4 and 6 bytes a score when the kernel runs (16-bit
scores; in fp32 the fallback has no casts: 24 and 28).

A softmax cross entropy over ``C`` classes is one captured op, but each program runs it as several
passes over its ``N x C`` scores (``d`` bytes each), which for a large vocabulary weigh as much as a
transformer layer's element-wise ops (:func:`loss_bytes`); bytes moved per score:

    eager     forward 2d (log_softmax reads the scores, writes the log-probabilities; nll_loss gathers)
              backward 4d (nll_loss writes a zero-filled gradient, log_softmax's backward reads it and
              the log-probabilities and writes the scores' gradient)
    fused     Megatron-LM's vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py),
              in fp32 as its GPT models call it: forward c + 32 (an fp32 copy, c = d + 4 or 0 for fp32
              scores; the row max reads 4; subtract, exponentiate and normalise in place 8 each; the
              sum reads 4), backward 8 + c (the output gradient multiplied in place, cast back)
    compiled  forward 2d (one looped reduction kernel reads the scores twice: max, then the sum of
              exponentials), backward 2d (reads the scores again, writes their gradient)

Every time is a rank's while all ranks of its machine compute at once: the device's
``concurrency_slowdown`` (CPU ranks sharing cores and caches, measured by ``Cluster.local``; 1 for
a GPU) times the op's time alone.

The batch and tensor-parallel scaling: costs of batch-dependent ops scale by
``micro_batch / captured_batch``; split ops divide by the tensor-parallel degree, with
the split GEMM dimension divided before the efficiency is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Protocol

from .. import ops
from ..config import DTYPE_BYTES, Precision
from ..capture.fusion import for_kernels
from ..capture.opgraph import FLOAT_DTYPES, Gemm, OpGraph, OpKind, OpNode, dtype_bytes
from ..hardware import Device
from .low_precision import Recipe, cast_seconds, is_fp8_linear, recipe_of

_GEMM_KINDS = (OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION)
_FUSABLE = (OpKind.ELEMENTWISE, OpKind.DROPOUT, OpKind.SOFTMAX)
FALLBACK_SOFTMAX_KERNELS = 5   # Megatron's PyTorch softmax: cast, scale, mask, softmax, cast back
FREE_KINDS = (OpKind.VIEW,)   # ops that take no time (views: no kernel)
FUSED_ATTENTION_BACKWARD = 5 / 4   # products a fused attention backward runs / those its FLOPs count
TILE = (256, 128)                  # a GPU GEMM's output tile, m x n (module docstring)
SPLIT_K = (1, 2, 4, 8, 16)         # the split-K factors a GPU GEMM library picks from


class MeasuredTimes(Protocol):
    """Measured (forward, backward) seconds of an op at a given micro-batch scale, split ``shard`` ways
    along the GEMM dimension ``split_dim`` ("" when not a split GEMM), or None (profiler/ops.py)."""

    def lookup(self, node: OpNode, batch_scale: float, shard: int, split_dim: str, dtype: str
               ) -> tuple[float, float] | None: ...

    def optimizer_seconds_per_param(self, kernels: str) -> float | None:
        """Measured seconds of one optimizer step per parameter as a program running ``kernels`` steps it
        (compiled: through torch.compile, runtime/optim.py), or None."""


@dataclass(frozen=True)
class OpTime:
    fwd: float
    bwd: float


def gemm_efficiency(device: Device, gemm: Gemm, attention: bool = False, waves: bool = True,
                    fp8: bool = False) -> float:
    """Achieved fraction of peak for a GEMM of these dimensions (a fused attention's with ``attention``:
    its own kernel's tiles, so no GEMM tile quantization; none either without ``waves``; an fp8 GEMM's,
    of the fp8 peak, with ``fp8``: ``Device.fp8_matmul_efficiency`` where the device has one)."""
    half = device.matmul_half_dim

    def g(d: float) -> float:
        return d / (d + half)

    base = best_efficiency(device, attention, fp8) * g(gemm.m) * g(gemm.n)
    if attention or not waves or device.sm_count is None:
        return base * g(gemm.k)
    sms = device.sm_count
    tiles = gemm.batch * math.ceil(gemm.m / TILE[0]) * math.ceil(gemm.n / TILE[1])
    best = 0.0
    for s in SPLIT_K:
        if s > 1 and tiles * (s // 2) >= sms:
            break                       # the previous split already filled a wave
        parts = tiles * s
        fill = gemm.batch * s * gemm.m * gemm.n / (math.ceil(parts / sms) * sms * TILE[0] * TILE[1])
        best = max(best, g(gemm.k / s) * fill)
    return base * best


def best_efficiency(device: Device, attention: bool = False, fp8: bool = False) -> float:
    """``e_max``: the most of peak :func:`gemm_efficiency` gives any shape of the kind (its every other
    factor, ``g`` and the wave fill ``q``, is at most 1)."""
    own = device.attention_efficiency if attention else device.fp8_matmul_efficiency if fp8 else None
    return device.matmul_efficiency if own is None else own


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


def loss_bytes(graph: OpGraph, node: OpNode, kernels: str, dtype: str) -> tuple[float, float] | None:
    """Forward and backward bytes a softmax cross entropy moves over its scores as ``kernels`` run it
    (module docstring), at the captured batch and unsplit; None for any other op, or scores whose
    producer the graph does not hold. ``dtype`` is the training dtype, which scores of the model's
    dtype are kept in (scores cast to another dtype on purpose keep theirs)."""
    if node.kind is not OpKind.LOSS or not ops.is_cross_entropy(node.target):
        return None
    if not node.inputs or node.inputs[0] not in graph.node_index:
        return None
    scores = graph.node(node.inputs[0]).outputs[0]
    d = DTYPE_BYTES[dtype] if scores.dtype == graph.float_dtype else dtype_bytes(scores.dtype)
    if kernels == "fused":
        cast = 0.0 if d >= 4 else d + 4.0
        per = (cast + 32.0, 8.0 + cast)
    elif kernels == "compiled":
        per = (2.0 * d, 2.0 * d)
    else:
        per = (2.0 * d, 4.0 * d)
    return per[0] * scores.numel, per[1] * scores.numel


def is_attention_softmax(node: OpNode) -> bool:
    """A softmax over attention scores ``[batch, heads, queries, keys]``: the 4-D input Megatron's
    FusedScaleMaskSoftmax takes (a router's softmax over experts is not one)."""
    return node.kind is OpKind.SOFTMAX and len(node.outputs[0].shape) == 4


def fallback_softmax_bytes(node: OpNode, dtype: str) -> tuple[float, float] | None:
    """Forward and backward bytes Megatron-LM's PyTorch fallback of its fused scale-mask-softmax moves over an
    attention softmax's scores (module docstring), at the captured batch and unsplit; None for any other op.
    ``dtype`` is the training dtype the scores are kept in."""
    if not is_attention_softmax(node):
        return None
    d = DTYPE_BYTES[dtype]
    casts = 2.0 * d + 8.0 if d < 4 else 0.0
    numel = node.outputs[0].numel
    return (24.0 + casts) * numel, (28.0 + casts) * numel


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


def fused_ops(graph: OpGraph, kernels: str) -> frozenset[str]:
    """The ops a program running ``kernels`` fuses into their consumer: none eager; otherwise
    :func:`fused_away` of the graph as that program keeps it (capture/fusion.py's ``for_kernels``)."""
    return frozenset() if kernels == "eager" else fused_away(for_kernels(graph, kernels))


@dataclass(frozen=True)
class ComputeModel:
    """Times ops of one graph on one device in one dtype. ``split_dims`` maps a node to the
    GEMM dimension tensor parallelism splits ("n" column, "k" row, "batch" heads)."""

    graph: OpGraph
    device: Device
    dtype: str                      # "bf16" | "fp16" | "fp32": what weights and activations are kept in
    measured: MeasuredTimes | None = None
    waves: bool = True              # tile and wave quantization (False: the smooth e_mm alone)
    fp8: Recipe | None = None       # the linear layers' fp8 recipe (cost_model/low_precision.py), or None
    kernels: str = "eager"          # Precision.kernels: how the fp8 casts run
    fused_softmax: bool = True      # Precision.fused_softmax: False prices Megatron's PyTorch softmax fallback

    @classmethod
    def of(cls, graph: OpGraph, device: Device, precision: Precision, measured: MeasuredTimes | None = None,
           waves: bool = True) -> "ComputeModel":
        """The model of ``graph``'s ops under ``precision``: its storage dtype, fp8 recipe, kernels and softmax."""
        return cls(graph, device, precision.storage, measured, waves=waves, fp8=recipe_of(precision),
                   kernels=precision.kernels, fused_softmax=precision.fused_softmax)

    @property
    def peak(self) -> float:
        return self.device.peak(self.dtype)

    @property
    def bandwidth(self) -> float:
        return self.device.memory_bandwidth * self.device.memory_efficiency

    def op_time(self, node: OpNode, batch_scale: float, shard: int, split_dim: str,
                fused: frozenset[str] | Mapping[str, bool] = frozenset()) -> OpTime:
        """Forward and backward seconds of ``node`` for one micro-batch, on a rank computing while every
        other rank of its machine does (``Device.concurrency_slowdown``; 1 on GPUs)."""
        t = self._alone(node, batch_scale, shard, split_dim, fused)
        slow = self.device.concurrency_slowdown
        return t if slow == 1.0 else OpTime(t.fwd * slow, t.bwd * slow)

    def _alone(self, node: OpNode, batch_scale: float, shard: int, split_dim: str,
               fused: frozenset[str] | Mapping[str, bool]) -> OpTime:
        if node.kind in FREE_KINDS:
            return OpTime(0.0, 0.0)
        if self.measured is not None:
            hit = self.measured.lookup(node, batch_scale, shard, split_dim, self.dtype)
            if hit is not None:
                return OpTime(*hit)
        scale = (batch_scale if node.batch_dependent else 1.0) / shard
        launch = self.device.kernel_overhead
        mem_fwd, mem_bwd = self._memory_seconds(node, scale, fused)
        if node.kind in _GEMM_KINDS and node.gemm is not None:
            gemm = scaled_gemm(node.gemm, batch_scale if node.batch_dependent else 1.0, split_dim, shard)
            eff = gemm_efficiency(self.device, gemm, node.kind is OpKind.ATTENTION, self.waves)
            work = scale * node.gemm.density / (self.peak * eff)
            if self.fp8 is not None and is_fp8_linear(node):
                return self._fp8_linear(node, gemm, work, scale, mem_fwd, mem_bwd)
            fwd = max(node.flops_fwd * work, mem_fwd)
            redo = FUSED_ATTENTION_BACKWARD if node.kind is OpKind.ATTENTION else 1.0
            bwd = max(node.flops_bwd * work * redo, mem_bwd) if node.flops_bwd else 0.0
        else:
            fwd, bwd = mem_fwd, (mem_bwd if node.requires_grad else 0.0)
        fused_launch = self._kernels(node, fused) * launch
        return OpTime(fwd + fused_launch, bwd + (fused_launch * 2 if node.requires_grad else 0.0))

    def _fallback(self, node: OpNode) -> bool:
        """Whether ``node`` is an attention softmax run as Megatron's PyTorch fallback (module docstring)."""
        return not self.fused_softmax and self.kernels == "fused" and is_attention_softmax(node)

    def _kernels(self, node: OpNode, fused: frozenset[str] | Mapping[str, bool]) -> int:
        """Kernels ``node`` launches in its forward: none fused into its consumer, one, or the fallback's."""
        if node.name in fused:
            return 0
        return FALLBACK_SOFTMAX_KERNELS if self._fallback(node) else 1

    def least_time(self, node: OpNode, shard: int, fused: frozenset[str] | Mapping[str, bool] = frozenset()
                   ) -> tuple[OpTime, OpTime]:
        """A floor on an unmeasured op's forward and backward seconds in any split (:meth:`op_time`), as
        ``(rate, fixed)``: at least ``rate * batch_scale + fixed`` each (``rate`` is 0 for an op that does not
        depend on the batch). Its GEMM runs at ``e_max`` (:func:`best_efficiency`), as fp8 where the recipe
        makes it an fp8 linear (whichever of the two tensor-core rates is faster), its casts and rescales left
        out; its bytes, density, fused backward and launches as :meth:`op_time` counts them. Every term of the
        roofline is proportional to the op's share of the batch, so the floor is linear in it: what lets a
        bound price a layer at every micro-batch size from a few numbers (solver/bounds.py)."""
        if node.kind in FREE_KINDS:
            return OpTime(0.0, 0.0), OpTime(0.0, 0.0)
        if self.measured is not None:
            raise ValueError("least_time floors the analytic times: a profiled op's measured time has none")
        unit = 1.0 / shard   # the op's scale at batch_scale 1 (or at any, when it does not depend on the batch)
        mem_fwd, mem_bwd = self._memory_seconds(node, unit, fused)
        fp8 = self.fp8 is not None and is_fp8_linear(node)
        if node.kind in _GEMM_KINDS and node.gemm is not None:
            attention = node.kind is OpKind.ATTENTION
            per_flop = unit * node.gemm.density / (self.peak * best_efficiency(self.device, attention))
            if fp8:
                per_flop = min(per_flop, unit / (self.device.peak(self.fp8.peak) * best_efficiency(self.device, fp8=True)))
            redo = FUSED_ATTENTION_BACKWARD if attention else 1.0
            fwd = max(node.flops_fwd * per_flop, mem_fwd)
            bwd = max(node.flops_bwd * per_flop * redo, mem_bwd) if node.flops_bwd else 0.0
        else:
            fwd, bwd = mem_fwd, (mem_bwd if node.requires_grad else 0.0)
        launch = self._kernels(node, fused) * self.device.kernel_overhead
        slow = self.device.concurrency_slowdown
        fixed = OpTime(launch * slow, 2 * launch * slow if node.requires_grad and (node.flops_bwd or not fp8) else 0.0)
        if node.batch_dependent:
            return OpTime(fwd * slow, bwd * slow), fixed
        return OpTime(0.0, 0.0), OpTime(fixed.fwd + fwd * slow, fixed.bwd + bwd * slow)

    def _memory_seconds(self, node: OpNode, scale: float, fused: frozenset[str] | Mapping[str, bool]
                        ) -> tuple[float, float]:
        """(forward, backward) seconds the op's bytes take at ``scale`` (its share of the captured batch over
        its split): proportional to ``scale``."""
        moved = node.bytes_fwd * scale * self._byte_ratio(node)
        if node.name in fused:
            moved -= node.output_bytes * scale * self._byte_ratio(node) * 2  # neither written nor re-read
            moved = max(moved, 0.0)
        passes = (fallback_softmax_bytes(node, self.dtype) if self._fallback(node)
                  else loss_bytes(self.graph, node, self.kernels, self.dtype))
        if passes is not None:
            return tuple(b * scale / self.bandwidth for b in passes)
        return moved / self.bandwidth, 2.0 * moved / self.bandwidth

    def _fp8_linear(self, node: OpNode, gemm: Gemm, work_bf16: float, scale: float, mem_fwd: float,
                    mem_bwd: float) -> OpTime:
        """A linear layer's GEMMs on the fp8 tensor cores (the forward's on its recipe's kernel, at ``gemm_share``
        of the tensor-wise one's throughput) plus their operands' casts and outputs' rescales (low_precision.py)."""
        recipe = self.fp8
        work = scale / (self.device.peak(recipe.peak) * gemm_efficiency(self.device, gemm, False, self.waves, True))
        cast_fwd, cast_bwd = cast_seconds(recipe, self.kernels, gemm, self.device)
        launch = self.device.kernel_overhead
        fwd = max(node.flops_fwd * work / recipe.gemm_share, mem_fwd) + cast_fwd + launch
        if not node.flops_bwd:
            return OpTime(fwd, 0.0)
        grads = (node.flops_bwd / 2 * (work + work_bf16) if recipe.hp_grad_weight   # dW in bf16
                 else node.flops_bwd * work)
        return OpTime(fwd, max(grads, mem_bwd) + cast_bwd + 2 * launch)

    def _byte_ratio(self, node: OpNode) -> float:
        """Captured bytes -> training-dtype bytes for an op whose output has the model's dtype (a fp32
        capture trained in bf16); an op computing in a dtype the model casts to on purpose (an
        RMSNorm's float32 statistics of a bf16 model) keeps its own."""
        out = node.outputs[0].dtype
        if out in FLOAT_DTYPES and out == self.graph.float_dtype:
            return DTYPE_BYTES[self.dtype] / dtype_bytes(out)
        return 1.0
