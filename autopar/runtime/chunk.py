"""One pipeline chunk as an ``nn.Module``: its layers run the exported graph's nodes eagerly.

Why not ``torch.distributed.pipelining``'s ``pipeline()`` split or ``parallelize_module``:
the plan cuts at capture's layers (not at ``pipe_split`` markers in user code), a value may
skip to any later chunk and a tied weight lives in two chunks, and the plan shards every op
(not only ``nn.Linear`` / ``nn.Embedding`` modules) with the specs the ILP chose. So each
layer is a small module that runs its slice of the exported graph node by node:

- with ``tp == 1`` on plain tensors (the graph's ops, nothing added);
- with ``tp > 1`` on this rank's shards, as codegen/lower.py lowered the plan's specs: each
  argument converted by explicit collectives (codegen/collectives.py, whose backward supplies
  Megatron's ``f`` and ``g``) to the spec the op's strategy reads it in, shape arguments at
  local sizes, the vocabulary-parallel embedding and loss as codegen/shard_ops.py writes them.
  Parameters are DTensors of the tp mesh (so that FSDP2 and checkpoints see their layout); a
  layer reads their local shards;
- with ``cp > 1`` (``tp == 1``) on this rank's tokens of each sequence: ``NodeRunner.context``
  (context_runner.py) converts inputs and runs each node as context.py decided (locally, whole after a
  gather, or as ring attention);
- an MoE region with ``ep > 1`` or ``cp > 1`` as one call of the layer's ``ExpertsModule``
  (experts.py) at the region's output node, its other nodes skipped.

Each layer is its own module so FSDP2 can gather its parameters just in time (ZeRO-3) and
``torch.utils.checkpoint`` can recompute it (recompute ``full``); ``selective`` recomputes only
the attention core's nodes (Korthikanti et al.).
"""

from __future__ import annotations

import operator
from functools import cached_property
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ..codegen.lower import (CONTEXT_HOPS, SKIPPED_TARGETS, R, How, LoweredGraph, LoweredOp, Step, alias_writes,
                             convert, normal)
from ..errors import ConfigError
from .graph import ChunkSpec, LayerSpec, SplitGraph
from .shards import apply_steps, run_op


def attr_name(fqn: str) -> str:
    """A parameter / buffer name usable as a module attribute."""
    return fqn.replace(".", "__")


