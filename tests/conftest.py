"""Shared fixtures: small models captured once per session.

Models are built on the meta device (nothing is allocated); the captured OpGraph is
immutable, so sharing it between tests is safe.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hugging Face builders must never download
# One intra-op thread per test process, and for every process it starts. The unit tests run in two
# xdist workers beside the distributed tests' gloo ranks on a 2-core machine: with torch's default
# (one OpenMP thread per core) each worker's threads spin-wait between parallel regions, and every
# gloo collective then waits for a rank the spinning threads keep off a core.
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from autopar.capture import OpGraph, capture  # noqa: E402
from autopar.models import GPTConfig, build_gpt  # noqa: E402

# Property tests draw the same examples on every run (derandomize, no example database): a suite
# whose result depends on the run is not a suite; explore more with make bench or by hand.
settings.register_profile("autopar", derandomize=True, database=None, print_blob=True)
settings.load_profile("autopar")

# The planner's reference model: 8 identical blocks, so pp in {1, 2, 4, 8} and
# interleaved pp * v in {2, 4, 8} divide the blocks.
PLAN_GPT = GPTConfig(vocab_size=256, hidden=128, heads=4, layers=8, seq_len=64, dropout=0.1)


@pytest.fixture(scope="session")
def plan_gpt():
    """(model on meta, example inputs of batch 1, captured graph) of PLAN_GPT."""
    model, inputs = build_gpt(PLAN_GPT, batch_size=1, device="meta")
    return model, inputs, capture(model, inputs)


@pytest.fixture(scope="session")
def plan_graph(plan_gpt) -> OpGraph:
    return plan_gpt[2]


@pytest.fixture(scope="module")
def one_rank_world():
    """A one-rank gloo process group in this process, for the runtime's pieces that need a group."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_mesh(one_rank_world):
    """The one-rank world's 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (1,))
