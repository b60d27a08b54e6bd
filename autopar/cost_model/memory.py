"""Memory per device: model states by ZeRO stage, activations by layer, schedule and recompute.

Model states (Rajbhandari et al., ZeRO, section 3), for ``Psi`` parameters held by a
device after tensor/pipeline splitting, data-parallel degree ``N_d``, ``w``/``g``/``K``
bytes per parameter of weights, gradients and optimizer state (2 / 2 / 12 for bf16
mixed-precision Adam)::

    zero 0:  (w + g + K) Psi          zero 2:  w Psi + (g + K) Psi / N_d
    zero 1:  (w + g) Psi + K Psi/N_d  zero 3:  (w + g + K) Psi / N_d

Activations of one layer for one micro-batch are the bytes of the tensors autograd
saves (capture/rules.py; compiled, what a compiled program keeps: capture/fusion.py),
each storage counted once and charged to the first layer that saves it, at the training
precision (floating tensors of the model's dtype at 2 bytes in bf16, a float32 copy the model
makes on purpose at 4; masks 1 byte; the attention probabilities at 4 where Megatron's PyTorch softmax ran,
``Precision(fused_softmax=False)``, which saves its fp32 output). Tensor parallelism divides a tensor in the split region by ``t``; sequence
parallelism divides the replicated region by ``t`` as well. Selective recomputation
drops what the attention core's ops save of the values the core computes (capture/layers.py: from
``Q K^T`` through the value product, or a fused attention op), keeping its inputs and what the ops
after it save, as the runtime's checkpoint of the core does; full recomputation keeps only the tensors that
enter the layer from outside; per-op recomputation ("op", runtime/recompute.py) keeps those
and the outputs of :func:`op_kept`'s nodes (every second matrix product, fused attention). For
the Megatron GPT layer this reproduces Korthikanti et al. Table 2: ``sbh(34 + 5as/h)`` and its TP/SP/recompute variants.

In-flight micro-batches per pipeline device ``i`` of ``p`` with ``m`` micro-batches:
GPipe ``m``; 1F1B ``min(m, p - i)``; interleaved 1F1B with ``v`` chunks per device
``min(m v, 2(p - i - 1) + (v - 1) p + 1)`` chunk-passes (Megatron's warm-up count),
which for ``i = 0`` is Korthikanti's factor ``1 + (p - 1)/(p v)`` times ``L/p`` layers.
Interleaved chunks of one device differ in size (the last device's last chunk holds the head
and the loss, whose logits can outweigh every block), so its peak is not that count times the
largest chunk: :func:`interleaved_peak` walks the device's own order (Megatron's, as
runtime/schedules.py runs it) and takes the most its in-flight passes hold at once.
The zero-bubble schedules hold a pass's activations from its forward to its weight-gradient
pass (the input-gradient pass keeps the autograd graph for it): :func:`order_peak` walks the
device's order likewise (ZB-H1 holds ``min(m, p)`` passes on every device, 1F1B's first
device's count; ZB-V ``2p`` chunk passes, as many layers as 1F1B's first device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..capture.opgraph import Layer, OpGraph, OpKind, SavedTensor
from ..config import SPLIT_BACKWARD, ParallelConfig, Precision
from ..runtime.schedules import build, releases
from .compute import is_attention_softmax
from .tensor_parallel import TPLayout


def model_state_bytes(numel: float, precision: Precision, zero: int, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes for ``numel`` parameters on one device."""
    w, g, k = precision.weight_bytes * numel, precision.grad_bytes * numel, precision.optimizer_bytes * numel
    if zero >= 1:
        k /= dp
    if zero >= 2:
        g /= dp
    if zero >= 3:
        w /= dp
    return w, g, k


def saved_owner(graph: OpGraph) -> dict[str, int]:
    """Storage root -> index of the first layer that saves it."""
    owner: dict[str, int] = {}
    for node in graph.nodes:
        for st in node.saved:
            owner.setdefault(st.root, node.layer)
    return owner


