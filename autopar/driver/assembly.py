"""How one rank's :class:`~.program.Program` is built, as explicit steps (torchtitan's ``parallelize_llama``
is the model), each a function of what it reads, returning what it makes:

1. :func:`export_model`: the model exported at one micro-batch in the mode it is in (as DDP and FSDP run
   it), on this rank's device, checked to carry the plan's loss; then ``compile_rank`` (codegen/compile.py)
   lowers the plan onto it: the rank's chunks, each layer's ops and collectives, its actions;
2. :func:`apply_mesh`: every process group of the rank (runtime/mesh.py builds them, in one order on
   every rank);
3. :func:`apply_tensor_parallel`: this rank's parameters: its experts, its tensor-parallel shards
   (DTensors of the tp mesh), or the whole, materialised from the meta device where the model was built;
4. :func:`build_chunks`: the chunks of generated layers around those parameters;
5. :func:`apply_fsdp` (ZeRO-2/3) or :func:`apply_data_parallel` (ZeRO 0-1: buckets as DDP's);
6. :func:`tied_groups`: parameters held by several pipeline stages, with their stages' group;
7. :func:`build_optimizer`: what the optimizer steps (local shards without FSDP2), ZeRO-1's partition.

What the steps share about the rank is a :class:`RankSetup`. Training, full tensors and checkpoints are
program.py's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..capture.export import LossFn, loss_source, run_export
from ..capture.loss import check_loss
from ..codegen.compile import RankProgram
from ..errors import ConfigError
from ..codegen.inputs import example_at
from ..codegen.split import on_device
from ..plan import Plan
from ..plan.loss import PARALLELIZE, LossSource
from ..plan.placement import Replicate, Shard, normal
from ..runtime.context_state import ContextRank
from ..runtime.data_parallel import GradReducer, dedupe, local, shard_unit
from ..runtime.expert_parallel import shard_experts
from ..runtime.experts import ExpertsModule
from ..runtime.fp8 import Float8Linear, emulated, gathered_in_fp8
from ..runtime.mesh import Coords, MeshGroups
from ..runtime.optim import MasterOptimizer, Zero1Optimizer, compile_step, innermost, steps_elementwise, wrapped
from ..runtime.pipeline import backward_ends
from ..runtime.sharded_init import Materializer
from .chunk import ChunkModule, NodeRunner
from .materialize import dtensor_placement, local_view, materialize_buffers

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class RankSetup:
    """What every step needs of the rank: the plan, its rank and coordinates, its device, the deadline of a
    wait on a peer (seconds), and the materializer of a model built on the meta device (None otherwise)."""

    plan: Plan
    rank: int
    coords: Coords
    device: torch.device
    timeout: float
    materializer: Materializer | None = None

    @property
    def fsdp(self) -> bool:
        """ZeRO-2/3 with more than one gradient replica, or offloaded whole (on one too): FSDP2 units."""
        return self.zero >= 2

    @property
    def zero(self) -> int:
        """The ZeRO stage that runs: 0 without gradient replicas, unless offloaded whole (FSDP2's offload policy)."""
        cfg = self.plan.config
        return cfg.zero if cfg.grad_replicas > 1 or cfg.offload == "all" else 0

    def value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A parameter's or buffer's full value: materialised (one module at a time) when on meta."""
        if value.is_meta and self.materializer is not None:
            return self.materializer.tensor(name)
        return value.detach()


def export_model(setup: RankSetup, model: nn.Module, loss_fn: LossFn | None, inputs_record: dict) -> Any:
    """The model exported at one micro-batch on inputs on its own device (meta, or the CPU for a model the rank
    then moves to its GPU: a model that does not move its inputs, as Hugging Face's do not, would mix
    devices), its factories pointed at this rank's device, its meta buffers given values; the plan's loss
    checked on the loss_fn given (a missing or another one) and on what the export made (a stand-in)."""
    plan = setup.plan
    where = torch.device("meta") if setup.materializer is not None else \
        next((p.device for p in model.parameters()), setup.device)
    inputs = example_at(inputs_record, plan.config.micro_batch_size, where)
    check_loss(plan.loss, None if loss_fn is None else LossSource.of(loss_fn), to=PARALLELIZE)
    program = run_export(model, inputs, loss_fn, train_mode=False)
    check_loss(plan.loss, loss_source(program), to=PARALLELIZE)
    on_device(program, setup.device)
    if setup.materializer is not None:
        materialize_buffers(program, setup.materializer)
    return program


def apply_mesh(setup: RankSetup, compiled: RankProgram) -> MeshGroups:
    """Every process group of this rank: the (pp, dp, cp, tp) device mesh, expert parallelism's groups when MoE
    regions run as one call (ep > 1 or cp > 1), a group per set of pipeline stages holding the same parameter."""
    program = compiled.program
    tied = [h for h in program.holders.values() if len(h) > 1]
    return program.mesh.build(setup.device.type, experts=bool(program.regions), tied=tied)


def apply_tensor_parallel(setup: RankSetup, compiled: RankProgram, groups: MeshGroups, model: nn.Module
                          ) -> dict[str, nn.Parameter]:
    """This rank's parameters by fqn (each once): its experts (a plain tensor, also under tensor parallelism), its
    tensor-parallel shard of the plan's split dim (a DTensor of the tp mesh), or the whole. A meta model's
    parameter is materialised here, except under FSDP2, whose parameters stay on meta until fully_shard has
    sharded them (:func:`apply_fsdp`)."""
    program = compiled.program
    full = dict(model.named_parameters())
    params: dict[str, nn.Parameter] = {}
    for chunk in compiled.chunks:
        for fqn in chunk.spec.params:
            if fqn not in params:
                params[fqn] = _distribute(setup, fqn, full[fqn], program.param_dims.get(fqn),
                                          fqn in program.expert_params, groups.tp)
    return params


def _distribute(setup: RankSetup, fqn: str, value: torch.Tensor, dim: int | None, expert: bool,
                tp_mesh: Any) -> nn.Parameter:
    requires_grad = value.requires_grad
    value = value.detach() if (setup.fsdp and value.is_meta) else setup.value(fqn, value)
    if expert:
        value = shard_experts(value, setup.plan.config.ep, setup.coords.ep)
    place = dtensor_placement(normal(Shard(dim), value.dim()) if dim is not None else Replicate())
    tp = tp_mesh is not None and not expert
    if value.is_meta:   # ZeRO-2/3 of a meta model: fully_shard first
        data = distribute_tensor(value, tp_mesh, [place], src_data_rank=None) if tp else value
    elif setup.materializer is not None:
        # the same value on every rank: each takes its own piece, copied (a view would keep the whole
        # module's values alive)
        piece = local_view(value, tp_mesh, [place]) if tp else value
        data = piece.to(setup.device).clone()
        if tp:
            data = DTensor.from_local(data, tp_mesh, [place], run_check=False, shape=value.shape,
                                      stride=value.stride())
    else:
        # a user's model: scattered from tp rank 0, in case the ranks built it with different seeds
        data = value.to(setup.device).clone()
        if tp:
            data = distribute_tensor(data, tp_mesh, [place])
    return nn.Parameter(data, requires_grad=requires_grad)


def build_chunks(setup: RankSetup, compiled: RankProgram, groups: MeshGroups, params: dict[str, nn.Parameter],
                 compile: str | None) -> tuple[NodeRunner, dict[int, ChunkModule]]:
    """The rank's chunks: each layer's generated code (its checked first call, then ``torch.compile`` with the
    ``compile`` backend per layer when given: under FSDP2, whose hooks surround every layer) around its
    parameters; MoE regions run by their experts module."""
    program = compiled.program
    context = ContextRank(program.context, groups.group("cp"), setup.coords.cp, setup.timeout) \
        if program.context is not None else None
    fp8 = None
    if setup.plan.precision.compute == "fp8":   # the plan's linear layers through torchao's float8 (runtime/fp8.py)
        fp8 = Float8Linear(setup.plan.precision.recipe, emulated(setup.device), groups.tp)
        # the weights FSDP2 gathers in fp8 (Precision.gathers_fp8): torchao's cast-before-gather weights
        params = {fqn: gathered_in_fp8(p, fp8) if fqn in program.fp8_gathered else p for fqn, p in params.items()}
    runner = NodeRunner(program, groups.tp, context, compile=compile, fp8=fp8)
    buffers = {k: v.to(setup.device) for k, v in program.split.buffer_value.items()}
    experts = {r.output: ExpertsModule(r, params[r.gate_up], params[r.down], groups.group("ep"), setup.timeout)
               for r in program.regions if r.gate_up in params}
    return runner, {chunk.index: ChunkModule(chunk, runner, params, buffers, experts) for chunk in compiled.chunks}


def apply_fsdp(setup: RankSetup, compiled: RankProgram, groups: MeshGroups, chunks: dict[int, ChunkModule]
               ) -> dict[str, nn.Parameter]:
    """ZeRO-2/3 with FSDP2: a unit per repeated block, one for each large run of the other layers, the small
    runs left to the chunk's root unit (kept gathered from forward to backward, as is the unit that ends the
    model: capture/structure.py's shard_units, the collectives the cost model counts); expert weights
    sharded over their own replicas. With tp > 1 the parameters are already DTensors of the tp sub-mesh:
    FSDP2 shards them further over the dp sub-mesh of the same root mesh (2-D, as torchtitan does).
    Returns the parameters as FSDP2 holds them; a meta model's are given their values here."""
    # FSDP2 warns that a layer returning a view loses its pre-backward hook if the view is then written in
    # place; every layer here copies an input it writes (chunk.py, written_inputs), so the hazard does not
    # arise: silence that warning for autopar's own modules only
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDP)?(Layer|Chunk)Module\) "
                            r"returned a view tensor", category=UserWarning)
    replicas, zero3, offload = setup.plan.config.grad_replicas, setup.zero == 3, setup.plan.config.offload == "all"
    fp8 = bool(compiled.program.fp8_gathered)   # weights gathered in fp8 (runtime/fp8.py)
    expert_ranks = groups.ranks("edp") if compiled.program.regions else (setup.rank,)
    for chunk in chunks.values():
        for layer in chunk.layers:
            for experts in layer.experts.values():
                shard_unit(experts, offload, mesh=groups.edp, reshard_after_forward=zero3)
                experts.set_gradient_divide_factor(float(replicas))
                if dist.get_backend() != "nccl" and len(expert_ranks) > 1:
                    # gloo has no pre-multiplied sum: sum, then divide (FSDP2 divides a one-rank mesh's
                    # gradient by the factor itself, and would divide twice with this set)
                    experts.set_force_sum_reduction_for_comms(True)
        layers = {layer.spec.index: layer for layer in chunk.layers}
        holds = lambda i: any(True for _ in layers[i].parameters(recurse=False))  # noqa: E731
        units = compiled.program.graph.structure.shard_units(list(layers), holds)
        for unit in units.units:
            if unit != units.root:
                modules = [layers[i] for i in unit]
                shard_unit(modules if len(modules) > 1 else modules[0], offload, fp8, mesh=groups.dp,
                           reshard_after_forward=zero3 and unit not in units.kept)
        shard_unit(chunk, offload, fp8, mesh=groups.dp, reshard_after_forward=False)
    params = {fqn: p for chunk in chunks.values() for fqn, p in chunk.named_model_parameters().items()}
    if setup.materializer is not None:
        _materialize_sharded(setup, compiled, chunks, params)
    return params


