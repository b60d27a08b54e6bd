"""The exported training graph cut into pipeline chunks and layers, ready to run.

``parallelize`` exports the model at one micro-batch (torch.export, as capture does), so the
graph's fx nodes carry the same names as the plan's OpGraph. Every call_function node gets
the layer of the nearest captured op before it in graph order (capture skips ops without a
tensor output, e.g. ``_assert_tensor_metadata``), so each layer, and each chunk (a run of
layers), is a contiguous range of the graph.

What a chunk needs and gives:

- *graph inputs* (the batch's tensors): read from the micro-batch directly, on every rank;
- *parameters, buffers, constants*: held by the chunk (a parameter read by two chunks, a
  tied embedding and head, is held by both; their gradients are summed after backward);
- *values*: a node's output read by a later chunk crosses the cut (point-to-point), including
  skip connections to a chunk further on; the last chunk gives the loss. A value computed from
  the batch and buffers alone (``OpGraph.replicated``: rotary cos/sin, positions) is computed again
  at the start of the reading chunk's first layer instead, as each stage of torchtitan computes
  its own (the cost model sends the same values).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..plan.structure import first_difference
from ..capture.build import strip_wrapper
from ..capture.opgraph import OpGraph
from ..errors import ConfigError, PlanMismatchError
from ..plan import Plan
from ..plan.placement import Placement
from .lower import local_shape
from .redistribute import R
from ..runtime.pipeline import Value



@dataclass(frozen=True)
class LayerSpec:
    """One layer of one chunk: its nodes (graph order) and what crosses its edges."""

    index: int                     # OpGraph layer index
    name: str
    nodes: tuple[str, ...]         # fx call_function node names, in graph order
    inputs: tuple[str, ...]        # values (node / graph-input names) read from before this layer
    outputs: tuple[str, ...]       # values read after this layer (by later layers or chunks)
    params: tuple[str, ...]        # parameter fqns read
    buffers: tuple[str, ...]       # buffer / constant placeholder names read
    attention_core: frozenset[str]  # nodes selective recomputation drops


@dataclass(frozen=True)
class ChunkSpec:
    """One pipeline chunk (virtual stage): its layers and the values crossing its cuts."""

    index: int
    layers: tuple[LayerSpec, ...]
    graph_inputs: tuple[str, ...]  # batch tensors read
    recv: tuple[str, ...]          # values received from earlier chunks
    send: tuple[str, ...]          # values later chunks read (the loss for the last chunk)
    params: tuple[str, ...]        # parameter fqns held
    buffers: tuple[str, ...]


@dataclass(frozen=True)
class SplitGraph:
    """The exported program cut into chunks, with where each value is produced and read."""

    program: ExportedProgram
    chunks: tuple[ChunkSpec, ...]
    producer: Mapping[str, int]             # value -> chunk that computes it
    consumers: Mapping[str, tuple[int, ...]]  # value -> later chunks that read it
    param_of: Mapping[str, str]             # param placeholder -> parameter fqn (canonical)
    buffer_value: Mapping[str, torch.Tensor]  # buffer / constant placeholder -> tensor
    user_inputs: tuple[str, ...]            # graph-input placeholders, flattening order
    in_spec: Any                            # pytree spec of (args, kwargs)
    loss: str                               # the node whose value is the loss

    @cached_property
    def node_map(self) -> Mapping[str, torch.fx.Node]:
        """Every fx node of the program by name."""
        return {n.name: n for n in self.program.graph.nodes}

    def meta(self, value: str) -> torch.Tensor | Any:
        """The fake value (shape, dtype) of a node or placeholder at one micro-batch."""
        return self.node_map[value].meta.get("val")


def plan_chunks(plan) -> list[tuple[str, ...]]:
    """The plan's chunks in model order (Plan.model_chunks)."""
    return plan.model_chunks()


