"""Walk an ExportedProgram's graph into OpNodes (layer assignment comes after, in layers.py).

For every call_function node we derive, from the fake-tensor metadata export leaves on
it: output shapes, which inputs are parameters, whether the output needs a gradient
(some input does) and scales with the batch (some input does, or a size argument is the batch
size: ``GraphWalk._sized_by_batch``), the storage it aliases
(views resolve to their base, so a tensor saved through three views counts once),
what autograd saves for backward (rules.py), FLOPs (flops.py) and bytes moved.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

import torch
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.export.graph_signature import InputKind

from ..errors import CaptureError
from ..ops import DROPOUTS, GROUPED_MM, base_name
from .dims import node_dims
from .export import INTERNAL_PATHS
from .flops import FlopCache, attention_flops, count_matmul_flops, gemm_shape, grouped_mm_flops, is_causal
from .opgraph import GraphInput, OpKind, OpNode, SavedTensor, TensorMeta
from .rules import ArgInfo, op_kind, saved_spec

_WRAPPER_PREFIX = "model."
# FLOPs per output element of memory-bound ops (forward); only their bytes matter for time.
_ELEMENT_FLOPS = {OpKind.NORM: 5.0, OpKind.SOFTMAX: 5.0, OpKind.LOSS: 5.0}


class DataDependentShape(Exception):
    """A tensor's size is a symbol torch.export could not fix: it depends on tensor values."""


def tensor_meta(value: Any) -> TensorMeta | None:
    if isinstance(value, torch.Tensor):
        try:
            shape = tuple(int(d) for d in value.shape)
        except GuardOnDataDependentSymNode as exc:
            raise DataDependentShape(str(tuple(value.shape))) from exc
        return TensorMeta(shape, str(value.dtype).removeprefix("torch."))
    return None


def strip_wrapper(fqn: str) -> str:
    """A name inside capture's LossWrapper (``model.x``) as the user's model names it (``x``)."""
    return fqn[len(_WRAPPER_PREFIX):] if fqn.startswith(_WRAPPER_PREFIX) else fqn


@dataclass
class _Source:
    """What a graph value is: a parameter, buffer, constant, user input or op output."""

    kind: str                 # "param" | "buffer" | "const" | "input" | "op"
    name: str                 # FQN for params/buffers, node name otherwise
    requires_grad: bool
    batch_dependent: bool
    root: str                 # storage root
    meta: TensorMeta | None


