"""One pipeline chunk as an ``nn.Module``: its layers run the exported graph's nodes eagerly.

Why not ``torch.distributed.pipelining``'s ``pipeline()`` split or ``parallelize_module``:
the plan cuts at capture's layers (not at ``pipe_split`` markers in user code), a value may
skip to any later chunk and a tied weight lives in two chunks, and the plan shards every op
(not only ``nn.Linear`` / ``nn.Embedding`` modules) with the specs the ILP chose. So each
layer is a small module that runs its slice of the exported graph node by node:

- with ``tp == 1`` on plain tensors (the graph's ops, nothing added);
- with ``tp > 1`` on DTensors: parameters are distributed with the plan's split dims, every
  input is redistributed to the spec the plan's strategy reads it in, and every output to the
  plan's output spec. DTensor's own sharding propagation then runs each op on its shards and
  its autograd supplies the backward collectives (the all-reduce of a column-parallel input's
  gradient, Megatron's ``f``). An op DTensor has no rule for runs on gathered (replicated)
  inputs: slower, never wrong, and listed in ``NodeRunner.fallbacks``;
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

import contextlib
import operator
from functools import cached_property
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from .graph import ChunkSpec, LayerSpec, SplitGraph
from .specs import OpSpec, placement, split_dim

SKIPPED_TARGETS = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                      "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"})
_LOSSES = ("cross_entropy", "nll_loss")


def attr_name(fqn: str) -> str:
    """A parameter / buffer name usable as a module attribute."""
    return fqn.replace(".", "__")


class NodeRunner:
    """Runs fx nodes of one exported program on plain tensors or on DTensors of ``mesh``."""

    def __init__(self, split: SplitGraph, mesh: DeviceMesh | None, specs: Mapping[str, OpSpec],
                 local_ops: frozenset[str] = frozenset()) -> None:
        self.nodes = split.node_map
        self.module = split.program.graph_module
        self.mesh = mesh
        self.specs = specs
        self.local_ops = local_ops    # attention: run on local shards (see _run_local)
        self.fallbacks: set[str] = set()
        self.context = None           # a context.ContextRunner when cp > 1: runs every node on local tokens
        self.moe_outputs: dict[str, Any] = {}   # MoE region output node -> region, run as one call (experts.py)
        self.moe_skip: frozenset[str] = frozenset()   # the regions' other nodes, not run
        self.loss_parallel = False    # the loss ran vocabulary-parallel: its backward must too
        # what each node is, decided once rather than from str(target) on every call
        targets = {name: str(n.target) for name, n in self.nodes.items()}
        self.skipped = frozenset(name for name, t in targets.items() if t in SKIPPED_TARGETS)
        self.writes = frozenset(name for name, n in self.nodes.items() if _writes(n.target))
        self.context_hops = {name: t for name, t in targets.items() if t in _CONTEXT_HOPS}
        self.losses = frozenset(name for name, t in targets.items() if any(k in t for k in _LOSSES))

    def wrap(self, value: Any, spec: str = "R") -> Any:
        """A local tensor (replicated, or this rank's shard of ``spec``) as a DTensor of the mesh."""
        if self.mesh is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        place = placement(spec, value.dim()) or Replicate()
        return DTensor.from_local(value, self.mesh, [place], run_check=False)

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
        if region is not None:
            return self._moe(region, env, env[region.hidden_input], env[region.index_input],
                             env[region.weight_input])
        args = torch.fx.node.map_arg(node.args, load)
        kwargs = torch.fx.node.map_arg(node.kwargs, load)
        if self.mesh is None or node.target is operator.getitem:
            return node.target(*args, **kwargs)
        if name in self.context_hops:
            return _run_context_hop(self.context_hops[name], args, kwargs)
        return self._run_dtensor(node, args, kwargs)

    def _moe(self, region: Any, env: dict[str, Any], hidden: Any, index: Any, weights: Any) -> Any:
        """An MoE region's output from its inputs by this layer's ExpertsModule (experts.py): on whole
        local tensors, handed on as a replicated DTensor under tensor parallelism."""
        module = env[("experts", region.output)]
        if self.mesh is None:
            return module(hidden, index, weights)
        out = module(_full(hidden), _full(index), _full(weights))
        out = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
        spec = self.specs.get(region.output)
        return self.to_spec(out, spec.output) if spec is not None else out

    def _run_dtensor(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        spec = self.specs.get(node.name)
        if spec is not None:
            args = tuple(self.to_spec(a, spec.inputs.get(n.name)) if isinstance(n, torch.fx.Node) else a
                         for a, n in zip(args, node.args))
        # an in-place op must write the tensor itself, never a contiguous copy of it
        wrap = self.wrap if node.name in self.writes else (lambda v: _consistent(self.wrap(v)))
        args, kwargs = _map_tensors((args, kwargs), wrap)
        if node.name in self.local_ops:
            return self._run_local(node, args, kwargs, spec)
        if node.name not in self.fallbacks:
            try:
                with self._loss_context(node, args):
                    out = node.target(*args, **kwargs)
            except (NotImplementedError, RuntimeError) as exc:
                if "sharding" not in str(exc).lower() and "DTensor" not in str(exc) and \
                        not isinstance(exc, NotImplementedError):
                    raise
                self.fallbacks.add(node.name)
        if node.name in self.fallbacks:
            local_args, local_kwargs = _map_tensors((args, kwargs), _full)
            out = node.target(*local_args, **local_kwargs)
        out = _map_tensors(out, self.wrap)
        out = self._settle_masked_partial(node, out)
        if spec is not None and isinstance(out, DTensor):
            out = self.to_spec(out, spec.output)
        return out

    def _settle_masked_partial(self, node: torch.fx.Node, out: Any) -> Any:
        """A vocabulary-parallel embedding's output is a masked partial (DTensor's ``_MaskPartial``): its
        mask is applied, and freed, by the first reduction, so redistributing the same value a second
        time (a token embedding read by a block and by its residual add) fails with a bare AssertionError
        inside DTensor (found by tests/distributed/test_fuzz.py). Such an output read by several ops is
        reduced once here, to Replicate, and each reader takes its own placement from that. The readers'
        gradients then sum to a partial one, which DTensor cannot turn back into a masked partial: a
        hook makes it replicated first."""
        if (isinstance(out, DTensor) and len(node.users) > 1
                and any(p.is_partial() and type(p) is not Partial for p in out.placements)):
            out = out.redistribute(self.mesh, [Replicate()] * len(out.placements))
            if out.requires_grad:
                out.register_hook(_replicated_grad)
        return out

    def _run_local(self, node: torch.fx.Node, args: tuple, kwargs: dict, spec: OpSpec | None) -> Any:
        """Attention split along a batch or head dim ``d`` (or whole): every slice is independent, so
        the op runs on this rank's slices of q, k, v (and of a mask that has dim ``d``) and the
        output is that slice. Written out because DTensor has no rule for CPU attention's backward.
        Keys and values with fewer heads than the queries (grouped-query attention, ``enable_gqa``)
        are split along the heads too when the plan's spec split them: query head ``i`` reads key
        head ``i // groups``, and contiguous splits of both keep every group on one rank."""
        d = split_dim(spec.output) if spec is not None else None
        first = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor))
        place = Shard(d % first.dim()) if d is not None else Replicate()

        def prep(t: DTensor) -> torch.Tensor:
            whole = d is None or t.dim() != first.dim() or (t.shape[place.dim] != first.shape[place.dim]
                                                             and t.placements[0] != place)
            target = Replicate() if whole else place
            return (t if t.placements[0] == target else t.redistribute(self.mesh, [target])).to_local()

        local_args, local_kwargs = torch.utils._pytree.tree_map_only(DTensor, prep, (args, kwargs))
        out = node.target(*local_args, **local_kwargs)
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: DTensor.from_local(t, self.mesh, [place], run_check=False), out)

    def to_spec(self, value: Any, spec: str | None) -> Any:
        """``value`` redistributed to ``spec`` (unchanged if not a DTensor, or for ``P`` / ``C`` / None)."""
        if spec is None or not isinstance(value, DTensor):
            return value
        place = placement(spec, value.dim())
        if place is None or value.placements[0] == place:
            return value
        out = value.redistribute(self.mesh, [place])
        if out.requires_grad:
            # The backward of a redistribution can hand on a strided slice (a Shard(d) -> Replicate
            # gather's gradient is a narrow of dim d), which a later view's backward cannot view.
            out.register_hook(_contiguous)
        return out

    def _loss_context(self, node: torch.fx.Node, args: tuple):
        """The vocabulary-parallel cross entropy: logits split along the class dim."""
        if node.name in self.losses and args and isinstance(args[0], DTensor):
            d = args[0].placements[0]
            if d.is_shard() and d.dim == args[0].dim() - 1:
                self.loss_parallel = True
                return loss_parallel()
        return contextlib.nullcontext()

    def backward_context(self, has_loss: bool):
        """Around the backward of the pass that computed the loss: loss_parallel again when the loss
        ran vocabulary-parallel, else its backward (nll_loss / log_softmax) would gather the logits."""
        return loss_parallel() if has_loss and self.loss_parallel else contextlib.nullcontext()