class NodeRunner:
    """Runs fx nodes of one exported program on plain tensors: whole, or (``tp > 1``) this rank's shards
    as the lowering (codegen/lower.py) says, with its collectives (codegen/collectives.py)."""

    def __init__(self, split: SplitGraph, mesh: DeviceMesh | None, lowered: LoweredGraph | None = None) -> None:
        self.nodes = split.node_map
        self.module = split.program.graph_module
        self.mesh = mesh
        self.group = mesh.get_group() if mesh is not None else None
        self.lowered = lowered
        self.context = None           # a context.ContextRunner when cp > 1: runs every node on local tokens
        self.moe_outputs: dict[str, Any] = {}   # MoE region output node -> region, run as one call (experts.py)
        self.moe_skip: frozenset[str] = frozenset()   # the regions' other nodes, not run
        # what each node is, decided once rather than from str(target) on every call
        targets = {name: str(n.target) for name, n in self.nodes.items()}
        self.skipped = frozenset(name for name, t in targets.items() if t in SKIPPED_TARGETS)
        self.context_hops = {name: t for name, t in targets.items() if t in CONTEXT_HOPS}

    def run(self, name: str, env: dict[str, Any]) -> Any:
        node = self.nodes[name]
        if name in self.skipped or name in self.moe_skip:
            return None

        def load(n: torch.fx.Node) -> Any:
            return getattr(self.module, n.target) if n.op == "get_attr" else env[n.name]

        region = self.moe_outputs.get(name)
        if self.context is not None:
            compute = None if region is None else (lambda *values: self._moe(region, env, *values))
            return self.context.run(node, env, load, compute)
        if self.lowered is not None and node.target is not operator.getitem:
            return self._run_lowered(node, self.lowered.ops[name], env, load)
        if region is not None:
            return self._moe(region, env, env[region.hidden_input], env[region.index_input],
                             env[region.weight_input])
        args = torch.fx.node.map_arg(node.args, load)
        kwargs = torch.fx.node.map_arg(node.kwargs, load)
        if name in self.context_hops:
            return _run_context_hop(self.context_hops[name], args, kwargs)
        return node.target(*args, **kwargs)

    def _moe(self, region: Any, env: dict[str, Any], hidden: Any, index: Any, weights: Any) -> Any:
        """An MoE region's output from its (whole) inputs by this layer's ExpertsModule (experts.py)."""
        return env[("experts", region.output)](hidden, index, weights)

    # --- tensor parallelism: the lowered program --------------------------------------------------
    def _read(self, name: str, value: Any, steps: tuple[Step, ...], env: dict[str, Any]) -> Any:
        """``value`` (node ``name``'s) converted as the lowering says, once per layer pass (at every read
        for a tensor some op writes in place: a conversion made before the write is stale after it)."""
        if not steps or not isinstance(value, torch.Tensor):
            return value
        if name in self.lowered.pinned:
            return apply_steps(value, steps, self.group)
        key = ("read", name, steps)
        if key not in env:
            env[key] = apply_steps(value, steps, self.group)
        return env[key]

    def _run_lowered(self, node: torch.fx.Node, op: LoweredOp, env: dict[str, Any], load) -> Any:
        if op.how is How.SKIP:
            return None
        if op.how is How.MOE:
            region = self.moe_outputs[node.name]
            hidden, index, weights = (self._read(v, env[v], op.reads[v], env)
                                      for v in (region.hidden_input, region.index_input, region.weight_input))
            return self._moe(region, env, hidden, index, weights)

        def read(n: torch.fx.Node) -> Any:
            if n.name in op.writes:   # written in place: a copy of its own, which then replaces it
                env[n.name] = apply_steps(load(n), op.reads[n.name], self.group).clone()
                return env[n.name]
            return self._read(n.name, load(n), op.reads.get(n.name, ()), env)

        args = list(torch.fx.node.map_arg(node.args, read))
        kwargs = dict(torch.fx.node.map_arg(node.kwargs, read))
        for i, sizes in op.shape_args.items():
            args[i] = list(sizes)
        if node.name in self.context_hops:
            return _run_context_hop(self.context_hops[node.name], tuple(args), kwargs)
        out = run_op(node.target, op.how, args, kwargs, self.group)
        if op.local_shape is not None and isinstance(out, torch.Tensor) and tuple(out.shape) != op.local_shape:
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            raise ConfigError(f"tensor parallelism: op {node.name} ({node.target}) gave a shard of shape "
                              f"{tuple(out.shape)} from shards {shapes} where the plan's spec {op.output} needs "
                              f"{op.local_shape}: the plan's "
                              "sharding does not fit this op; re-plan with fixed={'tp': 1} and report it")
        if op.after:   # the output, or every piece of a list output (a split)
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: apply_steps(t, op.after, self.group), out)
        return out

    def to_cut(self, chunk: int, name: str, value: Any, spec: str) -> Any:
        """Node ``name``'s value (held as chunk ``chunk`` holds it) in ``spec``, to send across a cut."""
        if self.lowered is None or not isinstance(value, torch.Tensor):
            return value
        held = self.lowered.held[chunk].get(name, R)
        d = value.dim()
        return apply_steps(value, convert(normal(held, d), normal(spec, d), False), self.group)