@dataclass
class GraphWalk:
    """Mutable state of one walk; ``run`` yields OpNodes with ``layer=-1``."""

    program: ExportedProgram
    param_requires_grad: Mapping[str, bool]
    param_alias: Mapping[str, str] = field(default_factory=dict)  # any FQN -> canonical FQN (tied weights)
    flop_cache: FlopCache = field(default_factory=FlopCache)
    sources: dict[str, _Source] = field(default_factory=dict)
    root_numel: dict[str, tuple[int, str]] = field(default_factory=dict)
    params: dict[str, TensorMeta] = field(default_factory=dict)
    buffers: dict[str, TensorMeta] = field(default_factory=dict)
    inputs: list[GraphInput] = field(default_factory=list)

    def run(self) -> Iterator[OpNode]:
        self._placeholders()
        for node in self.program.graph.nodes:
            if node.op == "call_function":
                op = self._op(node)
                if op is not None:
                    yield op

    def _placeholders(self) -> None:
        specs = {s.arg.name: s for s in self.program.graph_signature.input_specs if hasattr(s.arg, "name")}
        for node in self.program.graph.nodes:
            if node.op != "placeholder":
                continue
            meta = tensor_meta(node.meta.get("val"))
            spec = specs.get(node.name)
            if spec is not None and spec.kind is InputKind.PARAMETER:
                fqn = strip_wrapper(spec.target)
                # torch.export keeps one placeholder per *name* of a tied parameter; fold every
                # alias onto the name model.named_parameters() gives, so a tied weight counts once.
                fqn = self.param_alias.get(fqn, fqn)
                rg = self.param_requires_grad.get(fqn, True)
                if meta is not None and rg:
                    self.params[fqn] = meta
                self.sources[node.name] = _Source("param", fqn, rg, False, node.name, meta)
            elif spec is not None and spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                fqn = strip_wrapper(spec.target or node.name)
                if meta is not None and spec.kind is InputKind.BUFFER:
                    self.buffers[fqn] = meta
                self.sources[node.name] = _Source("buffer", fqn, False, False, node.name, meta)
            else:
                self.sources[node.name] = _Source("input", node.name, False, meta is not None, node.name, meta)
                if meta is not None:
                    self.inputs.append(GraphInput(node.name, meta, True))
                    self.root_numel[node.name] = (meta.numel, meta.dtype)

    def _tensor_args(self, node: torch.fx.Node) -> list[tuple[int, torch.fx.Node]]:
        """(position, producer) of every tensor-valued fx.Node argument, in flattening order."""
        found: list[tuple[int, torch.fx.Node]] = []
        for pos, arg in enumerate(list(node.args) + list(node.kwargs.values())):
            for leaf in (arg if isinstance(arg, (list, tuple)) else [arg]):
                if isinstance(leaf, torch.fx.Node) and _holds_tensor(leaf.meta.get("val")):
                    found.append((pos, leaf))
        return found

    def _op(self, node: torch.fx.Node) -> OpNode | None:
        name = base_name(node.target)
        kind = op_kind(name)
        value = node.meta.get("val")
        try:
            outputs = tuple(m for m in map(tensor_meta, value if isinstance(value, (list, tuple)) else [value]) if m)
        except DataDependentShape as exc:
            where = _source_line(node) or module_path(node) or "the model"
            raise CaptureError(
                f"capturing failed at {where}: {node.target} makes a tensor of shape {exc} whose size depends on "
                f"the values of a tensor (in {module_path(node) or 'the model'}), which a static graph cannot plan. "
                "Hint: compute it with static shapes (masks and torch.where instead of selecting rows; a "
                "mixture-of-experts layer: a grouped or capacity-based dispatch, Hugging Face "
                "experts_implementation='grouped_mm')") from exc
        targs = self._tensor_args(node)
        srcs = [self.sources[a.name] for _, a in targs]
        if name == "getitem":  # the element of a multi-output op, not the list itself
            srcs = [replace(srcs[0], meta=outputs[0] if outputs else None)] if srcs else []
        metas = [s.meta for s in srcs]
        rg = any(s.requires_grad for s in srcs) and any(o.is_float for o in outputs)
        bd = any(s.batch_dependent for s in srcs) or self._sized_by_batch(node, metas, outputs)
        if name == "getitem":
            kind = OpKind.VIEW
        root = self._root(node, name, kind, targs, outputs)
        self.sources[node.name] = _Source("op", node.name, rg, bd, root, outputs[0] if outputs else None)
        if not outputs:
            return None
        saved = self._saved(node, name, targs, srcs, outputs[0])
        fwd, bwd = self._flops(node, name, kind, targs, srcs, outputs[0], rg)
        dims, reduced = node_dims(name, node, targs, [s.kind in ("op", "input") for s in srcs],
                                  outputs[0].shape)
        param_dims = ()
        if kind is OpKind.VIEW and srcs and all(s.kind == "param" and s.requires_grad for s in srcs):  # W.t()
            param_dims, _ = node_dims(name, node, targs, [True] * len(srcs), outputs[0].shape)
        moved = 0.0 if kind in (OpKind.VIEW, OpKind.CREATION) else float(
            sum(m.nbytes for m in metas if m) + sum(o.nbytes for o in outputs))
        return OpNode(
            name=node.name, target=str(node.target), kind=kind,
            inputs=tuple(dict.fromkeys(s.name for s in srcs if s.kind in ("op", "input"))),
            params=tuple(dict.fromkeys(s.name for s in srcs if s.kind == "param" and s.requires_grad)),
            outputs=outputs, flops_fwd=fwd, flops_bwd=bwd, bytes_fwd=moved, requires_grad=rg,
            batch_dependent=bd, saved=saved, module_path=module_path(node), module_type=module_type(node),
            layer=-1, gemm=gemm_shape(name, kind, [m for m in metas if m], outputs[0],
                                      [s.batch_dependent for s in srcs],
                                      kind is OpKind.ATTENTION and is_causal(node.target, node.args, node.kwargs)),
            dims=dims, reduced=reduced, param_dims=param_dims)

    def _sized_by_batch(self, node: torch.fx.Node, metas: list, outputs: tuple) -> bool:
        """An op that reads nothing batch-dependent yet takes the batch size as a size argument:
        torch.export bakes ``x.shape[0]`` into the graph as a number, so ``cls.expand(x.shape[0], 1, -1)``
        (a learned token prepended to every sequence) or ``torch.zeros(x.shape[0], n)`` reads no
        batch-dependent tensor. Left batch-independent, its size would not scale with the micro-batch
        in the cost model, and the sharding solver would take it for a constant. Recognised by a size
        argument that starts with the batch size, where the output's dim 0 is the batch and no tensor
        input's dim 0 is."""
        batch = batch_size_of(self.inputs)
        if batch <= 1 or not outputs or not outputs[0].shape or outputs[0].shape[0] != batch:
            return False
        if any(m is not None and m.shape and m.shape[0] == batch for m in metas):
            return False
        sizes = [a for a in node.args if isinstance(a, (list, tuple)) and a and all(type(v) is int for v in a)]
        return any(a[0] == batch for a in sizes)

    def _root(self, node: torch.fx.Node, name: str, kind: OpKind, targs: list, outputs: tuple) -> str:
        if kind is OpKind.VIEW and targs:
            return self.sources[targs[0][1].name].root
        if name == "getitem":  # element of a multi-output op: its own storage
            key = f"{node.args[0].name}[{node.args[1]}]"
        else:
            key = node.name
        if outputs:
            self.root_numel.setdefault(key, (outputs[0].numel, outputs[0].dtype))
        return key

    def _saved(self, node: torch.fx.Node, name: str, targs: list, srcs: list[_Source],
               out: TensorMeta) -> tuple[SavedTensor, ...]:
        args = [ArgInfo(pos, s.meta, s.requires_grad) for (pos, _), s in zip(targs, srcs) if s.meta]
        spec = saved_spec(name, args, out, _kwargs_with_defaults(node, name))
        by_pos: dict[int, _Source] = {}
        for (pos, _), s in zip(targs, srcs):
            by_pos.setdefault(pos, s)
        saved: list[SavedTensor] = []
        for pos in spec.inputs:
            src = by_pos.get(pos)
            if src is None or src.kind in ("param", "buffer") or self._is_param_view(src):
                continue  # weights (and views of them, W.t()) live in parameter memory, not activation memory
            numel, dtype = self.root_numel.get(src.root, (src.meta.numel, src.meta.dtype))
            saved.append(SavedTensor(src.root, numel, dtype, src.batch_dependent))
        me = self.sources[node.name]
        if spec.output:
            numel, dtype = self.root_numel.get(me.root, (out.numel, out.dtype))
            saved.append(SavedTensor(me.root, numel, dtype, me.batch_dependent))
        for label, numel, dtype in spec.extras:
            saved.append(SavedTensor(f"{node.name}:{label}", numel, dtype, me.batch_dependent))
        return tuple(saved)

    def _is_param_view(self, src: _Source) -> bool:
        root = self.sources.get(src.root)
        return src.kind == "op" and root is not None and root.kind == "param"

    def _flops(self, node: torch.fx.Node, name: str, kind: OpKind, targs: list, srcs: list[_Source],
               out: TensorMeta, rg: bool) -> tuple[float, float]:
        if kind is OpKind.ATTENTION and len(srcs) >= 3:
            return attention_flops(srcs[0].meta, srcs[1].meta, srcs[2].meta, rg)
        if name in GROUPED_MM and len(srcs) >= 2 and srcs[0].meta and srcs[1].meta:
            return grouped_mm_flops(srcs[0].meta, srcs[1].meta, out, (srcs[0].requires_grad, srcs[1].requires_grad))
        if kind in (OpKind.MATMUL, OpKind.CONV):
            args = torch.fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
            kwargs = torch.fx.node.map_arg(dict(node.kwargs), lambda a: a.meta.get("val"))
            grads = tuple(s.requires_grad for s in srcs)
            return count_matmul_flops(node.target, args, kwargs, grads, self.flop_cache)
        if kind in (OpKind.VIEW, OpKind.CREATION):
            return 0.0, 0.0
        per = _ELEMENT_FLOPS.get(kind, 1.0)
        fwd = per * out.numel
        return fwd, (2.0 * fwd if rg else 0.0)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def _kwargs_with_defaults(node: torch.fx.Node, name: str) -> dict:
    """Named arguments of the call (dropout's p and train), positional ones included."""
    kwargs = dict(node.kwargs)
    if name in DROPOUTS and len(node.args) >= 2:
        kwargs.setdefault("p", node.args[1])
        if len(node.args) >= 3:
            kwargs.setdefault("train", node.args[2])
    return kwargs