def split_graph(program: ExportedProgram, graph: OpGraph, chunk_layers: Sequence[Sequence[str]],
                aliases: Mapping[str, str]) -> SplitGraph:
    """Cut ``program`` into chunks of the named layers (the plan's stages' chunks, in order)."""
    sig = program.graph_signature
    fx_nodes = list(program.graph.nodes)
    param_of, buffer_value = placeholders(program, aliases)
    user_inputs = tuple(s.arg.name for s in sig.input_specs if s.kind is InputKind.USER_INPUT)
    layer_of = _layer_of_nodes(fx_nodes, graph)
    layer_index = {layer.name: layer.index for layer in graph.layers}
    missing = [name for chunk in chunk_layers for name in chunk if name not in layer_index]
    if missing:
        raise PlanMismatchError(f"the plan's stages name layers {missing[:3]} the model does not have: the plan "
                                "was made for another model; re-plan with autopar.plan on this model")
    chunk_of_layer = {layer_index[name]: c for c, chunk in enumerate(chunk_layers) for name in chunk}
    if sorted(chunk_of_layer) != list(range(len(graph.layers))):
        raise PlanMismatchError("the plan's stages do not cover every layer of the model once: re-plan")
    output = next(n for n in fx_nodes if n.op == "output")
    loss = output.args[0][0] if isinstance(output.args[0], (list, tuple)) else output.args[0]
    where = {n.name: chunk_of_layer[layer_of[n.name]] for n in fx_nodes if n.name in layer_of}
    users = {n.name: [u for u in n.users if u.op == "call_function"] for n in fx_nodes}
    by_layer: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(graph.layers))}
    for n in fx_nodes:
        if n.name in layer_of:
            by_layer[layer_of[n.name]].append(n)
    layers = {i: _layer_spec(graph.layers[i].name, i, nodes, layer_of, users, param_of, set(user_inputs), graph,
                             loss.name)
              for i, nodes in by_layer.items()}
    consumers: dict[str, set[int]] = {}
    for n in fx_nodes:
        if n.name in where:
            for u in users[n.name]:
                if where[u.name] != where[n.name]:
                    consumers.setdefault(n.name, set()).add(where[u.name])
    order = {n.name: i for i, n in enumerate(fx_nodes)}
    fx_by_name = {n.name: n for n in fx_nodes}
    # each chunk's layers, computing again what it would receive that reads the batch and buffers alone
    computed = [_compute_again(c, tuple(layers[layer_index[name]] for name in names), by_layer, fx_by_name, where,
                               users, order, layer_of, param_of, set(user_inputs), graph, loss.name)
                for c, names in enumerate(chunk_layers)]
    for c, (_, again) in enumerate(computed):
        for v in again:
            consumers.get(v, set()).discard(c)
    chunks = []
    for c, (specs, again) in enumerate(computed):
        reads = [v for spec in specs for v in spec.inputs]
        chunks.append(ChunkSpec(
            index=c, layers=specs,
            graph_inputs=tuple(dict.fromkeys(v for v in reads if v in user_inputs)),
            # in graph order, the order the producers send in (NCCL matches sends to receives by order)
            recv=tuple(sorted(dict.fromkeys(v for v in reads if v in where and where[v] != c and v not in again),
                              key=order.__getitem__)),
            send=tuple(v for v in (n.name for n in fx_nodes) if where.get(v) == c and consumers.get(v))
            + ((loss.name,) if where.get(loss.name) == c else ()),
            params=tuple(dict.fromkeys(p for spec in specs for p in spec.params)),
            buffers=tuple(dict.fromkeys(b for spec in specs for b in spec.buffers))))
    return SplitGraph(program=program, chunks=tuple(chunks), producer=where,
                      consumers={k: tuple(sorted(v)) for k, v in consumers.items() if v}, param_of=param_of,
                      buffer_value=buffer_value, user_inputs=user_inputs, in_spec=program.call_spec.in_spec,
                      loss=loss.name)


def on_device(program: ExportedProgram, device: torch.device) -> None:
    """Point every device argument of the graph's ops at ``device``, the rank's: a graph exported
    from a model on meta (or on the CPU, and run on a GPU) creates tensors (``arange``, ``zeros``,
    ``to(device=...)``) on the device its model was on when exported. The bodies of higher-order ops
    too (a ``torch.autocast`` region's, whose device type follows the rank's device)."""
    def move(a: Any) -> Any:
        return device if isinstance(a, torch.device) else a

    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function":
                node.args = pytree.tree_map(move, node.args)
                node.kwargs = pytree.tree_map(move, node.kwargs)
                if node.target is torch.ops.higher_order.wrap_with_autocast:   # (device_type, dtype, ...)
                    node.args = (device.type, *node.args[1:])
        module.recompile()


