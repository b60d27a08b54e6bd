"""``autopar.parallelize``: a plan turned into the program one rank runs.

Every rank calls ``parallelize(model, plan, optimizer=...)`` inside an initialised process
group of ``plan.devices`` ranks and gets a :class:`Program`. Ranks form a ``(pp, dp, cp, tp)``
device mesh, tp innermost (runtime/mesh.py: the layout and the groups the cost model priced). The rank:

1. exports the model at one micro-batch, in the mode it is in (``model.train()`` / ``model.eval()``, per
   module, as DDP and FSDP respect it), and checks it is the plan's model (its structure:
   capture/structure.py), whatever device and example batch the plan was made on and from;
2. compiles its share (codegen/compile.py ``compile_rank``: the graph cut into the plan's chunks,
   each op lowered for tensor parallelism, the chunks of its pipeline stage, ``cfg.device_chunks(stage)``
   (``c mod pp``, or ZB-V's V), and its actions) and builds those chunks: each layer's generated code
   (codegen/layers.py) with parameters copied from the model, tensor-parallel ones distributed with the
   plan's split dims (assembly.py's steps, each a function: export_model, apply_mesh,
   apply_tensor_parallel, build_chunks, ...);
3. sets up data parallelism: the bucketed all-reduce of data_parallel.py (ZeRO 0 and 1, the
   latter with its partitioned optimizer), or FSDP2 ``fully_shard`` on every layer and chunk
   (ZeRO-2: ``reshard_after_forward=False`` and no resharding between the step's micro-batches,
   ZeRO-3: ``True``; both reduce-scatter the gradients after every backward, as the cost model
   prices them);
4. runs the plan's schedule (runtime/schedules.py, checked before the first send) on each global
   batch with runtime/pipeline.py's executor (torch only: a standalone program runs the same).

Context parallelism (``cp > 1``, codegen/context.py): the ``cp`` ranks of a group take the same
samples and each runs the graph on its tokens of every sequence (ring attention, gathers where an
op mixes positions), with tensor parallelism inside each of them when ``tp > 1``; the loss each
reports is its share, and the group's mean is the micro-batch's loss.
Expert parallelism (``ep > 1``, experts.py): each MoE region runs as one all-to-all dispatch over
``ep`` consecutive data-parallel ranks holding ``E / ep`` experts each. Dense weights' gradients
are averaged over the ``dp * cp`` ranks holding them (ZeRO shards over them too); expert weights'
are summed over their ``dp * cp / ep`` expert replicas and divided by ``dp * cp``.

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

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..capture import param_aliases
from ..capture.export import LossFn
from ..codegen.compile import compile_rank
from ..codegen.inputs import check_batch, describe_inputs
from ..codegen.layers import class_name
from ..codegen.source import program_source, write_support
from ..codegen.split import flatten_batch
from ..config import SPLIT_BACKWARD
from ..errors import ConfigError, PlanMismatchError
from ..plan import Plan
from ..runtime.batches import replica_micro_batches
from ..runtime.context_ops import shard_inputs
from ..runtime.data_parallel import all_reduce_grads, local
from ..runtime.failures import at_step, non_finite_loss, non_finite_norm, peer_wait, wait_or_fail
from ..runtime.host_heap import keep_freed_memory
from ..runtime.optim import Zero1Optimizer, check_clip, clip_grad_norm_, norm_pieces, wrapped
from ..runtime.fp8 import fp8_gathered, refresh_scales
from ..runtime.mesh import Mesh
from ..runtime.losses import LossShare, loss_dtype
from ..runtime.pipeline import ChunkIO, PipelineRunner, Topology
from ..runtime.sharded_init import InitFn, Materializer, has_meta
from .assembly import (OptimizerFactory, RankSetup, apply_data_parallel, apply_fsdp, apply_mesh, apply_tensor_parallel,
                       build_chunks, build_optimizer, export_model, tied_groups)
from .checkpoint import load_program, save_program
from .checks import check_model, check_world

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits on a peer before failing


def parallelize(model: nn.Module, plan: Plan, optimizer: OptimizerFactory | None = None, *,
                loss_fn: LossFn | None = None, example_inputs: Any = None,
                timeout: float = DEFAULT_TIMEOUT, init_seed: int = 0, init: InitFn | None = None,
                compile: bool | str | None = None) -> "Program":
    """This rank's share of ``plan`` for ``model``: a :class:`Program` that trains it.

    ``optimizer`` maps parameters to an optimizer (``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``); where the plan
    has ranks step parts of parameters (tensor parallelism, ZeRO-2/3) it must be element-wise, as AdamW and SGD
    are and Muon, Adafactor and LAMB are not (a ConfigError says so: runtime/optim.py probes it);
    ``loss_fn`` must be the one the plan was made with (the plan records its ``module:qualname``; a
    missing or another one, or a plan priced with a stand-in loss, is a PlanMismatchError saying what
    to pass: capture/loss.py); ``example_inputs`` is needed only for a
    plan without recorded inputs (one made before they were recorded). ``timeout`` (seconds)
    bounds every wait on a peer. Raises PlanMismatchError when the plan's device count is not
    the world size or the plan was made for another model.

    A model built on the meta device (``with torch.device("meta"): model = ...``) is materialised
    shard by shard: each rank initialises only what it holds, with the model's own init seeded by
    ``init_seed`` and each module's name (runtime/sharded_init.py: every plan, and
    ``autopar.init_weights(model, init_seed)`` in one process, give the same values). ``init(module)``
    replaces the model's ``_init_weights`` where a module's own ``reset_parameters`` is not enough.
    A model on a real device is used as it is (``init_seed`` and ``init`` are ignored).

    ``compile``: run the generated code through ``torch.compile`` (True: inductor; a string names
    another backend, e.g. "aot_eager"): each chunk as one compiled region, or each layer under
    ZeRO-2/3 (FSDP2's hooks surround every layer); and the optimizer's step from its second call on
    (runtime/optim.py; dynamo keeps 8 versions of a function, so past the eighth compiled program
    in one process the optimizer's step runs eager, with a warning). The default follows the plan: a plan
    priced for compiled kernels (``Precision(kernels="compiled")``) is compiled, an eager one is not.
    Compiling an eager plan is allowed (it runs faster, and keeps less for backward, than the plan
    priced).
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
            compile = kernels == "compiled"
        self.compile: str | None = ("inductor" if compile is True else compile) or None
        if self.compile and plan.config.schedule in SPLIT_BACKWARD:
            priced = " (this plan priced compiled kernels)" if kernels == "compiled" else ""
            raise ConfigError(
                f"schedule={plan.config.schedule!r} splits each chunk's backward into an input- and a weight-gradient "
                "pass, and a torch.compile'd chunk's backward is one compiled node that cannot be split (torch."
                f"distributed.pipelining refuses it too): pass compile=False{priced}, or re-plan with "
                "schedule='1f1b' or 'interleaved'")
        check_model(model)
        check_world(plan)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        cfg = plan.config
        self.plan, self.cfg, self.timeout = plan, cfg, float(timeout)
        self.rank = dist.get_rank()
        self.mesh = Mesh.of(cfg)
        at = self.mesh.coords(self.rank)
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank, self.ep_rank = at.pp, at.dp, at.cp, at.tp, at.ep
        self.micro_batches = plan.micro_batches
        per_replica = plan.global_batch_size // cfg.dp
        if per_replica != cfg.micro_batch_size * self.micro_batches:
            raise PlanMismatchError(f"plan's global batch {plan.global_batch_size} over dp={cfg.dp} is not "
                                    f"{self.micro_batches} micro-batches of {cfg.micro_batch_size}: re-plan")
        self.device = _device()
        if self.device.type == "cpu":
            keep_freed_memory()   # the step's buffers reused, not faulted in again each step (runtime/host_heap.py)
        # a model on meta: each rank materialises what it holds (runtime/sharded_init.py); ZeRO-2/3 parameters
        # only once sharded (after fully_shard), so that no rank ever holds its stage's whole weights
        materializer = Materializer(model, init_seed, init) if has_meta(model) else None
        setup = RankSetup(plan, self.rank, at, self.device, self.timeout, materializer)
        self.fsdp, self.zero = setup.fsdp, setup.zero
        self.inputs_record = describe_inputs(example_inputs) if example_inputs is not None else plan.extra.get("inputs")
        if self.inputs_record is None:
            raise ConfigError("the plan does not record its example inputs: pass parallelize(..., example_inputs=) "
                              "shaped like the inputs the plan was made with")
        # the steps (assembly.py), in order: each a function of what it reads
        exported = export_model(setup, model, loss_fn, self.inputs_record)
        self.compiled = compiled = compile_rank(plan, exported, self.rank, model)   # the one lowering
        self.graph, self.split = compiled.program.graph, compiled.program.split
        self.groups = groups = apply_mesh(setup, compiled)
        self.params = apply_tensor_parallel(setup, compiled, groups, model)
        # compiled per layer under FSDP2 (its hooks gather each layer's parameters around the layer's code), else
        # per chunk after the first step (which runs the code that checks every shard's shape)
        self.node_runner, self.chunks = build_chunks(setup, compiled, groups, self.params,
                                                     self.compile if self.fsdp else None)
        if self.fsdp:
            self.params, self.reducers = apply_fsdp(setup, compiled, groups, self.chunks), []
        else:
            self.reducers = apply_data_parallel(setup, compiled, groups, self.chunks, bool(self.compile))
        # the weights FSDP2 gathers in fp8: their scales refreshed before each step's first gather (runtime/fp8.py)
        self.fp8_weights = fp8_gathered(self.params.values()) if compiled.program.fp8_gathered else []
        self.compile_chunks = bool(self.compile) and not self.fsdp
        self.tied = tied_groups(compiled, groups, self.params)
        self.optimizer, self.stepped, self.shards = build_optimizer(setup, compiled, groups, self.params, optimizer,
                                                                    self.compile)
        # what the training methods read
        self.my_chunks = [chunk.index for chunk in compiled.chunks]
        self.holders = compiled.program.holders
        self.expert_fqns = compiled.program.expert_params
        self.tp_partial = compiled.program.lowered.partial_params if compiled.program.lowered is not None \
            else frozenset()
        zero1 = wrapped(self.optimizer, Zero1Optimizer)
        if zero1 is not None:   # each gradient summed onto the rank that steps it, but those more sums follow
            owners = zero1.owners(self.params, self.tp_partial | {fqn for fqn, _ in self.tied})
            for reducer in self.reducers:
                reducer.reduce_to_owners(owners)
        self.tp_mesh, self.ep_group = groups.tp, groups.group("ep")
        self.aliases = param_aliases(model)
        state = model.state_dict()
        self.state_keys = list(state)
        self.buffers = {k: setup.value(k, v).cpu().clone() for k, v in state.items() if k not in self.aliases}
        # parameters that never change, kept for full_state_dict: those no chunk holds (no op reads
        # them) and frozen ones (requires_grad=False: no gradient, so no optimizer step moves them)
        self.unused = {n: setup.value(n, p).cpu().clone() for n, p in model.named_parameters()
                       if n not in self.holders or (not p.requires_grad and materializer is None)}
        self.steps = 0                      # forward_backward calls so far (the step failures name)
        self.grad_norm: torch.Tensor | None = None   # the step's total gradient norm, once clip_grad_norm_ ran
        self.micro_losses: torch.Tensor | None = None
        # the step's micro-batch losses to every rank (runtime/losses.py): started after this rank's last
        # forward, in the gradients' last bucket when their all-reduce spans every rank
        last_stage = cfg.chunk_device(cfg.pp * cfg.virtual_stages - 1)   # the loss's (ZB-V: pipeline rank 0)
        self.loss_share = LossShare(cfg.shares_losses, cfg.losses_ride_gradients,
                                    self.pp_rank == last_stage and self.tp_rank == 0, cfg.dp, self.dp_rank,
                                    self.micro_batches, cfg.cp, self.device, self.timeout,
                                    loss_dtype(plan.precision.storage), self.reducers[0] if self.reducers else None)
        self.actions = compiled.actions   # the schedule's, checked for deadlock by the compiler
        sends = {c.index: {s.value: s for s in c.sends} for c in compiled.chunks}
        topology = Topology(cfg.pp, list(groups.ranks("pp")), self.pp_rank,
                            [cfg.chunk_device(c.index) for c in self.split.chunks])
        self.runner = PipelineRunner(
            self.chunks, {c.index: ChunkIO(c.graph_inputs, c.recv, c.send) for c in self.split.chunks},
            dict(compiled.program.values), self.split.loss, topology,
            lambda chunk, name, value: self.node_runner.to_cut(sends[chunk][name], value), self._before_backward,
            peer_wait(self.timeout), self.device, self.loss_share.start, self._after_backward,
            self.tp_mesh.get_group() if self.tp_mesh is not None else None)

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

    def _after_backward(self, chunk: int) -> None:
        """The chunk's last backward of the step returned: its gradients are complete."""
        for reducer in self.reducers:
            reducer.ended(self.my_chunks.index(chunk))

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
        self.grad_norm = None
        for p in self.parameters():
            p.grad = None
        for _, shard in self.shards:   # the last step's local gradients, held there too (_finish_grads)
            shard.grad = None
        if self.fp8_weights:
            refresh_scales(self.fp8_weights, self.groups.dp.get_group(), self.node_runner.fp8)
        micro = []
        for part in replica_micro_batches(batch, self.dp_rank, self.cfg.dp, self.cfg.micro_batch_size,
                                          self.micro_batches, self.plan.global_batch_size):
            leaves = [t.to(self.device) if isinstance(t, torch.Tensor) else t
                      for t in flatten_batch(part, self.split.in_spec)]
            inputs = dict(zip(self.split.user_inputs, leaves))
            context = self.node_runner.context
            if context is not None:   # this rank's tokens of the sequences
                inputs = shard_inputs(inputs, context.plan.inputs, context.plan.cp, context.rank)
            micro.append(inputs)
        with torch.autograd.set_grad_enabled(True):
            self.runner.run(self.actions, micro, 1.0 / self.micro_batches)   # the losses go to self.loss_share
        if self.compile_chunks:
            for chunk in self.chunks.values():
                chunk.compile(backend=self.compile)
            self.compile_chunks = False
        self._finish_grads()
        self.micro_losses = self.loss_share.result()
        return self.micro_losses.mean().to(self.device)

    def train_step(self, batch: Any, max_grad_norm: float | None = None) -> torch.Tensor:
        """``forward_backward``, the gradients clipped to a total norm of ``max_grad_norm`` where given
        (:meth:`clip_grad_norm_`), then one optimizer step; returns the loss. A micro-batch whose loss is
        not finite stops the step before the optimizer runs (the parameters are unchanged) with a
        RuntimeFailure, raised on every rank, naming the micro-batch and its samples; so does a gradients'
        norm that is not finite, when clipping computes it."""
        if self.optimizer is None:
            raise ConfigError("train_step needs an optimizer: parallelize(model, plan, optimizer=lambda params: "
                              "torch.optim.AdamW(params, lr=...))")
        loss = self.forward_backward(batch)
        self._check_finite(self.steps - 1)
        if max_grad_norm is not None:   # a norm that is not finite stops the step as a loss that is not does
            failure = non_finite_norm(self.clip_grad_norm_(max_grad_norm), self.rank, self.steps - 1)
            if failure is not None:
                raise failure
        with at_step(self.steps - 1, "the optimizer step"):
            self.optimizer.step()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that the model's total gradient norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` does on one device; returns
        that norm, the same on every rank (also kept as ``grad_norm``, for logging; None before a step's
        gradients are clipped, as ``forward_backward`` leaves it). Call it after ``forward_backward``, before
        the optimizer steps (``train_step(batch, max_grad_norm=...)`` does). Collective. The torch function over
        ``program.parameters()`` would not do this: a rank holds parts of some gradients and copies of others,
        so each rank would compute another norm and scale by another factor (runtime/optim.py)."""
        check_clip(max_norm, norm_type)   # before the collective, not as a failure of the step
        with at_step(self.steps - 1, "clip_grad_norm_"):
            split = self.compiled.program.param_dims if self.cfg.tp > 1 else {}
            pieces = norm_pieces(self.params, lambda fqn: self.holders[fqn][0] == self.pp_rank,
                                 lambda fqn: split.get(fqn) is not None, self.tp_rank, self.reducers)
            self.grad_norm = clip_grad_norm_(pieces, max_norm, norm_type, self.timeout)
        return self.grad_norm

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
        tp_group = self.tp_mesh.get_group() if self.tp_mesh is not None else None
        all_reduce_grads([(f"{fqn}'s tensor-parallel gradient", self.params[fqn], tp_group)
                          for fqn in sorted(self.tp_partial & set(self.params))], self.timeout)
        all_reduce_grads([(f"tied parameter {fqn}'s gradient", self.params[fqn], group)
                          for fqn, group in self.tied], self.timeout)
        for p, shard in self.shards:   # the local shards the optimizer steps (assembly.build_optimizer)
            shard.grad = None if p.grad is None else local(p.grad)

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
        text = self.source()
        write_support(folder)
        path = os.path.join(folder, name)
        with open(path, "w") as fh:
            fh.write(text)
        return path

    # --- full tensors on every rank -------------------------------------------------------------
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's full gradient under the model's own names, on every rank (zeros for a
        frozen parameter or one no op reads, as ``p.grad`` is None for those on one device)."""
        with at_step(self.steps - 1, "full_grads"):
            for reducer in self.reducers:   # ZeRO-1 left each mean on the rank that steps it
                reducer.share()
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
            src = self.mesh.rank(pp=src_stage)
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
