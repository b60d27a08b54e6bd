"""Emission: each layer of a rank's program as a ``torch.fx.GraphModule`` on local tensors.

:func:`layer_module` turns one layer (a run of the exported graph's nodes) into generated code::

    forward(*inputs, *params, *buffers) -> (*outputs, *written inputs)

- Without tensor parallelism each node is the graph's own op, as the model's code called it.
- With it (a :class:`~.lower.LoweredGraph`), every read of a value is the chain of collectives
  its conversion names (collectives.py), emitted once per layer per value and conversion (a
  value some op writes in place is converted afresh at each read, and an argument the op writes
  is written on a converted copy that replaces it); shape arguments are this rank's local sizes;
  the vocabulary-parallel embedding and loss, reductions over a split dim and losses over split
  rows call shard_ops.py. With ``checks``, every shard an op computes has its shape checked where
  it is made (a plan whose sharding does not fit the op raises naming the node); the shapes are
  static, so a program runs the checked code once and the code without checks after.
- A ``torch.no_grad()`` / autocast region of the model (a higher-order op) is inlined between
  the calls that enter and leave its context, as torch.compile writes them.
- With context parallelism (a :class:`~.context_state.ContextRank`), each read of a value is
  then converted as context.py decided (gathered whole, cut to this rank's tokens, or a
  partial value resolved: context_ops.py), shape arguments are composed with the local sizes of
  the sequence, and attention runs as ring attention (or this rank's queries over whole keys),
  a mean loss as this rank's sum over the group's count of targets. Tensor parallelism's
  conversion of a value comes first, then context parallelism's (the two act on different dims
  and different groups, so they commute; a conversion along a dim both split is refused).
- An MoE region run as one call (:attr:`~.lower.How.MOE`) calls its experts module.
- Inputs some op of the layer writes in place are cloned first (FSDP2 hands a layer its inputs
  as views autograd refuses to write) and returned after the outputs, for later layers to read.
- Selective recompute: each run of attention-core nodes is a GraphModule of its own, called
  through ``torch.utils.checkpoint`` (recomputed in backward).

Why generated code rather than an interpreter over the nodes: what runs is Python a user can
read (``module.code``), the host does no per-node bookkeeping beyond the ops themselves (what a
GPU step waits on at small sizes), and ``torch.compile`` takes it as it is.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import ops
from ..capture.build import module_path, module_type
from ..errors import ConfigError
from ..ops import CONTEXT_HOPS, SKIPPED_TARGETS, base_name, runs_in_fp8
from ..plan.placement import Partial, Shard
from ..runtime import collectives, context_ops, shard_ops
from .bindings import use_bindings
from ..runtime.context_state import (ContextOp, ContextRank, Conversion, GatherTokens, Local, Mode, Resolve,
                            holds_tensor)
from .lower import How, LoweredGraph, LoweredOp
from .redistribute import Copy, ReduceScatter, Split, Step, split_dim


@dataclass(frozen=True)
class LayerIO:
    """What one layer reads and gives, by the exported graph's node names."""

    nodes: tuple[str, ...]          # call_function nodes, in graph order
    inputs: tuple[str, ...]         # values made before the layer
    outputs: tuple[str, ...]        # values read after it
    params: tuple[str, ...]         # parameter placeholders read (local shards under tp)
    buffers: tuple[str, ...]        # buffer / constant placeholders read
    written: tuple[str, ...] = ()   # inputs the layer writes in place: cloned first, returned after outputs
    core: frozenset[str] = frozenset()   # nodes recomputed in backward (selective recompute)