def meta_buffers(program: ExportedProgram, model_name: str) -> dict[str, tuple[str, str | None]]:
    """The buffers and constants ``program`` reads that are on the meta device (a model built there):
    placeholder -> (its ``program.state_dict`` / ``program.constants`` key, the model's name of the
    buffer), for a rank to give values (runtime/sharded_init.py; buffers are small: a rank holds every
    one its chunks read); the name is None for an empty constant (Hugging Face's cache placeholders,
    ``torch.tensor([])``), whose value is any empty tensor. Any other tensor the forward made on the
    meta device (a lifted constant) has no value to run with: raises."""
    out: dict[str, tuple[str, str | None]] = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind is InputKind.BUFFER:
            store = program.state_dict if spec.persistent is not False else program.constants
            if store[spec.target].is_meta:
                out[spec.arg.name] = (spec.target, strip_wrapper(spec.target))
        elif spec.kind is InputKind.CONSTANT_TENSOR and program.constants[spec.target].is_meta:
            if program.constants[spec.target].numel() == 0:
                out[spec.arg.name] = (spec.target, None)
                continue
            raise ConfigError(f"{model_name}'s forward reads a tensor it made on the meta device ({spec.target}), "
                              "which has no value to run with: create it on the device of the inputs in the "
                              "forward, or build the model on the CPU")
    return out


def empty_like_meta(t: torch.Tensor) -> torch.Tensor:
    """An empty meta tensor's value (on the CPU)."""
    return torch.empty(t.shape, dtype=t.dtype)


def placeholders(program: ExportedProgram, aliases: Mapping[str, str]) -> tuple[dict, dict]:
    param_of: dict[str, str] = {}
    buffer_value: dict[str, torch.Tensor] = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind is InputKind.PARAMETER:
            fqn = strip_wrapper(spec.target)
            param_of[spec.arg.name] = aliases.get(fqn, fqn)
        elif spec.kind is InputKind.BUFFER:
            buffer_value[spec.arg.name] = program.state_dict[spec.target] if spec.persistent is not False \
                else program.constants[spec.target]
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            buffer_value[spec.arg.name] = program.constants[spec.target]
    return param_of, buffer_value


def _layer_of_nodes(fx_nodes: Sequence[torch.fx.Node], graph: OpGraph) -> dict[str, int]:
    """Layer of every call_function node: its own, else that of the nearest captured op before
    it (the first layer for ops before any)."""
    captured = {node.name: node.layer for node in graph.nodes}
    calls = [n for n in fx_nodes if n.op == "call_function"]
    names = {c.name for c in calls}
    unknown = [n.name for n in graph.nodes if n.name not in names]
    if unknown:
        raise PlanMismatchError(f"the model's graph at this micro-batch lacks ops {unknown[:3]} of the plan's "
                                "graph: the model changed since planning; re-plan")
    out: dict[str, int] = {}
    current = next((captured[n.name] for n in calls if n.name in captured), 0)
    for n in calls:
        current = captured.get(n.name, current)
        out[n.name] = current
    return out


def _compute_again(c: int, specs: tuple[LayerSpec, ...], by_layer: Mapping[int, list[torch.fx.Node]],
                   fx_by_name: Mapping[str, torch.fx.Node], where: Mapping[str, int], users: Mapping[str, list],
                   order: Mapping[str, int], layer_of: Mapping[str, int], param_of: Mapping[str, str],
                   user_inputs: set[str], graph: OpGraph, loss: str) -> tuple[tuple[LayerSpec, ...], frozenset[str]]:
    """Chunk ``c``'s layers with the values it reads from earlier chunks that are computed from the batch
    and buffers alone (OpGraph.replicated, capture/replicated.py) computed again at the start of its
    first layer, with what they are computed from, instead of received; and the names computed again."""
    wanted = [v for spec in specs for v in spec.inputs if v in graph.replicated and where.get(v, c) != c]
    again: dict[str, torch.fx.Node] = {}
    stack = [fx_by_name[v] for v in wanted]
    while stack:
        node = stack.pop()
        if node.name in again:
            continue
        again[node.name] = node
        stack += [a for a in node.all_input_nodes if a.op == "call_function"]
    if not again:
        return specs, frozenset()
    first = specs[0].index
    nodes = sorted(again.values(), key=lambda n: order[n.name]) + list(by_layer[first])
    here = {**layer_of, **{v: first for v in again}}
    spec = _layer_spec(specs[0].name, first, nodes, here, users, param_of, user_inputs, graph, loss)
    others = {s.index for s in specs[1:]}
    # what it computes again is an output only where a later layer of this chunk reads it
    outputs = tuple(v for v in spec.outputs
                    if v not in again or any(where.get(u.name) == c and layer_of[u.name] in others for u in users[v]))
    return (dataclasses.replace(spec, outputs=outputs), *specs[1:]), frozenset(again)


