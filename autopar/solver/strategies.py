"""Per-op sharding strategies on a 1-D tensor-parallel group of ``t`` ranks (Alpa, Zheng et al. 2022, sec. 4).

A tensor's *spec* is a placement (autopar/plan/placement.py): ``R`` (``Replicate()``), ``S(d)``
(``Shard(d)``: split along dim ``d`` in ``t`` contiguous blocks), ``P`` (``Partial()``: partial sums
awaiting a reduction). A batch-independent constant op (a mask, a rotary table) that every rank makes
whole has one strategy, ``const`` (``Strategy.const``): it reads and makes ``R`` at no cost, whatever
its producers hold. ``S(d)`` is offered when ``shape[d] % t == 0``,
except on a *batch dim* (one whose size scales with the batch: dim 0 of the inputs, carried
through the ops' dims maps), whose size at run time is the micro-batch's, not the example's:
there it is offered exactly when the :class:`OpContext` allows batch splits. A layout that
splits a batch dim runs only micro-batches that divide by ``t`` (the search knows); one solved
without batch splits runs any. Either way the layout does not depend on the example's batch size.

A :class:`Strategy` of an op fixes the spec it needs of each activation input, the spec of
its output, the split dim of each parameter (``None``: whole), the GEMM dim the split
divides, the collectives it runs itself, the inputs whose gradient it leaves partial
(each needs an all-reduce in backward, once per producer: Megatron's ``f``) and the
parameter elements whose gradient must be all-reduced once per step (a weight kept whole
while its op splits along a dim the weight does not have: data parallelism inside the
group). The rules by op class:

- matmul with a weight: replicate; column (weight split on its out dim, output ``S(-1)``,
  input gradient partial); row (input ``S(-1)``, weight split on its in dim, output ``P``);
  ``split(d)`` of a token/batch dim (weight whole: step all-reduce);
- matmul of two activations: ``split(d)`` of any output dim, from the dims maps (batch dims
  split both inputs; ``m``/``n`` split one and leave the other's gradient partial);
  ``contract``: both split along the contracted dim, output ``P``;
- attention: ``split(d)`` of a batch dim common to q, k, v (batch, heads);
- convolution: replicate, ``split(0)`` (batch), column (output channels), row (input channels, ``P``);
- embedding: replicate, vocab (weight ``S(0)``, output ``P``), hidden (weight ``S(1)``, output
  ``S(-1)``), ``split(d)`` of an index dim;
- class losses: vocab (logits split on the class dim: the vocabulary-parallel cross entropy, one
  all-reduce of every rank's row max, exp-sum and target logit, as runtime/shard_ops.py runs it;
  nll: one of the target's value), offered for the losses of ``ops.VOCAB_LOSSES``, whose
  all-reduce that table sizes; ``split(d)`` of a row dim (an all-reduce of the loss), for
  ``ops.ROW_LOSSES``;
- norms, softmax, reductions, element-wise ops, pooling: ``split(d)`` of any output dim whose
  source dims are not reduced (batch norm may split its batch dim: per-rank statistics, as
  DDP without SyncBatchNorm does); sum/mean/amax/amin also split a reduced dim and
  all-reduce their output (``split_reduce(d)``);
- views: the producer's spec carried through the dims map (``P`` passes through); a view of a
  parameter (``W.t()``): whole, or split along a dim whose parameter dim divides (the parameter
  split with it);
- ops without a dims map: replicate only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

from .. import ops
from ..capture.opgraph import OpGraph, OpKind, OpNode, TensorMeta
from ..plan.placement import Partial, Placement, Replicate, Shard

R, P = Replicate(), Partial()




@dataclass(frozen=True)
class Comm:
    """A collective of ``numel`` elements (the full tensor, at the captured batch)."""

    kind: str           # all_reduce | all_gather | reduce_scatter | all_to_all
    phase: str          # fwd | bwd
    numel: int
    batch_dependent: bool


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on the group (see the module docstring)."""

    name: str
    inputs: tuple[Placement, ...]                 # required spec per activation input (node.inputs order)
    output: Placement
    params: tuple[tuple[str, int | None], ...]    # (fqn, split dim or None) per parameter the op reads
    gemm: str = ""                                # GEMM dim divided: "n" | "k" | "m" | "batch" | ""
    comms: tuple[Comm, ...] = ()                  # collectives the strategy runs itself
    partial: tuple[int, ...] = ()                 # inputs whose gradient comes out partial
    step: int = 0                                 # parameter elements all-reduced once per step
    const: bool = False                           # a batch-independent constant: reads and makes R for free

    @property
    def split_params(self) -> frozenset[str]:
        return frozenset(p for p, d in self.params if d is not None)


