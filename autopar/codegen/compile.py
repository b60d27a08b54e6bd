"""The compiler: a plan and one export of its model -> what each rank runs.

    compile_program(plan, exported, model) -> CompiledProgram     every chunk, every stage
    compile_rank(plan, exported, rank, model) -> RankProgram      one rank's share of it

This is the one place the lowering sequence runs, in this order:

1. ``check_structure``: the export is the plan's model (capture/structure.py's fingerprint);
2. ``split_graph``: the graph cut into the plan's chunks (split.py), each a run of layers;
3. ``plan_specs``: each op's tensor-parallel placements, found by its identity (specs.py);
4. ``lower`` (tp > 1): each read's redistribution as typed collectives, each op's local form (lower.py);
5. ``analyse`` (cp > 1): each value's context-parallel state and each op's conversion (context.py);
6. per chunk: its layers (the parameters each holds or shares with the chunk, the inputs it writes
   in place, its recompute mode), the values it receives (the shard a receiver allocates) and
   the values it sends (the collectives taking each from the placement it is held in to the one it
   crosses the cut in);
7. the pipeline schedule's actions, built and checked for deadlock (schedules.py).

Everything here is decided before the first step and is the same on every rank of a pipeline
stage (ranks differ in the shards they hold and in their coordinates only), so one
:class:`CompiledProgram` serves the standalone folder (every chunk, one program for every rank) and
:meth:`CompiledProgram.rank` gives a rank its chunks and actions (``autopar.parallelize``,
the profiler). Generating each layer's code from its :class:`LayerProgram` (layers.py) needs the
rank's process group, so the drivers do it with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Mapping

from torch import nn

from ..capture import graph_of, param_aliases
from ..capture.opgraph import MoERegion, OpGraph, OpKind
from ..config import PRECISION_DTYPES, SPLIT_BACKWARD, TORCH_DTYPE_NAMES, ParallelConfig
from ..ops import SKIPPED_TARGETS, base_name
from ..errors import ConfigError
from ..plan import Plan
from ..plan.placement import Placement, normal
from ..runtime.mesh import Coords, Mesh
from ..runtime import schedules
from .context import ContextPlan, analyse
from .layers import LayerIO, fp8_linear
from .lower import How, LoweredGraph, cut_spec, lower, written_inputs
from ..runtime.pipeline import Value, split_backward
from .regions import check_regions
from .redistribute import R, Step, convert
from .specs import OpSpec, plan_specs
from .split import ChunkSpec, LayerSpec, SplitGraph, check_structure, cut_values, plan_chunks, split_graph


@dataclass(frozen=True)
class LayerProgram:
    """One layer as a chunk runs it: the parameters it holds (``own``: no other layer of the chunk
    reads them) and those it is handed (``shared``: the chunk holds them), the inputs it writes in
    place (copied first, returned after its outputs), its recompute mode."""

    spec: LayerSpec
    own: tuple[str, ...]
    shared: tuple[str, ...]
    written: tuple[str, ...]
    recompute: str

    def io(self, param_of: Mapping[str, str]) -> LayerIO:
        """What the layer's generated code reads and gives (``param_of``: placeholder -> fqn): its
        parameters shared first, then its own."""
        placeholder = {fqn: ph for ph, fqn in param_of.items()}
        spec = self.spec
        return LayerIO(spec.nodes, spec.inputs, spec.outputs, tuple(placeholder[f] for f in (*self.shared, *self.own)),
                       spec.buffers, self.written, spec.attention_core if self.recompute == "selective" else frozenset())


@dataclass(frozen=True)
class Send:
    """A value a chunk sends across a cut: held in ``held`` there, crossing in ``crossing``, taken from
    one to the other by ``steps`` (collectives on the tensor-parallel group; none at tp = 1)."""

    value: str
    held: Placement
    crossing: Placement
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class ChunkProgram:
    """One pipeline chunk: run by pipeline stage ``stage`` (``ParallelConfig.chunk_device``: chunk ``c`` on stage
    ``c mod pp``, or ZB-V's V)."""

    index: int
    stage: int
    spec: ChunkSpec
    layers: tuple[LayerProgram, ...]
    shared: tuple[str, ...]            # parameters several of its layers read: held by the chunk
    receives: tuple[str, ...]          # values from earlier chunks, in the order they are sent
    sends: tuple[Send, ...]


@dataclass(frozen=True)
class CompiledProgram:
    """The plan lowered onto one export of its model, for every rank (module docstring)."""

    plan: Plan
    graph: OpGraph
    split: SplitGraph
    specs: Mapping[str, OpSpec]               # node -> its tensor-parallel placements (empty at tp = 1)
    param_dims: Mapping[str, int | None]      # parameter fqn -> the dim tensor parallelism splits
    lowered: LoweredGraph | None              # tp > 1
    context: ContextPlan | None               # cp > 1
    regions: tuple[MoERegion, ...]            # MoE regions run as one call (ep > 1 or cp > 1)
    chunks: tuple[ChunkProgram, ...]
    values: Mapping[str, Value]               # every value crossing a cut, as a receiver allocates it
    schedule: schedules.Schedule

    @property
    def mesh(self) -> Mesh:
        return Mesh.of(self.plan.config)

    @cached_property
    def expert_params(self) -> frozenset[str]:
        return frozenset(p for r in self.regions for p in (r.gate_up, r.down))

    @cached_property
    def fp8_gathered(self) -> frozenset[str]:
        """The parameters FSDP2 gathers in fp8 (Precision.gathers_fp8): the weights every use of which is an fp8
        linear layer's weight (a weight also read otherwise, a tied embedding's, is gathered as it is held)."""
        if not self.plan.precision.gathers_fp8(self.plan.config):
            return frozenset()
        fp8, other = set(), set()
        for name, fqn in self.split.param_of.items():
            node = self.split.node_map.get(name)
            if node is None:
                continue
            for user in node.users:
                ok = fp8_linear(user) and user.args[1] is node and node not in (*user.args[:1], *user.args[2:])
                (fp8 if ok else other).add(fqn)
        return frozenset(fp8 - other)

    @cached_property
    def moe_inputs(self) -> dict[str, tuple[str, str, str]]:
        """Region output node -> its (tokens, expert ids, weights) inputs."""
        return {r.output: (r.hidden_input, r.index_input, r.weight_input) for r in self.regions}

    @cached_property
    def asserts(self) -> frozenset[str]:
        """Metadata asserts (ops.SKIPPED_TARGETS): no rank runs them."""
        return frozenset(name for name, n in self.split.node_map.items() if str(n.target) in SKIPPED_TARGETS)

    @cached_property
    def region_skip(self) -> frozenset[str]:
        """Every node of a region run as one call but its output: not run."""
        return frozenset(name for r in self.regions for name in r.nodes if name != r.output)

    @cached_property
    def skipped(self) -> frozenset[str]:
        """Nodes no rank runs."""
        return self.asserts | self.region_skip

    def crossing(self, value: str) -> Placement:
        """The placement ``value`` crosses a cut in: the plan's output placement if split, else whole (the loss
        always whole)."""
        return R if value == self.split.loss else cut_spec(self.specs.get(value))

    @cached_property
    def holders(self) -> dict[str, tuple[int, ...]]:
        """Parameter fqn -> the pipeline stages holding it (two for a tied embedding and head)."""
        out: dict[str, set[int]] = {}
        for chunk in self.chunks:
            for fqn in chunk.spec.params:
                out.setdefault(fqn, set()).add(chunk.stage)
        return {fqn: tuple(sorted(s)) for fqn, s in out.items()}

    def rank(self, rank: int) -> "RankProgram":
        coords = self.mesh.coords(rank)
        return RankProgram(self, rank, coords, tuple(c for c in self.chunks if c.stage == coords.pp),
                           self.schedule[coords.pp])


@dataclass(frozen=True)
class RankProgram:
    """What one rank runs: its chunks (every layer's ops on its shards, each redistribution an explicit
    collective, the values it receives and sends) in the order of its schedule's actions."""

    program: CompiledProgram
    rank: int
    coords: Coords
    chunks: tuple[ChunkProgram, ...]
    actions: tuple[schedules.Action, ...]

    def __str__(self) -> str:
        return describe(self)


def compile_program(plan: Plan, exported: Any, model: nn.Module) -> CompiledProgram:
    """The plan lowered onto ``exported`` (capture's run_export of ``model`` at one micro-batch; ``model``
    gives its parameters' names and whether each trains): the module docstring's steps 1-7. Raises
    PlanMismatchError when the export is not the plan's model, ConfigError for what the runtime cannot run."""
    cfg = plan.config
    if plan.precision.grad_accumulation == "fused" and plan.micro_batches > 1:
        raise ConfigError(f"this plan prices its {plan.micro_batches} micro-batches' gradients accumulated inside the "
                          "weight-gradient GEMMs (Precision(grad_accumulation='fused'), Megatron-LM's fusion); the "
                          "programs autopar compiles add them by autograd, a pass the plan did not price: re-plan with "
                          "Precision(grad_accumulation='autograd') (the default with eager or compiled kernels)")
    if plan.precision.param_gather == "overlapped" and cfg.zero == 1 and cfg.grad_replicas > 1:
        raise ConfigError("this plan prices ZeRO-1's gather of the updated weights hidden under the next step's forward "
                          "(Precision(param_gather='overlapped'), Megatron-Core's --overlap-param-gather); the programs "
                          "autopar compiles broadcast them after the optimizer step, with nothing to hide them: re-plan "
                          "with Precision(param_gather='after_step') (the default)")
    if plan.precision.grad_reduce == "all_reduce" and cfg.zero == 1 and cfg.grad_replicas > 1:
        raise ConfigError("this plan prices ZeRO-1's gradients all-reduced, every rank receiving the whole sum "
                          "(Precision(grad_reduce='all_reduce'), DeepSpeed 0.4.4-0.12's stage 1); the programs autopar "
                          "compiles reduce-scatter them, half the bytes: re-plan with "
                          "Precision(grad_reduce='reduce_scatter') (the default)")
    check_weights_dtype(plan, model)
    graph = graph_of(model, exported)
    check_structure(plan, graph)
    split = split_graph(exported, graph, plan_chunks(plan), param_aliases(model))
    specs, dims = plan_specs(plan, graph)
    regions = tuple(graph.moe) if (cfg.ep > 1 or cfg.cp > 1) else ()
    # what is decided so far; the lowering, the context analysis, the chunks and the cut values complete it below
    compiled = CompiledProgram(plan, graph, split, specs, dims, None, None, regions, (), {},
                               schedules.build(cfg.schedule, cfg.pp, plan.micro_batches, cfg.virtual_stages))
    moe = compiled.moe_inputs
    lowered = lower(split.node_map, graph, split.chunks, specs, split.param_of, dims, cfg.tp, moe) \
        if cfg.tp > 1 else None
    if regions:
        layer_of = {name: layer.index for chunk in split.chunks for layer in chunk.layers for name in layer.nodes}
        check_regions(regions, split.node_map, layer_of, split.param_of, cfg.ep, cfg.cp, compiled.asserts)
    context = None
    if cfg.cp > 1:
        attention = frozenset(n.name for n in graph.nodes if n.kind is OpKind.ATTENTION)
        context = analyse(split.program, cfg.cp, attention, moe, compiled.region_skip)
    schedules.check(compiled.schedule, plan.micro_batches, cfg.virtual_stages, cfg.schedule)
    chunks = tuple(_chunk(spec, compiled, lowered) for spec in split.chunks)
    if cfg.schedule in SPLIT_BACKWARD:
        split_backward()   # a torch without torch.distributed.pipelining's split backward is refused here
    tokens = context.local_shape if context is not None else None
    values = cut_values(split, graph, compiled.crossing, cfg.tp, tokens)
    return replace(compiled, lowered=lowered, context=context, chunks=chunks, values=values)


def check_weights_dtype(plan: Plan, model: nn.Module) -> None:
    """The model's trainable floating-point weights in the dtype the plan prices its weights, activations and
    compute in (``Precision.storage``: ``compute``, or ``fp8_storage`` around an fp8 plan's GEMMs): a program
    runs the model in its own dtype, so an fp32 model under a bf16 plan would train with twice the activations
    and at fp32's speed, and not fit where the plan says it does, or the other way round. And the plan's
    gradients in that dtype (``Precision.grads``): a program accumulates and reduces them so."""
    prec = plan.precision
    if prec.grads != prec.storage and prec.storage in TORCH_DTYPE_NAMES:
        # autograd accumulates a gradient in its parameter's dtype, and the program reduces it so
        raise ConfigError(f"this plan prices gradients accumulated and reduced in {prec.grads} (Precision(grads="
                          f"{prec.grads!r})), but a program keeps them in its weights' dtype, {prec.storage}: re-plan "
                          f"with Precision(..., grads={prec.storage!r}) (Megatron-LM's fp32 main gradients: export the "
                          f"plan to Megatron-LM)")
    want = TORCH_DTYPE_NAMES.get(prec.storage)
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                    if p.requires_grad and p.is_floating_point()})
    if want is None or not found or found == [want]:
        return
    other = PRECISION_DTYPES.get(found[0])
    if prec.compute == "fp8":
        priced = f"Precision(compute='fp8', fp8_storage={prec.fp8_storage!r})"
        replan = (f" or re-plan with Precision(compute='fp8', fp8_storage={other!r})" if len(found) == 1 and other
                  else "")
    else:
        priced = f"Precision(compute={prec.compute!r})"
        replan = (f" or re-plan with Precision(compute={other!r}, grads={other!r})" if len(found) == 1 and other
                  else "")
    raise ConfigError(f"this plan is priced with {want} weights and activations ({priced}), but the model's "
                      f"trainable parameters are {', '.join(found)}: pass the model in {want} "
                      f"(model.to(torch.{want})){replan}")


