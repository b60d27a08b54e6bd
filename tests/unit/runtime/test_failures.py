"""runtime/failures.py without peers: a send, receive or collective that raises as it starts (gloo reports a
connection a dead peer closed at once) fails the step naming the collective and the peer, as one that fails
while it runs does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.errors import RuntimeFailure
from autopar.runtime.failures import Failed, peer_wait, start, wait_or_fail
from autopar.runtime.pipeline import ChunkIO, PipelineRunner, Topology, Value
from autopar.runtime.schedules import build


def _closed(*args, **kwargs):
    raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")


def test_a_collective_that_raises_as_it_starts_is_named_with_its_peers_when_waited_on():
    work = start(_closed, torch.zeros(1), async_op=True)
    assert isinstance(work, Failed)
    with pytest.raises(RuntimeFailure, match=r"all_reduce of x with rank 1 failed .*Connection closed by peer"):
        wait_or_fail(work, 1.0, "all_reduce of x", peers=[1])


def test_a_started_collective_is_its_own_work():
    sentinel = object()
    assert start(lambda *a, **k: sentinel, 1, async_op=True) is sentinel


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (2 * x,)


@pytest.mark.parametrize("broken", ["isend", "irecv"])
def test_a_pipeline_send_or_receive_to_a_dead_peer_names_it(monkeypatch, broken):
    """Stage 0 of two (the peer, rank 1, holds chunk 1): its forward sends ``h`` and its backward receives
    h's gradient; whichever of the two raises as it starts names rank 1 and what it moved."""
    monkeypatch.setattr(dist, broken, _closed)
    if broken == "irecv":   # the send goes through: only the receive breaks
        monkeypatch.setattr(dist, "isend", lambda *a, **k: type("Done", (), {"wait": lambda self, timeout=None: True})())
    io = {0: ChunkIO(("x",), (), ("h",)), 1: ChunkIO((), ("h",), ("loss",))}
    values = {"h": Value(0, (1,), (2,), torch.float32, True)}
    runner = PipelineRunner({0: _Double()}, io, values, "loss", Topology(2, [0, 1], 0), None, None, peer_wait(1.0),
                            torch.device("cpu"))
    actions = build("1f1b", 2, 1)[0]
    kind = "send of value h" if broken == "isend" else "receive of gradient of h"
    with pytest.raises(RuntimeFailure, match=rf"{kind} \(micro-batch 0\) with rank 1 failed.*Connection closed"):
        runner.run(actions, [{"x": torch.ones(2, requires_grad=True)}], 1.0)
