"""Values every pipeline chunk can compute for itself: what reads the batch and buffers alone.

A decoder computes some values once, before its first layer, and hands them to every layer: the
rotary embedding's cos and sin (from a buffer and positions), position ids, masks built from the
inputs. None reads a parameter, so none has a gradient, and a later pipeline stage can compute
them from the batch it already has, as Megatron-LM and torchtitan stages do: sending them instead
costs a point-to-point transfer per value and micro-batch (on a tiny Llama, 3 sends a cut where the
hidden state alone needs 1).

A node is *replicated* when it is a call_function node whose every input is a user input, a buffer
or constant, a higher-order op's body, or another replicated node, whose op is deterministic
(no ``nondeterministic_seeded`` tag: a dropout mask drawn again would differ) and writes nothing
in place (a write would act twice), and whose value no op writes in place, directly or through a
view (the exported graph keeps ``x.mul_(y)``: the value a later chunk reads is the written one,
which computing it again would miss). The set is the closure of that rule in graph order. The cost
model sends none of them across a cut (cost_model/layer_cost.py ``crossing_numels``) and the split
makes each reading chunk compute them (codegen/split.py), so what is priced is what runs. Their
compute on a reading chunk is not priced: elementwise work on inputs and buffers, small beside a
layer's.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

_LEAVES = (InputKind.USER_INPUT, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def replicated_values(program: ExportedProgram) -> frozenset[str]:
    """The names of ``program``'s call_function nodes computed from the batch and buffers alone
    (module docstring), in no particular order."""
    leaves = {s.arg.name for s in program.graph_signature.input_specs
              if s.kind in _LEAVES and hasattr(s.arg, "name")}
    bodies = {n.name for n in program.graph.nodes if n.op == "get_attr"}
    written = _written(program.graph)
    out: set[str] = set()
    for node in program.graph.nodes:
        if node.op != "call_function" or node.name in written or not _deterministic(node, program.graph_module):
            continue
        if all(a.name in leaves or a.name in bodies or a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return frozenset(out)


def _deterministic(node: fx.Node, root: torch.nn.Module) -> bool:
    """Whether running ``node`` again gives the same value and changes nothing else: no random op,
    no in-place write (a higher-order op's body checked op by op)."""
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                body = getattr(root, str(a.target), None)
                if not isinstance(body, fx.GraphModule) or not all(
                        _deterministic(n, body) for n in body.graph.nodes if n.op == "call_function"):
                    return False
        return True
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
            return False
        return True
    return target.__module__ == "_operator"   # getitem and arithmetic on sizes


def _written(graph: fx.Graph) -> set[str]:
    """The nodes whose value some op writes in place (``Tensor(a!)`` in its schema), directly or through
    a view of it (a return marked ``Tensor(a)``: the view's writes reach the tensor it views)."""
    base: dict[str, str] = {}
    written: set[str] = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            base[node.name] = node.args[0].name       # a piece of a list of views (split) is a view too
            continue
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if not isinstance(value, fx.Node) or arg.alias_info is None:
                continue
            if arg.alias_info.is_write:
                written.add(value.name)
            elif any(r.alias_info is not None for r in schema.returns):
                base[node.name] = value.name          # a view of ``value``
    for name in list(written):
        while name in base:
            name = base[name]
            written.add(name)
    return written
