"""runtime/optim.py's probe of an optimizer factory: element-wise optimizers (every one of torch.optim's that
steps without a closure, foreach and fused kernels included) pass; Muon, Adafactor and a LAMB-style trust
ratio, whose update of a part differs from the whole's, do not; a factory the probe cannot run is reported,
not guessed. The refusal that reads it (driver/assembly.py) is tested on ranks in
tests/distributed/test_optimizers.py."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.optim import steps_elementwise


class TrustRatio(torch.optim.Optimizer):
    """LAMB's layer-wise adaptation without its moments: the step is scaled by the tensor's norms."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                update = p.grad / (p.grad.norm() + 1e-6)
                p.sub_(group["lr"] * p.norm() / (update.norm() + 1e-6) * update)


ELEMENTWISE = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps),
    "radam": lambda ps: torch.optim.RAdam(ps),
    "rprop": lambda ps: torch.optim.Rprop(ps),
    "adamax": lambda ps: torch.optim.Adamax(ps),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    # parameter groups sorted by ndim, as recipes exclude biases and norms from weight decay
    "groups-by-ndim": lambda ps: torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                                                    {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]),
}


def _adafactor(ps):
    from transformers.optimization import Adafactor
    return Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False)


NOT_ELEMENTWISE = {
    "muon-matrices": lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=1e-2),
    "muon-all": lambda ps: torch.optim.Muon(ps, lr=1e-2),   # refuses the vector: probed on the matrix alone
    "adafactor": _adafactor,
    "trust-ratio": lambda ps: TrustRatio(ps),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_an_elementwise_optimizer_passes(name) -> None:
    assert steps_elementwise(ELEMENTWISE[name]) == (True, "")


@pytest.mark.parametrize("name", sorted(NOT_ELEMENTWISE))
def test_an_optimizer_whose_parts_step_otherwise_is_caught(name) -> None:
    if name.startswith("muon") and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is torch >= 2.9")
    elementwise, how = steps_elementwise(NOT_ELEMENTWISE[name])
    assert elementwise is False
    assert "stepped in halves along dim" in how


def test_a_factory_the_probe_cannot_run_is_reported_not_guessed() -> None:
    elementwise, why = steps_elementwise(lambda ps: torch.optim.LBFGS(ps))   # its step wants a closure
    assert elementwise is None and "closure" in why
    mine = {}
    elementwise, why = steps_elementwise(lambda ps: torch.optim.AdamW([mine[id(p)] for p in ps]))
    assert elementwise is None and why.startswith("KeyError")


def test_the_probe_leaves_the_global_random_state_alone() -> None:
    torch.manual_seed(3)
    before = torch.get_rng_state()
    steps_elementwise(ELEMENTWISE["adamw"])
    assert torch.equal(before, torch.get_rng_state())
