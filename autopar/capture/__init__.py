"""Capture: model + example inputs -> OpGraph, via torch.export (non-strict)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..errors import CaptureError
from ..progress import module_calls
from .build import GraphWalk, batch_size_of, node_stacks
from .dtypes import check_dtypes
from .export import LossFn, check_model, loss_source, run_export
from .layers import build_layers
from .loss import LossSource
from .moe import count_routed_flops, eager_warning, find_regions
from .opgraph import (FLOAT_DTYPES, Gemm, GraphInput, Layer, MoERegion, OpGraph, OpKind, OpNode, SavedTensor,
                      TensorMeta)
from .replicated import replicated_values
from .structure import ModelStructure, first_difference, structure_of

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
    Raises :class:`autopar.CaptureError` naming the source line when export fails, and naming the
    example input when an op mixes dtypes a real kernel refuses (capture/dtypes.py). ``progress``: a
    bar of the repeated blocks traced (:func:`repeated_blocks`), on a terminal once it takes a second.
    """
    check_model(model, meta_mix=True)   # before the bar walks its modules
    with module_calls(repeated_blocks(model), "autopar: capturing", "layers", enabled=progress):
        program = run_export(model, example_inputs, loss_fn)
    casts = check_dtypes(program, type(model).__name__, example_inputs)   # raises where a real kernel would
    try:
        graph = graph_of(model, program)
        return dataclasses.replace(graph, warnings=graph.warnings + casts) if casts else graph
    except CaptureError:
        # the graph cannot be planned (an op whose shape depends on tensor values): exported again with
        # stack traces, which plain exports leave out (export.py), so that the error names the line
        graph_of(model, run_export(model, example_inputs, loss_fn, stack_traces=True))
        raise


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, as a progress bar counts them: the children of each ModuleList or
    Sequential of two or more modules of one class (transformer layers), outermost only (not the
    experts inside a layer)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) > 1 and len({type(c) for c in children}) == 1:
            blocks += children
            inside.update(id(m) for c in children for m in c.modules())
    return blocks


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
                   structure=structure_of(nodes_t, layers, walk.params), loss=loss, warnings=warnings, moe=moe,
                   replicated=replicated_values(program))