@dataclass
class OpContext:
    """Shapes, gradient flags and batch dims of every tensor of one graph, for strategy generation.
    ``batch_split``: whether a strategy may split a batch dim (module docstring)."""

    graph: OpGraph
    batch_split: bool = True
    _inputs: dict[str, TensorMeta] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._inputs = {gi.name: gi.meta for gi in self.graph.inputs}

    @cached_property
    def batch_dims(self) -> Mapping[str, frozenset[int]]:
        """Tensor name -> its dims whose size scales with the batch: dim 0 of a batched graph input,
        then each op's output dims its dims maps take from an input's batch dim (a batch-dependent op
        without a map, or whose map loses the batch, is taken to keep it in dim 0)."""
        out = {gi.name: frozenset({0}) if gi.batch_dependent and gi.meta.shape else frozenset()
               for gi in self.graph.inputs}
        for node in self.graph.nodes:
            dims: set[int] = set()
            if node.batch_dependent and node.outputs[0].shape:
                for i, src in enumerate(node.inputs[:len(node.dims)]):
                    source = out.get(src, frozenset())
                    dims.update(o for o, e in enumerate(node.dims[i]) if e in source)
                if not dims:
                    dims = {0}
            out[node.name] = frozenset(dims)
        return out

    def splittable(self, name: str, dim: int, t: int) -> bool:
        """Whether tensor ``name`` may be split ``t`` ways along ``dim`` (module docstring)."""
        shape = self.meta(name).shape
        if not 0 <= dim < len(shape):
            return False
        if dim in self.batch_dims.get(name, ()):
            return self.batch_split
        return shape[dim] % t == 0

    def meta(self, name: str) -> TensorMeta:
        if name in self.graph.node_index:
            return self.graph.node(name).outputs[0]
        return self._inputs[name]

    def requires_grad(self, name: str) -> bool:
        return name in self.graph.node_index and self.graph.node(name).requires_grad

    def is_const(self, name: str) -> bool:
        """Batch-independent and without gradient: every rank has it whole, for free."""
        if name not in self.graph.node_index:
            return False
        node = self.graph.node(name)
        return not node.batch_dependent and not node.requires_grad

    @cached_property
    def param_meta(self) -> Mapping[str, TensorMeta]:
        return self.graph.params


def replicate(node: OpNode) -> Strategy:
    return Strategy("replicate", tuple(R for _ in node.inputs), R, tuple((p, None) for p in node.params))