def compile_rank(plan: Plan, exported: Any, rank: int, model: nn.Module) -> RankProgram:
    """Rank ``rank``'s share of :func:`compile_program`: the chunks of its pipeline stage and its actions."""
    return compile_program(plan, exported, model).rank(rank)


def _chunk(spec: ChunkSpec, compiled: CompiledProgram, lowered: LoweredGraph | None) -> ChunkProgram:
    cfg = compiled.plan.config
    experts = compiled.expert_params   # held by the region's experts module, neither a layer nor the chunk
    use: dict[str, int] = {}
    for layer in spec.layers:
        for p in layer.params:
            use[p] = use.get(p, 0) + 1
    stage = cfg.chunk_device(spec.index)
    modes = cfg.chunk_modes(stage, [compiled.graph.recomputable[s.index] for s in spec.layers])
    layers = tuple(LayerProgram(layer, tuple(p for p in layer.params if use[p] == 1 and p not in experts),
                                tuple(p for p in layer.params if use[p] > 1 and p not in experts),
                                written_inputs(layer, compiled.split.node_map), mode)
                   for layer, mode in zip(spec.layers, modes, strict=True))
    sends = []
    for v in spec.send:
        crossing = compiled.crossing(v)
        held, steps = R, ()
        if lowered is not None:
            held = lowered.held[spec.index].get(v, R)
            meta = compiled.split.meta(v)
            if hasattr(meta, "dim"):
                steps = convert(normal(held, meta.dim()), normal(crossing, meta.dim()), False)
        sends.append(Send(v, held, crossing, steps))
    shared = tuple(p for p in spec.params if use[p] > 1 and p not in experts)
    return ChunkProgram(spec.index, stage, spec, layers, shared, spec.recv, tuple(sends))