def op_kept(graph: OpGraph, layer: Layer) -> frozenset[str]:
    """Nodes of ``layer`` whose outputs recompute "op" keeps (runtime/recompute.py's policy read on the
    captured graph, one node per product): the 1st, 3rd, ... matrix product in forward order, and
    every fused attention. The others rerun in the backward."""
    kept, products = [], 0
    for node in graph.layer_nodes(layer):
        if node.kind is OpKind.MATMUL:
            products += 1
            if products % 2:
                kept.append(node.name)
        elif node.kind is OpKind.ATTENTION:
            kept.append(node.name)
    return frozenset(kept)


@dataclass(frozen=True)
class ActivationModel:
    """Activation bytes per layer for one graph, tensor-parallel layout and precision.

    A tensor's bytes on a device are ``nbytes * (micro-batch scale if it scales with the batch) /
    shard``; everything but the scale is fixed by the layer, mode and layout, so each layer's terms are
    listed once (:meth:`_terms`) and only scaled per micro-batch size (the search prices every layer at
    every micro-batch size)."""

    graph: OpGraph
    layout: TPLayout
    precision: Precision
    sequence_parallel: bool = False
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def _saved_in(self, layer: Layer, owner: Mapping[str, int], selective: bool = False) -> Iterable[SavedTensor]:
        """The tensors ``layer``'s ops save, each storage once; ``selective``: but those an attention
        core's op saves of a value the core computes (:meth:`_recomputed`)."""
        seen: set[str] = set()
        for node in self.graph.layer_nodes(layer):
            for st in node.saved:
                if selective and self._recomputed(node.name, st.root):
                    continue
                if st.root not in seen and owner.get(st.root) == layer.index:
                    seen.add(st.root)
                    yield st

    def _term(self, name: str, st: SavedTensor, per: int | None) -> tuple[int, bool, int]:
        """(bytes unscaled, scales with the batch, shard) of one tensor."""
        return st.nbytes(per, self.graph.float_dtype), st.batch_dependent, self.layout.shard(name, self.sequence_parallel)

    def _terms(self, what: str, layer: Layer, owner: Mapping[str, int] | None = None) -> tuple[tuple, ...]:
        """The terms of ``what`` in ``layer``, in summation order (cached): "none" / "selective" the
        tensors it saves (all, or all but the attention core's), "boundary" those entering it, "outputs"
        its ops' first outputs, "kept" the outputs of :func:`op_kept`'s nodes."""
        key = (what, layer.index, id(owner))
        if key not in self._cache:
            self._cache[key] = tuple(self._list(what, layer, owner))
        return self._cache[key]

    def _list(self, what: str, layer: Layer, owner: Mapping[str, int] | None) -> Iterable[tuple]:
        graph, per = self.graph, self.precision.activation_bytes
        if what in ("none", "selective"):
            fp32 = self._fp32_probabilities
            for st in self._saved_in(layer, owner, what == "selective"):
                yield self._term(st.root, st, 4 if st.root in fp32 else per)
        elif what == "boundary":
            for name in layer.inputs:
                if name in graph.node_index:
                    node = graph.node(name)
                    meta, bd = node.outputs[0], node.batch_dependent
                else:
                    gi = next((g for g in graph.inputs if g.name == name), None)
                    if gi is None:
                        continue
                    meta, bd = gi.meta, gi.batch_dependent
                yield self._term(name, SavedTensor(name, meta.numel, meta.dtype, bd), per if meta.is_float else None)
        else:
            nodes = (graph.layer_nodes(layer) if what == "outputs"
                     else (graph.node(name) for name in op_kept(graph, layer)))
            for node in nodes:
                meta = node.outputs[0]
                yield self._term(node.name, SavedTensor(node.name, meta.numel, meta.dtype, node.batch_dependent),
                                 per if meta.is_float else None)

    @functools.cached_property
    def _fp32_probabilities(self) -> frozenset[str]:
        """The attention softmaxes whose output is saved in fp32: those of Megatron's PyTorch softmax
        (``Precision(fused_softmax=False)``, valid with fused kernels only), which upcasts the scores before it;
        none otherwise."""
        if self.precision.fused_softmax:
            return frozenset()
        return frozenset(n.name for n in self.graph.nodes if is_attention_softmax(n))

    @staticmethod
    def _sum(terms: Iterable[tuple], batch_scale: float, start=0.0) -> float:
        total = start
        for nbytes, bd, shard in terms:
            total += nbytes * (batch_scale if bd else 1.0) / shard
        return total

    def layer_bytes(self, layer: Layer, recompute: str, batch_scale: float, owner: Mapping[str, int]) -> float:
        """Activation bytes one micro-batch leaves in ``layer`` until its backward."""
        if recompute == "full":
            return self.boundary_bytes(layer, batch_scale)
        if recompute == "op":
            return self.boundary_bytes(layer, batch_scale) + self._sum(self._terms("kept", layer), batch_scale, 0)
        return self._sum(self._terms("selective" if recompute == "selective" else "none", layer, owner), batch_scale)

    def boundary_bytes(self, layer: Layer, batch_scale: float) -> float:
        """Bytes of the activations entering ``layer`` from earlier layers (what full recompute keeps)."""
        return self._sum(self._terms("boundary", layer), batch_scale)

    def _recomputed(self, saver: str, root: str) -> bool:
        """Whether selective recomputation frees ``root`` as node ``saver`` saves it: the saver is in an
        attention core and so is the op that made ``root`` (or the op whose internal tensor it is, a
        dropout mask, a log-sum-exp). The core runs under a checkpoint: its ops keep nothing, the
        checkpoint keeps the core's inputs (Q, K, V: made outside it) and an op after the core keeps its
        output as it would anyway (the value product's output, read by the output projection)."""
        graph, name = self.graph, root.split(":")[0]
        return (graph.node(saver).attention_core and name in graph.node_index
                and graph.node(name).attention_core)

    def largest_tensor(self, layers: Iterable[Layer], batch_scale: float) -> float:
        """Bytes of the largest activation any op of these layers produces (a gradient buffer's size)."""
        return max((nbytes * (batch_scale if bd else 1.0) / shard
                    for layer in layers for nbytes, bd, shard in self._distinct_outputs(layer)), default=0.0)

    def _distinct_outputs(self, layer: Layer) -> tuple[tuple, ...]:
        key = ("distinct", layer.index)
        if key not in self._cache:
            self._cache[key] = tuple(dict.fromkeys(self._terms("outputs", layer)))
        return self._cache[key]


