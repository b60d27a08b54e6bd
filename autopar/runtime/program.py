"""``autopar.parallelize``: a plan turned into the program one rank runs.

Every rank calls ``parallelize(model, plan, optimizer=...)`` inside an initialised process
group of ``plan.devices`` ranks and gets a :class:`Program`. Ranks form a ``(pp, dp, cp, tp)``
device mesh, tp innermost (``rank = tp_rank + tp (cp_rank + cp (dp_rank + dp pp_rank))``, the
layout the cost model priced). The rank:

1. exports the model at one micro-batch, in the mode it is in (``model.train()`` / ``model.eval()``, per
   module, as DDP and FSDP respect it), and checks it is the plan's model (its structure:
   capture/structure.py), whatever device and example batch the plan was made on and from;
2. cuts the graph into the plan's chunks and builds the ones of its pipeline stage
   (chunk ``c`` runs on stage ``c mod pp``), with parameters copied from the model,
   tensor-parallel ones distributed with the plan's split dims;
3. sets up data parallelism: the bucketed all-reduce of data_parallel.py (ZeRO 0 and 1, the
   latter with its partitioned optimizer), or FSDP2 ``fully_shard`` on every layer and chunk
   (ZeRO-2: ``reshard_after_forward=False`` and no resharding between the step's micro-batches,
   ZeRO-3: ``True``; both reduce-scatter the gradients after every backward, as the cost model
   prices them);
4. runs the plan's schedule (schedules.py, checked before the first send) on each global batch.

Context parallelism (``cp > 1``, context.py): the ``cp`` ranks of a group take the same samples
and each runs the graph on its tokens of every sequence (ring attention, gathers where an op mixes
positions); the loss each reports is its share, and the group's mean is the micro-batch's loss.
Expert parallelism (``ep > 1``, experts.py): each MoE region runs as one all-to-all dispatch over
``ep`` consecutive data-parallel ranks holding ``E / ep`` experts each. Dense weights' gradients
are averaged over the ``dp * cp`` ranks holding them (ZeRO shards over them too); expert weights'
are summed over their ``dp * cp / ep`` expert replicas and divided by ``dp * cp``. Context with
tensor parallelism (``cp > 1`` and ``tp > 1``) is refused: re-plan with ``tp=1`` or ``cp=1``.

Gradients are those of the mean loss over the global batch: each micro-batch's loss is
scaled by ``1 / micro_batches`` and the data-parallel reduction averages. A parameter held by
two stages (tied embedding and head) gets the sum of both stages' gradients on both.
Full gradients and parameters (``full_grads``, ``full_state_dict``) are gathered whole on every
rank (tensor-parallel shards, FSDP shards, experts of every ep rank).

What differs from one device, by design:

- the loss is the mean of the micro-batches' losses, which is the global mean when every
  micro-batch has as many loss terms (fixed-length batches; with ``ignore_index`` padding
  it weights micro-batches equally, as Megatron-LM does);
- batch norm in train mode normalises over what one rank sees of one micro-batch (as DDP without
  SyncBatchNorm does), and buffers the forward mutates (running statistics) are not updated;
- dropout in train mode draws its own random numbers on every rank.

The program runs each module in the mode it is in when ``parallelize`` is called, as DDP and FSDP
do: after ``model.eval()`` dropout is off and batch norm uses its running statistics, and the
program computes what the model computes in eval mode. (The plan prices the training graph
either way; changing the mode later does not change the program.)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..capture import graph_of, param_aliases
from ..capture.export import LossFn, run_export
from ..capture.opgraph import OpKind
from ..codegen.lower import R, cut_spec, lower
from ..solver.strategies import spec_dim
from ..codegen.source import program_source, write_support
from ..errors import ConfigError, PlanMismatchError
from ..plan import Plan
from . import schedules
from .checkpoint import load_program, save_program
from .chunk import ChunkModule, NodeRunner, class_name
from .context import analyse
from .context_runner import ContextRunner
from .data_parallel import GradReducer, Zero1Optimizer, local
from .expert_parallel import shard_experts
from .experts import ExpertsModule, check_regions, expert_groups, skipped_nodes
from .checks import check_model, check_structure, check_world
from .failures import at_step, non_finite_loss, wait_or_fail
from .graph import flatten_batch, on_device, plan_chunks, split_graph
from .inputs import check_batch, describe_inputs, example_at, slice_batch
from .materialize import InitFn, Materializer, has_meta, local_view, materialize_buffers
from .pipeline import ChunkIO, PipelineRunner, Topology, Value
from .specs import node_specs, sequence_parallel

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits on a peer before failing

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def parallelize(model: nn.Module, plan: Plan, optimizer: OptimizerFactory | None = None, *,
                loss_fn: LossFn | None = None, example_inputs: Any = None,
                timeout: float = DEFAULT_TIMEOUT, init_seed: int = 0, init: InitFn | None = None,
                compile: bool | str | None = None) -> "Program":
    """This rank's share of ``plan`` for ``model``: a :class:`Program` that trains it.

    ``optimizer`` maps parameters to an optimizer (``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``);
    ``loss_fn`` must be the one the plan was made with; ``example_inputs`` is needed only for a
    plan without recorded inputs (one made before they were recorded). ``timeout`` (seconds)
    bounds every wait on a peer. Raises PlanMismatchError when the plan's device count is not
    the world size or the plan was made for another model.

    A model built on the meta device (``with torch.device("meta"): model = ...``) is materialised
    shard by shard: each rank initialises only what it holds, with the model's own init seeded by
    ``init_seed`` and each module's name (materialize.py: every plan, and
    ``autopar.init_weights(model, init_seed)`` in one process, give the same values). ``init(module)``
    replaces the model's ``_init_weights`` where a module's own ``reset_parameters`` is not enough.
    A model on a real device is used as it is (``init_seed`` and ``init`` are ignored).

    ``compile``: run the generated code through ``torch.compile`` (True: inductor; a string names
    another backend, e.g. "aot_eager"): each chunk as one compiled region, or each layer under
    ZeRO-2/3 (FSDP2's hooks surround every layer). The default follows the plan: a plan
    priced for compiled kernels (``Precision(kernels="compiled")``) is compiled, an eager one is not.
    Compiling an eager plan is allowed (it runs faster, and keeps less for backward, than the plan
    priced). Context parallelism runs node by node and is not compiled.
    """
    return Program(model, plan, optimizer, loss_fn=loss_fn, example_inputs=example_inputs, timeout=timeout,
                   init_seed=init_seed, init=init, compile=compile)


class Program:
    """One rank's program: ``forward_backward``, ``train_step``, ``full_grads``, ``full_state_dict``."""

    def __init__(self, model: nn.Module, plan: Plan, optimizer: OptimizerFactory | None, *,
                 loss_fn: LossFn | None, example_inputs: Any, timeout: float, init_seed: int = 0,
                 init: InitFn | None = None, compile: bool | str | None = None) -> None:
        kernels = plan.precision.kernels
        if kernels == "fused":
            raise ConfigError("this plan prices hand-written fused kernels (Precision(kernels='fused'), Megatron-LM's), "
                              "which autopar's runtime does not have: re-plan with Precision(kernels='compiled') "
                              "(torch.compile) or the default 'eager'")
        if compile is not None and not isinstance(compile, (bool, str)):
            raise ConfigError(f"compile must be True, False, a torch.compile backend name or None (follow the "
                              f"plan), got {compile!r}")
        if compile is None:
            compile = kernels == "compiled" and plan.config.cp == 1
        if compile and plan.config.cp > 1:
            raise ConfigError("context parallelism runs node by node and cannot be compiled: pass compile=False")
        self.compile: str | None = ("inductor" if compile is True else compile) or None
        check_model(model)
        check_world(plan)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        cfg = plan.config
        if cfg.cp > 1 and cfg.tp > 1:
            raise ConfigError(f"this autopar cannot run context parallelism together with tensor parallelism "
                              f"({cfg.short()}): re-plan with fixed={{'tp': 1}} or fixed={{'cp': 1}}")
        self.plan, self.cfg, self.timeout = plan, cfg, float(timeout)
        self.rank = dist.get_rank()
        self.tp_rank = self.rank % cfg.tp
        self.cp_rank = (self.rank // cfg.tp) % cfg.cp
        self.dp_rank = (self.rank // (cfg.tp * cfg.cp)) % cfg.dp
        self.pp_rank = self.rank // (cfg.tp * cfg.cp * cfg.dp)
        self.ep_rank = self.dp_rank % cfg.ep
        self.micro_batches = plan.micro_batches
        per_replica = plan.global_batch_size // cfg.dp
        if per_replica != cfg.micro_batch_size * self.micro_batches:
            raise PlanMismatchError(f"plan's global batch {plan.global_batch_size} over dp={cfg.dp} is not "
                                    f"{self.micro_batches} micro-batches of {cfg.micro_batch_size}: re-plan")
        self.device = _device()
        # a model on meta: each rank materialises what it holds (materialize.py); ZeRO-2/3 parameters
        # only once sharded (after fully_shard), so that no rank ever holds its stage's whole weights
        self.materializer = Materializer(model, init_seed, init) if has_meta(model) else None
        self.fsdp = cfg.zero >= 2 and cfg.grad_replicas > 1
        self.inputs_record = plan.extra.get("inputs")
        self._export(model, loss_fn, example_inputs)
        self.aliases = param_aliases(model)
        state = model.state_dict()
        self.state_keys = list(state)
        self.buffers = {k: self._value(k, v).cpu().clone() for k, v in state.items() if k not in self.aliases}
        self.steps = 0                      # forward_backward calls so far (the step failures name)
        self.micro_losses: torch.Tensor | None = None
        self._mesh()
        self._expert_groups()
        self._build_chunks(model)
        self._data_parallel()
        # compiled per chunk after the first step (which runs the code that checks every shard's shape)
        self.compile_chunks = bool(self.compile) and not self.fsdp
        self._tied_groups()
        # parameters that never change, kept for full_state_dict: those no chunk holds (no op reads
        # them) and frozen ones (requires_grad=False: no gradient, so no optimizer step moves them)
        self.unused = {n: self._value(n, p).cpu().clone() for n, p in model.named_parameters()
                       if n not in self.holders or (not p.requires_grad and self.materializer is None)}
        self.schedule = schedules.build(cfg.schedule, cfg.pp, self.micro_batches, cfg.virtual_stages)
        schedules.check(self.schedule, self.micro_batches, cfg.virtual_stages)
        self.actions = self.schedule[self.pp_rank]
        self.runner = PipelineRunner(
            self.chunks, {c.index: ChunkIO(c.graph_inputs, c.recv, c.send) for c in self.split.chunks},
            self._cut_values(), self.split.loss, self._topology(), self._to_cut, self._before_backward,
            lambda work, what, peer: wait_or_fail(work, self.timeout, what, peers=[peer]), self.device)
        self.optimizer = self._optimizer(optimizer)
        self.materializer = None   # its last module's values and the meta model are not needed any more

    # --- construction -------------------------------------------------------------------------
    def _export(self, model: nn.Module, loss_fn: LossFn | None, example_inputs: Any) -> None:
        """Export the model at one micro-batch, in the mode it is in (as DDP and FSDP run it), and check it
        is the plan's model."""
        if example_inputs is not None:
            self.inputs_record = describe_inputs(example_inputs)
        if self.inputs_record is None:
            raise ConfigError("the plan does not record its example inputs: pass parallelize(..., example_inputs=) "
                              "shaped like the inputs the plan was made with")
        # a meta model is exported on meta inputs (a model that does not move its inputs to its own
        # device, as Hugging Face's do, would mix devices); on_device points the graph at this rank's
        where = torch.device("meta") if self.materializer is not None else self.device
        inputs = example_at(self.inputs_record, self.cfg.micro_batch_size, where)
        program = run_export(model, inputs, loss_fn, train_mode=False)
        self.graph = graph_of(model, program)
        check_structure(self.plan, self.graph)
        on_device(program, self.device)
        if self.materializer is not None:
            materialize_buffers(program, self.materializer)
        self.split = split_graph(program, self.graph, plan_chunks(self.plan), param_aliases(model))

    def _mesh(self) -> None:
        cfg = self.cfg
        self.mesh = init_device_mesh(self.device.type, (cfg.pp, cfg.dp, cfg.cp, cfg.tp),
                                     mesh_dim_names=("pp", "dp", "cp", "tp"))
        self.tp_mesh = self.mesh["tp"] if cfg.tp > 1 else None
        self.cp_group = self.mesh["cp"].get_group() if cfg.cp > 1 else None
        # the dense weights' gradient (and ZeRO) group: the dp * cp ranks of this (pp, tp) position
        self.dp_mesh = self.mesh["dp"] if cfg.cp == 1 else self.mesh["dp", "cp"]._flatten("dp_cp")
        self.dp_group = self.dp_mesh.get_group()
        self.specs: dict = {}
        self.param_dims: dict = {}
        if cfg.tp > 1:
            if not self.plan.sharding:
                raise PlanMismatchError("the plan has tp > 1 but no per-op sharding (a plan file written by an "
                                        "autopar before estimates had one, or edited): make it again with "
                                        "autopar.plan or autopar.estimate")
            self.specs, self.param_dims = node_specs(self.plan.sharding, self.graph)
            if cfg.sequence_parallel:
                self.specs = sequence_parallel(self.specs, self.graph, cfg.tp)

    def _expert_groups(self) -> None:
        """Expert parallelism's groups (experts.py), when MoE regions run as one call (ep > 1 or cp > 1)."""
        cfg = self.cfg
        self.regions = self.graph.moe if (cfg.ep > 1 or cfg.cp > 1) else ()
        self.expert_fqns = frozenset(p for r in self.regions for p in (r.gate_up, r.down))
        self.ep_group = self.expert_group = self.expert_mesh = None
        self.expert_ranks = [self.rank]
        if self.regions:
            groups = expert_groups(cfg, self.rank, self.global_rank, self.device.type)
            self.ep_group, self.expert_group, self.expert_ranks, self.expert_mesh = groups

    def _build_chunks(self, model: nn.Module) -> None:
        cfg = self.cfg
        attention = frozenset(n.name for n in self.graph.nodes if n.kind is OpKind.ATTENTION)
        lowered = None
        if cfg.tp > 1:
            moe = {r.output: (r.hidden_input, r.index_input, r.weight_input) for r in self.regions}
            lowered = lower(self.split.node_map, self.graph, self.split.chunks, self.specs, self.split.param_of,
                            self.param_dims, cfg.tp, lambda v: cut_spec(self.specs.get(v)), moe)
        # compiled per layer under FSDP2 (its hooks gather each layer's parameters around the layer's
        # code), else per chunk (_data_parallel): one compiled region for all of a chunk's layers
        self.node_runner = NodeRunner(self.split, self.tp_mesh, lowered, compile=self.compile if self.fsdp else None)
        self.tp_partial = lowered.partial_params if lowered is not None else frozenset()
        if self.regions:
            layer_of = {name: layer.index for chunk in self.split.chunks for layer in chunk.layers
                        for name in layer.nodes}
            check_regions(self.regions, self.split.node_map, layer_of, self.split.param_of, cfg.ep, cfg.cp,
                          self.node_runner.skipped)
            self.node_runner.moe_outputs = {r.output: r for r in self.regions}
            self.node_runner.moe_skip = skipped_nodes(self.regions)
        if cfg.cp > 1:
            plan = analyse(self.split.program, cfg.cp, attention,
                           {r.output: (r.hidden_input, r.index_input, r.weight_input) for r in self.regions},
                           self.node_runner.skipped | self.node_runner.moe_skip)
            self.node_runner.context = ContextRunner(plan, self.cp_group, self.cp_rank, self.timeout)
        full = dict(model.named_parameters())
        self.my_chunks = [c for c in range(len(self.split.chunks)) if c % cfg.pp == self.pp_rank]
        self.params: dict[str, nn.Parameter] = {}
        for c in self.my_chunks:
            for fqn in self.split.chunks[c].params:
                if fqn not in self.params:
                    self.params[fqn] = self._distribute(fqn, full[fqn])
        self.split = dataclasses.replace(
            self.split, buffer_value={k: v.to(self.device) for k, v in self.split.buffer_value.items()})
        experts = {r.output: ExpertsModule(r, self.params[r.gate_up], self.params[r.down], self.ep_group,
                                           self.timeout)
                   for r in self.regions if r.gate_up in self.params}
        modes = {c: [cfg.layer_mode(self.pp_rank, k) for k in range(len(self.split.chunks[c].layers))]
                 for c in self.my_chunks}
        self.chunks = {c: ChunkModule(self.split.chunks[c], self.split, self.node_runner, self.params, modes[c],
                                      experts) for c in self.my_chunks}

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
        place = Shard(d % value.dim()) if d is not None else Replicate()
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
            from torch.distributed.fsdp import fully_shard
            # With tp > 1 the parameters are already DTensors of the tp sub-mesh: FSDP2 shards them
            # further over the dp sub-mesh of the same root mesh (2-D, as torchtitan does).
            mesh = self.dp_mesh
            for chunk in self.chunks.values():
                for layer in chunk.layers:
                    for experts in layer.experts.values():
                        # expert weights: sharded over their own replicas, averaged like the dense ones
                        fully_shard(experts, mesh=self.expert_mesh, reshard_after_forward=self.zero == 3)
                        experts.set_gradient_divide_factor(float(replicas))
                        if dist.get_backend() != "nccl" and len(self.expert_ranks) > 1:
                            # gloo has no pre-multiplied sum: sum, then divide (FSDP2 divides a one-rank
                            # mesh's gradient by the factor itself, and would divide twice with this set)
                            experts.set_force_sum_reduction_for_comms(True)
                for layer in chunk.layers:
                    if any(True for _ in layer.parameters(recurse=False)):
                        fully_shard(layer, mesh=mesh, reshard_after_forward=self.zero == 3)
                fully_shard(chunk, mesh=mesh, reshard_after_forward=self.zero == 3)
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

    def _tied_groups(self) -> None:
        """A process group per parameter held by several pipeline stages, over those stages' ranks."""
        cfg = self.cfg
        holders: dict[str, tuple[int, ...]] = {}
        for c, spec in enumerate(self.split.chunks):
            for fqn in spec.params:
                holders[fqn] = tuple(sorted(set(holders.get(fqn, ()) + (c % cfg.pp,))))
        self.holders = holders
        self.tied: list[tuple[str, Any]] = []
        sets = sorted({h for h in holders.values() if len(h) > 1})
        groups = {}
        for h in sets:  # every rank creates every group, in the same order (new_group is collective)
            for dp_r in range(cfg.dp):
                for cp_r in range(cfg.cp):
                    for tp_r in range(cfg.tp):
                        ranks = [self.global_rank(s, dp_r, tp_r, cp_r) for s in h]
                        g = dist.new_group(ranks)
                        if self.rank in ranks:
                            groups[h] = g
        for fqn, h in sorted(holders.items()):
            if h in groups and fqn in self.params:
                self.tied.append((fqn, groups[h]))

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """The rank at those mesh coordinates (tp innermost, then cp, dp, pp outermost)."""
        cfg = self.cfg
        return tp_rank + cfg.tp * (cp_rank + cfg.cp * (dp_rank + cfg.dp * pp_rank))

    def _topology(self) -> Topology:
        cfg = self.cfg
        ranks = [self.global_rank(s, self.dp_rank, self.tp_rank, self.cp_rank) for s in range(cfg.pp)]
        return Topology(cfg.pp, ranks, self.pp_rank)

    def _cut_spec(self, value: str) -> str:
        return R if value == self.split.loss else cut_spec(self.specs.get(value))

    def _to_cut(self, chunk: int, name: str, value: torch.Tensor) -> torch.Tensor:
        return self.node_runner.to_cut(chunk, name, value, self._cut_spec(name))

    def _cut_values(self) -> dict[str, Value]:
        """Every value crossing a cut, with the shard a receiver allocates: this rank's tokens under
        context parallelism (context.py's local shape), its block of a tensor-parallel split."""
        out = {}
        context = self.node_runner.context
        for v, readers in self.split.consumers.items():
            meta = self.split.meta(v)
            shape = list(meta.shape)
            if context is not None:
                shape = list(context.plan.local_shape(v, shape))
            d = spec_dim(self._cut_spec(v))
            if d is not None and shape:
                shape[d % len(shape)] //= self.cfg.tp
            grad = self.graph.node(v).requires_grad if v in self.graph.node_index else True
            out[v] = Value(self.split.producer[v], tuple(readers), tuple(shape), meta.dtype,
                           grad and meta.is_floating_point())
        return out

    def _optimizer(self, factory: OptimizerFactory | None):
        if factory is None:
            return None
        params = list(self.parameters())
        if self.zero == 1:
            experts = {id(self.params[f]) for f in self.expert_fqns if f in self.params}
            partitions = [([p for p in params if id(p) not in experts], self.dp_group,
                           dist.get_process_group_ranks(self.dp_group))]
            if experts:
                partitions.append(([p for p in params if id(p) in experts], self.expert_group, self.expert_ranks))
            return Zero1Optimizer(partitions, factory, self.rank, self.timeout)
        return factory(params)

    # --- training -----------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its shards), each once."""
        return list({id(p): p for p in self.params.values()}.values())

    def _before_backward(self, chunk: int, last: bool) -> None:
        if self.fsdp:
            # ZeRO-2 and 3 reduce-scatter every backward (only a shard of the gradients is ever held);
            # ZeRO-2 keeps the weights gathered until the step's last backward (one gather per step)
            if self.zero == 2:
                self.chunks[chunk].set_reshard_after_backward(last)
        elif last:
            for reducer in self.reducers:
                reducer.start(self.my_chunks.index(chunk))

    def forward_backward(self, batch: Any) -> torch.Tensor:
        """Gradients of the mean loss over ``batch`` (the whole global batch, the same on every rank)
        into this rank's parameters (previous gradients are dropped); returns that loss. Every
        rank also gets each micro-batch's loss in ``micro_losses`` (``dp * micro_batches`` values,
        replica-major). A failure raises RuntimeFailure naming this rank and the step."""
        check_batch(batch, self.inputs_record, self.plan.global_batch_size)
        step, self.steps = self.steps, self.steps + 1
        with at_step(step, "forward_backward"):
            return self._forward_backward(batch)

    def _forward_backward(self, batch: Any) -> torch.Tensor:
        for p in self.parameters():
            p.grad = None
        per = self.plan.global_batch_size // self.cfg.dp
        mbs = self.cfg.micro_batch_size
        micro = []
        for i in range(self.micro_batches):
            start = self.dp_rank * per + i * mbs
            part = batch if mbs == self.plan.global_batch_size else slice_batch(batch, start, start + mbs,
                                                                                 self.plan.global_batch_size)
            leaves = [t.to(self.device) if isinstance(t, torch.Tensor) else t
                      for t in flatten_batch(part, self.split.in_spec)]
            inputs = dict(zip(self.split.user_inputs, leaves))
            if self.node_runner.context is not None:   # this rank's tokens of the sequences
                inputs = {k: self.node_runner.context.shard_input(k, v) for k, v in inputs.items()}
            micro.append(inputs)
        with torch.autograd.set_grad_enabled(True):
            losses = self.runner.run(self.actions, micro, 1.0 / self.micro_batches)
        if self.compile_chunks:
            for chunk in self.chunks.values():
                chunk.compile(backend=self.compile)
            self.compile_chunks = False
        self._finish_grads()
        return self._share_loss(losses)

    def train_step(self, batch: Any) -> torch.Tensor:
        """``forward_backward`` then one optimizer step; returns the loss. A micro-batch whose loss is
        not finite stops the step before the optimizer runs (the parameters are unchanged) with a
        RuntimeFailure, raised on every rank, naming the micro-batch and its samples."""
        if self.optimizer is None:
            raise ConfigError("train_step needs an optimizer: parallelize(model, plan, optimizer=lambda params: "
                              "torch.optim.AdamW(params, lr=...))")
        loss = self.forward_backward(batch)
        self._check_finite(self.steps - 1)
        with at_step(self.steps - 1, "the optimizer step"):
            self.optimizer.step()
        return loss

    def _check_finite(self, step: int) -> None:
        """Every rank holds the same micro-batch losses (all-reduced), so every rank raises alike."""
        failure = non_finite_loss(self.micro_losses, self.rank, step, self.micro_batches, self.cfg.micro_batch_size,
                                  self.plan.global_batch_size // self.cfg.dp)
        if failure is not None:
            raise failure

    def _finish_grads(self) -> None:
        for reducer in self.reducers:
            reducer.finish()
        # replicated parameters whose gradient each tp rank holds a part of (codegen/lower.py), summed
        # before the tied ones (a tied parameter can be both: one reduction at a time on a tensor)
        works = []
        tp_group = self.tp_mesh.get_group() if self.tp_mesh is not None else None
        for fqn in sorted(self.tp_partial & set(self.params)):
            p = self.params[fqn]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            works.append((dist.all_reduce(local(p.grad), group=tp_group, async_op=True), fqn))
        for work, fqn in works:
            wait_or_fail(work, self.timeout, f"all_reduce of {fqn}'s tensor-parallel gradient", tp_group)
        works = []
        for fqn, group in self.tied:
            p = self.params[fqn]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            works.append((dist.all_reduce(local(p.grad), group=group, async_op=True), fqn, group))
        for work, fqn, group in works:
            wait_or_fail(work, self.timeout, f"all_reduce of tied parameter {fqn}'s gradient", group)

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Every replica's micro-batch losses on every rank (``micro_losses``); returns their mean."""
        cfg, m = self.cfg, self.micro_batches
        if self.plan.devices == 1:   # nothing to share: no collective, no copies
            self.micro_losses = torch.stack(losses).detach().float().reshape(m)
            return self.micro_losses.mean()
        owner = self.pp_rank == cfg.pp - 1 and self.tp_rank == 0
        per = torch.zeros(cfg.dp * m, device=self.device)
        if owner:
            per[self.dp_rank * m:(self.dp_rank + 1) * m] = torch.stack(losses).detach().float().reshape(m)
        work = dist.all_reduce(per, async_op=True)
        wait_or_fail(work, self.timeout, "all_reduce of the step's losses")
        self.micro_losses = (per / cfg.cp).cpu()   # each cp rank reports its share (context.py)
        return self.micro_losses.mean().to(self.device)

    # --- the generated code ----------------------------------------------------------------------
    def source(self) -> str:
        """The code this rank runs, as Python source (codegen/source.py): a class per layer of its chunks.
        Every rank of a pipeline stage runs the same code (they differ in the shards they hold)."""
        cfg = self.cfg
        layers = [(class_name(layer.spec.name), layer.generated) for c in self.my_chunks
                  for layer in self.chunks[c].layers if layer.generated is not None]
        title = (f"Pipeline stage {self.pp_rank} of {self.plan.model_name} under {cfg.short()}: chunks "
                 f"{self.my_chunks}, micro-batches of {cfg.micro_batch_size}.")
        return program_source(layers, title)

    def write_source(self, folder: str, name: str) -> str:
        """Write :meth:`source` as ``folder/name`` beside the collectives it imports; returns its path."""
        os.makedirs(folder, exist_ok=True)
        write_support(folder)
        path = os.path.join(folder, name)
        with open(path, "w") as fh:
            fh.write(self.source())
        return path

    # --- full tensors on every rank -------------------------------------------------------------
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's full gradient under the model's own names, on every rank (zeros for a
        frozen parameter or one no op reads, as ``p.grad`` is None for those on one device)."""
        with at_step(self.steps - 1, "full_grads"):
            grads = self._gather(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
        return {**{n: torch.zeros_like(p) for n, p in self.unused.items()}, **grads}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's ``state_dict`` on every rank, as full CPU tensors under its own keys
        (every name of a tied parameter; buffers as the model had them, since the forward does not
        update them): ``torch.save`` it, and ``model.load_state_dict(torch.load(path))`` restores
        the single-device model."""
        with at_step(self.steps - 1, "full_state_dict"):
            canonical = {**self.unused, **self._gather(lambda p: p.detach())}
        params = {alias: canonical[name] for alias, name in self.aliases.items() if name in canonical}
        return {k: params[k] if k in params else self.buffers[k] for k in self.state_keys
                if k in params or k in self.buffers}

    def _gather(self, pick: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for fqn in sorted(self.holders):
            src_stage = self.holders[fqn][0]
            src = self.global_rank(src_stage, 0, 0)
            meta = self.graph.params.get(fqn)
            if meta is None:
                continue
            if self.pp_rank == src_stage:
                value = pick(self.params[fqn])
                value = value.full_tensor() if isinstance(value, DTensor) else value
                buf = value.detach().clone().contiguous()
                if fqn in self.expert_fqns and self.ep_group is not None:   # every ep rank's experts
                    parts = [torch.empty_like(buf) for _ in range(self.cfg.ep)]
                    work = dist.all_gather(parts, buf, group=self.ep_group, async_op=True)
                    wait_or_fail(work, self.timeout, f"all_gather of experts {fqn}", self.ep_group)
                    buf = torch.cat(parts)
            else:
                buf = torch.empty(meta.shape, dtype=getattr(torch, str(meta.dtype).removeprefix("torch.")),
                                  device=self.device)
            work = dist.broadcast(buf, src=src, async_op=True)
            wait_or_fail(work, self.timeout, f"broadcast of {fqn}")
            out[fqn] = buf.cpu()
        return out

    # --- sharded checkpoints (checkpoint.py) ----------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Write this program's parameters, optimizer state and step count to the folder ``path`` with
        torch.distributed.checkpoint, each rank only its own shards. Collective: every rank calls it.
        ``load_checkpoint`` of a program of any plan of the same model, or ``autopar.load_checkpoint``
        in one process, reads it back."""
        with at_step(self.steps - 1, "save_checkpoint"):
            save_program(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Fill this program's parameters, optimizer state and step count from a checkpoint
        ``save_checkpoint`` wrote under any plan of the same model (resharded as this plan holds them):
        training goes on as the saving program would have. Collective: every rank calls it."""
        with at_step(self.steps - 1, "load_checkpoint"):
            load_program(self, path)


def _device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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