def bind(target: Any, args: tuple | list, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An aten op's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def layer_module(io: LayerIO, nodes: Mapping[str, fx.Node], source: nn.Module, lowered: LoweredGraph | None = None,
                 group: Any = None, experts: Mapping[str, nn.Module] | None = None,
                 moe: Mapping[str, tuple[str, str, str]] | None = None, skip: frozenset[str] = frozenset(),
                 name: str = "Layer", checks: bool = False, context: ContextRank | None = None,
                 fp8: nn.Module | None = None) -> fx.GraphModule:
    """The layer's generated module. ``source``: the exported graph module (region bodies); ``experts``
    / ``moe``: MoE region output node -> its experts module / its (hidden, index, weights) inputs, for
    regions run as one call; ``skip``: nodes not run (the regions' other nodes); ``checks``: check the
    shape of every shard an op computes (the shapes are static: a program runs this once, on its
    first call, and the code without checks after); ``context``: this rank of a context-parallel group;
    ``fp8``: the module (runtime/fp8.py) the linear layers ops.runs_in_fp8 names are called through."""
    emitter = _Emitter(nodes, source, lowered, group, experts or {}, moe or {}, skip, checks, context, fp8)
    return emitter.module(io, name)


class _Emitter:
    def __init__(self, nodes: Mapping[str, fx.Node], source: nn.Module, lowered: LoweredGraph | None, group: Any,
                 experts: Mapping[str, nn.Module], moe: Mapping[str, tuple[str, str, str]],
                 skip: frozenset[str], checks: bool = False, context: ContextRank | None = None,
                 fp8: nn.Module | None = None) -> None:
        self.nodes, self.source, self.lowered, self.group = nodes, source, lowered, group
        self.experts, self.moe, self.skip, self.checks = experts, moe, skip, checks
        self.context, self.fp8 = context, fp8

    def module(self, io: LayerIO, name: str) -> fx.GraphModule:
        self.graph = fx.Graph()
        self.attrs: dict[str, Any] = {}
        self.env: dict[str, Any] = {}
        self.cache: dict[tuple[str, tuple[Step, ...]], fx.Node] = {}
        self.pieces: dict[str, tuple[Step, ...]] = {}   # list outputs whose pieces take a conversion when read
        for v in (*io.inputs, *io.params, *io.buffers):
            self.env[v] = self.graph.placeholder(v)
        if self.lowered is not None:
            self.attrs["tp_group"] = self.group
            self.group_node = self.graph.get_attr("tp_group")
        if self.context is not None:
            self.attrs["cp_group"] = self.context.group
            self.cp_node = self.graph.get_attr("cp_group")
        for v in io.written:
            self.env[v] = self.graph.call_method("clone", (self.env[v],))
        segment: list[str] = []
        for n in io.nodes:
            if n in io.core:
                segment.append(n)
                continue
            self._core(segment, io)
            segment = []
            self._node(self.nodes[n])
        self._core(segment, io)
        self.graph.output(tuple(self.env[v] for v in (*io.outputs, *io.written)))
        use_bindings(self.graph)
        module = fx.GraphModule(self.attrs, self.graph, class_name=name)
        return module

    # --- values ---------------------------------------------------------------------------------
    def steps(self, value: Any, steps: tuple[Step, ...]) -> Any:
        for s in steps:
            value = self.graph.call_function(s.function, (value, *s.args, self.group_node))
        return value

    def read(self, name: str, steps: tuple[Step, ...]) -> Any:
        """Node ``name``'s value converted by ``steps``: once per layer (afresh for a tensor written in place)."""
        value = self.env[name]
        if not steps or not isinstance(value, fx.Node):
            return value
        if name in self.lowered.pinned:
            return self.steps(value, steps)
        key = (name, steps)
        if key not in self.cache:
            self.cache[key] = self.steps(value, steps)
        return self.cache[key]

    def load(self, n: fx.Node) -> Any:
        return self.attr(n) if n.op == "get_attr" else self.env[n.name]

    def attr(self, n: fx.Node) -> Any:
        """A get_attr of the exported graph: a region's body stays the source node (``_region`` inlines it);
        a tensor constant becomes an attribute of the generated module."""
        value = getattr(self.source, n.target)
        if isinstance(value, nn.Module):
            return n
        self.attrs[n.target] = value
        return self.graph.get_attr(n.target)

    # --- nodes ----------------------------------------------------------------------------------
    def _node(self, node: fx.Node) -> None:
        name = node.name
        if str(node.target) in SKIPPED_TARGETS or name in self.skip:
            self.env[name] = None
            return
        if node.target is operator.getitem:
            parent, index = node.args
            held = self.env[parent.name]
            if isinstance(held, (list, tuple)):    # an inlined region's outputs
                self.env[name] = held[index]
                return
            piece = self.graph.call_function(operator.getitem, (held, index))
            self.env[name] = self.steps(piece, self.pieces.get(parent.name, ()))
            return
        op = self.lowered.ops[name] if self.lowered is not None else None
        if op is not None and op.how is How.SKIP:
            self.env[name] = None
            return
        step = self.context.plan.steps.get(name) if self.context is not None else None
        if name in self.moe:
            names = self.moe[name]
            cp = step.convert if step is not None else ((),) * len(names)
            values = [self.convert(v, op.reads.get(v, ()) if op is not None else (), c) for v, c in zip(names, cp)]
            target = f"experts_{name}"
            self.attrs[target] = self.experts[name]
            self.env[name] = self.graph.call_module(target, tuple(values))
            return
        args, kwargs = self._args(node, op, step)
        if str(node.target) in CONTEXT_HOPS:
            self.env[name] = self._region(str(node.target), args, kwargs)
            return
        first = len(self.graph.nodes)
        if step is not None and step.mode.replaces_op:
            out = self._context_op(node, op, step, args, kwargs)
        elif op is None and self.fp8 is not None and fp8_linear(node):
            self.attrs["fp8_linear"] = self.fp8
            out = self.graph.call_module("fp8_linear", tuple(args), kwargs)
        elif op is None:
            out = self.graph.create_node("call_function", node.target, tuple(args), kwargs, name=name)
        else:
            out = self._lowered_op(node, op, args, kwargs)
        if step is not None and step.scale != 1.0:   # a sum over the group's tokens: cp times this rank's
            out = self.graph.call_function(context_ops.scaled, (out, step.scale))
        self.env[name] = out
        self._tag(node, first)

    def _tag(self, node: fx.Node, first: int) -> None:
        """The module path of the model's code that made ``node``, on the nodes emitted for it (source.py
        writes it as a comment)."""
        path = module_path(node)
        if path:   # the nodes made since ``first``, from the end (a list of the whole graph per node is quadratic)
            for made in itertools.islice(reversed(self.graph.nodes), len(self.graph.nodes) - first):
                made.meta.setdefault("module_path", path)

    def _args(self, node: fx.Node, op: LoweredOp | None, step: ContextOp | None) -> tuple[list, dict]:
        """The node's arguments as this rank reads them: each tensor converted by tensor parallelism's
        steps, then context parallelism's (``step.convert``, by position among the node's tensor
        arguments, context.tensor_args' order); shape arguments at this rank's local sizes."""
        position = itertools.count()

        def read(n: fx.Node) -> Any:
            cp = step.convert[next(position)] if step is not None and holds_tensor(n.meta.get("val")) else ()
            if n.op == "get_attr":
                return self.attr(n)
            if op is not None and n.name in op.writes:   # written in place: a converted copy, which replaces it
                self.env[n.name] = self.graph.call_method("clone", (self.steps(self.env[n.name], op.reads[n.name]),))
                return self.env[n.name]
            return self.convert(n.name, op.reads.get(n.name, ()) if op is not None else (), cp)

        args = list(fx.node.map_arg(node.args, read))
        kwargs = dict(fx.node.map_arg(node.kwargs, read))
        if op is not None:
            for i, sizes in op.shape_args.items():
                args[i] = list(sizes)
        if step is not None:
            for i, sizes in step.rewrite:   # the sequence's local size, composed with the tensor-parallel split
                full = _full_sizes(node, i)
                tp = op.shape_args[i] if op is not None and i in op.shape_args else full
                args[i] = compose(full, tp, sizes, node.name)
        return args, kwargs

    def convert(self, name: str, steps: tuple[Step, ...], cp: tuple) -> Any:
        """Node ``name``'s value through tensor parallelism's ``steps`` then context parallelism's ``cp``
        conversion (once per layer)."""
        value = self.read(name, steps) if self.lowered is not None else self.env[name]
        if not cp or not isinstance(value, fx.Node):
            return value
        d = _split_after(steps, self.lowered, name)
        for c in cp:
            if not isinstance(c, Resolve) and d is not None and d == c.layout.dim:
                raise ConfigError(f"{name} is split along dim {d} by tensor parallelism (sequence parallelism) and "
                                  "context parallelism must gather or cut it along the same dim: re-plan with "
                                  "sequence_parallel=False")
        key = ("cp", name, steps, cp)
        if key not in self.cache:
            for c in cp:
                value = self.cp_step(value, c)
            self.cache[key] = value
        return self.cache[key]

    def cp_step(self, value: fx.Node, conversion: Conversion) -> fx.Node:
        c = self.context
        call = self.graph.call_function
        if isinstance(conversion, Resolve):
            return call(context_ops.resolve, (value, c.plan.cp, self.cp_node, c.timeout))
        layout = conversion.layout
        if isinstance(conversion, GatherTokens):
            return call(context_ops.gather, (value, layout.dim, layout.seq, layout.outer, layout.inner, c.plan.cp,
                                             c.rank, self.cp_node, c.timeout))
        return call(context_ops.take_tokens, (value, layout.dim, layout.seq, layout.outer, layout.inner,
                                              c.plan.cp, c.rank))

    def _context_op(self, node: fx.Node, op: LoweredOp | None, step: ContextOp, args: list, kwargs: dict) -> Any:
        """Attention over the group's sequence, or a mean loss over the group's targets (context.py)."""
        c = self.context
        call = self.graph.call_function
        if op is not None and op.how not in (How.LOCAL, How.WHOLE, How.VOCAB_LOSS):
            raise ConfigError(f"node {node.name} runs as {op.how.value} under tensor parallelism and as "
                              f"{step.mode.value} under context parallelism, which this autopar cannot combine: "
                              "re-plan with tp=1 or cp=1")
        if step.mode is Mode.LOSS_MEAN:
            args, kwargs = _with_arg(node.target, args, kwargs, "reduction", shard_ops.SUM)
            total = (self._lowered_op(node, op, args, kwargs) if op is not None else
                     self.graph.create_node("call_function", node.target, tuple(args), kwargs, name=node.name))
            a = bind(node.target, args, kwargs)
            return call(context_ops.target_mean, (total, a["target"], a.get("ignore_index", -100), c.plan.cp,
                                                  self.cp_node, c.timeout))
        if op is not None and op.how is How.VOCAB_LOSS:
            raise ConfigError(f"node {node.name}: a vocabulary-parallel loss is not attention: re-plan with tp=1")
        a = bind(node.target, args, kwargs)
        common = (a["query"], a["key"], a["value"], a.get("attn_mask"), bool(a.get("is_causal", False)),
                  a.get("scale"), bool(a.get("enable_gqa", False)), c.plan.cp, c.rank)
        if step.mode is Mode.RING:
            return call(context_ops.ring, (*common, self.cp_node, c.timeout))
        return call(context_ops.local_query, common)

    def _lowered_op(self, node: fx.Node, op: LoweredOp, args: list, kwargs: dict) -> Any:
        g, target, how, name = self.group_node, node.target, op.how, node.name
        call = self.graph.call_function
        if how in (How.LOCAL, How.WHOLE) and self.fp8 is not None and fp8_linear(node):
            self.attrs["fp8_linear"] = self.fp8
            out = self.graph.call_module("fp8_linear", tuple(args), {**kwargs, **_linear_split(node, op)})
        elif how in (How.LOCAL, How.WHOLE):
            out = self.graph.create_node("call_function", target, tuple(args), kwargs, name=name)
        elif how is How.VOCAB_EMBEDDING:
            a = bind(target, args, kwargs)
            out = call(shard_ops.vocab_embedding, (a["weight"], a["indices"], g, a.get("padding_idx", -1)))
        elif how is How.VOCAB_LOSS:
            a = bind(target, args, kwargs)
            fn, rest = shard_ops.VOCAB_LOSS_FORMS[ops.VOCAB_LOSSES[base_name(target)].form]
            out = call(fn, (a["self"], a["target"], g) + tuple(a[k] for k in rest))
        elif how is How.ROW_LOSS:
            a = bind(target, args, kwargs)
            names = [x.name for x in target._schema.arguments]
            reduction = a.get("reduction", shard_ops.MEAN)
            local_args = [shard_ops.SUM if n == "reduction" else a[n] for n in names if n in a]
            local = self.graph.create_node("call_function", target, tuple(local_args), {}, name=name + "_local_sum")
            ignore = a.get("ignore_index")
            out = call(shard_ops.row_total, (local, g, reduction, args[0],
                                             args[1] if ignore is not None else None,
                                             -100 if ignore is None else ignore))
        else:
            local = self.graph.create_node("call_function", target, tuple(args), kwargs, name=name + "_local")
            out = (call(collectives.reduce, (local, g)) if how is How.REDUCE_SUM else
                   call(collectives.reduce_max, (local, g, how is How.REDUCE_MAX)))
        if self.checks and op.local_shape is not None and isinstance(node.meta.get("val"), torch.Tensor):
            call(shard_ops.expect_shape, (out, self._local_shape(node, op), name, str(op.output)))
        if op.after:
            if isinstance(node.meta.get("val"), (list, tuple)):   # a split's pieces, converted as they are read
                self.pieces[name] = op.after
                return out
            return self.steps(out, op.after)
        return out

    def _local_shape(self, node: fx.Node, op: LoweredOp) -> tuple[int, ...]:
        """The shape of the node's output on this rank: tensor parallelism's shard of context parallelism's tokens."""
        state = self.context.plan.states.get(node.name) if self.context is not None else None
        if not isinstance(state, Local):
            return op.local_shape
        full = tuple(node.meta["val"].shape)
        return tuple(compose(full, op.local_shape, self.context.plan.local_shape(node.name, full), node.name))

    def _region(self, hop: str, args: list, kwargs: dict) -> tuple[Any, ...]:
        """A no_grad / autocast region of the model inlined: enter its context, its body's nodes, leave it."""
        call = self.graph.call_function
        if hop == "wrap_with_set_grad_enabled":
            enabled, body, *rest = args
            before = call(torch.is_grad_enabled, ())
            call(torch._C._set_grad_enabled, (enabled,))
            outs = self._body(body, rest)
            call(torch._C._set_grad_enabled, (before,))
            return outs
        device_type, dtype, enabled, cache_enabled, body, *rest = args
        ctx = call(torch.amp.autocast_mode._enter_autocast, (device_type, dtype, enabled, cache_enabled))
        outs = self._body(body, rest)
        call(torch.amp.autocast_mode._exit_autocast, (ctx,))
        return outs

    def _body(self, body: fx.Node, values: list) -> tuple[Any, ...]:
        sub = getattr(self.source, body.target)
        inner = _Emitter({n.name: n for n in sub.graph.nodes}, sub, None, None, {}, {}, frozenset())
        inner.graph, inner.attrs, inner.env, inner.cache, inner.pieces = self.graph, self.attrs, {}, {}, {}
        inner.group_node = None
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(placeholders, values, strict=True):
            inner.env[ph.name] = value
        for n in sub.graph.nodes:
            if n.op == "call_function":
                inner._node(n)
            elif n.op == "output":
                return tuple(fx.node.map_arg(n.args[0], inner.load))
        raise AssertionError("a graph without an output node")

    # --- selective recompute --------------------------------------------------------------------
    def _core(self, segment: list[str], io: LayerIO) -> None:
        """A run of attention-core nodes as its own module, called through checkpoint."""
        if not segment:
            return
        inside = set(segment)
        reads = tuple(dict.fromkeys(a.name for n in segment for a in self.nodes[n].all_input_nodes
                                    if a.name not in inside and a.op != "get_attr"))
        later = set(io.nodes[io.nodes.index(segment[-1]) + 1:])
        outs = tuple(n for n in segment
                     if any(u.name in later or u.name not in io.nodes for u in self.nodes[n].users))
        core = _Emitter(self.nodes, self.source, self.lowered, self.group, self.experts, self.moe, self.skip,
                        self.checks, self.context)
        module = core.module(LayerIO(tuple(segment), reads, outs, (), ()), "Recomputed")
        target = f"recompute_{len([k for k in self.attrs if k.startswith('recompute_')])}"
        self.attrs[target] = module
        result = self.graph.call_function(checkpoint, (self.graph.get_attr(target), *[self.env[r] for r in reads]),
                                          {"use_reentrant": False})
        for i, out in enumerate(outs):
            self.env[out] = self.graph.call_function(operator.getitem, (result, i))


