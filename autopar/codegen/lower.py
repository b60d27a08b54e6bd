"""Lowering: the plan's per-op specs -> what one tensor-parallel rank runs, op by op, on its shards.

For every node of the exported graph the lowering decides, once and before the first step:

- the spec each value is *held* in on this rank (a node's output spec; ``R`` for the batch's
  inputs and buffers; a parameter's split from the plan; a value received from an earlier
  pipeline chunk in the spec it crossed the cut in);
- per tensor argument, the collective(s) that turn the held spec into the spec the op's strategy
  reads it in (redistribute.py's :func:`~.redistribute.convert`, typed steps naming collectives.py's
  functions): the spec-to-spec table the sharding ILP priced, so what is priced is what runs;
- how the op runs (:class:`How`): on this rank's shards with shape arguments rewritten to local
  sizes (``local``), or as one of the ops whose shards need more than that: the
  vocabulary-parallel embedding (a masked lookup whose output is partial) and cross entropy
  (Megatron's: all-reduces of the row max, the sum of exponentials and the target logit), a
  reduction over a split dim (local, then an all-reduce), a loss over split rows (local sum,
  then an all-reduce of the sum and of the count);
- the output's spec.

Gradients: the collectives' backward keeps Megatron's convention (collectives.py), and an
``R`` value read by an op whose work is split over the ranks (any of its specs is ``S`` or
``P``) is read through ``copy`` (Megatron's ``f``): its backward sums the ranks' partial
gradients. A replicated bias of an op with a partial output (a row-parallel linear) is read
as ``P`` (rank 0 adds it). A replicated parameter only such ops read skips the copies: its
gradient is summed over the group once per step (``LoweredGraph.partial_params``).

An op the plan gave no spec (one the plan's graph did not have), a higher-order op (a
``torch.no_grad()`` or autocast region of the model), an op whose local form is not known, and
every alias of a tensor some op writes in place run whole: every input made ``R``, the output
``R`` (slower, never wrong). Where this rank's graph differs from the plan's (another example
batch), each op's specs are checked against the rank's own dims maps and re-derived from its
input where they do not fit. Every local output's shape is checked against the shape the
lowering expects; a mismatch raises naming the node.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import torch

from .. import ops
from ..capture.opgraph import OpGraph, OpKind
from ..capture.structure import is_volatile, plumbing
from ..ops import CONTEXT_HOPS, SKIPPED_TARGETS, base_name
from ..plan.placement import Placement, Shard, normal
from .redistribute import P, R, Copy, KeepFirst, Step, ToPartial, convert, split_dim
from .specs import OpSpec


class How(Enum):
    LOCAL = "local"               # the op on this rank's shards
    WHOLE = "whole"               # the op on whole (R) inputs
    SKIP = "skip"                 # metadata asserts: nothing to run
    VOCAB_EMBEDDING = "vocab_embedding"
    VOCAB_LOSS = "vocab_loss"
    ROW_LOSS = "row_loss"         # a loss over this rank's rows: local sum, all-reduced sum and count
    REDUCE_SUM = "reduce_sum"     # a reduction over a split dim: local, then all-reduce
    REDUCE_MAX = "reduce_max"
    REDUCE_MIN = "reduce_min"
    MOE = "moe"                   # an MoE region as one call of its ExpertsModule, on whole inputs


@dataclass(frozen=True)
class LoweredOp:
    """One node as this rank runs it."""

    node: str
    how: How
    reads: Mapping[str, tuple[Step, ...]]   # tensor argument (node / placeholder name) -> its conversion
    output: Placement                       # spec of the output as held
    shape_args: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # arg index -> local sizes
    local_shape: tuple[int, ...] | None = None   # expected shape of a tensor output on this rank
    after: tuple[Step, ...] = ()            # the output's conversion to ``output`` (an op run whole)
    writes: tuple[str, ...] = ()            # arguments written in place that were converted: the
                                            # converted value replaces the argument's (held R after)


@dataclass(frozen=True)
class LoweredGraph:
    """Every node's LoweredOp, and each value's held spec per chunk (for the pipeline's cuts)."""

    tp: int
    ops: Mapping[str, LoweredOp]
    held: Mapping[int, Mapping[str, Placement]]   # chunk -> value -> spec held there
    partial_params: frozenset[str] = frozenset()   # parameter fqns whose gradient is summed once per step
    pinned: frozenset[str] = frozenset()           # aliases of tensors written in place (written_families):
                                                   # converted afresh at every read, never reused

    def collectives(self) -> int:
        """How many collectives a forward pass runs: its conversions' communicating steps (a split
        takes a slice, ``copy`` communicates in backward only) and the ops' own."""
        own = {How.VOCAB_LOSS: 1, How.ROW_LOSS: 2, How.REDUCE_SUM: 1, How.REDUCE_MAX: 1, How.REDUCE_MIN: 1}
        steps = [s for op in self.ops.values() for read in (*op.reads.values(), op.after) for s in read]
        return sum(1 for s in steps if s.communicates) + sum(own.get(op.how, 0) for op in self.ops.values())


def cut_spec(op_spec: Any) -> Placement:
    """The spec a value crosses a pipeline cut in: the plan's output spec if S(d), else R."""
    return op_spec.output if op_spec is not None and split_dim(op_spec.output) is not None else R




def _ndim(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _first_ndim(node: torch.fx.Node) -> int:
    """The dims of a node's (first) tensor output."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _written(node: torch.fx.Node) -> list[str]:
    """The tensor arguments an op writes in place (``Tensor(a!)`` in its schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node) and arg.alias_info is not None and arg.alias_info.is_write:
            out.append(value.name)
    return out


def _size(node: torch.fx.Node | None, dim: int) -> int | None:
    shape = _shape(node) if node is not None else None
    return shape[dim] if shape is not None and dim < len(shape) else None


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _class_ids(node: torch.fx.Node) -> bool:
    """A class loss against class ids without per-class weights (what the vocabulary-parallel form computes)."""
    target = node.args[1] if len(node.args) > 1 else node.kwargs.get("target")
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    val = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
    return weight is None and isinstance(val, torch.Tensor) and not val.is_floating_point()


def _aligned(value: torch.fx.Node, node: torch.fx.Node, out_spec: Placement) -> Placement:
    """The spec of a buffer read by an op whose output is ``out_spec``: split along the dim it broadcasts
    to the output's split dim (a norm's running statistics along the channels), else R."""
    d, shape, out = split_dim(out_spec), _shape(value), _shape(node)
    if d is None or not shape or out is None:
        return R
    if base_name(node.target) in ops.CHANNEL_NORMS and len(shape) == 1:
        return Shard(0) if d == 1 and shape[0] == out[1] else R
    e = d - (len(out) - len(shape))
    return Shard(e) if e >= 0 and shape[e] == out[d] and shape[e] != 1 else R


def local_shape(shape: tuple[int, ...], spec: Placement, tp: int) -> tuple[int, ...]:
    d = split_dim(spec)
    if d is None or not shape:
        return shape
    out = list(shape)
    out[d] //= tp
    return tuple(out)


class _Lowering:
    def __init__(self, nodes: Mapping[str, torch.fx.Node], graph: OpGraph, specs: Mapping[str, Any],
                 param_of: Mapping[str, str], param_dims: Mapping[str, int | None], tp: int) -> None:
        self.nodes, self.specs, self.param_of, self.param_dims, self.tp = nodes, specs, param_of, param_dims, tp
        self.ops = {op.name: op for op in graph.nodes}   # capture's view of each op, at this rank's shapes
        indices = plumbing(graph.nodes, graph.inputs)
        self.volatile = frozenset(op.name for op in graph.nodes if is_volatile(op, indices))
        self.pinned: frozenset[str] = frozenset()

    def param_spec(self, placeholder: str) -> Placement:
        d = self.param_dims.get(self.param_of[placeholder])
        return R if d is None else normal(Shard(d), _ndim(self.nodes[placeholder]))

    def lower(self, node: torch.fx.Node, held: dict[str, Placement]) -> LoweredOp:
        name, target = node.name, str(node.target)
        tensors = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if target in SKIPPED_TARGETS:
            return LoweredOp(name, How.SKIP, {}, R)
        if node.target is operator.getitem:
            parent = node.args[0]
            spec = held.get(parent.name, R)
            if split_dim(spec) is not None and _ndim(node) != _first_ndim(parent):
                spec = R    # a piece of another rank (statistics of a split norm): not read as a shard
            return LoweredOp(name, How.LOCAL, {}, spec)
        spec = self.specs.get(name)
        if spec is None and name in self.volatile:
            carried = self.propagate(node, held)   # a volatile op the plan's export lacked: its input's spec
            spec = None if carried is None else OpSpec("carried", carried[1], carried[0])
        if spec is None or target in CONTEXT_HOPS or any(a.name not in held for a in tensors):
            return self.whole(node, held)
        if name in self.pinned:   # a tensor written in place, or a view of one: every alias held whole
            return self.whole(node, held, _written(node))
        out_spec = normal(spec.output, _ndim(node))
        reads: dict[str, tuple[Step, ...]] = {}
        wanted: dict[str, Placement] = {}
        for a in tensors:
            if a.name in self.param_of:
                d = spec.params.get(self.param_of[a.name])
                wanted[a.name] = R if d is None else normal(Shard(d), _ndim(a))
            elif a.name in spec.inputs:
                wanted[a.name] = normal(spec.inputs[a.name], _ndim(a))
            else:   # a buffer or constant the plan does not list: broadcast against the output
                wanted[a.name] = _aligned(a, node, out_spec)
        how = self.how(node, spec)
        written = _written(node)
        if how is How.WHOLE or any(convert(held[w], wanted[w], True) for w in written):
            # an argument written in place is written where it is held, not in a converted copy
            return self.whole(node, held, written)
        if how is How.LOCAL and not self.fits(node, wanted, out_spec):
            repaired = self.propagate(node, held)
            if repaired is None:
                return self.whole(node, held)
            wanted, out_spec = repaired
        if how is How.LOCAL and split_dim(out_spec) is not None and all(w == R for w in wanted.values()):
            # nothing sharded goes in, a shard comes out (a view sequence parallelism splits): run whole, then split
            whole = self.whole(node, held)
            return LoweredOp(name, How.WHOLE, whole.reads, out_spec, {}, whole.local_shape,
                             convert(R, out_spec, False))
        if how is How.LOCAL and out_spec == P:
            # a replicated parameter of an op with a partial output (a row-parallel bias) is added once
            for a in tensors:
                if a.name in self.param_of and wanted[a.name] == R:
                    wanted[a.name] = P
        split = any(s != R for s in wanted.values()) or out_spec != R
        for a in tensors:
            reads[a.name] = convert(held[a.name], wanted[a.name], split)
        if how in (How.REDUCE_SUM, How.REDUCE_MAX, How.REDUCE_MIN, How.ROW_LOSS, How.VOCAB_LOSS):
            out_spec = R
        shape = _shape(node)
        local = local_shape(shape, out_spec, self.tp) if shape is not None and how is How.LOCAL else None
        if how in (How.REDUCE_SUM, How.REDUCE_MAX, How.REDUCE_MIN):
            local = shape
        return LoweredOp(name, how, reads, out_spec, self.shape_args(node, wanted, local), local)

    def fits(self, node: torch.fx.Node, wanted: Mapping[str, Placement], out_spec: Placement) -> bool:
        """Whether the op, run on shards in the specs ``wanted``, computes its output's shard in ``out_spec``
        at this rank's shapes (its dims maps, capture/dims.py). The plan's graph may differ from this
        rank's: another example batch makes another dim the outermost of a merged run (a view of
        ``[b*s, h]`` as ``[b, s, h]`` keeps a split of ``b*s`` on ``s`` when ``b`` is 1, on ``b`` when
        it is not)."""
        op = self.ops.get(node.name)
        if op is None or out_spec == P:
            return True
        d = split_dim(out_spec)
        for i, name in enumerate(op.inputs):
            w = wanted.get(name, R)
            e = op.dims[i][d] if d is not None and i < len(op.dims) and d < len(op.dims[i]) else -1
            if d is None:
                if w != R:
                    return False
            elif w == R:
                if e >= 0 and _size(self.nodes.get(name), e) != 1:
                    return False
            elif w == P or split_dim(w) != e or (i == 0 and e in op.reduced):
                return False
        return True

    def propagate(self, node: torch.fx.Node, held: Mapping[str, Placement]
                  ) -> tuple[dict[str, Placement], Placement] | None:
        """Specs for an op of one activation input (a view, an element-wise op) from the spec its input is
        held in, by the op's dims maps at this rank's shapes; None when it has other inputs."""
        op = self.ops.get(node.name)
        if op is None or len(op.inputs) != 1 or not op.dims or op.params:
            return None
        name = op.inputs[0]
        src = normal(held.get(name, R), _ndim(self.nodes[name]) if name in self.nodes else 0)
        shape = _shape(node)
        e = split_dim(src)
        if src == P and op.kind is OpKind.VIEW:
            return {name: P}, P
        if e is not None and e not in op.reduced and shape is not None:
            d = next((d for d, m in enumerate(op.dims[0]) if m == e), None)
            if d is not None and shape[d] % self.tp == 0:
                return {name: src}, Shard(d)
        return {name: R}, R

    def how(self, node: torch.fx.Node, spec: Any) -> How:
        b, strategy = base_name(node.target), spec.strategy
        if strategy == "vocab":
            if b == "embedding":
                return How.VOCAB_EMBEDDING
            return How.VOCAB_LOSS if b in ops.VOCAB_LOSSES and _class_ids(node) else How.WHOLE
        if strategy.startswith("split_reduce"):
            if not isinstance(node.meta.get("val"), torch.Tensor):
                return How.WHOLE      # max.dim's indices: not an all-reduce of the local ones
            return {"sum": How.REDUCE_SUM, "amax": How.REDUCE_MAX, "max": How.REDUCE_MAX,
                    "amin": How.REDUCE_MIN, "min": How.REDUCE_MIN}.get(b, How.WHOLE)
        if spec.output == R and any(split_dim(s) is not None for s in spec.inputs.values()):
            return How.ROW_LOSS if b in ops.ROW_LOSSES else How.WHOLE    # split rows of a loss
        return How.LOCAL

    def whole(self, node: torch.fx.Node, held: dict[str, Placement], written: list[str] = ()) -> LoweredOp:
        reads = {a.name: convert(held.get(a.name, R), R, False) for a in node.all_input_nodes if a.op != "get_attr"}
        writes = tuple(w for w in written if reads.get(w))
        for w in writes:
            held[w] = R
        return LoweredOp(node.name, How.WHOLE, reads, R, {}, _shape(node), (), writes)

    def shape_args(self, node: torch.fx.Node, wanted: Mapping[str, Placement], local: tuple[int, ...] | None
                   ) -> dict[int, tuple[int, ...]]:
        """Shape arguments at this rank's sizes (a view's target shape, a split's sizes)."""
        b = base_name(node.target)
        if local is None or self.tp == 1:
            return {}
        if b in ops.SHAPE_ARG and len(node.args) > ops.SHAPE_ARG[b] and isinstance(node.args[ops.SHAPE_ARG[b]], (list, tuple)):
            i = ops.SHAPE_ARG[b]
            return {i: local} if tuple(node.args[i]) != local else {}
        if b == "unflatten" and len(node.args) >= 3:
            dim = node.args[1] % max(len(local) - len(node.args[2]) + 1, 1)
            return {2: tuple(local[dim:dim + len(node.args[2])])}
        if b in ops.SIZED_SPLITS and len(node.args) >= 2 and isinstance(node.args[0], torch.fx.Node):
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            d = split_dim(wanted.get(node.args[0].name, R))
            if d is not None and d == dim % max(_ndim(node.args[0]), 1):
                sizes = node.args[1]
                if isinstance(sizes, int):
                    return {1: (sizes // self.tp,)}
                return {1: tuple(s // self.tp for s in sizes)}
        return {}


def lower(nodes: Mapping[str, torch.fx.Node], graph: OpGraph, chunks: Any, specs: Mapping[str, Any],
          param_of: Mapping[str, str],
          param_dims: Mapping[str, int | None], tp: int,
          moe: Mapping[str, tuple[str, ...]] | None = None) -> LoweredGraph:
    """Lower every node of ``chunks`` (codegen.split.ChunkSpec, in order) for a group of ``tp`` ranks.

    A value received from an earlier chunk is held in the spec it crossed the cut in (:func:`cut_spec`
    of its op's spec); ``moe``: MoE region output -> the region's inputs, for regions run as one call
    (runtime/experts.py)."""
    moe = moe or {}
    lowering = _Lowering(nodes, graph, dict(specs), param_of, param_dims, tp)
    lowering.pinned = written_families(nodes.values())
    ops: dict[str, LoweredOp] = {}
    held_by_chunk: dict[int, dict[str, Placement]] = {}
    leaves = {name: lowering.param_spec(name) if name in param_of else R
              for name, n in nodes.items() if n.op in ("placeholder", "get_attr")}
    for chunk in chunks:
        held = {**leaves, **{v: cut_spec(specs.get(v)) for v in chunk.recv}}
        for layer in chunk.layers:
            for name in layer.nodes:
                if name in moe:
                    op = LoweredOp(name, How.MOE, {v: convert(held.get(v, R), R, False) for v in moe[name]}, R)
                else:
                    op = lowering.lower(nodes[name], held)
                ops[name] = op
                held[name] = op.output
        held_by_chunk[chunk.index] = held
    ops, partial = _step_reduced(ops, param_of)
    return LoweredGraph(tp, ops, held_by_chunk, partial, lowering.pinned)


def alias_writes(nodes) -> tuple[dict[str, str], set[str]]:
    """(value -> the tensor it is a view of, or the same tensor as; the tensors some op writes in place,
    directly or through a view) over ``nodes`` in graph order. Aliases follow the ops' schemas: a return
    marked ``Tensor(a)`` is a view of (or, in place, the same tensor as) the argument marked
    ``Tensor(a)``, a write is marked ``Tensor(a!)``; a piece of a list of views (``split``) is a view too."""
    root: dict[str, str] = {}
    written: set[str] = set()
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            parent = node.args[0]
            if isinstance(parent, torch.fx.Node) and parent.name in root:
                root[node.name] = root[parent.name]
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if not isinstance(value, torch.fx.Node) or arg.alias_info is None:
                continue
            origin = root.get(value.name, value.name)
            if arg.alias_info.is_write:
                written.add(origin)
            if any(r.alias_info is not None and r.alias_info.before_set == arg.alias_info.before_set
                   for r in schema.returns):
                root[node.name] = origin
    return root, written


def written_families(nodes) -> frozenset[str]:
    """The nodes whose output is, or is a view of, a tensor some op writes in place (directly or through a
    view: ``x[:, 1:] = y`` on a clone). Such a family must stay one tensor on every rank: a converted copy of
    one of them would take the write and leave the others as they were, so they all run whole (``R``)."""
    nodes = list(nodes)
    root, written = alias_writes(nodes)
    return frozenset(n.name for n in nodes if n.op == "call_function"
                     and (n.name in written or root.get(n.name) in written))


def _step_reduced(ops: dict[str, LoweredOp], param_of: Mapping[str, str]
                  ) -> tuple[dict[str, LoweredOp], frozenset[str]]:
    """A replicated parameter that only ops with split work read (a norm's weight under sequence
    parallelism, a row-parallel bias) has a partial gradient on every rank: it is summed once per step
    (``partial_params``, as the cost model prices it) rather than by a ``copy`` at every read of every
    micro-batch. One that an op also reads whole (its gradient whole on every rank) keeps its copies."""
    partial_reads = {(Copy(),): (), (ToPartial(),): (KeepFirst(),)}
    uses: dict[str, set[bool]] = {}
    for op in ops.values():
        for name, steps in op.reads.items():
            if name in param_of:
                uses.setdefault(name, set()).add(steps in partial_reads)
    step = {name for name, kinds in uses.items() if kinds == {True}}
    out = {}
    for name, op in ops.items():
        if any(n in step for n in op.reads):
            op = dataclasses.replace(op, reads={n: partial_reads[s] if n in step else s for n, s in op.reads.items()})
        out[name] = op
    return out, frozenset(param_of[name] for name in step)


def written_inputs(spec: Any, nodes: Mapping[str, torch.fx.Node]) -> tuple[str, ...]:
    """The layer's inputs that one of its ops writes in place, directly or through a view of them
    (codegen/lower.py ``alias_writes``)."""
    _, written = alias_writes(nodes[name] for name in spec.nodes)
    return tuple(n for n in spec.inputs if n in written)
