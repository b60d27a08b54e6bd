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

from ..capture.build import module_path
from . import collectives, shard_ops
from .lower import CONTEXT_HOPS, SKIPPED_TARGETS, How, LoweredGraph, LoweredOp, Step


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
                 name: str = "Layer", checks: bool = False) -> fx.GraphModule:
    """The layer's generated module. ``source``: the exported graph module (region bodies); ``experts``
    / ``moe``: MoE region output node -> its experts module / its (hidden, index, weights) inputs, for
    regions run as one call; ``skip``: nodes not run (the regions' other nodes); ``checks``: check the
    shape of every shard an op computes (the shapes are static: a program runs this once, on its
    first call, and the code without checks after)."""
    emitter = _Emitter(nodes, source, lowered, group, experts or {}, moe or {}, skip, checks)
    return emitter.module(io, name)


class _Emitter:
    def __init__(self, nodes: Mapping[str, fx.Node], source: nn.Module, lowered: LoweredGraph | None, group: Any,
                 experts: Mapping[str, nn.Module], moe: Mapping[str, tuple[str, str, str]],
                 skip: frozenset[str], checks: bool = False) -> None:
        self.nodes, self.source, self.lowered, self.group = nodes, source, lowered, group
        self.experts, self.moe, self.skip, self.checks = experts, moe, skip, checks

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
        module = fx.GraphModule(self.attrs, self.graph, class_name=name)
        return module

    # --- values ---------------------------------------------------------------------------------
    def steps(self, value: Any, steps: tuple[Step, ...]) -> Any:
        for s in steps:
            fn = getattr(collectives, s.kind)
            args = (value, s.dim, self.group_node) if s.dim is not None else (value, self.group_node)
            value = self.graph.call_function(fn, args)
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
        if name in self.moe:
            values = [self.read(v, op.reads.get(v, ())) if op is not None else self.env[v] for v in self.moe[name]]
            target = f"experts_{name}"
            self.attrs[target] = self.experts[name]
            self.env[name] = self.graph.call_module(target, tuple(values))
            return
        if op is None:
            args = fx.node.map_arg(node.args, self.load)
            kwargs = fx.node.map_arg(node.kwargs, self.load)
        else:
            args, kwargs = self._lowered_args(node, op)
        if str(node.target) in CONTEXT_HOPS:
            self.env[name] = self._region(str(node.target), args, kwargs)
            return
        first = len(self.graph.nodes)
        if op is None:
            self.env[name] = self.graph.create_node("call_function", node.target, tuple(args), kwargs, name=name)
        else:
            self.env[name] = self._lowered_op(node, op, args, kwargs)
        self._tag(node, first)

    def _tag(self, node: fx.Node, first: int) -> None:
        """The module path of the model's code that made ``node``, on the nodes emitted for it (source.py
        writes it as a comment)."""
        path = module_path(node)
        if path:   # the nodes made since ``first``, from the end (a list of the whole graph per node is quadratic)
            for made in itertools.islice(reversed(self.graph.nodes), len(self.graph.nodes) - first):
                made.meta.setdefault("module_path", path)

    def _lowered_args(self, node: fx.Node, op: LoweredOp) -> tuple[list, dict]:
        def read(n: fx.Node) -> Any:
            if n.name in op.writes:   # written in place: a converted copy of its own, which then replaces it
                self.env[n.name] = self.graph.call_method("clone", (self.steps(self.env[n.name], op.reads[n.name]),))
                return self.env[n.name]
            if n.op == "get_attr":
                return self.attr(n)
            return self.read(n.name, op.reads.get(n.name, ()))

        args = list(fx.node.map_arg(node.args, read))
        kwargs = dict(fx.node.map_arg(node.kwargs, read))
        for i, sizes in op.shape_args.items():
            args[i] = list(sizes)
        return args, kwargs

    def _lowered_op(self, node: fx.Node, op: LoweredOp, args: list, kwargs: dict) -> Any:
        g, target, how, name = self.group_node, node.target, op.how, node.name
        call = self.graph.call_function
        if how in (How.LOCAL, How.WHOLE):
            out = self.graph.create_node("call_function", target, tuple(args), kwargs, name=name)
        elif how is How.VOCAB_EMBEDDING:
            a = bind(target, args, kwargs)
            out = call(shard_ops.vocab_embedding, (a["weight"], a["indices"], g, a.get("padding_idx", -1)))
        elif how is How.VOCAB_LOSS:
            a = bind(target, args, kwargs)
            if "label_smoothing" in a:
                out = call(shard_ops.vocab_cross_entropy, (a["self"], a["target"], g, a["reduction"],
                                                           a["ignore_index"], a["label_smoothing"]))
            else:
                out = call(shard_ops.vocab_nll, (a["self"], a["target"], g, a["reduction"], a["ignore_index"]))
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
            call(shard_ops.expect_shape, (out, op.local_shape, name, op.output))
        if op.after:
            if isinstance(node.meta.get("val"), (list, tuple)):   # a split's pieces, converted as they are read
                self.pieces[name] = op.after
                return out
            return self.steps(out, op.after)
        return out

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
                        self.checks)
        module = core.module(LayerIO(tuple(segment), reads, outs, (), ()), "Recomputed")
        target = f"recompute_{len([k for k in self.attrs if k.startswith('recompute_')])}"
        self.attrs[target] = module
        result = self.graph.call_function(checkpoint, (self.graph.get_attr(target), *[self.env[r] for r in reads]),
                                          {"use_reentrant": False})
        for i, out in enumerate(outs):
            self.env[out] = self.graph.call_function(operator.getitem, (result, i))


def class_name(layer: str) -> str:
    """``model.layers.3`` -> ``Layer_model_layers_3`` (the generated module's class name)."""
    return "Layer_" + "".join(c if c.isalnum() else "_" for c in layer)
