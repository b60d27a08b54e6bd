"""How one rank's :class:`~.program.Program` is assembled: its model exported at one micro-batch,
the mesh and its groups, the chunks of generated layers with this rank's parameters (sharded,
materialised from the meta device where the model was built there), data parallelism (buckets,
ZeRO-1, FSDP2), tied parameters across stages, the pipeline's cut values, the optimizer.

A mixin of Program's (its ``__init__`` calls these in order); training, full tensors and
checkpoints are program.py's.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..capture.export import LossFn, loss_source, run_export
from ..capture.loss import check_loss
from ..codegen.compile import compile_rank
from ..runtime.context_state import ContextRank
from ..codegen.inputs import describe_inputs, example_at
from ..runtime.optim import compile_step
from ..runtime.pipeline import Topology
from ..codegen.split import on_device
from ..errors import ConfigError
from ..plan.loss import PARALLELIZE, LossSource
from ..plan.placement import Replicate, Shard, normal
from .chunk import ChunkModule, NodeRunner
from ..runtime.data_parallel import GradReducer, Zero1Optimizer, local, shard_unit
from ..runtime.expert_parallel import shard_experts
from ..runtime.experts import ExpertsModule
from .materialize import dtensor_placement, local_view, materialize_buffers

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Assembly:
    """Program's construction steps (see program.py for the attributes they set)."""

    # --- construction -------------------------------------------------------------------------
    def _export(self, model: nn.Module, loss_fn: LossFn | None, example_inputs: Any) -> None:
        """Export the model at one micro-batch, in the mode it is in (as DDP and FSDP run it), and check it
        is the plan's model with the plan's loss."""
        if example_inputs is not None:
            self.inputs_record = describe_inputs(example_inputs)
        if self.inputs_record is None:
            raise ConfigError("the plan does not record its example inputs: pass parallelize(..., example_inputs=) "
                              "shaped like the inputs the plan was made with")
        # exported on inputs on the model's own device (meta, or the CPU for a model the rank then moves
        # to its GPU): a model that does not move its inputs, as Hugging Face's do not, would mix
        # devices; on_device then points the graph's factories at this rank's device
        where = torch.device("meta") if self.materializer is not None else \
            next((p.device for p in model.parameters()), self.device)
        inputs = example_at(self.inputs_record, self.cfg.micro_batch_size, where)
        # the plan's loss: the loss_fn given (a missing or another one), then what the export made (a stand-in)
        check_loss(self.plan.loss, None if loss_fn is None else LossSource.of(loss_fn), to=PARALLELIZE)
        program = run_export(model, inputs, loss_fn, train_mode=False)
        check_loss(self.plan.loss, loss_source(program), to=PARALLELIZE)
        on_device(program, self.device)
        if self.materializer is not None:
            materialize_buffers(program, self.materializer)
        # the one lowering sequence (codegen/compile.py): this rank's chunks, each layer's ops and collectives
        self.compiled = compile_rank(self.plan, program, self.rank, model)
        self.graph, self.split = self.compiled.program.graph, self.compiled.program.split
        self.param_dims = self.compiled.program.param_dims

    def _mesh(self) -> None:
        """Every process group of this rank (mesh.py builds them, in one order on every rank): the
        (pp, dp, cp, tp) device mesh, expert parallelism's groups when MoE regions run as one call
        (ep > 1 or cp > 1: experts.py), a group per set of pipeline stages holding the same parameter."""
        compiled = self.compiled.program
        self.regions = compiled.regions
        self.expert_fqns = compiled.expert_params
        self.holders = compiled.holders()
        self.groups = groups = self.mesh.build(self.device.type, experts=bool(self.regions),
                                               tied=[h for h in self.holders.values() if len(h) > 1])
        self.tp_mesh = groups.tp
        self.cp_group = groups.group("cp")
        # the dense weights' gradient (and ZeRO) group: the dp * cp ranks of this (pp, tp) position
        self.dp_mesh = groups.dp
        self.dp_group = groups.dp.get_group()
        self.ep_group = groups.group("ep")
        self.expert_group, self.expert_mesh = groups.group("edp"), groups.edp
        self.expert_ranks = list(groups.ranks("edp")) if self.regions else [self.rank]

    def _build_chunks(self, model: nn.Module) -> None:
        compiled = self.compiled.program
        # compiled per layer under FSDP2 (its hooks gather each layer's parameters around the layer's
        # code), else per chunk (_data_parallel): one compiled region for all of a chunk's layers
        context = ContextRank(compiled.context, self.cp_group, self.cp_rank, self.timeout) \
            if compiled.context is not None else None
        self.node_runner = NodeRunner(compiled, self.tp_mesh, context, compile=self.compile if self.fsdp else None)
        self.tp_partial = compiled.lowered.partial_params if compiled.lowered is not None else frozenset()
        full = dict(model.named_parameters())
        self.my_chunks = [chunk.index for chunk in self.compiled.chunks]
        self.params: dict[str, nn.Parameter] = {}
        for chunk in self.compiled.chunks:
            for fqn in chunk.spec.params:
                if fqn not in self.params:
                    self.params[fqn] = self._distribute(fqn, full[fqn])
        buffers = {k: v.to(self.device) for k, v in self.split.buffer_value.items()}
        experts = {r.output: ExpertsModule(r, self.params[r.gate_up], self.params[r.down], self.ep_group,
                                           self.timeout)
                   for r in self.regions if r.gate_up in self.params}
        self.chunks = {chunk.index: ChunkModule(chunk, self.node_runner, self.params, buffers, experts)
                       for chunk in self.compiled.chunks}

    def _value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A parameter's or buffer's full value: materialised (one module at a time) when on meta."""
        if value.is_meta and self.materializer is not None:
            return self.materializer.tensor(name)
        return value.detach()

    def _distribute(self, fqn: str, value: torch.Tensor) -> nn.Parameter:
        """This rank's parameter: its experts, its tensor-parallel shard, or the whole (a DTensor of
        the tp mesh when tp > 1). A meta model's parameter is materialised here, except for ZeRO-2/3,
        whose parameters stay on meta until fully_shard has sharded them (_materialize_sharded)."""
        requires_grad = value.requires_grad
        value = value.detach() if (self.fsdp and value.is_meta) else self._value(fqn, value)
        if fqn in self.expert_fqns:   # this rank's experts, a plain tensor even under tensor parallelism
            value = shard_experts(value, self.cfg.ep, self.ep_rank)
        d = self.param_dims.get(fqn)
        place = dtensor_placement(normal(Shard(d), value.dim()) if d is not None else Replicate())
        tp = self.tp_mesh is not None and fqn not in self.expert_fqns
        if value.is_meta:   # ZeRO-2/3 of a meta model: fully_shard first
            data = distribute_tensor(value, self.tp_mesh, [place], src_data_rank=None) if tp else value
        elif self.materializer is not None:
            # the same value on every rank: each takes its own piece, copied (a view would keep the
            # whole module's values alive)
            piece = local_view(value, self.tp_mesh, [place]) if tp else value
            data = piece.to(self.device).clone()
            if tp:
                data = DTensor.from_local(data, self.tp_mesh, [place], run_check=False, shape=value.shape,
                                          stride=value.stride())
        else:
            # a user's model: scattered from tp rank 0, in case the ranks built it with different seeds
            data = value.to(self.device).clone()
            if tp:
                data = distribute_tensor(data, self.tp_mesh, [place])
        return nn.Parameter(data, requires_grad=requires_grad)

    def _materialize_sharded(self) -> None:
        """ZeRO-2/3 on a meta model: storage for the (now sharded) parameters, then each filled with
        its shard of the materialised value, one module's values at a time."""
        for chunk in self.chunks.values():   # to_empty of the meta tensors only: the buffers hold values
            chunk._apply(lambda t: torch.empty_like(t, device=self.device) if t.is_meta else t)
        with torch.no_grad():
            for fqn, p in self.params.items():
                full = self.materializer.tensor(fqn)
                if fqn in self.expert_fqns:
                    full = shard_experts(full, self.cfg.ep, self.ep_rank)
                local(p).copy_(local_view(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)

    def _data_parallel(self) -> None:
        cfg = self.cfg
        replicas = cfg.grad_replicas
        self.zero = cfg.zero if replicas > 1 else 0
        self.reducers: list[GradReducer] = []
        if self.fsdp:
            # FSDP2 warns that a layer returning a view loses its pre-backward hook if the view is then
            # written in place; every layer here copies an input it writes (chunk.py, written_inputs),
            # so the hazard does not arise: silence that warning for autopar's own modules only
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDP)?(Layer|Chunk)Module\) "
                                    r"returned a view tensor", category=UserWarning)
            # With tp > 1 the parameters are already DTensors of the tp sub-mesh: FSDP2 shards them
            # further over the dp sub-mesh of the same root mesh (2-D, as torchtitan does).
            mesh = self.dp_mesh
            for chunk in self.chunks.values():
                for layer in chunk.layers:
                    for experts in layer.experts.values():
                        # expert weights: sharded over their own replicas, averaged like the dense ones
                        shard_unit(experts, mesh=self.expert_mesh, reshard_after_forward=self.zero == 3)
                        experts.set_gradient_divide_factor(float(replicas))
                        if dist.get_backend() != "nccl" and len(self.expert_ranks) > 1:
                            # gloo has no pre-multiplied sum: sum, then divide (FSDP2 divides a one-rank
                            # mesh's gradient by the factor itself, and would divide twice with this set)
                            experts.set_force_sum_reduction_for_comms(True)
                # a unit per repeated block, one for each large run of the other layers, the small runs
                # left to the chunk's root unit (kept gathered from forward to backward, as is the unit
                # that ends the model): capture/structure.py, the cost model counts the same collectives
                layers = {layer.spec.index: layer for layer in chunk.layers}
                holds = lambda i: any(True for _ in layers[i].parameters(recurse=False))  # noqa: E731
                units = self.graph.structure.shard_units(list(layers), holds)
                for unit in units.units:
                    if unit != units.root:
                        modules = [layers[i] for i in unit]
                        shard_unit(modules if len(modules) > 1 else modules[0], mesh=mesh,
                                   reshard_after_forward=self.zero == 3 and unit not in units.kept)
                shard_unit(chunk, mesh=mesh, reshard_after_forward=False)
            self.params = {fqn: p for chunk in self.chunks.values()
                           for fqn, p in chunk.named_model_parameters().items()}
            if self.materializer is not None:
                self._materialize_sharded()
        elif replicas > 1:
            named = [self.chunks[c].named_model_parameters() for c in self.my_chunks]
            dense = [[p for fqn, p in ps.items() if fqn not in self.expert_fqns] for ps in named]
            self.reducers.append(GradReducer(_dedupe(dense), self.dp_group, replicas, self.timeout))
            if self.expert_fqns:
                expert = [[p for fqn, p in ps.items() if fqn in self.expert_fqns] for ps in named]
                self.reducers.append(GradReducer(expert, self.expert_group, replicas, self.timeout))
            if self.compile:
                for k, c in enumerate(self.my_chunks):
                    self.chunks[c].break_before(_bucket_starts(self.chunks[c], [r.buckets[k] for r in self.reducers]))

    def _tied_groups(self) -> None:
        """Each parameter held by several pipeline stages with the group of those stages' ranks."""
        self.tied: list[tuple[str, Any]] = [(fqn, self.groups.tied[h]) for fqn, h in sorted(self.holders.items())
                                            if h in self.groups.tied and fqn in self.params]

    def _topology(self) -> Topology:
        ranks = list(self.groups.ranks("pp"))
        return Topology(self.cfg.pp, ranks, self.pp_rank)

    def _to_cut(self, chunk: int, name: str, value: torch.Tensor) -> torch.Tensor:
        """A value chunk ``chunk`` sends, as it crosses the cut (the send's collectives, codegen/compile.py)."""
        return self.node_runner.to_cut(self.sends[chunk][name], value)

    def _optimizer(self, factory: OptimizerFactory | None):
        # what the optimizer steps: without FSDP2, a tensor-parallel parameter's local shard (a plain
        # tensor on its storage) rather than the DTensor, as Megatron's optimizer steps plain shards:
        # every op of an update on a DTensor pays its dispatch (about 8 per tensor in AdamW's
        # single-tensor loop), and the state it keeps is plain too. _finish_grads hands each shard its
        # gradient; checkpoint.py presents both with the parameter's layout.
        self.stepped = {fqn: local(p) if isinstance(p, DTensor) and not self.fsdp else p
                        for fqn, p in self.params.items()}
        self.shards = list({id(p): (p, s) for p, s in zip(self.params.values(), self.stepped.values())
                            if s is not p}.values())   # (parameter, the shard stepped), each once
        if factory is None:
            return None
        params = list({id(p): p for p in self.stepped.values()}.values())
        if self.zero == 1:
            experts = {id(self.stepped[f]) for f in self.expert_fqns if f in self.stepped}
            partitions = [([p for p in params if id(p) not in experts], self.dp_group,
                           dist.get_process_group_ranks(self.dp_group))]
            if experts:
                partitions.append(([p for p in params if id(p) in experts], self.expert_group, self.expert_ranks))
            optimizer = Zero1Optimizer(partitions, factory, self.rank, self.timeout)
            inner = optimizer.inner
        else:
            optimizer = inner = factory(params)
        if self.compile and inner is not None:
            compile_step(inner, self.compile)
        return optimizer


def _bucket_starts(chunk: ChunkModule, buckets: Iterable[Iterable[Any]]) -> list[int]:
    """For each gradient bucket of ``chunk``, the first of its layers whose backward writes one of the
    bucket's gradients (the last to run in backward): once the backward of the layers from there on
    has run, the bucket is complete."""
    params = chunk.named_model_parameters()
    first: dict[int, int] = {}
    for i, layer in enumerate(chunk.layers):
        experts = [fqn for m in layer.experts.values() for fqn in m.named_model_parameters()]
        for fqn in (*layer.own, *layer.shared, *experts):
            first.setdefault(id(params[fqn]), i)
    return sorted({min(first.get(id(p), 0) for p in bucket.params) for group in buckets for bucket in group})


def _dedupe(per_chunk: list[list[nn.Parameter]]) -> list[list[nn.Parameter]]:
    """A parameter shared by two chunks of this rank is reduced once, with the earlier chunk (whose
    last backward comes last)."""
    seen: set[int] = set()
    out: list[list[nn.Parameter]] = [[] for _ in per_chunk]
    for c in range(len(per_chunk)):
        for p in per_chunk[c]:
            if id(p) not in seen:
                seen.add(id(p))
                out[c].append(p)
    return out
