"""Custom autograd Functions: torch.export keeps their forward and drops their backward, so capture
checks that the backward is the forward's gradient and refuses one that is not (capture/functions.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.errors import CaptureError


class StraightThrough(torch.autograd.Function):
    """Rounds forward, passes the gradient through unchanged (autograd's gradient of round is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class HandWrittenTanh(torch.autograd.Function):
    """tanh with its exact derivative written by hand (a memory-saving kernel's pattern)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class Net(nn.Module):
    def __init__(self, function: type) -> None:
        super().__init__()
        self.function = function
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.function.apply(self.a(x)))


def test_exact_backward_is_captured() -> None:
    graph = capture(Net(HandWrittenTanh), (torch.randn(2, 8),))
    assert any("tanh" in n.target for n in graph.nodes)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_backward_that_is_not_the_gradient_is_refused(device: str) -> None:
    model = Net(StraightThrough).to(device)
    with pytest.raises(CaptureError, match=r"StraightThrough, a torch.autograd.Function whose backward is not "
                                           r"the gradient of its forward"):
        capture(model, (torch.randn(2, 8, device=device),))


def test_function_apply_is_restored_after_capture() -> None:
    before = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(CaptureError):
        capture(Net(StraightThrough), (torch.randn(2, 8),))
    assert torch.autograd.Function.__dict__["apply"] is before