def _layer_spec(name: str, index: int, nodes: list[torch.fx.Node], layer_of: Mapping[str, int],
                users: Mapping[str, list], param_of: Mapping[str, str], user_inputs: set[str], graph: OpGraph,
                loss: str) -> LayerSpec:
    own = {n.name for n in nodes}
    inputs: dict[str, None] = {}
    params: dict[str, None] = {}
    buffers: dict[str, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "placeholder":
                if a.name in param_of:
                    params[param_of[a.name]] = None
                elif a.name not in own:
                    (inputs if a.name in user_inputs else buffers)[a.name] = None
            elif a.op == "call_function" and a.name not in own:
                inputs[a.name] = None
    outputs = tuple(n.name for n in nodes
                    if n.name == loss or any(layer_of.get(u.name) != index for u in users[n.name]))
    core = frozenset(graph.nodes[i].name for i in graph.layers[index].nodes if graph.nodes[i].attention_core)
    return LayerSpec(index=index, name=name, nodes=tuple(n.name for n in nodes), inputs=tuple(inputs),
                     outputs=outputs, params=tuple(params), buffers=tuple(buffers), attention_core=core)


def flatten_batch(batch: Any, in_spec: Any) -> list[Any]:
    """The batch's leaves in the exported program's input order (kwargs reordered as exported)."""
    from ..capture.export import normalize_inputs
    args, kwargs = normalize_inputs(batch)
    arg_spec, kw_spec = in_spec.children() if hasattr(in_spec, "children") else in_spec.children_specs
    keys = list(kw_spec.context) if kw_spec.context else []
    if set(keys) != set(kwargs) or len(args) != arg_spec.num_children:
        raise PlanMismatchError(f"the batch has {len(args)} positional and keyword inputs {sorted(kwargs)}, but the "
                                f"program was built for {arg_spec.num_children} positional and "
                                f"{sorted(keys)}: pass batches shaped like the plan's example inputs")
    return pytree.tree_leaves((tuple(args), {k: kwargs[k] for k in keys}))


def check_structure(plan: Plan, graph: OpGraph) -> None:
    """The model exported here is the one the plan was made for: the same layers, the same ops the plan
    relies on in each, the same parameter names and shapes (capture/structure.py), whatever device,
    example batch and mode each was exported on, at and in."""
    if plan.structure is None:
        raise PlanMismatchError(f"the plan (schema {plan.schema_version}) was made by an older autopar, whose "
                                "model fingerprint this one does not compute: re-plan with autopar.plan")
    if plan.fingerprint == graph.fingerprint:
        return
    where = first_difference(plan.structure, graph.structure) or "their fingerprints differ"
    raise PlanMismatchError(
        f"the plan was made for a model with fingerprint {plan.fingerprint} ({plan.model_name}), but "
        f"{graph.model_name} here has {graph.fingerprint}: {where} (another config, or another loss_fn?); "
        "re-plan with autopar.plan on this model")


def cut_values(split: SplitGraph, graph: OpGraph, spec_of: Callable[[str], Placement], tp: int,
               tokens: Callable[[str, list[int]], Sequence[int]] | None = None) -> dict[str, Value]:
    """Every value crossing a cut (pipeline.py's Value), with the shard a receiving rank allocates: its
    block along the split of the spec it crosses in (``spec_of``), of this rank's tokens under context
    parallelism (``tokens(value, shape)``, context.py's local shape). A batch-dependent value that crosses
    whole (R) under tensor parallelism crosses scattered (``Value.scatter``: 1/t from each rank, all-gathered
    by the receivers), as the cost model prices it (cost_model/estimator.py)."""
    out = {}
    for v, readers in split.consumers.items():
        meta = split.meta(v)
        shape = list(meta.shape) if tokens is None else list(tokens(v, list(meta.shape)))
        node = graph.node(v) if v in graph.node_index else None
        grad = node.requires_grad if node is not None else True
        spec = spec_of(v)
        local = local_shape(tuple(shape), spec, tp)
        scatter = (tp > 1 and spec == R and node is not None and node.batch_dependent and meta.is_floating_point()
                   and math.prod(local) % tp == 0)
        out[v] = Value(split.producer[v], tuple(readers), local, meta.dtype, grad and meta.is_floating_point(),
                       scatter)
    return out
