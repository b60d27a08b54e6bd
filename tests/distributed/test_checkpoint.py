"""Sharded checkpoints (driver/checkpoint.py: torch.distributed.checkpoint) on 2 and 4 gloo ranks.

Each scenario (checkpoint_cases.py, one job on the session's world of its ranks) trains a source plan one
step, saves, and trains two more; fresh programs built from shifted weights then load the
checkpoint:

- the same plan (resume): the loaded model is the saved one bit for bit, and the two steps after it
  give the uninterrupted run's losses and parameters (within 1e-6: the same plan runs the same
  operations, so in practice bitwise);
- other plans (tensor, pipeline, data parallelism, another ZeRO stage, without expert parallelism; a
  model built on the meta device, which parallelize initialises shard by shard before the load):
  the loaded model is the saved one bit for bit, and the next step's loss and parameters equal the
  source's continuing (loss relative 1e-5, parameters 1e-6, observed <= 1.2e-7: the plans add in
  other orders);
- one process (``autopar.load_checkpoint`` into a plain model and AdamW): the same checks; and the
  control: loaded without the optimizer state, the step moves parameters over 1e-4 away (AdamW's
  first step moves each element by about lr = 1e-3), so the checks above see the optimizer state.

ZeRO-1 saves each parameter's optimizer state from its owner only; the MoE scenarios save expert
weights split over the ep ranks (and, under ZeRO-3, FSDP2-sharded within each rank's experts); on 4
ranks, ZeRO-3 over tensor-parallel shards saves each weight on its (dp, tp) mesh.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, make_plan  # noqa: E402

BASE = dict(dp=1, tp=1, pp=1, cp=1, ep=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b",
            virtual_stages=1, sequence_parallel=False)
# name: (model, source plan, {target: plan}); plans as ParallelConfig fields over BASE (a target's
# "model": the model it is built from, when not the source's)
SCENARIOS = {
    "gpt-dp2-zero3": ("gpt", dict(dp=2, zero=3), {"tp2": dict(tp=2, micro_batch_size=2),
                                                   "pp2": dict(pp=2, micro_batch_size=2),
                                                   # built on meta: sharded initialisation, then the load
                                                   "dp2-zero3-meta": dict(dp=2, zero=3, model="gpt-meta")}),
    # expert weights sharded by ep and again by FSDP2 (2-D layout) -> whole on each rank / ep with ZeRO-1
    "moe-ep2-zero3": ("moe", dict(dp=2, ep=2, zero=3), {"dp2": dict(dp=2), "ep2-zero1": dict(dp=2, ep=2, zero=1)}),
    # ZeRO-1: each parameter's optimizer state saved by its owner; expert weights plain tensors
    "moe-ep2-zero1": ("moe", dict(dp=2, ep=2, zero=1), {}),
    # the optimizer steps tensor-parallel shards as plain tensors: saved (and resumed) as DTensors
    "gpt-tp2": ("gpt", dict(tp=2, micro_batch_size=2), {"dp2-zero3": dict(dp=2, zero=3)}),
    # the optimizer offloaded: its state is the host copies' (of FSDP2's shards, then of tensor-parallel shards),
    # refreshed from the loaded weights on resume
    "gpt-dp2-zero3-offload": ("gpt", dict(dp=2, zero=3, offload="optimizer"),
                              {"tp2-offload": dict(tp=2, micro_batch_size=2, offload="optimizer")}),
    # 4 ranks: FSDP2 shards each tensor-parallel shard again (a 2-D layout) -> tp x pp, and whole in one process
    "gpt-dp2-tp2-zero3": ("gpt", dict(dp=2, tp=2, zero=3, micro_batch_size=2),
                          {"tp2-pp2": dict(tp=2, pp=2, micro_batch_size=2)}),
}
WORLDS = {"gpt-dp2-tp2-zero3": 4}   # a scenario's ranks, when not 2
TARGETS = [(s, t) for s, (_, _, targets) in SCENARIOS.items() for t in [*targets, "one_process"]]


def _plan(model: str, fields: dict, world: int) -> dict:
    name = "-".join(f"{k}{v}" for k, v in fields.items())
    return make_plan(Case(f"{model}-{name}", model, {**BASE, **fields}, world)).to_dict()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Scenario -> each rank's results."""
    import worlds
    folder = str(tmp_path_factory.mktemp("checkpoints"))
    jobs = []
    for name, (model, source, targets) in SCENARIOS.items():   # one job per scenario: planned while the last runs
        size = WORLDS.get(name, 2)
        scenario = (name, model, _plan(model, source, size),
                    {t: (_plan(model, {k: v for k, v in f.items() if k != "model"}, size), f.get("model", model))
                     for t, f in targets.items()})
        w = worlds.world(size)
        jobs.append((name, w, w.submit("checkpoint_cases:run", [scenario], folder)))
    out: dict[str, list[dict]] = {}
    for name, w, k in jobs:
        ranks = w.result(k)
        for got in ranks:
            assert "error" not in got, got["error"]
        out[name] = [got[name] for got in ranks]
    return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_resume_equals_uninterrupted(results, scenario):
    for rank, r in enumerate(results[scenario]):
        assert r["resume_steps"] == 1, (rank, r["resume_steps"])
        assert r["resume_load_diff"] == 0.0, (rank, r["resume_load_diff"])
        for a, b in zip(r["resume_losses"], r["source_losses"]):
            assert abs(a - b) <= 1e-6, (rank, r["resume_losses"], r["source_losses"])
        assert r["resume_state_diff"] <= 1e-6, (rank, r["resume_state_diff"])


@pytest.mark.parametrize("scenario,target", TARGETS, ids=[f"{s}-to-{t}" for s, t in TARGETS])
def test_load_into_another_plan_continues(results, scenario, target):
    for rank, got in enumerate(results[scenario]):
        r, want = got[target], got["source_losses"][1]
        assert r["steps"] == 1, (rank, r["steps"])
        assert r["load_diff"] == 0.0, (rank, r["load_diff"])
        assert math.isclose(r["loss"], want, rel_tol=1e-5), (rank, r["loss"], want)
        assert r["params_diff"] <= 1e-6, (rank, r["params_diff"])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_checkpoint_without_optimizer_state_is_not_a_resume(results, scenario):
    for rank, got in enumerate(results[scenario]):
        r = got["one_process"]
        assert r["steps_fresh_optimizer"] == 1 and r["load_diff_fresh_optimizer"] == 0.0, (rank, r)
        assert r["params_diff_fresh_optimizer"] > 1e-4, (rank, r["params_diff_fresh_optimizer"])


def test_one_process_loader_refusals(tmp_path):
    """No ranks: a folder that is no checkpoint, a checkpoint of another model, a model on meta."""
    import torch
    import torch.distributed.checkpoint as dcp

    import autopar
    with pytest.raises(autopar.ConfigError, match="no checkpoint at"):
        autopar.load_checkpoint(tmp_path / "missing", torch.nn.Linear(2, 2))
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"other.weight": torch.zeros(2, 2)}, checkpoint_id=str(tmp_path / "other"), no_dist=True)
    with pytest.raises(autopar.ConfigError, match=r"lacks 2 of this model's entries \(first: bias, weight\)"):
        autopar.load_checkpoint(tmp_path / "other", torch.nn.Linear(2, 2))
    with pytest.raises(autopar.ConfigError, match="autopar.init_weights"):
        autopar.load_checkpoint(tmp_path / "other", torch.nn.Linear(2, 2, device="meta"))
