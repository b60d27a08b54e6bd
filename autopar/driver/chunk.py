"""One pipeline chunk as an ``nn.Module``: each of its layers runs generated code.

Why not ``torch.distributed.pipelining``'s ``pipeline()`` split or ``parallelize_module``:
the plan cuts at capture's layers (not at ``pipe_split`` markers in user code), a value may
skip to any later chunk and a tied weight lives in two chunks, and the plan shards every op
(not only ``nn.Linear`` / ``nn.Embedding`` modules) with the specs the ILP chose. So each
layer is a small module around its slice of the exported graph, emitted as a
``torch.fx.GraphModule`` by codegen/layers.py:

- with ``tp == 1`` on plain tensors (the graph's ops, nothing added);
- with ``tp > 1`` on this rank's shards, as codegen/lower.py lowered the plan's specs: each
  argument converted by explicit collectives (runtime/collectives.py, whose backward supplies
  Megatron's ``f`` and ``g``) to the spec the op's strategy reads it in, shape arguments at
  local sizes, the vocabulary-parallel embedding and loss as runtime/shard_ops.py writes them.
  Parameters are DTensors of the tp mesh (so that FSDP2 and checkpoints see their layout); a
  layer passes their local shards to its code;
- an MoE region with ``ep > 1`` or ``cp > 1`` as one call of the layer's ``ExpertsModule``
  (experts.py) at the region's output node, its other nodes skipped;
- with ``cp > 1`` on this rank's tokens of each sequence, as codegen/context.py decided: each
  read converted (gathered, cut to local tokens, a partial value resolved), attention as ring
  attention, the loss over the group's targets (runtime/context_ops.py); with ``tp > 1`` too,
  tensor parallelism's conversions first, then context parallelism's.

Each layer is its own module so FSDP2 can gather its parameters just in time (ZeRO-3) and
``torch.utils.checkpoint`` can recompute it (recompute ``full``, and ``op`` with
runtime/recompute.py's per-op policy); ``selective`` recomputes only the attention core's nodes
(Korthikanti et al.).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..codegen.compile import ChunkProgram, CompiledProgram, LayerProgram, Send
from ..runtime.context_state import ContextRank
from ..codegen.layers import class_name, layer_module
from ..runtime.recompute import run_layer
from ..codegen.redistribute import apply_steps


def attr_name(fqn: str) -> str:
    """A parameter / buffer name usable as a module attribute."""
    return fqn.replace(".", "__")


class NodeRunner:
    """What the layers of one rank's program share: the compiled program (its exported graph, the
    tensor-parallel lowering, the MoE regions run as one call), the tensor-parallel group and this rank of
    the context-parallel group (cp > 1)."""

    def __init__(self, compiled: CompiledProgram, mesh: DeviceMesh | None, context: ContextRank | None = None,
                 compile: str | None = None, fp8: nn.Module | None = None) -> None:
        self.compiled = compiled
        self.fp8 = fp8           # the plan's fp8 linear layers' module (runtime/fp8.py), or None
        self.compile = compile   # a torch.compile backend for every layer's code, or None
        self.mesh = mesh
        self.group = mesh.get_group() if mesh is not None else None
        self.context = context

    def layer_module(self, layer: LayerProgram, experts: Mapping[str, nn.Module], checks: bool = False
                     ) -> torch.fx.GraphModule:
        """The layer's generated module (codegen/layers.py); ``checks``: with a shape check of every shard
        (for the first call)."""
        compiled = self.compiled
        split = compiled.split
        return layer_module(layer.io(split.param_of), split.node_map, split.program.graph_module, compiled.lowered,
                            self.group, experts, compiled.moe_inputs, compiled.skipped, name=class_name(layer.spec.name),
                            checks=checks, context=self.context, fp8=self.fp8)

    def to_cut(self, send: Send, value: Any) -> Any:
        """A value as it crosses a pipeline cut: the send's collectives on the tensor-parallel group."""
        if not send.steps or not isinstance(value, torch.Tensor):
            return value
        return apply_steps(value, send.steps, self.group)


