"""Pinned means pinned: published recipes plan exactly as pinned, and a pin that breaks a real rule
is refused naming the rule and the nearest valid values.

The recipes here are real model shapes (what a pin is valid for depends on the layer count):
NVIDIA's GPT-3 175B recipe (interleaved v=12, beyond the search's own cap of 8), and a sample of
the published runs of bench/sources.md (bench/published.py; bench/fidelity_published.py plans every
one of them, Llama 3 405B with tp 8 x cp 16 included; its 131k-token capture alone takes 30 s):
Megatron's 529.6B on 35 stages and torchtitan's FSDP2 Llama 3.1 8B on 128 H100.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from autopar import Cluster, InfeasiblePlanError
from autopar.capture import capture
from autopar.models import registry
from autopar.solver import solve

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench" / "published.py"


@pytest.fixture(scope="module")
def published():
    spec = importlib.util.spec_from_file_location("published", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["published"] = module          # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt3():
    model, inputs = registry.build("gpt3-175b", device="meta")
    return capture(model, inputs)


NVIDIA_GPT3 = dict(tp=4, pp=8, schedule="interleaved", virtual_stages=12, micro_batch_size=1)


def test_nvidia_gpt3_recipe_plans_as_pinned(gpt3):
    plan, _ = solve(gpt3, Cluster.from_spec("16x8xH100-SXM"), 256, fixed=NVIDIA_GPT3)
    for name, value in NVIDIA_GPT3.items():
        assert getattr(plan.config, name) == value, (name, plan.config)
    assert plan.config.dp == 4 and len(plan.stages) == 8
    assert all(len(stage.chunks) == 12 for stage in plan.stages)


def test_a_pin_that_breaks_a_rule_names_it_and_the_nearest_values(gpt3):
    """96 blocks over pp=8 x v chunks: at most 12 chunks per device (uneven chunks are allowed)."""
    fixed = dict(NVIDIA_GPT3, virtual_stages=13)
    with pytest.raises(InfeasiblePlanError) as info:
        solve(gpt3, Cluster.from_spec("16x8xH100-SXM"), 256, fixed=fixed)
    message = str(info.value)
    assert "virtual_stages=13 breaks the rule that pp x virtual_stages is at most the repeated blocks" in message \
        and "nearest valid: 12)" in message, message


@pytest.mark.parametrize("name", ["SC21 529.6B", "torchtitan 8B 128 GPUs eager"])
def test_published_runs_plan_with_what_they_publish_pinned(published, name):
    row = next(r for r in published.ROWS if r.name == name)
    plan = published.plan_row(row)
    for field, value in row.fixed.items():
        assert getattr(plan.config, field) == value, (field, plan.config)
    assert plan.fits and plan.config.devices == published.cluster_of(row).devices
