"""Forward and backward FLOPs of one op, and its GEMM shape.

Matmuls and convolutions are counted by ``torch.utils.flop_counter.FlopCounterMode``:
the op is re-run on meta tensors of the captured shapes, forward and then backward
(``torch.autograd.grad`` for exactly the inputs that need a gradient), so a linear on
the network input costs 1x forward in backward, a hidden one 2x. Results are cached
per (op, shapes, dtypes, requires-grad, scalar args), so 96 identical decoder layers
cost one count.

Attention is counted by formula, because FlopCounterMode counts the CPU SDPA kernel
as 0: forward ``4 b h s_q s_k d`` (QK^T and PV, causal masking not discounted, as in
Megatron-LM's accounting), backward twice that. What a causal kernel skips is its GEMM's
``density`` (:func:`causal_density`), which prices the time, not the count.

Grouped GEMMs (``grouped_mm``, transformers' ``grouped_mm_fallback``) are counted by formula
too (FlopCounterMode does not know the custom op): ``x`` [S, k] times the weight of each
row's group [k, n] is ``2 S k n`` forward, whichever group a row belongs to; backward
``2 S k n`` per operand that needs a gradient.

Other ops are memory-bound; they count one FLOP per output element forward and per
input element backward, which the roofline then ignores next to their bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from ..ops import BIAS_MATMULS
from .opgraph import Gemm, OpKind, TensorMeta


@dataclass
class FlopCache:
    """Explicit cache of counted ops: key -> (forward FLOPs, backward FLOPs)."""

    entries: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _key(target: Any, args: tuple, kwargs: dict, grads: tuple[bool, ...]) -> tuple:
    def norm(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), str(x.dtype))
        return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)
    flat_args = tree_map(norm, args)
    return (str(target), repr(flat_args), repr(sorted((k, norm(v)) for k, v in kwargs.items())), grads)


def _as_meta(x: Any, requires_grad: bool) -> Any:
    if isinstance(x, torch.Tensor):
        t = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
        return t.requires_grad_(requires_grad and t.is_floating_point())
    return x


def count_matmul_flops(target: Callable, args: tuple, kwargs: dict, grads: tuple[bool, ...],
                       cache: FlopCache) -> tuple[float, float]:
    """FLOPs of a matmul/conv node: ``args`` hold example tensors (fake or meta) in call order,
    ``grads[i]`` whether the i-th tensor argument (in flattening order) needs a gradient."""
    key = _key(target, args, kwargs, grads)
    if key in cache.entries:
        return cache.entries[key]
    flags = iter(grads)
    meta_args = tree_map(lambda x: _as_meta(x, next(flags)) if isinstance(x, torch.Tensor) else x, args)
    leaves = [x for x in _leaves(meta_args) if isinstance(x, torch.Tensor) and x.requires_grad]
    try:
        with FlopCounterMode(display=False) as counter:
            out = target(*meta_args, **kwargs)
            fwd = float(counter.get_total_flops())
            if leaves and isinstance(out, torch.Tensor) and out.requires_grad:
                torch.autograd.grad(out, leaves, torch.empty_like(out), allow_unused=True)
            bwd = float(counter.get_total_flops()) - fwd
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        # The op cannot run on meta tensors (rare: data-dependent shapes). Counted as 0 and
        # reported in OpGraph.warnings rather than guessed.
        cache.failures.append(f"{target}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        fwd, bwd = 0.0, 0.0
    cache.entries[key] = (fwd, bwd)
    return fwd, bwd


def _leaves(tree: Any) -> list:
    out: list = []
    tree_map(lambda x: out.append(x), tree)
    return out


def attention_flops(q: TensorMeta, k: TensorMeta, v: TensorMeta, needs_grad: bool) -> tuple[float, float]:
    """Fused attention: QK^T is ``2 b h s_q s_k d`` and PV ``2 b h s_q s_k d_v``."""
    bh = math.prod(q.shape[:-2])
    s_q, d = q.shape[-2], q.shape[-1]
    s_k, d_v = k.shape[-2], v.shape[-1]
    fwd = 2.0 * bh * s_q * s_k * (d + d_v)
    return fwd, (2.0 * fwd if needs_grad else 0.0)


def causal_density(s_q: int, s_k: int) -> float:
    """Share of the ``s_q x s_k`` (query, key) pairs a causal mask keeps, with SDPA's alignment
    (query ``i`` sees keys ``0..i``): ``s(s + 1) / 2`` of ``s^2`` when the lengths match."""
    if s_q <= 0 or s_k <= 0:
        return 1.0
    kept = s_q * (s_q + 1) / 2 if s_q <= s_k else s_k * (s_k + 1) / 2 + (s_q - s_k) * s_k
    return kept / (s_q * s_k)


def is_causal(target: Any, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether an attention op's call passes ``is_causal=True`` (by position or name, per its schema)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return bool(kwargs.get("is_causal", False))
    names = [a.name for a in schema.arguments]
    if "is_causal" not in names:
        return False
    pos = names.index("is_causal")
    value = args[pos] if pos < len(args) else kwargs.get("is_causal", False)
    return value is True


def grouped_mm_flops(x: TensorMeta, w: TensorMeta, out: TensorMeta, grads: tuple[bool, bool]
                     ) -> tuple[float, float]:
    """Grouped GEMM: ``x`` [S, k] @ per-group ``w`` [G, k, n] -> [S, n] is ``2 S k n``; the batched
    form ([G, m, k] @ [G, k, n]) ``2 G m k n``; the 2-D form ([m, K] @ [K, n] -> [G, m, n], groups
    along K) ``2 m K n``. Backward: the same once per operand in ``grads`` (needs a gradient)."""
    if len(x.shape) == 2 and len(w.shape) == 2:
        fwd = 2.0 * x.shape[0] * x.shape[1] * w.shape[1]
    else:
        fwd = 2.0 * out.numel * x.shape[-1]
    return fwd, fwd * sum(grads)


def gemm_shape(name: str, kind: OpKind, tensors: list[TensorMeta], out: TensorMeta | None,
               batch_dependent: list[bool], causal: bool = False) -> Gemm | None:
    """The GEMM an op performs, for the matmul efficiency model; None when it is not one.
    ``causal``: an attention op under ``is_causal`` (its GEMM's ``density``)."""
    if out is None or len(tensors) < 2:
        return None
    if kind is OpKind.ATTENTION:
        q, k = tensors[0], tensors[1]
        density = causal_density(q.shape[-2], k.shape[-2]) if causal else 1.0
        return Gemm(math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1],
                    "batch" if batch_dependent[0] else "", density)
    if kind is OpKind.CONV:
        w = tensors[1]
        if len(out.shape) < 3 or len(w.shape) < 3:
            return None
        return Gemm(1, out.shape[0] * math.prod(out.shape[2:]), w.shape[0], math.prod(w.shape[1:]),
                    "m" if batch_dependent[0] else "")
    if kind is not OpKind.MATMUL:
        return None
    if name in BIAS_MATMULS:
        tensors, batch_dependent = tensors[1:], batch_dependent[1:]
    a, b = tensors[0], tensors[1]
    if name == "linear":  # weight is (n, k)
        m, k = math.prod(a.shape[:-1]), a.shape[-1]
        scaled = "m" if batch_dependent[0] else ""
        return Gemm(1, m, b.shape[0], k, scaled)
    if len(a.shape) >= 2 and len(b.shape) >= 2:
        batch = math.prod(out.shape[:-2]) if len(out.shape) > 2 else 1
        scaled = "batch" if (batch > 1 and (batch_dependent[0] or batch_dependent[1])) else (
            "m" if batch_dependent[0] else "")
        if len(b.shape) == 2 and len(a.shape) > 2:  # activation @ weight
            return Gemm(1, math.prod(a.shape[:-1]), b.shape[-1], a.shape[-1], "m" if batch_dependent[0] else "")
        return Gemm(batch, a.shape[-2], b.shape[-1], a.shape[-1], scaled)
    return None
