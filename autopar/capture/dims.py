"""Dimension maps of one op: which input dim each output dim comes from, and which dims it reduces.

For an op with output ``y`` and tensor arguments ``x_0, x_1, ...`` the map of ``x_i`` is a
tuple with one entry per dim of ``y`` (its first output for multi-output ops): the dim of
``x_i`` it is taken from, or -1 when none is (a new dim, a broadcast one, the inner dims
of a merged or split run, a contracted or windowed one). ``reduced`` lists the dims of the
first tensor argument the op reduces or normalises over (softmax's dim, a layer norm's
normalised dims, a reduction's dims, a loss' class dim).

The sharding ILP (solver/sharding.py) reads them: an output split along ``d`` needs
``x_i`` split along ``map_i[d]`` (or whole, when -1); a split of a reduced dim is not
local. Ops this module does not know get no map (``None``): the ILP keeps them
replicated, which is always correct.

Views are mapped by grouping input and output dims into runs of equal products
(``(b, s, h) -> (b, s, heads, hd)``: runs ``b|b``, ``s|s``, ``h|heads hd``); the
outermost non-unit dim of a run maps to the outermost of the other side's run (a
contiguous split of one is a contiguous split of the other), the rest map to -1.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .. import ops

Map = tuple[int, ...]


def shape_of(value: Any) -> tuple[int, ...] | None:
    """Shape of a tensor (or of the first tensor of a list), else None."""
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    return tuple(int(d) for d in value.shape) if isinstance(value, torch.Tensor) else None


def bound_args(node: torch.fx.Node) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in (empty for ops without a schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _norm(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _dims_list(value: Any, ndim: int) -> list[int] | None:
    """A ``dim`` argument as a sorted list of non-negative dims; None means every dim."""
    if value is None:
        return None
    if isinstance(value, int):
        return [_norm(value, ndim)]
    vals = list(value)
    return sorted({_norm(int(v), ndim) for v in vals}) if vals else None


def broadcast_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> Map:
    """Right-aligned broadcasting: out dim -> the same-sized input dim, -1 for new or size-1 dims."""
    off = len(out_shape) - len(in_shape)
    res = []
    for d, size in enumerate(out_shape):
        e = d - off
        res.append(e if e >= 0 and in_shape[e] == size and size != 1 else -1)
    return tuple(res)


def reshape_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> Map:
    """Views: group non-unit dims into runs of equal products; outermost dims of matching runs map."""
    ins = [i for i, s in enumerate(in_shape) if s != 1]
    outs = [j for j, s in enumerate(out_shape) if s != 1]
    res = [-1] * len(out_shape)
    i = j = 0
    while i < len(ins) and j < len(outs):
        i0, j0 = i, j
        pi, pj = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(ins):
                pi *= in_shape[ins[i]]
                i += 1
            elif pj < pi and j < len(outs):
                pj *= out_shape[outs[j]]
                j += 1
            else:
                return tuple(res)  # products never meet: leave the rest unmapped
        res[outs[j0]] = ins[i0]
    return tuple(res)


def _identity_except(ndim: int, dropped: Sequence[int]) -> Map:
    return tuple(-1 if d in dropped else d for d in range(ndim))


def _matmul_maps(a: tuple[int, ...], b: tuple[int, ...], out: tuple[int, ...]) -> tuple[Map, Map] | None:
    """torch.matmul: batch dims broadcast, m from a[-2], n from b[-1]; the contracted dim is in neither."""
    if len(a) >= 2 and len(b) >= 2:
        nb = len(out) - 2
        ma = broadcast_map(a[:-2], out[:nb]) + (len(a) - 2, -1)
        mb = broadcast_map(b[:-2], out[:nb]) + (-1, len(b) - 1)
        return ma, mb
    if len(a) == 1 and len(b) >= 2:   # (k) @ (..., k, n) -> (..., n)
        return tuple([-1] * len(out)), broadcast_map(b[:-2], out[:-1]) + (len(b) - 1,)
    if len(a) >= 2 and len(b) == 1:   # (..., m, k) @ (k) -> (..., m)
        return broadcast_map(a[:-2], out[:-1]) + (len(a) - 2,), tuple([-1] * len(out))
    return None


def op_dims(name: str, node: torch.fx.Node, targs: Sequence[tuple[int, torch.fx.Node]],
            out_shape: tuple[int, ...]) -> tuple[tuple[Map | None, ...], tuple[int, ...]]:
    """(one map per tensor argument in ``targs`` order or None when unknown, reduced dims of the first)."""
    shapes = [shape_of(a.meta.get("val")) for _, a in targs]
    if not targs or any(s is None for s in shapes):
        return tuple(None for _ in targs), ()
    try:
        maps, reduced = _dispatch(name, node, shapes, out_shape)
    except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError):
        return tuple(None for _ in targs), ()
    if maps is None or len(maps) != len(targs) or any(m is not None and len(m) != len(out_shape) for m in maps):
        return tuple(None for _ in targs), ()
    return tuple(maps), tuple(reduced)


def _dispatch(name: str, node: torch.fx.Node, shapes: list, out: tuple[int, ...]):
    x = shapes[0]
    nd = len(x)
    args = bound_args(node)
    if name in ops.BROADCASTING:
        return [broadcast_map(s, out) for s in shapes], ()
    if name in ops.RESHAPES:
        return [reshape_map(x, out)] + [None] * (len(shapes) - 1), ()
    if name == "permute":
        perm = [_norm(int(d), nd) for d in args["dims"]]
        return [tuple(perm)], ()
    if name == "transpose":
        a, b = _norm(int(args["dim0"]), nd), _norm(int(args["dim1"]), nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
        return [tuple(perm)], ()
    if name in ("t", "numpy_T", "mT"):
        perm = list(range(nd))
        if nd >= 2:
            perm[-1], perm[-2] = perm[-2], perm[-1]
        return [tuple(perm) if name != "numpy_T" else tuple(reversed(range(nd)))], ()
    if name == "movedim":
        src = [_norm(int(d), nd) for d in (args["source"] if isinstance(args["source"], (list, tuple))
                                           else [args["source"]])]
        dst = [_norm(int(d), nd) for d in (args["destination"] if isinstance(args["destination"], (list, tuple))
                                           else [args["destination"]])]
        perm = [-1] * nd
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter(d for d in range(nd) if d not in src)
        return [tuple(p if p >= 0 else next(rest) for p in perm)], ()
    if name == "select":
        dim = _norm(int(args["dim"]), nd)
        return [tuple(d for d in range(nd) if d != dim)], ()
    if name in ("unbind",):
        dim = _norm(int(args.get("dim", 0)), nd)
        return [tuple(d for d in range(nd) if d != dim)], ()
    if name in ("slice", "narrow"):
        dim = _norm(int(args["dim"]), nd)
        return [_identity_except(nd, [] if x[dim] == out[dim] else [dim])], ()
    if name in ops.SPLITS:
        dim = _norm(int(args.get("dim", 0)), nd)
        return [_identity_except(nd, [] if x[dim] == out[dim] else [dim])], ()
    if name == "getitem":
        if len(x) == len(out):
            return [tuple(d if x[d] == out[d] else -1 for d in range(nd))], ()
        return None, ()
    if name in ("cat", "concat"):
        dim = _norm(int(args.get("dim", 0)), len(out))
        return [_identity_except(len(out), [dim]) if len(s) == len(out) else tuple([-1] * len(out))
                for s in shapes], ()
    if name == "stack":
        dim = _norm(int(args.get("dim", 0)), len(out))
        return [tuple(-1 if d == dim else (d if d < dim else d - 1) for d in range(len(out))) for _ in shapes], ()
    if name in ("tril", "triu"):
        return [_identity_except(nd, [nd - 2, nd - 1])], ()
    if name in ("constant_pad_nd", "pad"):
        pad = list(args["pad"])
        padded = [nd - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]]
        return [_identity_except(nd, padded)], ()
    if name == "repeat":
        reps = list(args["repeats"])
        base = broadcast_map(x, out)
        lead = len(out) - nd
        return [tuple(-1 if (d < lead or reps[d] != 1) else base[d] for d in range(len(out)))], ()
    if name in ("flip", "roll"):
        dims = _dims_list(args.get("dims"), nd)
        return [_identity_except(nd, range(nd) if dims is None else dims)], ()
    if name in ("cumsum", "cumprod"):
        return [tuple(range(nd))], (_norm(int(args["dim"]), nd),)
    if name == "repeat_interleave":
        if args.get("dim") is None or len(shapes) > 1:
            return None, ()
        return [tuple(range(nd))], ()
    if name in ops.SOFTMAXES:
        return [tuple(range(nd))], (_norm(int(args["dim"]), nd),)
    if name in ops.LAYER_NORMS:
        k = len(list(args["normalized_shape"]))
        return [broadcast_map(s, out) for s in shapes], tuple(range(nd - k, nd))
    if name in ops.BATCH_NORMS:
        return [broadcast_map(s, out) if i == 0 else None for i, s in enumerate(shapes)], \
            tuple(d for d in range(nd) if d != 1)
    if name in ops.CHANNEL_NORMS:   # group and instance norms
        keep = (0,) if name in ops.GROUP_NORMS else (0, 1)
        return [tuple(range(nd)) if i == 0 else None for i in range(len(shapes))], \
            tuple(d for d in range(nd) if d not in keep)
    if name in ops.REDUCTIONS:
        return _reduction(args, x, out, len(shapes))
    if name.startswith(("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool", "lp_pool")):
        k = 3 if "3d" in name else 1 if "1d" in name else 2
        lead = len(out) - k
        return [tuple(d if d < lead else -1 for d in range(len(out)))], ()
    if name == "linear":
        maps = [tuple(range(len(out) - 1)) + (-1,)]
        if len(shapes) > 1:
            maps.append(tuple([-1] * (len(out) - 1)) + (0,))
        if len(shapes) > 2:
            maps.append(broadcast_map(shapes[2], out))
        return maps, ()
    if name in ("mm", "bmm", "matmul"):
        pair = _matmul_maps(shapes[0], shapes[1], out) if len(shapes) == 2 else None
        return (list(pair) if pair else None), ()
    if name in ("addmm", "baddbmm") and len(shapes) == 3:
        pair = _matmul_maps(shapes[1], shapes[2], out)
        return ([broadcast_map(shapes[0], out)] + list(pair) if pair else None), ()
    if name == "outer" and len(shapes) == 2:
        return [(0, -1), (-1, 0)], ()
    if name in ops.SDPA:
        return _attention(shapes, out), ()
    if name in ops.FORWARD_CONVOLUTIONS:
        maps = [(0,) + tuple([-1] * (len(out) - 1))]
        if len(shapes) > 1:
            maps.append((-1, 0) + tuple([-1] * (len(out) - 2)))
        if len(shapes) > 2:
            maps.append((-1, 0) + tuple([-1] * (len(out) - 2)))
        return maps, ()
    if name == "embedding":
        # embedding(weight, indices): the weight is usually a parameter, the indices the activation
        ids_first = len(shapes) == 1
        ids_map = tuple(range(len(out) - 1)) + (-1,)
        return ([ids_map] if ids_first else [tuple([-1] * (len(out) - 1)) + (1,), ids_map]), ()
    if name in ops.CLASS_LOSSES:
        cls = 1 if nd >= 2 else 0
        if len(out) == 0:
            return [() for _ in shapes], (cls,)
        keep = [d for d in range(nd) if d != cls]
        return [tuple(keep)] + [tuple(range(len(out))) for _ in shapes[1:]], (cls,)
    if name in ops.ELEMENT_LOSSES:
        if len(out) == 0:
            return [() for _ in shapes], tuple(range(nd))
        return [broadcast_map(s, out) for s in shapes], ()
    return None, ()


def _reduction(args: dict, x: tuple[int, ...], out: tuple[int, ...], n: int):
    nd = len(x)
    dims = _dims_list(args.get("dim"), nd)
    reduced = list(range(nd)) if dims is None else dims
    keep = bool(args.get("keepdim", False))
    if keep:
        m = tuple(-1 if d in reduced else d for d in range(nd))
    else:
        m = tuple(d for d in range(nd) if d not in reduced)
    if len(m) != len(out):
        return None, ()
    return [m] + [None] * (n - 1), tuple(reduced)


def _attention(shapes: list, out: tuple[int, ...]) -> list[Map | None]:
    """q (..., Lq, E), k (..., Lk, E), v (..., Lk, Ev) -> (..., Lq, Ev); a mask broadcasts to (..., Lq, Lk).

    Grouped-query attention (``enable_gqa``: k and v with ``h_kv`` heads dividing q's ``h``): the
    output's heads dim maps to k's and v's heads dim too, since query head ``i`` reads key head
    ``i // (h / h_kv)``: the same contiguous split of both (``h_kv`` divisible by the split) keeps
    every group's query heads with their key head."""
    q, k, v = shapes[0], shapes[1], shapes[2]
    nb = len(out) - 2

    def kv_map(t: Sequence[int]) -> Map:
        m = list(broadcast_map(t[:-2], out[:nb]))
        heads = len(t) - 3
        if nb >= 1 and heads >= 0 and m[nb - 1] < 0 and 1 < t[heads] < out[nb - 1] and out[nb - 1] % t[heads] == 0:
            m[nb - 1] = heads
        return tuple(m)

    maps: list[Map | None] = [
        broadcast_map(q[:-2], out[:nb]) + (len(q) - 2, -1),
        kv_map(k) + (-1, -1),
        kv_map(v) + (-1, len(v) - 1),
    ]
    for mask in shapes[3:]:
        scores = out[:-1] + (k[-2],)
        maps.append(broadcast_map(mask, scores)[:-1] + (-1,))
    return maps


def node_dims(name: str, node: torch.fx.Node, targs: Sequence[tuple[int, torch.fx.Node]],
              keep: Sequence[bool], out_shape: tuple[int, ...] | None) -> tuple[tuple[Map, ...], tuple[int, ...]]:
    """``OpNode.dims`` and ``OpNode.reduced``: maps of the activation inputs (``keep[i]`` marks a tensor
    argument that is one; the first argument of each producer counts), ``()`` when any is unknown."""
    if out_shape is None:
        return (), ()
    maps, reduced = op_dims(name, node, targs, out_shape)
    chosen: dict[str, Map | None] = {}
    for (_, arg), m, k in zip(targs, maps, keep):
        if k and arg.name not in chosen:
            chosen[arg.name] = m
    if not chosen or any(m is None for m in chosen.values()):
        return (), tuple(reduced)
    return tuple(chosen.values()), tuple(reduced)  # type: ignore[arg-type]


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
