"""A layer whose ops write one of its inputs in place (``x += y``) gets that input copied inside the
layer (chunk.written_inputs): FSDP2 hands a layer its inputs as views made by a custom autograd
Function, which autograd refuses to write in place (23 Hugging Face architectures at ZeRO-3)."""

from __future__ import annotations

import torch

from autopar.codegen.lower import written_inputs
from autopar.codegen.split import LayerSpec


class Body(torch.nn.Module):
    def forward(self, x, y, z):
        x.add_(y)                 # written directly
        z.view(-1)[:2].mul_(2.0)  # written through a view
        return (x * y).sum() + z.sum()


def _spec() -> tuple[LayerSpec, dict[str, torch.fx.Node]]:
    program = torch.export.export(Body(), (torch.randn(4), torch.randn(4), torch.randn(2, 2)), strict=False)
    nodes = {n.name: n for n in program.graph.nodes}
    inputs = tuple(n.name for n in program.graph.nodes if n.op == "placeholder")
    ops = tuple(n.name for n in program.graph.nodes if n.op == "call_function")
    return LayerSpec(index=0, name="body", nodes=ops, inputs=inputs, outputs=(), params=(), buffers=(),
                     attention_core=frozenset()), nodes


def test_inputs_written_directly_or_through_a_view_are_found() -> None:
    spec, nodes = _spec()
    x, y, z = spec.inputs
    assert written_inputs(spec, nodes) == (x, z)


def test_a_layer_reading_only_writes_nothing() -> None:
    spec, nodes = _spec()
    reads = tuple(n for n in spec.nodes if not str(nodes[n].target).split(".")[1].endswith("_"))
    assert written_inputs(LayerSpec(0, "body", reads, spec.inputs, (), (), (), frozenset()), nodes) == ()