_CONTEXT_HOPS = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"})


def _run_context_hop(name: str, args: tuple, kwargs: dict) -> Any:
    """``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` (a ``torch.no_grad()`` or autocast region of
    the model, e.g. a rotary embedding) run as the context manager around their subgraph: the
    higher-order op itself leaves grad mode off when its arguments are DTensors (torch 2.13)."""
    if name == "wrap_with_set_grad_enabled":
        enabled, body, *rest = args
        with torch.set_grad_enabled(enabled):
            return _Body(body).run(*rest, **kwargs)
    device_type, dtype, enabled, cache_enabled, body, *rest = args
    with torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        return _Body(body).run(*rest, **kwargs)


class _Body(torch.fx.Interpreter):
    """A higher-order op's subgraph, without its metadata asserts (DTensor has no rule for them)."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if str(target) in SKIPPED_TARGETS:
            return None
        return super().call_function(target, args, kwargs)


def _replicated_grad(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * len(grad.placements))
    return grad


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _consistent(value: Any) -> Any:
    """A DTensor whose shard is laid out as its global strides say (a contiguous copy otherwise).

    DTensor plans an op from the global tensor's metadata, strides included: a composite op (matmul,
    reshape) decomposes into views that the global strides allow, then runs them on the local shard.
    A redistribution can leave the two disagreeing: the all-gathered or sliced shard is contiguous
    while the global strides are those of a transposed tensor, or the pieces of a split of a
    non-contiguous tensor keep their parent's strides while the global piece is contiguous (Mamba's
    in_proj output cut into gate, x, B, C and dt at tp=2); the local view then fails. A copy with
    contiguous strides on both sides computes the same values for an op that writes none of its
    inputs (the caller keeps in-place ops off it), and is made only where the two disagree."""
    if isinstance(value, DTensor) and value.is_contiguous() != value._local_tensor.is_contiguous():
        return value.clone(memory_format=torch.contiguous_format)
    return value


def _writes(target: Any) -> bool:
    """Whether an ATen op writes one of its arguments (``add_``, ``copy_``, an ``out=`` variant)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.is_mutable


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _map_tensors(tree: Any, fn) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, fn, tree)


def written_inputs(spec: LayerSpec, nodes: Mapping[str, torch.fx.Node]) -> tuple[str, ...]:
    """The layer's inputs that one of its ops writes in place, directly or through a view of them
    (an op's schema marks what it writes, ``Tensor(a!)``, and what it returns a view of, ``Tensor(a)``)."""
    root = {name: name for name in spec.inputs}   # value -> the input it is (a view of)
    written: set[str] = set()
    for name in spec.nodes:
        node = nodes[name]
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if not isinstance(value, torch.fx.Node) or value.name not in root or arg.alias_info is None:
                continue
            if arg.alias_info.is_write:
                written.add(root[value.name])
            if any(r.alias_info is not None and r.alias_info.before_set == arg.alias_info.before_set
                   for r in schema.returns):
                root[name] = root[value.name]   # the output aliases this input: a view, or the written input itself
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
            env[self.placeholder_of[fqn]] = value
        for fqn in self.own:
            env[self.placeholder_of[fqn]] = getattr(self, attr_name(fqn))
        for name in self.buffer_names:
            env[name] = self.runner.wrap(getattr(self, attr_name(name)))
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

