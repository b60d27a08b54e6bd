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


# --- the zero-bubble schedules' split backward (I, W), all chunks on one rank ---------------------------------

from autopar.runtime.pipeline import Value  # noqa: E402
from autopar.runtime.recompute import run_layer  # noqa: E402
from autopar.runtime.schedules import simulate  # noqa: E402

H = 6


class _Net(torch.nn.Module):
    """Four chunks' worth of parameters, with what splitting a backward must get right: a value skipping
    chunks (s, chunk 0 to 3), an output no received value reaches (e: chunk 1 computes it from the batch alone),
    a weight reaching both such an output and one its input reaches (w1), two weights added where autograd hands
    both one gradient tensor (a + b), a weight two chunks share (tied), a view sent across a cut (chunk 2's
    output), and optionally a recomputed layer (checkpointed, "full" or "op")."""

    def __init__(self, recompute: str = "none") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        p = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.5)  # noqa: E731
        self.w0, self.ws, self.w1, self.we, self.w2, self.tied = p(H, H), p(H, H), p(H, H), p(H, H), p(H, H), p(H, H)
        self.a, self.b = p(2, H), p(2, H)
        self.recompute = recompute

    def chunk(self, c: int, x, *got):
        if c == 0:
            return torch.tanh(x @ self.w0 @ self.tied), x @ self.ws
        if c == 1:
            (h,) = got
            return torch.tanh(h @ self.w1) + self.a + self.b, torch.sin(x @ self.w1 @ self.we)
        if c == 2:
            h, e = got
            out = run_layer(lambda u, v: (torch.tanh(u @ self.w2) * v,), (h, e), self.recompute)[0]
            return (out.reshape(2 * H).view(2, H),)
        h, s = got
        return (((h @ self.tied + s) ** 2).mean(),)

    def forward(self, x):
        h, s = self.chunk(0, x)
        h, e = self.chunk(1, x, h)
        (h,) = self.chunk(2, x, h, e)
        return self.chunk(3, x, h, s)[0]


class _Chunk(torch.nn.Module):
    def __init__(self, net: _Net, c: int, names: list[str]) -> None:
        super().__init__()
        self.net, self.c = [net], c
        for n in names:   # the chunk's parameters (the tied one in chunks 0 and 3)
            self.register_parameter(n, getattr(net, n))

    def forward(self, x, *got):
        return self.net[0].chunk(self.c, x, *got)


_IO = {0: ChunkIO(("x",), (), ("h0", "s")), 1: ChunkIO(("x",), ("h0",), ("h1", "e")),
       2: ChunkIO(("x",), ("h1", "e"), ("h2",)), 3: ChunkIO(("x",), ("h2", "s"), ("loss",))}
_VALUES = {v: Value(prod, readers, (2, H), torch.float32, True)
           for v, prod, readers in (("h0", 0, (1,)), ("s", 0, (3,)), ("h1", 1, (2,)), ("e", 1, (2,)), ("h2", 2, (3,)))}
_PARAMS = {0: ["w0", "ws", "tied"], 1: ["w1", "we", "a", "b"], 2: ["w2"], 3: ["tied"]}


def _serial(kind: str, pp: int, m: int) -> list:
    """Every device's actions of ``kind`` in one order that runs on one rank: by start time, unit durations."""
    v = 2 if kind in ("zbv", "interleaved") else 1
    times = simulate(build(kind, pp, m, v), v, lambda a: 1.0).times
    return sorted(times, key=lambda a: (times[a][0], a.stage, a.kind))


@pytest.mark.parametrize("kind,pp", [("1f1b", 4), ("zbh1", 4), ("zbv", 2)])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_split_backward_gives_the_gradients_of_one_backward(kind, pp, recompute):
    m = 3
    xs = [torch.randn(2, H, generator=torch.Generator().manual_seed(i)) for i in range(m)]
    ref = _Net(recompute)
    sum(ref(x) for x in xs).div(m).backward()
    net = _Net(recompute)
    chunks = {c: _Chunk(net, c, _PARAMS[c]) for c in range(4)}
    events = []
    runner = PipelineRunner(chunks, _IO, _VALUES, "loss", Topology(pp, [0] * pp, 0, [0] * 4), None,
                            lambda c, last: events.append(("before", c, last)), peer_wait(1.0), torch.device("cpu"),
                            after_backward=lambda c: events.append(("after", c)))
    actions = _serial(kind, pp, m)
    assert {a.kind for a in actions} == (set("FIW") if kind != "1f1b" else set("FB"))
    losses = runner.run(actions, [{"x": x} for x in xs], 1.0 / m)
    assert len(losses) == m and not runner.deferred and not runner.passes
    for name, p in ref.named_parameters():
        torch.testing.assert_close(getattr(net, name).grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
    # around every gradient-completing pass (B, or W), "last" on each chunk's final one; after it, the chunk's end
    completing = [a for a in actions if a.kind in "BW"]
    assert [e for e in events if e[0] == "before"] == [
        ("before", a.stage, all(b.stage != a.stage for b in completing[k + 1:])) for k, a in enumerate(completing)]
    assert sorted(e[1] for e in events if e[0] == "after") == [0, 1, 2, 3]


def test_split_backward_refuses_a_torch_without_it(monkeypatch):
    import torch.distributed.pipelining._backward as backward
    from autopar.errors import ConfigError
    from autopar.runtime.pipeline import split_backward
    monkeypatch.delattr(backward, "stage_backward_weight")
    with pytest.raises(ConfigError, match=r"torch >= 2\.6"):
        split_backward()