class _OwnGradient(torch.autograd.Function):
    """Identity forward; backward hands on the gradient, copied where something else holds it too.

    Autograd makes a parameter's first gradient of a step the incoming tensor itself when nothing
    else references it (AccumulateGrad's steal), and adds every later micro-batch's into it in place.
    ``DTensor.to_local``'s backward wraps the incoming local gradient in a fresh DTensor, which
    nothing else references, so the steal happened whatever held the local tensor: ViT's position
    embedding took the gradient of ``cat(class token, patches) + position``, of which the class
    token took a view (``cat``'s backward), and each later micro-batch was added into that memory
    twice (the class token's gradient at tp=2 with micro-batches of one sample: twice the true one,
    less the first micro-batch's); ``x + a + b`` hands ``a`` and ``b`` one tensor. The test one
    process's autograd makes, made here on the local tensor: one referenced elsewhere (by a view
    of it, by another node's input) is copied, in the parameter's layout (contiguous); a fresh one
    (a matmul's weight gradient) passes as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # compiled (dynamo traces this backward into the layer's graph), the count is not a value it can trace
        # (reading it broke the graph at every parameter): the copy is then made always, which is never wrong
        if torch.compiler.is_compiling() or grad._use_count() > 1:
            return grad.clone(memory_format=torch.contiguous_format)
        return grad


def local_shard(param: Any) -> Any:
    """A tensor-parallel parameter (a DTensor of the tp mesh, or of FSDP2's 2-D one) as this rank's
    shard, with autograd: its gradient comes back as the shard's (runtime/collectives.py keeps the
    gradient of a replicated parameter whole on every rank), in memory of its own (_OwnGradient)."""
    if not isinstance(param, DTensor):
        return param
    shard = param.to_local()
    return _OwnGradient.apply(shard) if shard.requires_grad and torch.is_grad_enabled() else shard


class LayerModule(nn.Module):
    """One layer: ``forward(*inputs, *shared_params) -> outputs`` over its slice of the graph."""

    def __init__(self, layer: LayerProgram, runner: NodeRunner, buffers: Mapping[str, torch.Tensor],
                 experts: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__()
        spec = self.spec = layer.spec
        # MoE regions of this layer run by their ExpertsModule (its own module, so that FSDP2 can
        # shard expert weights over another mesh), keyed by the region's output node
        self.experts = nn.ModuleDict({attr_name(out): m for out, m in (experts or {}).items()})
        self.expert_outputs = tuple((experts or {}).keys())
        self.own, self.shared, self.recompute = layer.own, layer.shared, layer.recompute
        self.buffer_names = tuple(spec.buffers)
        self.own_attrs = tuple(attr_name(fqn) for fqn in self.own)
        self.buffer_attrs = tuple(attr_name(name) for name in self.buffer_names)
        for name in self.buffer_names:
            self.register_buffer(attr_name(name), buffers[name], persistent=False)
        # inputs an op of this layer writes in place (``x += y`` in the model's code): written on a
        # copy made inside the layer, which later layers read instead (a second output). FSDP2 hands a
        # layer its inputs as views made by a custom autograd Function, and autograd refuses to
        # write in place on those.
        self.written = layer.written
        # the layer's generated code (kept out of the module tree: it holds no tensors of its own, and its
        # experts are this module's)
        experts_of = {out: self.experts[attr_name(out)] for out in self.expert_outputs}
        generated, checked = (runner.layer_module(layer, experts_of, checks) for checks in (False, True))
        self.__dict__["generated"] = generated   # the fx GraphModule: .code, codegen/source.py
        self.__dict__["program"] = torch.compile(generated, backend=runner.compile) if runner.compile else generated
        self.__dict__["checked"] = checked       # the same code checking every shard's shape: the first call

    def forward(self, *values: Any) -> tuple[Any, ...]:
        return run_layer(self._run, values, self.recompute)

    def _run(self, *values: Any) -> tuple[Any, ...]:
        n_in = len(self.spec.inputs)
        own, buffers = self._parameters, self._buffers   # (FSDP2 swaps the parameters held there)
        params = [local_shard(v) for v in values[n_in:]] + [local_shard(own[a]) for a in self.own_attrs]
        run, self.__dict__["checked"] = self.checked or self.program, None
        return run(*values[:n_in], *params, *(buffers[a] for a in self.buffer_attrs))


class ChunkModule(nn.Module):
    """One chunk: ``forward(*graph_inputs, *received) -> values sent on`` (the loss for the last)."""

    def __init__(self, chunk: ChunkProgram, runner: NodeRunner, params: Mapping[str, nn.Parameter],
                 buffers: Mapping[str, torch.Tensor], experts: Mapping[str, nn.Module] | None = None) -> None:
        """``params``: this rank's parameters by fqn; ``experts``: MoE region output -> its experts module."""
        super().__init__()
        self.spec = chunk.spec
        experts = experts or {}
        self.shared_params = chunk.shared
        for fqn in self.shared_params:
            self.register_parameter(attr_name(fqn), params[fqn])
        self.layers = nn.ModuleList()
        self.breaks: frozenset[int] = frozenset()   # break_before
        for layer in chunk.layers:
            mine = {out: m for out, m in experts.items() if out in layer.spec.nodes}
            module = LayerModule(layer, runner, buffers, mine)
            for fqn in layer.own:
                module.register_parameter(attr_name(fqn), params[fqn])
            self.layers.append(module)

    def break_before(self, layers: Sequence[int]) -> None:
        """Compiled (``Module.compile``), end a compiled region before each of these layers (their indices
        in the chunk), as torch's DDPOptimizer splits a DDP model at its gradient buckets: AOTAutograd
        runs a region's backward as one node, so only a region's end makes its gradients ready, and a
        bucket whose parameters all come after a break is all-reduced while the regions before it run
        their backward. Eager, nothing changes."""
        self.breaks = frozenset(i for i in layers if 0 < i < len(self.layers))

    def forward(self, *values: Any) -> tuple[Any, ...]:
        names = self.spec.graph_inputs + self.spec.recv
        env: dict[str, Any] = dict(zip(names, values))
        shared = {fqn: getattr(self, attr_name(fqn)) for fqn in self.shared_params}
        for i, layer in enumerate(self.layers):
            if i in self.breaks:
                torch._dynamo.graph_break()
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

