"""A plan compiled into a folder that trains with torch alone: ``emit(..., standalone=True)``.

The folder holds

- ``program.py`` (generated): the plan's constants (mesh, schedule, micro-batches, which
  parameters each pipeline stage holds and their tensor-parallel split dims, the values that cross
  each cut with the shard a receiver allocates), a class per layer (layers.py / source.py: the
  ops on this rank's shards with their collectives), and a class per chunk whose ``forward`` is
  the dataflow between its layers, spelled out line by line, ending in the conversions of the
  values it sends to the spec they cross the cut in;
- ``train.py`` (standalone_train.py, copied): torchrun entry point: process groups (the runtime's Mesh:
  the mesh the plan was priced on and ``parallelize`` builds), the model from the user's factory, each
  rank's shards of its weights, FSDP2 for ZeRO-2/3, the pipeline schedule, gradient reductions, AdamW
  (under ZeRO-1 partitioned over the replicas, as ``parallelize``'s), the loss file, sharded checkpoints;
- ``autopar_runtime/``: autopar's runtime library (autopar/runtime, :data:`autopar.runtime.STANDALONE`,
  torch alone), the same files ``parallelize`` runs: the pipeline executor, the collectives and sharded
  ops the generated layers call, context parallelism's ops and ring attention, the checkpoint format
  of ``Program.save_checkpoint`` (dcp_state.py: this folder writes and reads it too), the per-op
  recomputation policy, the optimizer step compiled under ``--compile``, a meta-built model's values
  (sharded_init.py), failures with deadlines, the Mesh;
- ``buffers.pt``: the constants the graph reads that the forward makes (not the model's buffers).

Context parallelism runs as in-process: the same analysis (context.py), the same generated calls
(context_ops.py, ring_attention.py, in autopar_runtime/), one program for every rank of a
context-parallel group (its place in the group is program.py's ``CP_RANK``, which train.py sets).
A model factory that builds on the meta device works as in ``parallelize``: each rank gives values
to the parameters and buffers it holds, one module at a time, from ``(--seed, module name)``
(autopar_runtime/sharded_init.py), the values ``parallelize(..., init_seed=)`` gives.
An fp8 plan runs its linear layers through torchao's float8 training, as ``parallelize`` does (the runtime
library's fp8.py: the folder then needs torchao beside torch, on the ranks and where it is emitted).
What the folder cannot run yet is refused at emit time with what to change: expert parallelism,
MoE regions run as one call (ep > 1, or cp > 1 on an MoE model), a batch that is not a flat tuple or
dict of tensors.

The model is built once here, from ``model_factory``, on the meta device when the factory takes
``device`` (``meta_model``: shapes, no weights, whatever the model's size: bench/standalone_emit.py
measures GPT-3 175B's through the CLI's planned_model.py, target 2 GB), and exported on meta at one
micro-batch, as each rank of ``autopar.parallelize`` does: the same lowering, the same generated
layers (tests/distributed/test_standalone.py runs the folder where autopar cannot be imported). The
buffers the graph reads are given their values by each rank, from the model train.py builds
(``META_BUFFERS``); ``buffers.pt`` holds the constants the forward makes (constants.py gives those it
makes on the meta device their values, without weights).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pprint
import shutil
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..capture.export import loss_source, normalize_inputs, run_export
from ..capture.loss import check_loss
from ..config import SPLIT_BACKWARD
from ..errors import ConfigError
from ..plan import Plan
from ..plan.loss import EMIT
from .compile import ChunkProgram, CompiledProgram, compile_program
from .constants import fill_made_constants
from ..runtime.context_state import ContextRank
from ..runtime.fp8 import Float8Linear
from ..runtime.losses import loss_dtype
from .inputs import example_at
from .layers import class_name, layer_module
from .source import Written, program_source, write_support
from .split import empty_like_meta, meta_buffers

PROGRAM, TRAIN, BUFFERS = "program.py", "train.py", "buffers.pt"
TRAIN_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standalone_train.py")
"""train.py as it is copied (a script of the folder: it imports program.py and pipeline.py beside it)."""

_HELD = '''
from autopar_runtime import recompute


class Held(torch.nn.Module):
    """One layer: its generated code, the parameters only it reads (this rank's shards) and its buffers;
    ``forward(*values, *shared parameters)``. A module of its own so that FSDP2 gathers its
    parameters around it (ZeRO-3) and checkpoint can recompute it (recompute "full", or "op": keeping
    what recompute.py's per-op policy keeps)."""

    def __init__(self, code, own, buffers, mode):
        super().__init__()
        self.code, self.recompute = code, mode   # the layer's recompute mode
        self.names = []
        for fqn, param in own.items():
            self.names.append(fqn.replace(".", "__"))
            self.register_parameter(self.names[-1], param)
        for i, value in enumerate(buffers):
            self.register_buffer(f"buffer{i}", value, persistent=False)
        self.n_buffers = len(buffers)

    def forward(self, *values):
        return recompute.run_layer(self._run, values, self.recompute)

    def _run(self, *values):
        own = [self._parameters[n] for n in self.names]
        return self.code(*values, *own, *(self._buffers[f"buffer{i}"] for i in range(self.n_buffers)))
'''


def emit_standalone(plan: Plan, out_dir: str, model_factory: str, batch_factory: str | None, loss_fn: str | None,
                    lr: float) -> str:
    """Write the folder (see the module docstring); return the path of its train.py."""
    cfg = plan.config
    refusals = [why for bad, why in (
        (cfg.ep > 1, "expert parallelism"),
        (plan.precision.kernels == "fused", "hand-written fused kernels")) if bad]
    if refusals:
        raise ConfigError(f"a standalone program cannot run {refusals[0]} ({cfg.short()}) yet: emit the script "
                          "that runs autopar.parallelize (standalone=False), or re-plan without it")
    record = plan.extra.get("inputs")
    if record is None:
        raise ConfigError("the plan does not record its example inputs: re-plan with autopar.plan")
    model = meta_model(model_factory)
    loss = _load(loss_fn) if loss_fn else None
    # on meta inputs too (a model does not move its inputs, as Hugging Face's do not); the generated
    # code creates its tensors on the rank's DEVICE
    example = functools.partial(example_at, record, cfg.micro_batch_size)
    exported = run_export(model, example(torch.device("meta")), loss, train_mode=False)
    check_loss(plan.loss, loss_source(exported), to=EMIT)   # a plan without its record: a stand-in shows here
    fill_made_constants(exported, model, example, loss)   # constants the forward made from data: their values
    # the one lowering sequence (compile.py): every chunk, for every rank (CP_RANK set by train.py)
    compiled = compile_program(plan, exported, model)
    if cfg.cp > 1 and compiled.graph.moe:
        raise ConfigError(f"a standalone program cannot run MoE regions as one call, as context parallelism needs "
                          f"them ({cfg.short()}) yet: emit with standalone=False, or re-plan with cp=1")
    split = compiled.split
    context = ContextRank(compiled.context, None, Written("CP_RANK"), Written("TIMEOUT")) \
        if compiled.context is not None else None
    # an fp8 plan's linear layers call the module train.py builds for its rank (FP8_RECIPE; runtime/fp8.py):
    # one here marks the calls (it needs torchao, as the folder's train.py will)
    fp8 = Float8Linear(plan.precision.recipe, emulate=True) if plan.precision.compute == "fp8" else None
    os.makedirs(out_dir, exist_ok=True)
    write_support(out_dir)   # autopar_runtime/: the runtime library, as parallelize runs it
    shutil.copyfile(TRAIN_TEMPLATE, os.path.join(out_dir, TRAIN))
    # the model's buffers (on meta here): given values by each rank (META_BUFFERS); an empty constant any empty value
    unset = {k: fqn for k, (_, fqn) in meta_buffers(exported, type(model).__name__).items() if fqn is not None}
    torch.save({k: empty_like_meta(v) if v.is_meta else v.detach().cpu() for k, v in split.buffer_value.items()
                if k not in unset}, os.path.join(out_dir, BUFFERS))
    layers, chunk_classes = [], []
    for chunk in compiled.chunks:
        text, chunk_layers = _chunk(chunk, compiled, context, fp8)
        layers += chunk_layers
        chunk_classes.append(text)
    source = program_source(layers, f"{plan.model_name} under {cfg.short()}: every chunk's layers and dataflow.")
    loss_name = loss_fn or "the model's own"
    factories = (f"# the loss ({loss_name}) is part of the exported graph, in the last chunk\n"
                 f"MODEL_FACTORY, BATCH_FACTORY, LR = {model_factory!r}, {batch_factory!r}, {lr!r}\n")
    constants = _constants(compiled, record, unset)
    with open(os.path.join(out_dir, PROGRAM), "w") as fh:
        fh.write(source + "\n" + _HELD + "\n\n" + "\n\n".join(chunk_classes) + "\n" + constants + factories)
    return os.path.join(out_dir, TRAIN)


def _load(ref: str) -> Any:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def meta_model(model_factory: str) -> torch.nn.Module:
    """The factory's model on the meta device: its graph is all the folder is generated from (the
    structure check, the split and the lowering read shapes; a value the graph reads comes from the
    model train.py builds: META_BUFFERS). A factory taking ``device`` is given "meta": no weight is
    allocated, whatever the model's size. One without is called as it is (it may load a checkpoint, or
    move the model to a device: not possible on meta) and what it builds elsewhere is moved to meta.
    train.py calls it with no arguments on every rank: that is what trains."""
    fn = _load(model_factory)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):   # a builtin or C callable: no signature to read
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            raise ConfigError(f"model_factory {model_factory} {signature} must be callable with no arguments "
                              "(train.py calls it so on every rank): give its parameters defaults") from None
    if signature is None or "device" not in signature.parameters:
        built = fn()
    else:
        try:
            built = fn(device="meta")
        except Exception as exc:   # noqa: BLE001 - named, with what to change
            raise ConfigError(
                f"model_factory {model_factory} fails with device=\"meta\" ({type(exc).__name__}: {exc}): the "
                "standalone folder is generated from the model's shapes, never its weights; build it on that "
                "device without reading values (train.py calls the factory with no arguments: its default device)"
            ) from exc
    model = built[0] if isinstance(built, tuple) else built
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model_factory {model_factory} must return an nn.Module (or (model, example_inputs)), "
                          f"got {type(model).__name__}")
    moved: dict[int, torch.Tensor] = {}   # what it made elsewhere: on meta too, ties kept
    for module in model.modules():
        for slot in ("_parameters", "_buffers"):
            for name, t in list(getattr(module, slot).items()):
                if t is not None and not t.is_meta:
                    if id(t) not in moved:
                        meta = t.detach().to("meta")
                        moved[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if slot == "_parameters" else meta
                    getattr(module, slot)[name] = moved[id(t)]
    return model


def _chunk(chunk: ChunkProgram, compiled: CompiledProgram, context: ContextRank | None,
           fp8: nn.Module | None) -> tuple[str, list]:
    """The chunk's class (its layers wired together) and its layers' generated modules (an fp8 plan's linear
    layers called through ``fp8``)."""
    split = compiled.split
    generated, build, body = [], [], []
    for k, layer in enumerate(chunk.layers):
        name = class_name(layer.spec.name)
        generated.append((name, layer_module(layer.io(split.param_of), split.node_map, split.program.graph_module,
                                             compiled.lowered, None, name=name, context=context, fp8=fp8)))
        build.append(f"            Held({name}(tp_group, cp_group=cp_group, fp8=fp8), {{f: params[f] for f in {list(layer.own)!r}}}, "
                     f"[buffers[b] for b in {list(layer.spec.buffers)!r}], {layer.recompute!r}),   # {layer.spec.name}")
        outs = [*layer.spec.outputs, *layer.written]
        args = [*layer.spec.inputs, *(f"shared[{_attr(p)!r}]" for p in layer.shared)]
        target = ", ".join(outs) + ("," if len(outs) == 1 else "")
        body.append(f"        {target} = layers[{k}]({', '.join(args)})")
    for send in chunk.sends:   # each value as it crosses the cut
        for s in send.steps:
            args = "".join(f", {a}" for a in s.args)
            call = f"collectives.{s.function.__name__}({send.value}{args}, self.tp_group)"
            body.append(f"        {send.value} = {call}   # sent as {send.crossing}")
    spec = chunk.spec
    layer_names = ", ".join(layer.spec.name for layer in chunk.layers)
    text = (f"class Chunk{chunk.index}(torch.nn.Module):\n"
            f'    """Chunk {chunk.index} (layers {layer_names}): reads {list(spec.graph_inputs + spec.recv)}, '
            f'sends {list(spec.send)}."""\n\n'
            f"    def __init__(self, tp_group, params, buffers, cp_group=None, fp8=None):\n"
            f"        super().__init__()\n        self.tp_group = tp_group\n"
            + "".join(f"        self.register_parameter({_attr(p)!r}, params[{p!r}])\n" for p in chunk.shared)
            + "        self.layers = torch.nn.ModuleList([\n" + "\n".join(build) + "\n        ])\n\n"
            f"    def forward(self, {', '.join((*spec.graph_inputs, *spec.recv))}):\n"
            f"        layers, shared = self.layers, self._parameters\n" + "\n".join(body) + "\n"
            f"        return ({', '.join(spec.send)}{',' if len(spec.send) == 1 else ''})\n")
    return text, generated


def _attr(fqn: str) -> str:
    return fqn.replace(".", "__")


def _constants(compiled: CompiledProgram, record: dict, unset: dict[str, str]) -> str:
    plan, split, graph = compiled.plan, compiled.split, compiled.graph
    cfg = plan.config
    n = len(split.chunks)
    schedule = compiled.schedule
    values = {v: (x.producer, x.consumers, x.shape, str(x.dtype), x.requires_grad, x.scatter)
              for v, x in sorted(compiled.values.items())}
    context = compiled.context
    seeds = {name: (s.dim, s.seq, s.outer, s.inner) for name, s in context.inputs.items()} if context else {}
    stage_params = {p: sorted({f for c in split.chunks if cfg.chunk_device(c.index) == p for f in c.params})
                    for p in range(cfg.pp)}
    ties = {f: list(s) for f, s in compiled.holders.items() if len(s) > 1}
    inputs = _input_keys(record, split)
    units = {c.index: _units(c, graph) for c in compiled.chunks}
    dims = compiled.param_dims
    lowered = compiled.lowered
    placement = f"{cfg.schedule}'s V: rank d holds chunks d and 2 PP - 1 - d" if cfg.v_shaped else "c % PP"
    fmt = lambda x: pprint.pformat(x, width=110, sort_dicts=False)   # noqa: E731
    return ("\n# --- the plan ------------------------------------------------------------------------------\n"
            "# the mesh (mesh.py): ranks tp innermost, then cp, dp, pp outermost\n"
            f"DP, CP, TP, PP, DEVICES = {cfg.dp}, {cfg.cp}, {cfg.tp}, {cfg.pp}, {plan.devices}\n"
            f"# chunk c runs on pipeline rank CHUNK_DEVICES[c] ({placement})\n"
            f"CHUNK_DEVICES = {[cfg.chunk_device(c) for c in range(n)]!r}\n"
            "# OFFLOAD: what lives in host memory: \"all\" ZeRO-3's shards, gradients and optimizer states (FSDP2's\n"
            "# CPUOffloadPolicy), \"optimizer\" the optimizer's states and host copies of the weights it steps\n"
            "# (optim.MasterOptimizer: fp32 ones of 16-bit weights when MASTER_WEIGHTS), \"none\" nothing (16-bit\n"
            "# weights' fp32 masters then kept beside them when MASTER_WEIGHTS)\n"
            f"OFFLOAD, MASTER_WEIGHTS = {cfg.offload!r}, {plan.precision.master_weights}\n"
            "# fp8 linear layers: torchao's float8 training recipe (None: the plan's precision throughout; runtime/fp8.py)\n"
            f"FP8_RECIPE = {plan.precision.recipe if plan.precision.compute == 'fp8' else None!r}\n"
            "# the weights FSDP2 gathers in fp8, each shard cast with the whole weight's scale (Precision.gathers_fp8)\n"
            f"FP8_GATHERED = {sorted(compiled.fp8_gathered)!r}\n"
            f"ZERO, MICRO_BATCH_SIZE, MICRO_BATCHES, GLOBAL_BATCH = {cfg.zero}, {cfg.micro_batch_size}, "
            f"{plan.micro_batches}, {plan.global_batch_size}\n"
            f"CHUNKS, LOSS = {n}, {split.loss!r}\n"
            "# the step's losses all-reduced so that every rank holds them (not when every rank computes them all: tp\n"
            "# alone), in the gradients' last bucket when their all-reduce spans every rank (runtime/losses.py)\n"
            f"SHARES_LOSSES, LOSSES_RIDE = {cfg.shares_losses}, {cfg.losses_ride_gradients}\n"
            "# the dtype the losses are kept and shared in (torch.<name>: fp32, float64 for a float64 plan)\n"
            f"LOSS_DTYPE = {str(loss_dtype(plan.precision.storage)).removeprefix('torch.')!r}\n"
            f"# each stage's actions ({cfg.schedule}): F<chunk>.<micro-batch> forward, B<chunk>.<micro-batch>\n"
            "# backward, or in a zero-bubble schedule (SPLIT_BACKWARD) the backward split: I (input gradients), W\n"
            "# (the weights')\n"
            f"SPLIT_BACKWARD = {cfg.schedule in SPLIT_BACKWARD}\n"
            f"SCHEDULE = {fmt({d: ' '.join(str(a) for a in acts) for d, acts in enumerate(schedule)})}\n"
            f"# the batch: graph input -> key (a dict batch) or position (a tuple); example shapes per sample\n"
            f"INPUTS = {fmt(inputs)}\n"
            f"EXAMPLE = {fmt(record)}\n"
            f"# context parallelism: the graph inputs each rank takes its tokens of, (dim, sequence, outer, inner)\n"
            f"CONTEXT_INPUTS = {fmt(seeds)}\n"
            f"# parameters each pipeline stage holds, and the dim tensor parallelism splits (absent: whole)\n"
            f"STAGE_PARAMS = {fmt(stage_params)}\n"
            f"TP_DIMS = {fmt({f: d for f, d in sorted(dims.items()) if d is not None})}\n"
            f"# parameters held by several stages (a tied embedding and head): gradients summed over them\n"
            f"TIED = {fmt(ties)}\n"
            f"# replicated parameters whose gradient each tensor-parallel rank holds a part of: summed once per step\n"
            f"TP_PARTIAL = {fmt(sorted(lowered.partial_params) if lowered is not None else [])}\n"
            f"# what each chunk reads and sends, and the values crossing cuts (producer, readers, shard shape, dtype, "
            "grad, scattered over the tensor-parallel group)\n"
            f"CHUNK_IO = {fmt({c.index: (c.graph_inputs, c.recv, c.send) for c in split.chunks})}\n"
            f"# ZeRO-2/3: each chunk's FSDP2 units (positions in its layers, the units the cost model priced), each\n"
            f"# with whether ZeRO-3 keeps it gathered from forward to backward (the unit that ends the model)\n"
            f"UNITS = {fmt(units)}\n"
            f"VALUES = {fmt(values)}\n"
            f"# the buffers the graph reads (not in buffers.pt): each rank takes their values from its model\n"
            f"META_BUFFERS = {fmt(unset)}\n")


def _units(chunk: ChunkProgram, graph: Any) -> list[tuple[list[int], bool]]:
    """The chunk's ZeRO-2/3 units (``ModelStructure.shard_units``, as the runtime wraps them) as positions
    in its layers, each with whether ZeRO-3 keeps it gathered after forward; the root's layers are in none
    (the chunk's own unit holds them); a layer holds its own parameters (LayerProgram.own)."""
    position = {layer.spec.index: k for k, layer in enumerate(chunk.layers)}
    holds = {layer.spec.index: bool(layer.own) for layer in chunk.layers}
    units = graph.structure.shard_units(list(position), holds.__getitem__)
    return [([position[i] for i in unit], unit in units.kept) for unit in units.units if unit != units.root]


def _input_keys(record: dict, split: Any) -> list[tuple[str, Any]]:
    """(graph input placeholder, batch key or position) in the program's input order."""
    example = example_at(record, 1)
    args, kwargs = normalize_inputs(example)
    arg_spec, kw_spec = (split.in_spec.children() if hasattr(split.in_spec, "children")
                         else split.in_spec.children_specs)
    keys = list(kw_spec.context) if kw_spec.context else []
    paths = [path for path, _ in pytree.tree_flatten_with_path((tuple(args), {k: kwargs[k] for k in keys}))[0]]
    out = []
    for name, path in zip(split.user_inputs, paths):
        if len(path) != 2:
            raise ConfigError("a standalone program takes a batch that is a flat tuple or dict of tensors: "
                              "emit with standalone=False")
        key = path[1]
        out.append((name, getattr(key, "key", getattr(key, "idx", None))))
    return out
