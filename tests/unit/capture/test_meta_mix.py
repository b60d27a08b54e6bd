"""A model built on the meta device whose own init made a tensor elsewhere (XLNet's
``torch.FloatTensor(...)`` parameter, DiffLlama's lambdas) plans as if wholly on meta, and is left as
it was (test_bad_input.py: an export that runs the model still refuses mixed devices)."""

from __future__ import annotations

import torch
from torch import nn

from autopar.capture import capture


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(16))           # on the CPU, as a legacy constructor leaves it
        self.register_buffer("offset", torch.zeros(16))

    def forward(self, x):
        return self.b(self.a(x) * self.scale + self.offset)


def test_mostly_meta_model_is_captured_and_left_as_it_was() -> None:
    model = Mixed()
    graph = capture(model, (torch.randn(2, 8, device="meta"),))
    assert "scale" in graph.params and graph.params["scale"].shape == (16,)
    assert model.scale.device.type == "cpu" and model.offset.device.type == "cpu"
    assert model.a.weight.is_meta and isinstance(model.scale, nn.Parameter)

