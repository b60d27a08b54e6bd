"""Capture: model + example inputs -> OpGraph, via torch.export (non-strict)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..collector import collector_paused
from ..errors import CaptureError
from .build import GraphWalk, batch_size_of, node_stacks
from .dtypes import check_dtypes
from .export import LossFn, check_model, loss_source, run_export
from .layers import build_layers
from ..plan.loss import LossSource
from .moe import count_routed_flops, eager_warning, find_regions
from .opgraph import (FLOAT_DTYPES, Gemm, GraphInput, Layer, MoERegion, OpGraph, OpKind, OpNode, SavedTensor,
                      TensorMeta)
from .repeat import export_program
from .replicated import replicated_values
from ..plan.structure import ModelStructure, first_difference
from .structure import op_ids, structure_of

__all__ = ["capture", "OpGraph", "OpNode", "Layer", "OpKind", "TensorMeta", "SavedTensor", "Gemm",
           "GraphInput", "MoERegion", "FLOAT_DTYPES", "ModelStructure", "first_difference", "LossSource"]


def param_aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied ones included) -> the name ``model.named_parameters()`` gives it."""
    canonical: dict[int, str] = {id(p): name for name, p in model.named_parameters()}
    return {name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def capture(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None = None, *,
            progress: bool = False) -> OpGraph:
    """Capture ``model`` called on ``example_inputs`` (then ``loss_fn``) as an OpGraph.

    The model may live on the meta device; nothing is computed on real data. The
    graph is the training forward pass (dropout on) down to the scalar loss.
    Mixture-of-experts layers become :class:`MoERegion` records (``OpGraph.moe``) whose ops
    count only the routed work (capture/moe.py).
    Repeated blocks (transformer layers) are traced a few times and copied to the model's depth,
    the same graph as tracing every one (capture/repeat.py); ``AUTOPAR_TRACE_EVERY_BLOCK=1`` in
    the environment traces every block (slower; for debugging: plans do not depend on it).
    Raises :class:`autopar.CaptureError` naming the source line when export fails, and naming the
    example input when an op mixes dtypes a real kernel refuses (capture/dtypes.py). ``progress``: a
    bar of the repeated blocks traced (repeat.py's ``repeated_blocks``), on a terminal once it takes a second.
    """
    check_model(model, meta_mix=True)   # before the bar walks its modules
    with collector_paused():   # (autopar/collector.py)
        program, _ = export_program(model, example_inputs, loss_fn, progress=progress)
        # raises where a real kernel would; the program with blocks copied holds every op, parameter and
        # placeholder of the whole one, so the error or notes are the same (test_repeat.py)
        casts = check_dtypes(program, type(model).__name__, example_inputs)
        try:
            graph = graph_of(model, program)
        except CaptureError:
            # the graph cannot be planned (an op whose shape depends on tensor values): exported again,
            # whole and with stack traces, which plain exports leave out (export.py), so that the error
            # names the line
            graph_of(model, run_export(model, example_inputs, loss_fn, stack_traces=True))
            raise
    return dataclasses.replace(graph, warnings=graph.warnings + casts) if casts else graph


def graph_of(model: nn.Module, program) -> OpGraph:
    """The OpGraph of an exported program of ``model`` (from capture's run_export)."""
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    walk = GraphWalk(program, requires_grad, param_aliases(model))
    nodes = list(walk.run())
    stacks = node_stacks(program)
    nodes_t, layers = build_layers(nodes, stacks, walk.params)
    moe = find_regions(nodes_t, walk.inputs, stacks, walk.params, program)
    nodes_t = count_routed_flops(nodes_t, moe, walk.params)
    warnings = tuple(f"FLOPs not counted for {f}" for f in walk.flop_cache.failures)
    warnings += tuple(w for w in (eager_warning(model),) if w)
    loss = loss_source(program)
    warnings += tuple(n for n in (loss.note,) if n)
    return OpGraph(model_name=type(model).__name__, nodes=nodes_t, layers=layers, params=dict(walk.params),
                   buffers=dict(walk.buffers), inputs=tuple(walk.inputs), batch_size=batch_size_of(walk.inputs),
                   structure=structure_of(nodes_t, layers, walk.params), loss=loss,
                   op_ids=op_ids(nodes_t, layers, walk.inputs), warnings=warnings, moe=moe,
                   replicated=replicated_values(program))