def fp8_linear(node: fx.Node) -> bool:
    """A linear layer an fp8 program runs on the fp8 tensor cores (ops.runs_in_fp8)."""
    if len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return False
    weight = node.args[1].meta.get("val")
    if weight is None or weight.dim() != 2:
        return False
    return runs_in_fp8(node.target, module_type(node), weight.shape[1], weight.shape[0])


def _linear_split(node: fx.Node, op: LoweredOp) -> dict[str, Any]:
    """How tensor parallelism splits a linear (runtime/fp8.py SPLITS), from its output as held: split along
    its last dim, column-parallel (the weight's outputs split); partial, row-parallel (its inputs split);
    split along another dim, its tokens (the weight whole)."""
    if op.how is How.WHOLE or not isinstance(op.output, (Partial, Shard)):
        return {"split": None}
    if isinstance(op.output, Partial):
        return {"split": "row"}
    ndim = node.meta["val"].dim()
    dim = op.output.dim % ndim
    return {"split": "column"} if dim == ndim - 1 else {"split": "tokens", "token_dim": dim}


def compose(full: Any, tp: Any, cp: Any, node: str) -> list:
    """Sizes local to both splits: ``full`` sizes, ``tp`` with tensor parallelism's split applied, ``cp``
    with context parallelism's: each dim divided by both (one split when only one touches it)."""
    full, tp, cp = list(full), list(tp), list(cp)
    if not len(full) == len(tp) == len(cp):
        raise ConfigError(f"node {node}: shape arguments {tp} (tensor parallel) and {cp} (context parallel) do not "
                          f"match {full}: re-plan with tp=1 or cp=1")
    out = []
    for f, a, b in zip(full, tp, cp):
        if a == f or b == f:
            out.append(b if a == f else a)
        elif isinstance(f, int) and f > 0 and (a * b) % f == 0:
            out.append(a * b // f)
        else:
            raise ConfigError(f"node {node}: size {f} split to {a} by tensor parallelism and to {b} by context "
                              "parallelism does not divide: re-plan with tp=1 or cp=1")
    return out


def _full_sizes(node: fx.Node, i: int) -> list[int]:
    """The whole sizes a shape argument (arg ``i``: a view's / expand's shape, unflatten's sizes) stands for,
    from the node's output shape (its ``-1`` entries resolved)."""
    out = list(node.meta["val"].shape)
    if i == 2:   # unflatten(x, dim, sizes)
        sizes = node.args[2]
        dim = node.args[1] % (len(out) - len(sizes) + 1)
        return out[dim:dim + len(sizes)]
    return out


def _split_after(steps: tuple[Step, ...], lowered: LoweredGraph | None, name: str) -> int | None:
    """The dim a value is split along over the tensor-parallel group after ``steps`` (None: whole or partial)."""
    if lowered is None:
        return None
    for s in reversed(steps):
        if isinstance(s, (Split, ReduceScatter)):
            return s.dim
        if not isinstance(s, Copy):
            return None
    op = lowered.ops.get(name)
    return split_dim(op.output) if op is not None else None


def _with_arg(target: Any, args: list, kwargs: dict, name: str, value: Any) -> tuple[list, dict]:
    """``args`` / ``kwargs`` of an aten op with its argument ``name`` set to ``value``."""
    names = [a.name for a in target._schema.arguments]
    i = names.index(name)
    if i < len(args):
        args = args[:i] + [value] + args[i + 1:]
    else:
        kwargs = {**kwargs, name: value}
    return args, kwargs


def class_name(layer: str) -> str:
    """``model.layers.3`` -> ``Layer_model_layers_3`` (the generated module's class name)."""
    return "Layer_" + "".join(c if c.isalnum() else "_" for c in layer)