def describe(program: RankProgram) -> str:
    """A rank's program as text: per chunk what it receives, each layer's ops with the collectives each runs,
    what it sends, then the schedule's actions (as torch.distributed.pipelining prints its action lists)."""
    compiled, cfg = program.program, program.program.plan.config
    at = program.coords
    lines = [f"rank {program.rank} of {compiled.plan.devices}: pp={at.pp} dp={at.dp} cp={at.cp} tp={at.tp} "
             f"({compiled.plan.model_name} under {cfg.short()}, micro-batches of {cfg.micro_batch_size})"]
    for chunk in program.chunks:
        names = [layer.spec.name for layer in chunk.layers]
        lines.append(f"chunk {chunk.index} (stage {chunk.stage}): layers {names[0]} .. {names[-1]} ({len(names)})")
        for v in chunk.receives:
            x = compiled.values[v]
            lines.append(f"  recv {v} from chunk {x.producer}: {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                         f" as {compiled.crossing(v)}" + (", 1/t from each rank, all-gathered" if x.scatter else ""))
        for v in chunk.spec.graph_inputs:
            lines.append(f"  input {v}")
        for layer in chunk.layers:
            lines += _layer_lines(layer, compiled)
        for send in chunk.sends:
            steps = " ; ".join(map(str, send.steps)) or "as held"
            to = compiled.split.consumers.get(send.value, ())
            where = f"to chunks {list(to)}" if to else "the loss"
            value = compiled.values.get(send.value)
            scatter = ", this rank's 1/t of it" if value is not None and value.scatter else ""
            lines.append(f"  send {send.value} {where}: held {send.held} -> {send.crossing} ({steps}){scatter}")
    lines.append("actions: " + " ".join(map(str, program.actions)))
    return "\n".join(lines)


def _layer_lines(layer: LayerProgram, compiled: CompiledProgram) -> list[str]:
    """One layer: its op count, then each op that runs a collective or a form other than the op on local
    shards (the rest run as the model wrote them, on this rank's shards)."""
    lowered, skipped = compiled.lowered, compiled.skipped
    spec = layer.spec
    run = [n for n in spec.nodes if n not in skipped]
    params = f"; holds {len(layer.own)} parameters" if layer.own else ""
    out = [f"  layer {spec.name}: {len(run)} ops, recompute {layer.recompute}{params}"]
    if lowered is None:
        return out
    for name in run:
        op = lowered.ops.get(name)
        if op is None:
            continue
        reads = [f"{arg} via {' ; '.join(map(str, steps))}" for arg, steps in op.reads.items()
                 if any(s.communicates or type(s).__name__ in ("Copy", "Split") for s in steps)]
        if op.how is How.LOCAL and not reads and not op.after:
            continue
        target = base_name(compiled.split.node_map[name].target)
        text = f"    {name} = {target} [{op.how.value}] -> {op.output}"
        if reads:
            text += ": reads " + ", ".join(reads)
        if op.after:
            text += "; then " + " ; ".join(map(str, op.after))
        out.append(text)
    return out
