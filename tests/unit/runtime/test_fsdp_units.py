"""ZeRO-2/3 units (runtime/data_parallel.py shard_unit) on a one-rank gloo group in this process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.runtime.data_parallel import shard_unit


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


class WithEmpty(nn.Module):
    """A layer holding a parameter with no elements, as MobileBERT's head does when its hidden size
    equals its embedding size (a 0 x 256 dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.cat([x, x @ self.empty.T], dim=-1)


def test_a_parameter_with_no_elements_stays_whole_and_the_rest_trains(mesh):
    torch.manual_seed(0)
    model, ref = WithEmpty(), WithEmpty()
    ref.load_state_dict(model.state_dict())
    # plain fully_shard fails at this backward: "_chunk_cat expects non-empty tensor" (torch 2.13)
    shard_unit(model, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert not isinstance(model.empty, torch.distributed.tensor.DTensor)
    assert model.empty.shape == (0, 4)
    torch.testing.assert_close(model.lin.weight.grad.full_tensor(), ref.lin.weight.grad)
