"""A compiled program's optimizer step (runtime/optim.py): eager on its first call, compiled after,
the same updates as the optimizer's own step, and a bound method that learning-rate schedulers wrap."""

from __future__ import annotations

import torch

from autopar.runtime.optim import compile_step


class _Backend:
    """A torch.compile backend that runs the graph as traced and counts the graphs it was given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return gm.forward


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((8, 4), (4,), (3, 3))]


def _train(params, optimizer, steps: int, scheduler=None, start: int = 0) -> None:
    for k in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (k + 1)) + 0.01 * i
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def test_first_step_runs_eager_the_next_compiled_and_both_update_as_the_optimizer_does() -> None:
    torch._dynamo.reset()
    ref, mine = _params(), _params()
    backend = _Backend()
    opt = torch.optim.AdamW(mine, lr=1e-2, weight_decay=0.1)
    compile_step(opt, backend)
    _train(mine, opt, 1)
    assert backend.graphs == 0                 # the state is made by an eager first step
    _train(mine, opt, 3, start=1)
    assert backend.graphs >= 1                 # then the step runs compiled
    _train(ref, torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1), 4)
    for a, b in zip(ref, mine):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)   # the same ops, rounded alike but for the
        # bias corrections (tensors when traced, Python floats eager)


def test_a_learning_rate_schedule_wraps_the_compiled_step_and_costs_one_recompile() -> None:
    torch._dynamo.reset()
    ref, mine = _params(1), _params(1)
    backend = _Backend()
    opt = torch.optim.AdamW(mine, lr=1e-2)
    compile_step(opt, backend)
    decay = lambda step: 1.0 / (step + 1)   # noqa: E731
    _train(mine, opt, 6, torch.optim.lr_scheduler.LambdaLR(opt, decay))   # wraps optimizer.step.__func__
    assert 1 <= backend.graphs <= 2, backend.graphs   # the learning rate is not specialised on
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    _train(ref, ref_opt, 6, torch.optim.lr_scheduler.LambdaLR(ref_opt, decay))
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for a, b in zip(ref, mine):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)   # the same ops, rounded alike but for the
        # bias corrections (tensors when traced, Python floats eager)