def _stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or {}
    return [(str(path), str(typ)) for path, typ in stack.values()]


@functools.lru_cache(maxsize=65536)
def _clean_path(path: str) -> str:
    """Export paths look like "model.blocks.0.attn" (or "L['self'].model.blocks[0]" in some versions).
    Cached: every op of a module repeats its path (a 126-layer Llama's 7,000 ops, about 30,000 levels)."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")
    if path == "model":
        return ""
    return strip_wrapper(path)


def module_path(node: torch.fx.Node) -> str:
    stack = _stack(node)
    return _clean_path(stack[-1][0]) if stack else ""


def module_paths(node_stack: list[tuple[str, str]]) -> list[str]:
    return [_clean_path(p) for p, _ in node_stack]


def module_type(node: torch.fx.Node) -> str:
    """The class name of the innermost module whose code made ``node`` (``"Linear"``), or ""."""
    stack = _stack(node)
    typ = stack[-1][1] if stack else ""
    return typ.rsplit(".", 1)[-1].strip("'>") if typ else ""


def _source_line(node: torch.fx.Node) -> str:
    """``file:line`` of the innermost frame in model code (not torch's nn.Module internals)."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(found):
        if not any(part in path for part in INTERNAL_PATHS):
            return f"{path}:{line}"
    return f"{found[-1][0]}:{found[-1][1]}" if found else ""


def batch_size_of(inputs: list[GraphInput]) -> int:
    """The batch size of the example inputs: dim 0 of the first input with a dimension."""
    for gi in inputs:
        if gi.meta.shape:
            return gi.meta.shape[0]
    return 1


def node_stacks(program: ExportedProgram) -> dict[str, list[str]]:
    """Cleaned module paths (outermost first) for each call_function node."""
    return {n.name: module_paths(_stack(n)) for n in program.graph.nodes if n.op == "call_function"}


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
