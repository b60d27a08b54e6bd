"""Per-op knowledge: the cost class of an ATen op and what autograd saves for its backward.

The saved-tensor rules follow the backward formulas of ATen's derivatives.yaml
(the same accounting as Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", section 4): a linear keeps its input when the weight
needs a gradient, GeLU keeps its input, softmax its output, dropout a 1-byte mask,
layer norm its input plus per-row statistics, fused attention q, k, v, its output
and the log-sum-exp. Ops without a rule keep every floating input that another
input's gradient could need (conservative: over-counts rather than under-counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .. import ops
from .opgraph import OpKind, TensorMeta

_KINDS: dict[str, OpKind] = {
    name: kind for kind, names in ((OpKind.MATMUL, ops.MATMULS), (OpKind.CONV, ops.CONVOLUTIONS),
                                   (OpKind.ATTENTION, ops.ATTENTIONS), (OpKind.NORM, ops.NORMS),
                                   (OpKind.SOFTMAX, ops.SOFTMAXES), (OpKind.DROPOUT, ops.DROPOUTS),
                                   (OpKind.EMBEDDING, ops.EMBEDDINGS), (OpKind.LOSS, ops.LOSSES),
                                   (OpKind.VIEW, ops.VIEWS), (OpKind.CREATION, ops.CREATION),
                                   (OpKind.REDUCTION, ops.REDUCTIONS), (OpKind.ELEMENTWISE, ops.ELEMENTWISE))
    for name in names}

def op_kind(name: str) -> OpKind:
    """Cost class of an op by its base name; unknown ops count as elementwise-like ``OTHER``."""
    return _KINDS.get(name, OpKind.OTHER)


@dataclass(frozen=True)
class ArgInfo:
    """One tensor argument of a node: its position, metadata and whether it needs a gradient."""

    position: int
    meta: TensorMeta
    requires_grad: bool


@dataclass(frozen=True)
class SavedSpec:
    """What a rule says an op saves: positions of saved tensor args, whether the output is
    saved, and internal extras as (label, numel, dtype)."""

    inputs: tuple[int, ...] = ()
    output: bool = False
    extras: tuple[tuple[str, int, str], ...] = ()


def _positions(args: Sequence[ArgInfo]) -> dict[int, ArgInfo]:
    return {a.position: a for a in args}


def _bilinear(args: Sequence[ArgInfo], a: int, b: int) -> tuple[int, ...]:
    """For out = f(a, b) bilinear: a is needed for b's gradient and vice versa."""
    pos = _positions(args)
    saved = []
    if a in pos and b in pos:
        if pos[b].requires_grad:
            saved.append(a)
        if pos[a].requires_grad:
            saved.append(b)
    return tuple(saved)


def saved_spec(name: str, args: Sequence[ArgInfo], out: TensorMeta | None, kwargs: dict) -> SavedSpec:
    """What autograd keeps for the backward of op ``name`` called with tensor ``args``."""
    if not any(a.requires_grad for a in args):
        return SavedSpec()
    kind = op_kind(name)
    if kind in (OpKind.VIEW, OpKind.CREATION) or name in ops.SAVES_NOTHING:
        return SavedSpec()
    if name in ops.BIAS_MATMULS:
        return SavedSpec(inputs=_bilinear(args, 1, 2))
    if name in ops.MATMULS or name in ops.FORWARD_CONVOLUTIONS:
        return SavedSpec(inputs=_bilinear(args, 0, 1))
    if kind is OpKind.ATTENTION:
        q = _positions(args).get(0)
        rows = math.prod(q.meta.shape[:-1]) if q else 0
        return SavedSpec(inputs=tuple(p for p in (0, 1, 2) if p in _positions(args)), output=True,
                         extras=(("lse", rows, "float32"),))
    if kind is OpKind.NORM:
        return _norm_saved(name, args)
    if kind is OpKind.SOFTMAX:
        return SavedSpec(output=True)
    if kind is OpKind.DROPOUT:
        p = kwargs.get("p", 0.5)
        train = kwargs.get("train", True)
        if out is None or not train or p == 0:
            return SavedSpec()
        return SavedSpec(extras=(("mask", out.numel, "bool"),))
    if kind is OpKind.EMBEDDING:
        return SavedSpec(inputs=(1,))
    if kind is OpKind.LOSS:
        first = _positions(args).get(0)
        extras = (("log_probs", first.meta.numel, first.meta.dtype),) if first and name.startswith("cross") else ()
        return SavedSpec(inputs=tuple(p for p in _positions(args) if p > 0), extras=extras)
    if name in ops.SAVES_OUTPUT:
        return SavedSpec(output=True)
    if name in ops.SAVES_INPUT:
        return SavedSpec(inputs=(0,))
    if name == "mul":
        return SavedSpec(inputs=_bilinear(args, 0, 1))
    if name == "div":
        pos = _positions(args)
        saved = {1} if 1 in pos else set()
        if 1 in pos and pos[1].requires_grad:
            saved.add(0)
        return SavedSpec(inputs=tuple(sorted(saved)))
    if name in ("masked_fill", "where", "index", "gather", "index_select", "scatter", "take_along_dim"):
        return SavedSpec(inputs=tuple(a.position for a in args if not a.meta.is_float))
    if kind is OpKind.REDUCTION:
        return SavedSpec(inputs=(0,), output=True) if name in ("amax", "amin", "max", "min", "norm",
                                                                "linalg_vector_norm", "logsumexp") else SavedSpec()
    # Unknown op: keep every floating tensor input (conservative).
    return SavedSpec(inputs=tuple(a.position for a in args if a.meta.is_float))


def _norm_saved(name: str, args: Sequence[ArgInfo]) -> SavedSpec:
    """Norms keep their input and per-group statistics (mean and reciprocal std, fp32)."""
    x = _positions(args).get(0)
    if x is None:
        return SavedSpec()
    if name in ops.CHANNEL_NORMS:
        channels = x.meta.shape[1] if len(x.meta.shape) > 1 else 1
        return SavedSpec(inputs=(0,), extras=(("stats", 2 * channels, "float32"),))
    rows = math.prod(x.meta.shape[:-1])
    count = 1 if name in ops.RMS_NORMS else 2
    return SavedSpec(inputs=(0,), extras=(("stats", count * rows, "float32"),))