def _materialize_sharded(setup: RankSetup, compiled: RankProgram, chunks: dict[int, ChunkModule],
                         params: dict[str, nn.Parameter]) -> None:
    """ZeRO-2/3 on a meta model: storage for the (now sharded) parameters, then each filled with its shard of
    the materialised value, one module's values at a time."""
    for chunk in chunks.values():   # to_empty of the meta tensors only: the buffers hold values
        chunk._apply(lambda t: torch.empty_like(t, device=setup.device) if t.is_meta else t)
    with torch.no_grad():
        for fqn, p in params.items():
            full = setup.materializer.tensor(fqn)
            if fqn in compiled.program.expert_params:
                full = shard_experts(full, setup.plan.config.ep, setup.coords.ep)
            local(p).copy_(local_view(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)


def apply_data_parallel(setup: RankSetup, compiled: RankProgram, groups: MeshGroups,
                        chunks: dict[int, ChunkModule], compiled_chunks: bool) -> list[GradReducer]:
    """ZeRO 0-1 with gradient replicas: the bucketed all-reduce of the dense weights over the dp * cp ranks of
    this (pp, tp) position, and of the expert weights over their replicas; none without replicas. Compiled
    chunks end a compiled region where a bucket starts (``break_before``), as DDPOptimizer does."""
    replicas = setup.plan.config.grad_replicas
    if replicas <= 1:
        return []
    experts = compiled.program.expert_params
    named = [chunks[c.index].named_model_parameters() for c in compiled.chunks]
    dense = [[p for fqn, p in ps.items() if fqn not in experts] for ps in named]
    ends = backward_ends(compiled.actions)
    reducers = [GradReducer(dedupe(dense, [ends[c.index] for c in compiled.chunks]), groups.dp.get_group(), replicas,
                            setup.timeout)]
    if experts:
        expert = [[p for fqn, p in ps.items() if fqn in experts] for ps in named]
        reducers.append(GradReducer(expert, groups.group("edp"), replicas, setup.timeout))
    if compiled_chunks:
        for k, c in enumerate(compiled.chunks):
            chunks[c.index].break_before(_bucket_starts(chunks[c.index], [r.buckets[k] for r in reducers]))
    return reducers


def tied_groups(compiled: RankProgram, groups: MeshGroups, params: dict[str, nn.Parameter]) -> list[tuple[str, Any]]:
    """Each parameter this rank holds that several pipeline stages hold, with the group of those stages' ranks."""
    return [(fqn, groups.tied[h]) for fqn, h in sorted(compiled.program.holders.items())
            if h in groups.tied and fqn in params]


def build_optimizer(setup: RankSetup, compiled: RankProgram, groups: MeshGroups, params: dict[str, nn.Parameter],
                    factory: OptimizerFactory | None, compile: str | None
                    ) -> tuple[Any, dict[str, Any], list[tuple[nn.Parameter, torch.Tensor]]]:
    """(optimizer or None, what it steps by fqn, (parameter, the shard stepped) pairs). Without FSDP2 a
    tensor-parallel parameter's local shard (a plain tensor on its storage) is stepped rather than the DTensor,
    as Megatron's optimizer steps plain shards: every op of an update on a DTensor pays its dispatch (about 8
    per tensor in AdamW's single-tensor loop), and the state it keeps is plain too; the program hands each
    shard its gradient, and checkpoint.py presents both with the parameter's layout. ZeRO-1 partitions the
    optimizer over the dense and the expert replicas."""
    stepped = {fqn: local(p) if isinstance(p, DTensor) and not setup.fsdp else p for fqn, p in params.items()}
    shards = list({id(p): (p, s) for p, s in zip(params.values(), stepped.values()) if s is not p}.values())
    if factory is None:
        return None, stepped, shards
    check_elementwise(setup, compiled, factory)
    unique = list({id(p): p for p in stepped.values()}.values())
    offload = setup.plan.config.offload
    user, master_weights = factory, setup.plan.precision.master_weights
    if offload == "optimizer":   # the states, the masters and the step on the host (cost_model/offload.py)
        factory = lambda ps: MasterOptimizer(ps, user, master_weights)  # noqa: E731
    elif MasterOptimizer.needed(unique, master_weights):   # fp32 masters of the 16-bit weights, on the device
        factory = lambda ps: MasterOptimizer(ps, user, host=False)  # noqa: E731
    if setup.zero == 1:
        experts = {id(stepped[f]) for f in compiled.program.expert_params if f in stepped}
        dp_group = groups.dp.get_group()
        partitions = [([p for p in unique if id(p) not in experts], dp_group, dist.get_process_group_ranks(dp_group))]
        if experts:
            partitions.append(([p for p in unique if id(p) in experts], groups.group("edp"), list(groups.ranks("edp"))))
        optimizer = Zero1Optimizer(partitions, factory, setup.rank, setup.timeout)
    else:
        optimizer = factory(unique)
    if (host := wrapped(optimizer, MasterOptimizer)) is not None:   # checkpoints name the masters it steps
        stepped = host.stepped(stepped)
    inner = innermost(optimizer)
    if compile and inner is not None:
        compile_step(inner, compile)
    if (offload != "none" and setup.device.type != "cpu" and isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
            and not inner.defaults.get("fused")):   # on the host's CPU cores (cost_model/offload.py)
        warnings.warn("this plan offloads the optimizer to the CPU and prices a fused AdamW step there; this optimizer "
                      "steps tensor by tensor, several times slower on a CPU (bench/offload.py): build it with fused=True",
                      stacklevel=3)
    return optimizer, stepped, shards


def check_elementwise(setup: RankSetup, compiled: RankProgram, factory: OptimizerFactory) -> None:
    """Refuse an optimizer that is not element-wise (runtime/optim.py: Muon, Adafactor, LAMB) where the plan has
    ranks step parts of parameters: tensor parallelism's splits, expert parallelism's experts of a stacked
    weight, ZeRO-2/3's shards. It would train, with no error, otherwise than one device does. Decided from the
    plan, alike on every rank; a factory the probe cannot run is warned about."""
    cfg = setup.plan.config
    split_tp = sorted(f for f, d in compiled.program.param_dims.items() if d is not None) if cfg.tp > 1 else []
    split_ep = sorted(compiled.program.expert_params) if cfg.ep > 1 else []   # [E, ...]: E/ep experts a rank
    sharded = setup.fsdp and cfg.grad_replicas > 1
    if not split_tp and not split_ep and not sharded:
        return
    how = " and ".join(filter(None, [
        f"tensor parallelism (tp={cfg.tp}) splits {len(split_tp)} parameters ({', '.join(split_tp[:3])}"
        f"{', ...' if len(split_tp) > 3 else ''})" if split_tp else "",
        f"expert parallelism (ep={cfg.ep}) splits the experts' stacked weights ({', '.join(split_ep[:2])}"
        f"{', ...' if len(split_ep) > 2 else ''})" if split_ep else "",
        f"ZeRO-{cfg.zero} shards every parameter over its {cfg.grad_replicas} data-parallel replicas" if sharded
        else ""]))
    elementwise, why = steps_elementwise(factory, setup.device)
    if elementwise is False:
        raise ConfigError(
            f"the optimizer does not step each element on its own (Muon, Adafactor and LAMB do not; AdamW and SGD do): "
            f"{why}. In this plan {how}, so each rank would step its parts and train otherwise than one device. Plan "
            f"with tp=1, ep=1 and zero <= 1 (autopar.plan(..., fixed=dict(tp=1, ep=1, zero=1)): ZeRO-1 steps whole "
            f"parameters), or pass an element-wise optimizer")
    if elementwise is None:
        warnings.warn(f"could not check that the optimizer steps each element on its own (its factory or step failed "
                      f"on a probe tensor: {why}); in this plan {how}, and an optimizer that is not element-wise (Muon, "
                      f"Adafactor, LAMB) would train otherwise than one device", stacklevel=4)


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