def in_flight(cfg: ParallelConfig, stage: int, micro_batches: int) -> int:
    """Micro-batch passes (chunk passes when interleaved) whose activations device ``stage`` holds at peak."""
    p, m, v = cfg.pp, micro_batches, cfg.virtual_stages
    if p == 1:
        return 1
    if cfg.schedule == "gpipe":
        return m
    if cfg.schedule == "1f1b":
        return min(m, p - stage)
    if cfg.schedule in SPLIT_BACKWARD:
        return sum(_held_at_peak(cfg.schedule, p, m, v, stage))
    return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)


@functools.lru_cache(maxsize=1024)
def _schedule(kind: str, p: int, m: int, v: int):
    return build(kind, p, m, v)


def _walk(kind: str, p: int, m: int, v: int, stage: int):
    """Device ``stage``'s actions as (its local chunk, +1 for a forward / -1 for a pass that frees it / 0), for
    ``min(m, 2p)`` micro-batches: both zero-bubble orders reach their steady holding by then, and hold no
    more after (tests/unit/cost_model/test_zero_bubble.py), so a long step's walk is a short one's."""
    local = {c: j for j, c in enumerate(ParallelConfig(pp=p, schedule=kind, virtual_stages=v).device_chunks(stage))}
    for a in _schedule(kind, p, min(m, 2 * p), v)[stage]:
        yield local[a.stage], 1 if a.kind == "F" else -1 if releases(a) else 0


def _held_at_peak(kind: str, p: int, m: int, v: int, stage: int) -> tuple[int, ...]:
    """Passes of each local chunk device ``stage`` holds when it holds the most (its order walked)."""
    return _held_walked(kind, p, min(m, 2 * p), v, stage)


@functools.lru_cache(maxsize=4096)
def _held_walked(kind: str, p: int, m: int, v: int, stage: int) -> tuple[int, ...]:
    held, best = [0] * v, (0, (0,) * v)
    for j, step in _walk(kind, p, m, v, stage):
        held[j] += step
        if sum(held) > best[0]:
            best = (sum(held), tuple(held))
    return best[1]