def _run_context_hop(name: str, args: tuple, kwargs: dict) -> Any:
    """``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` (a ``torch.no_grad()`` or autocast region of
    the model, e.g. a rotary embedding) run as the context manager around their subgraph."""
    if name == "wrap_with_set_grad_enabled":
        enabled, body, *rest = args
        with torch.set_grad_enabled(enabled):
            return _Body(body).run(*rest, **kwargs)
    device_type, dtype, enabled, cache_enabled, body, *rest = args
    with torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        return _Body(body).run(*rest, **kwargs)


class _Body(torch.fx.Interpreter):
    """A higher-order op's subgraph, without its metadata asserts."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if str(target) in SKIPPED_TARGETS:
            return None
        return super().call_function(target, args, kwargs)


def _local(param: Any) -> Any:
    """A tensor-parallel parameter (a DTensor of the tp mesh, or of FSDP2's 2-D one) as this rank's
    shard, with autograd: its gradient comes back as the shard's (codegen/collectives.py keeps the
    gradient of a replicated parameter whole on every rank)."""
    return param.to_local() if isinstance(param, DTensor) else param


def written_inputs(spec: LayerSpec, nodes: Mapping[str, torch.fx.Node]) -> tuple[str, ...]:
    """The layer's inputs that one of its ops writes in place, directly or through a view of them
    (codegen/lower.py ``alias_writes``)."""
    _, written = alias_writes(nodes[name] for name in spec.nodes)
    return tuple(n for n in spec.inputs if n in written)


class LayerModule(nn.Module):
    """One layer: ``forward(*inputs, *shared_params) -> outputs`` over its slice of the graph."""

    def __init__(self, spec: LayerSpec, runner: NodeRunner, own: Sequence[str], shared: Sequence[str],
                 param_of: Mapping[str, str], buffers: Mapping[str, torch.Tensor], recompute: str,
                 experts: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.spec = spec
        # MoE regions of this layer run by their ExpertsModule (its own module, so that FSDP2 can
        # shard expert weights over another mesh), keyed by the region's output node
        self.experts = nn.ModuleDict({attr_name(out): m for out, m in (experts or {}).items()})
        self.expert_outputs = tuple((experts or {}).keys())
        self.runner = runner
        self.own = tuple(own)
        self.shared = tuple(shared)
        self.recompute = recompute
        self.placeholder_of = {fqn: ph for ph, fqn in param_of.items()}
        self.buffer_names = tuple(spec.buffers)
        for name in self.buffer_names:
            self.register_buffer(attr_name(name), buffers[name], persistent=False)
        # inputs an op of this layer writes in place (``x += y`` in the model's code): written on a
        # copy made inside the layer, which later layers read instead (a second output). FSDP2 hands a
        # layer its inputs as views made by a custom autograd Function, and autograd refuses to
        # write in place on those.
        self.written = written_inputs(spec, runner.nodes)

    def forward(self, *values: Any) -> tuple[Any, ...]:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._run, *values, use_reentrant=False)
        return self._run(*values)

    def _run(self, *values: Any) -> tuple[Any, ...]:
        n_in = len(self.spec.inputs)
        env: dict[str, Any] = dict(zip(self.spec.inputs, values[:n_in]))
        for fqn, value in zip(self.shared, values[n_in:]):
            env[self.placeholder_of[fqn]] = _local(value)
        for fqn in self.own:
            env[self.placeholder_of[fqn]] = _local(getattr(self, attr_name(fqn)))
        for name in self.buffer_names:
            env[name] = getattr(self, attr_name(name))
        for out in self.expert_outputs:
            env[("experts", out)] = self.experts[attr_name(out)]
        for name in self.written:
            env[name] = env[name].clone()
        if self.recompute == "selective" and self.spec.attention_core and torch.is_grad_enabled():
            self._run_selective(env)
        else:
            for name in self.spec.nodes:
                env[name] = self.runner.run(name, env)
        return tuple(env[name] for name in self.spec.outputs + self.written)

    def _run_selective(self, env: dict[str, Any]) -> None:
        """Run the nodes, recomputing each run of attention-core nodes in backward."""
        for kind, names, reads, outs in self.segments:
            if kind == "plain":
                env[names[0]] = self.runner.run(names[0], env)
                continue

            def core(*vals: Any, names=names, reads=reads, outs=outs) -> tuple[Any, ...]:
                local = dict(zip(reads, vals))
                for name in names:
                    local[name] = self.runner.run(name, local)
                return tuple(local[name] for name in outs)

            results = checkpoint(core, *[env[r] for r in reads], use_reentrant=False)
            env.update(zip(outs, results))

    @cached_property
    def segments(self) -> list[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
        """("plain", (node,), (), ()) or ("core", nodes, values read from outside, values used after)."""
        nodes = list(self.spec.nodes)
        out = []
        i = 0
        while i < len(nodes):
            if nodes[i] not in self.spec.attention_core:
                out.append(("plain", (nodes[i],), (), ()))
                i += 1
                continue
            j = i
            while j < len(nodes) and nodes[j] in self.spec.attention_core:
                j += 1
            segment = nodes[i:j]
            reads = tuple(dict.fromkeys(a.name for n in segment for a in self.runner.nodes[n].all_input_nodes
                                        if a.name not in segment))
            later = set(nodes[j:])
            outs = tuple(n for n in segment if any(u.name in later or u.name not in nodes
                                                   for u in self.runner.nodes[n].users))
            out.append(("core", tuple(segment), reads, outs))
            i = j
        return out


class ChunkModule(nn.Module):
    """One chunk: ``forward(*graph_inputs, *received) -> values sent on`` (the loss for the last)."""

    def __init__(self, spec: ChunkSpec, split: SplitGraph, runner: NodeRunner,
                 params: Mapping[str, nn.Parameter], recompute: Sequence[str],
                 experts: Mapping[str, nn.Module] | None = None) -> None:
        """``recompute``: the recompute mode of each of the chunk's layers (ParallelConfig.layer_mode)."""
        super().__init__()
        self.spec = spec
        experts = experts or {}
        held = {fqn for m in experts.values() for fqn in m.named_model_parameters()}  # by ExpertsModules
        use_count: dict[str, int] = {}
        for layer in spec.layers:
            for p in layer.params:
                use_count[p] = use_count.get(p, 0) + 1
        self.shared_params = tuple(p for p in spec.params if use_count[p] > 1 and p not in held)
        for fqn in self.shared_params:
            self.register_parameter(attr_name(fqn), params[fqn])
        self.layers = nn.ModuleList()
        for layer, mode in zip(spec.layers, recompute, strict=True):
            own = [p for p in layer.params if use_count[p] == 1 and p not in held]
            shared = [p for p in layer.params if use_count[p] > 1 and p not in held]
            mine = {out: m for out, m in experts.items() if out in layer.nodes}
            module = LayerModule(layer, runner, own, shared, split.param_of, split.buffer_value, mode, mine)
            for fqn in own:
                module.register_parameter(attr_name(fqn), params[fqn])
            self.layers.append(module)

    def forward(self, *values: Any) -> tuple[Any, ...]:
        names = self.spec.graph_inputs + self.spec.recv
        env: dict[str, Any] = dict(zip(names, values))
        shared = {fqn: getattr(self, attr_name(fqn)) for fqn in self.shared_params}
        for layer in self.layers:
            ins = [env[v] for v in layer.spec.inputs] + [shared[p] for p in layer.shared]
            env.update(zip(layer.spec.outputs + layer.written, layer(*ins)))
        return tuple(env[v] for v in self.spec.send)

    def named_model_parameters(self) -> dict[str, nn.Parameter]:
        """Parameter fqn (the model's name) -> the parameter held here."""
        out = {fqn: getattr(self, attr_name(fqn)) for fqn in self.shared_params}
        for layer in self.layers:
            out.update({fqn: getattr(layer, attr_name(fqn)) for fqn in layer.own})
            for m in layer.experts.values():
                out.update(m.named_model_parameters())
        return out

