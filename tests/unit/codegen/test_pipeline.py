"""The pipeline executor on one rank (no communication): the loss-sharing hook runs once a step,
right after the rank's last forward, with every loss, before the backward passes left."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.failures import peer_wait
from autopar.runtime.pipeline import ChunkIO, PipelineRunner, Topology
from autopar.runtime.schedules import build


class _Square(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return ((self.w * x).pow(2).mean(),)


@pytest.mark.parametrize("order,micro_batches", [("1f1b", 1), ("1f1b", 3), ("forwards first", 3)])
def test_losses_are_handed_over_after_the_last_forward_before_the_backward_left(order, micro_batches):
    actions = build("1f1b", 1, micro_batches)[0]   # F0 B0 F1 B1 ...
    if order == "forwards first":   # F0 F1 F2 B0 B1 B2, as GPipe runs them
        actions = sorted(actions, key=lambda a: a.kind != "F")
    events = []
    chunk = _Square()
    runner = PipelineRunner({0: chunk}, {0: ChunkIO(("x",), (), ("loss",))}, {}, "loss", Topology(1, [0], 0), None,
                            lambda c, last: events.append("B"), peer_wait(1.0), torch.device("cpu"),
                            after_forwards=lambda losses: events.append(("shared", [t.item() for t in losses])))
    micro = [{"x": torch.full((2,), float(i + 1))} for i in range(micro_batches)]
    losses = runner.run(actions, micro, 1.0 / micro_batches)
    expected = [(4.0 * (i + 1) ** 2) for i in range(micro_batches)]
    assert [t.item() for t in losses] == expected
    shared = [k for k, e in enumerate(events) if isinstance(e, tuple)]
    assert len(shared) == 1 and events[shared[0]] == ("shared", expected)
    # every backward after the last forward still runs after the hand-over
    last_f = max(k for k, a in enumerate(actions) if a.kind == "F")
    backwards_after = sum(1 for a in actions[last_f + 1:] if a.kind == "B")
    assert events[shared[0] + 1:] == ["B"] * backwards_after and backwards_after >= 1
    # d/dw of the mean over micro-batches of mean((w x)^2) = 2 w mean(x^2)
    assert chunk.w.grad.item() == pytest.approx(sum(2 * 2.0 * (i + 1) ** 2 for i in range(micro_batches))
                                                / micro_batches)