def order_peak(cfg: ParallelConfig, stage: int, micro_batches: int, chunk_bytes: Sequence[float]) -> float:
    """Peak activation bytes of pipeline device ``stage`` under a zero-bubble schedule, its local chunks
    leaving ``chunk_bytes[j]`` per pass: its order (runtime/schedules.py) walked, a forward adding its
    chunk's bytes and a weight-gradient pass freeing them (:func:`_holdings`: the passes of each chunk held
    after each action, which the peak is the largest of, weighed by ``chunk_bytes``)."""
    held = _holdings(cfg.schedule, cfg.pp, min(micro_batches, 2 * cfg.pp), cfg.virtual_stages, stage)
    return max(0.0, float((held @ np.asarray(chunk_bytes, dtype=float)).max()))


@functools.lru_cache(maxsize=4096)
def _holdings(kind: str, p: int, m: int, v: int, stage: int) -> np.ndarray:
    """The distinct (chunk passes held) vectors device ``stage``'s order goes through, one row each (read-only:
    the search prices the same orders with every split's chunk sizes)."""
    steps = np.zeros((len(_schedule(kind, p, m, v)[stage]), v))
    for k, (j, step) in enumerate(_walk(kind, p, m, v, stage)):
        steps[k, j] = step
    held = np.unique(np.cumsum(steps, axis=0), axis=0) if len(steps) else np.zeros((1, v))
    held.setflags(write=False)
    return held


def chunk_passes(cfg: ParallelConfig, stage: int, micro_batches: int) -> tuple[int, ...]:
    """Micro-batch passes of each of device ``stage``'s chunks (one chunk unless interleaved) that
    it holds at some moment, whatever the sizes of its layers and chunks: its peak activations are
    at least the sum of these times each chunk's bytes of one pass (the outer search's memory
    bounds, solver/search.py and solver/even_split.py). :func:`in_flight` unless interleaved;
    interleaved, the warm-up's forwards and the first steady forward, all held before the first
    backward (:func:`interleaved_peak`), counted by chunk."""
    if cfg.schedule in SPLIT_BACKWARD and cfg.pp > 1:
        return _held_at_peak(cfg.schedule, cfg.pp, micro_batches, cfg.virtual_stages, stage)
    if cfg.schedule != "interleaved" or cfg.pp == 1:
        return (in_flight(cfg, stage, micro_batches),)
    p, v = cfg.pp, cfg.virtual_stages
    held = min(micro_batches * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return tuple(int(k) for k in np.bincount((np.arange(held) // p) % v, minlength=v))


def least_passes(cfg: ParallelConfig, stage: int, micro_batches: int) -> int:
    """The fewest passes of any one of device ``stage``'s layers it holds at its peak (:func:`chunk_passes`)."""
    return min(chunk_passes(cfg, stage, micro_batches))


def interleaved_peak(cfg: ParallelConfig, stage: int, micro_batches: int, chunk_bytes: Sequence[float]) -> float:
    """Peak activation bytes of pipeline device ``stage`` under interleaved 1F1B, its ``v`` chunks
    leaving ``chunk_bytes[j]`` per micro-batch pass. Megatron's order (runtime/schedules.py):
    forward step ``k`` runs local chunk ``(k // p) mod v``, backward step ``k`` chunk
    ``v - 1 - (k // p) mod v``; ``min(m v, 2 (p - d - 1) + (v - 1) p)`` warm-up forwards, then
    one forward and one backward alternately, then the remaining backwards. The peak is
    reached right after a forward; with equal chunks it is :func:`in_flight` passes of one chunk."""
    p, m, v = cfg.pp, micro_batches, len(chunk_bytes)
    total = m * v
    warmup = min(total, 2 * (p - stage - 1) + (v - 1) * p)
    size = np.asarray(chunk_bytes, dtype=float)
    steps = np.arange(total)
    added = np.cumsum(size[(steps // p) % v])                 # held after forward k, before any backward
    backwards = np.arange(total - warmup)                     # backward b follows forward warmup + b
    freed = np.concatenate([np.zeros(warmup + 1), np.cumsum(size[v - 1 - (backwards // p) % v])])[:total]
    return float((added - freed).max())