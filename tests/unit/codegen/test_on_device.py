"""``on_device`` points a graph exported on one device at the rank's, inside higher-order ops too: a
model whose rotary table is computed in a ``torch.autocast(enabled=False)`` region (as Hugging Face
Llama's is in transformers 5.17) ran on a GPU with that region still creating tensors on the CPU."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.codegen.split import on_device


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            table = self.inv_freq[:, None].to(dtype=torch.float32, device=x.device) @ positions[None, :]
        return x + table.sum()


def _devices(program: torch.export.ExportedProgram) -> tuple[set, set]:
    devices, autocast = set(), set()
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
                    if isinstance(a, torch.device):
                        devices.add(a)
                if node.target is torch.ops.higher_order.wrap_with_autocast:
                    autocast.add(node.args[0])
    return devices, autocast


def test_on_device_reaches_autocast_bodies():
    program = torch.export.export(Rotary(), (torch.randn(2, 3),), strict=False)
    before, autocast = _devices(program)
    assert before == {torch.device("cpu")} and autocast == {"cpu"}
    inside = [m for name, m in program.graph_module.named_modules() if name and isinstance(m, torch.fx.GraphModule)]
    assert inside, "the export has no higher-order region: the test no longer tests what it says"
    target = torch.device("cuda", 0)   # only written into the graph, never allocated on
    on_device(program, target)
    after, autocast = _devices(program)
    assert after == {target} and autocast == {"cuda"}
    assert all("device(type='cpu')" not in m.code for m in inside)