def node_strategies(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """Every strategy of ``node`` on ``t`` ranks, replicate first (a constant node has one: ``const``)."""
    if not node.inputs and node.param_dims and t > 1 and not ctx.is_const(node.name):
        return _param_view(ctx, node, t)
    if not node.inputs or ctx.is_const(node.name):
        return [Strategy("const", tuple(R for _ in node.inputs), R, tuple((p, None) for p in node.params),
                         const=True)]
    if t == 1 or not node.dims:
        return [replicate(node)]
    kind = node.kind
    if kind is OpKind.VIEW:
        return _view(ctx, node, t)
    if kind is OpKind.MATMUL:
        weights = [p for p in node.params if len(ctx.param_meta[p].shape) >= 2]
        if weights and len(node.inputs) == 1:
            return _linear(ctx, node, t, weights[0])
        if not node.params and len(node.inputs) == 2:
            return _generic(ctx, node, t) + _contract(ctx, node, t)
        return [replicate(node)]
    if kind is OpKind.ATTENTION:
        return _attention(ctx, node, t)
    if kind is OpKind.CONV and node.params and len(node.inputs) == 1:
        return _conv(ctx, node, t)
    if kind is OpKind.EMBEDDING and node.params and len(node.inputs) == 1:
        return _embedding(ctx, node, t)
    if kind is OpKind.LOSS:
        return _loss(ctx, node, t)
    if kind in (OpKind.CONV, OpKind.EMBEDDING, OpKind.CREATION):
        return [replicate(node)]
    out = _generic(ctx, node, t)
    if kind is OpKind.REDUCTION and ops.base_name(node.target) in ops.LINEAR_REDUCTIONS:
        out += _reduce_split(ctx, node, t)
    return out


def _partial(ctx: OpContext, node: OpNode, specs: tuple[Placement, ...], out_dim: int) -> tuple[int, ...]:
    """Inputs kept whole (R) while the output splits along ``out_dim``: their gradient sums over it."""
    return tuple(i for i, name in enumerate(node.inputs)
                 if specs[i] == R and node.dims[i][out_dim] < 0 and ctx.requires_grad(name))


def _param_dim(ctx: OpContext, node: OpNode, fqn: str, out_dim: int) -> int | None:
    """The dim of a parameter of an element-wise or norm op that runs along output dim ``out_dim``."""
    shape = ctx.param_meta[fqn].shape
    out = node.outputs[0].shape
    if ops.base_name(node.target) in ops.CHANNEL_NORMS:
        return 0 if out_dim == 1 and len(shape) == 1 and shape[0] == out[1] else None
    e = out_dim - (len(out) - len(shape))
    return e if e >= 0 and shape[e] == out[out_dim] and shape[e] != 1 else None


def _split_along(ctx: OpContext, node: OpNode, t: int, d: int, allow_reduced: bool = False
                 ) -> tuple[Placement, ...] | None:
    """Required input specs for an output split along ``d``, or None when not possible."""
    if not ctx.splittable(node.name, d, t):
        return None
    specs, mapped = [], False
    for i, name in enumerate(node.inputs):
        e = node.dims[i][d]
        if e < 0 or ctx.is_const(name) and ctx.meta(name).shape[e] % t:
            specs.append(R)
            continue
        if not ctx.splittable(name, e, t) or (i == 0 and e in node.reduced and not allow_reduced):
            return None
        specs.append(Shard(e))
        mapped = True
    return tuple(specs) if mapped else None


def _generic(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """Replicate, plus ``split(d)`` for every output dim ``d`` the dims maps allow."""
    out = [replicate(node)]
    bn = ops.base_name(node.target) in ops.BATCH_NORMS
    gemm_dims = len(node.outputs[0].shape)
    for d in range(len(node.outputs[0].shape)):
        specs = _split_along(ctx, node, t, d, allow_reduced=bn and d == 0)
        if specs is None:
            continue
        params, step = [], 0
        for p in node.params:
            e = _param_dim(ctx, node, p, d)
            if e is not None and ctx.param_meta[p].shape[e] % t == 0:
                params.append((p, e))
            else:
                params.append((p, None))
                step += ctx.param_meta[p].numel
        gemm = ""
        if node.gemm is not None:
            gemm = "n" if d == gemm_dims - 1 else "m" if d == gemm_dims - 2 else "batch"
        out.append(Strategy(f"split({d})", specs, Shard(d), tuple(params), gemm,
                            partial=_partial(ctx, node, specs, d), step=step))
    return out


def _view(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """The producer's spec carried through the dims map; other inputs (shape donors) are left whole. A view
    reading a parameter (``bias.expand_as(x)``: the parameter broadcast to an activation's shape) keeps it whole,
    so its output splits only along dims the parameter broadcasts over (a whole bias cannot fill a split dim it
    has), and its partial form, a parameter not being partial, is not offered."""
    rest = tuple(R for _ in node.inputs[1:])
    whole = tuple((p, None) for p in node.params)
    out = [Strategy("view", (R,) + rest, R, whole)] + ([] if node.params else [Strategy("view", (P,) + rest, P, ())])
    src = ctx.meta(node.inputs[0]).shape
    dims = node.dims[0]
    for e in range(len(src)):
        if not ctx.splittable(node.inputs[0], e, t):
            continue
        d = next((d for d, m in enumerate(dims) if m == e), None)
        if d is None or not ctx.splittable(node.name, d, t) or not _broadcasts(ctx, node, d):
            continue
        out.append(Strategy("view", (Shard(e),) + rest, Shard(d), whole))
    return out


def _broadcasts(ctx: OpContext, node: OpNode, d: int) -> bool:
    """Whether every parameter ``node`` reads is broadcast along its output dim ``d`` (absent there, or of size 1,
    aligned from the last dim as broadcasting aligns them)."""
    n = len(node.outputs[0].shape)
    for p in node.params:
        shape = ctx.param_meta[p].shape
        k = d - (n - len(shape))
        if k >= 0 and shape[k] != 1:
            return False
    return True


def _param_view(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """A view of a parameter (``W.t()`` that a matmul reads, as Falcon's and many hand-written linears
    do): whole (its gradient gathered whole when a consumer splits it), or split along an output dim
    whose parameter dim divides by ``t`` (the parameter split with it, as a column or row split of
    the matmul it feeds)."""
    out = [Strategy("replicate", (), R, tuple((p, None) for p in node.params))]
    for d in range(len(node.outputs[0].shape)):
        dims = [m[d] for m in node.param_dims]
        if all(e >= 0 and ctx.param_meta[p].shape[e] % t == 0 for p, e in zip(node.params, dims)):
            out.append(Strategy(f"split({d})", (), Shard(d), tuple(zip(node.params, dims))))
    return out


def _linear(ctx: OpContext, node: OpNode, t: int, weight: str) -> list[Strategy]:
    """Linear (weight (n, k)) or activation @ weight ((k, n)); a 1-D parameter is the bias."""
    x = node.inputs[0]
    w = ctx.param_meta[weight].shape
    out = node.outputs[0].shape
    n_dim, k_dim = (0, 1) if ops.base_name(node.target) == "linear" else (len(w) - 1, len(w) - 2)
    xk = len(ctx.meta(x).shape) - 1
    res = [replicate(node)]
    if node.dims and out and node.dims[0][len(out) - 1] >= 0:
        # the weight is the left operand (``W @ x``, Mamba's dt_proj): its rows are the output's
        # rows, not its columns; the column / row splits below are those of ``x @ W``
        return res + [s for d in range(len(out) - 1) if (s := _token_split(ctx, node, t, d)) is not None]

    def dims(w_dim: int | None, b_split: bool) -> tuple[tuple[str, int | None], ...]:
        return tuple((p, w_dim if p == weight else (0 if b_split else None)) for p in node.params)

    if w[n_dim] % t == 0 and out[-1] % t == 0 and all(
            ctx.param_meta[p].shape[0] % t == 0 for p in node.params if p != weight):
        res.append(Strategy("column", (R,), Shard(len(out) - 1), dims(n_dim, True), "n",
                            partial=(0,) if ctx.requires_grad(x) else ()))
    if w[k_dim] % t == 0 and ctx.splittable(x, xk, t):
        res.append(Strategy("row", (Shard(xk),), P, dims(k_dim, False), "k"))
    for d in range(len(out) - 1):
        split = _token_split(ctx, node, t, d)
        if split is not None:
            res.append(split)
    return res


def _token_split(ctx: OpContext, node: OpNode, t: int, d: int) -> Strategy | None:
    """A matmul with a weight, split along output dim ``d`` (a token or batch dim of the activation),
    the weight whole: its gradient is all-reduced once per step."""
    specs = _split_along(ctx, node, t, d)
    if specs is None:
        return None
    step = sum(ctx.param_meta[p].numel for p in node.params)
    return Strategy(f"split({d})", specs, Shard(d), tuple((p, None) for p in node.params), "m", step=step)


def _contract(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """Both operands split along the contracted dim: partial output. ``linear(x, w)`` contracts w's
    last dim (it computes ``x @ w.T``); ``matmul`` / ``mm`` / ``bmm`` the second operand's next to last."""
    a, b = (ctx.meta(n).shape for n in node.inputs)
    if len(a) < 2 or len(b) < 2:
        return []
    kb = len(b) - 1 if ops.base_name(node.target) == "linear" else len(b) - 2
    if not (ctx.splittable(node.inputs[0], len(a) - 1, t) and ctx.splittable(node.inputs[1], kb, t)):
        return []
    return [Strategy("contract", (Shard(len(a) - 1), Shard(kb)), P, (), "k")]


def _attention(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """Split a batch dim that q, k and v all have (batch, heads); masks follow or stay whole."""
    res = [replicate(node)]
    for d in range(len(node.outputs[0].shape) - 2):
        if any(node.dims[i][d] < 0 for i in range(min(3, len(node.inputs)))):
            continue
        specs = _split_along(ctx, node, t, d)
        if specs is not None:
            res.append(Strategy(f"split({d})", specs, Shard(d), (), "batch", partial=_partial(ctx, node, specs, d)))
    return res


def _conv(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    x = node.inputs[0]
    xs = ctx.meta(x).shape
    weight = node.params[0]
    w = ctx.param_meta[weight].shape
    out = node.outputs[0].shape
    res = [replicate(node)]
    step = sum(ctx.param_meta[p].numel for p in node.params)
    if ctx.splittable(node.name, 0, t) and ctx.splittable(x, 0, t):
        res.append(Strategy("split(0)", (Shard(0),), Shard(0), tuple((p, None) for p in node.params), "m", step=step))
    plain = len(w) >= 3 and out[1] == w[0] and xs[1] == w[1]   # groups == 1, not transposed
    if plain and w[0] % t == 0:
        res.append(Strategy("column", (R,), Shard(1), tuple((p, 0) for p in node.params), "n",
                            partial=(0,) if ctx.requires_grad(x) else ()))
    if plain and w[1] % t == 0:
        res.append(Strategy("row", (Shard(1),), P, tuple((p, 1 if p == weight else None) for p in node.params), "k"))
    return res


def _embedding(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    weight = node.params[0]
    vocab, hidden = ctx.param_meta[weight].shape[:2]
    out = node.outputs[0].shape
    res = [replicate(node)]
    if vocab % t == 0 and node.batch_dependent:
        # vocabulary parallel only for lookups of the batch's tokens: DTensor's masked partial output of
        # a table looked up by batch-independent indices (T5's relative position bias, reused by every
        # layer through views) cannot be run by the runtime, and such a table is small anyway
        res.append(Strategy("vocab", (R,), P, ((weight, 0),)))
    if hidden % t == 0:
        res.append(Strategy("hidden", (R,), Shard(len(out) - 1), ((weight, 1),)))
    for d in range(len(out) - 1):
        specs = _split_along(ctx, node, t, d)
        if specs is not None:
            res.append(Strategy(f"split({d})", specs, Shard(d), ((weight, None),),
                                step=ctx.param_meta[weight].numel))
    return res


def _loss(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """Vocabulary-parallel cross entropy, or a split of the rows with an all-reduce of the loss."""
    res = [replicate(node)]
    if not node.dims or not node.reduced:
        return res
    logits = ctx.meta(node.inputs[0])
    out = node.outputs[0]
    cls = node.reduced[0]
    base = ops.base_name(node.target)
    rest = tuple(R for _ in node.inputs[1:])
    rows = out.numel if out.shape else max(1, logits.numel // max(1, logits.shape[cls]))
    if base in ops.VOCAB_LOSSES and len(node.reduced) == 1 and ctx.splittable(node.inputs[0], cls, t):
        numel = ops.VOCAB_LOSSES[base].all_reduce_numel(rows, t)
        res.append(Strategy("vocab", (Shard(cls),) + rest, R, (),
                            comms=(Comm("all_reduce", "fwd", numel, node.batch_dependent),)))
    if out.shape:
        return res + [s for s in _generic(ctx, node, t)[1:]]
    if base not in ops.ROW_LOSSES:
        return res
    for d in range(len(logits.shape)):
        if d in node.reduced and base in ops.VOCAB_LOSSES or not ctx.splittable(node.inputs[0], d, t):
            continue
        specs = [Shard(d)]
        for name in node.inputs[1:]:
            shape = ctx.meta(name).shape
            e = d if len(shape) == len(logits.shape) else (d if d < cls else d - 1)
            if not ctx.splittable(name, e, t):
                specs = None
                break
            specs.append(Shard(e))
        if specs is not None:
            res.append(Strategy(f"split({d})", tuple(specs), R, (),
                                comms=(Comm("all_reduce", "fwd", max(1, out.numel), node.batch_dependent),)))
    return res


def _reduce_split(ctx: OpContext, node: OpNode, t: int) -> list[Strategy]:
    """A reduction over a split dim: local partial results, then an all-reduce of the output."""
    x = node.inputs[0]
    res = []
    for e in node.reduced:
        if ctx.splittable(x, e, t):
            res.append(Strategy(f"split_reduce({e})", (Shard(e),) + tuple(R for _ in node.inputs[1:]), R, (),
                                comms=(Comm("all_reduce", "fwd", max(1, node.outputs[0].numel),
                                            node.batch_dependent),)))
    return res
