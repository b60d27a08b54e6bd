"""Plans made the way a new user makes them run on the model they were made for, equal to one process.

Eight models a user brings (tests/distributed/new_users.py: Hugging Face Llama, Qwen2, GPT-2, BERT
and ViT with a classification head, T5, a small U-Net with batch norm and skip connections, and a
custom per-token regressor whose ``loss_fn`` reads ``targets`` and ``mask`` keys of the batch that its
forward does not take: they reach the loss micro-batched, split over the replicas and on the last
pipeline stage), each planned two ways:

- ``meta-b1``: on the meta device from batch-1 example inputs, as the README quickstart does;
- ``cpu-b8``: on the CPU from an example batch of 8, larger than every micro-batch below;

and run with real weights on 2 gloo ranks (the session's 2-rank world, worlds.py) at dp=2, tp=2, pp=2 1F1B
(micro-batch 2), dp=2 ZeRO-1 (two micro-batches per replica) and dp=2 ZeRO-3, global batch 8.
A second set puts models with dropout 0.1 in ``eval()`` first: the program runs in the mode the
model is in (as DDP does), so it computes the eval-mode loss. A third prices configurations with
``autopar.estimate`` (meta device, batch-1 inputs) instead of planning them, tensor parallelism
included: an estimate is a plan ``parallelize`` runs. ``make test`` runs a fixed sample of these cases
(CASES below says which), ``make bench`` every one.

The reference is one process accumulating gradients over the same micro-batches (the mean of
their losses): that is what the program computes by design, and the same as the whole batch's
loss except where an op mixes samples (the U-Net's batch norm in train mode normalises over what
one micro-batch holds, as with DDP). Tolerances are the harness's (tests/distributed/harness.py
``check_matches``), all fp32, for the reasons test_parallelize.py gives: loss relative 1e-5,
gradients 1e-4 of the largest, parameters after two AdamW steps 1e-4.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import new_users  # noqa: E402
import harness  # noqa: E402
from harness import STEPS, adamw, check_matches, round_trip  # noqa: E402
from suite import ALL_CASES  # noqa: E402

GLOBAL_BATCH = 8
BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
CONFIGS = {
    "dp2": dict(dp=2, micro_batch_size=4),
    "tp2": dict(tp=2, micro_batch_size=4),
    "pp2_1f1b": dict(pp=2, micro_batch_size=2),
    "dp2_zero1": dict(dp=2, zero=1, micro_batch_size=2),
    "dp2_zero3": dict(dp=2, zero=3, micro_batch_size=2),
}
# HF T5 under ZB-H1 (the schedule the planner picks for it at pp=2): its decoder's weights fall in several of
# the split backward's parameter groups whose paths share nodes (the relative position bias, computed once for
# both blocks), which W must not free group by group
ZERO_BUBBLE = {"pp2_zbh1": dict(pp=2, micro_batch_size=1, schedule="zbh1")}
SOURCES = {"meta-b1": ("meta", 1), "cpu-b8": ("cpu", 8)}


@dataclass(frozen=True)
class Case:
    model: str
    source: str          # key of SOURCES: where and from what batch the plan was made
    config: str          # key of CONFIGS
    dropout: float = 0.0
    eval: bool = False   # model.eval() before parallelize (and in the reference)
    estimate: bool = False   # autopar.estimate of the configuration instead of solve(fixed=...)

    @property
    def name(self) -> str:
        return f"{self.model}-{self.source}-{self.config}" + ("-eval" if self.eval else "") \
            + ("-estimate" if self.estimate else "")


# make bench (AUTOPAR_ALL_CASES=1) runs every model at every configuration from both sources, and the eval
# and estimate variants. The suite runs every configuration on the Hugging Face Llama, GPT-2 and BERT
# (test_parallelize.py leaves those to this file) but ZeRO-1, which shards only the optimizer's state
# whatever the architecture, on Llama alone; on the other models the configurations whose code
# depends on the architecture (tensor parallelism splits its ops, the pipeline cuts its layers, ZeRO-3
# shards its blocks). Plans from the batch-8 CPU source differ from the batch-1 meta ones where the
# example batch differs from the micro-batch: the suite runs that source at the two configurations of
# two micro-batches per replica on Llama and Qwen2 (the fingerprint and micro-batch regressions). An
# estimate's plan runs at tp=2 (make bench: ZeRO-3 too).
EVERY = ("llama", "gpt2", "bert")
SHAPED = ("tp2", "pp2_1f1b", "dp2_zero3")
CPU_B8 = ("pp2_1f1b", "dp2_zero1")


# The regressor's targets and mask at every parallelism that moves them (dp splits them, tp replicates
# them, pp needs them on the last stage), and at micro-batches smaller than the example batch.
TARGETS = {("meta-b1", "dp2"), ("meta-b1", "tp2"), ("meta-b1", "pp2_1f1b"), ("cpu-b8", "pp2_1f1b")}


def _in_suite(model: str, source: str, config: str) -> bool:
    if model == "tagger":
        return (source, config) in TARGETS
    if source == "cpu-b8":
        return model in ("llama", "qwen2") and config in CPU_B8
    return config in SHAPED or (model in EVERY and (config != "dp2_zero1" or model == "llama"))


CASES = [Case(m, s, c) for m in new_users.BUILDERS for s in SOURCES for c in CONFIGS if ALL_CASES or _in_suite(m, s, c)] \
    + [Case(m, "meta-b1", c, dropout=0.1, eval=True) for m in ("t5", "unet") for c in CONFIGS
       if ALL_CASES or c in ("dp2", "pp2_1f1b")] \
    + [Case("t5", "meta-b1", "pp2_zbh1", dropout=0.1, eval=True)] \
    + [Case(m, "meta-b1", c, estimate=True) for m in ("llama", "gpt2") for c in ("tp2", "dp2_zero3")
       if ALL_CASES or c == "tp2"]

_GRAPHS: dict = {}
_SHARDING: dict = {}


def make_plan(case: Case):
    """autopar's plan with every field pinned, from the case's source (each model captured once per source)."""
    from autopar import Precision
    from autopar.capture import capture
    from autopar.solver.sharding_solver import ShardingSolver
    from autopar.codegen.inputs import with_inputs
    from autopar.solver import solve
    device, batch = SOURCES[case.source]
    example = new_users.rows(new_users.batches(case.model, 1, GLOBAL_BATCH, device)[0], 0, batch)
    key = (case.model, case.source, case.dropout)
    if key not in _GRAPHS:
        model = new_users.build(case.model, device, case.dropout)
        _GRAPHS[key] = capture(model, example, new_users.LOSS_FNS.get(case.model))
    if case.estimate:
        import autopar
        model = new_users.build(case.model, device, case.dropout)
        return autopar.estimate(model, harness.test_cluster(2), example,
                                autopar.ParallelConfig(**{**BASE, **{**CONFIGS, **ZERO_BUBBLE}[case.config]}),
                                global_batch_size=GLOBAL_BATCH, loss_fn=new_users.LOSS_FNS.get(case.model))
    cluster = harness.test_cluster(2)
    if key not in _SHARDING:   # the cases of a graph share its sharding ILPs (the same plans, solved once)
        _SHARDING[key] = ShardingSolver(_GRAPHS[key], cluster, Precision.for_device(cluster.device.name))
    plan, _ = solve(_GRAPHS[key], cluster, GLOBAL_BATCH, fixed={**BASE, **{**CONFIGS, **ZERO_BUBBLE}[case.config]},
                    sharding=_SHARDING[key])
    return with_inputs(plan, example)


@functools.lru_cache(maxsize=None)
def reference(model_name: str, micro_batch_size: int, dropout: float = 0.0, eval_mode: bool = False) -> dict:
    """One process: loss and gradients of step 1, parameters after STEPS AdamW steps, each step the mean
    of the micro-batches' losses (the same for every case of this model, micro-batch size and mode)."""
    model = new_users.build(model_name, "cpu", dropout)
    if eval_mode:
        model.eval()
    data = new_users.batches(model_name, STEPS, GLOBAL_BATCH)

    def step_loss(batch) -> torch.Tensor:
        parts = [new_users.rows(batch, i, i + micro_batch_size) for i in range(0, GLOBAL_BATCH, micro_batch_size)]
        return sum(new_users.loss_of(model, model_name, p) for p in parts) / len(parts)

    return harness.one_process(model, data, step_loss)


def run_case(rank: int, world: int, case: Case, plan_dict: dict) -> dict:
    """One case on one rank of the session's 2-rank world (worlds.py)."""
    import autopar
    from autopar.runtime.data_parallel import local
    model = new_users.build(case.model, "cpu", case.dropout)
    if case.eval:
        model.eval()
    with harness.shared_exports((case.model, case.dropout)):
        program = autopar.parallelize(model, autopar.Plan.from_dict(plan_dict), adamw,
                                      loss_fn=new_users.LOSS_FNS.get(case.model), timeout=60)
    data = new_users.batches(case.model, STEPS, GLOBAL_BATCH)
    loss = program.forward_backward(data[0])
    grads = program.full_grads()
    program.optimizer.step()   # train_step(data[0]) is this forward_backward and this step
    for batch in data[1:]:
        program.train_step(batch)
    params = round_trip(program.full_state_dict(), new_users.build(case.model, "cpu", case.dropout))
    return {"loss": loss.item(), "grads": grads, "params": params,
            "local_numel": sum(local(p).numel() for p in program.parameters())}


@pytest.fixture(scope="module")
def plans():
    return {}


@pytest.fixture(scope="module")
def results(plans):
    """Per rank: case name -> result; each case planned here and handed to the session's 2-rank world
    at once (the ranks run it while this process plans the next)."""
    def plan(case):
        plans[case.name] = make_plan(case)
        return plans[case.name]
    return harness.run_cases(CASES, 2, function="test_new_users:run_case", plan=plan)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_runs_equal_to_one_process(plans, results, case):
    plan = plans[case.name]
    ref = reference(case.model, plan.config.micro_batch_size, case.dropout, case.eval)
    for rank, per_rank in enumerate(results):
        check_matches(per_rank[case.name], ref, rank)
    if plan.config.tp > 1 or plan.config.pp > 1 or plan.config.zero == 3:
        total = sum(p.numel() for p in ref["params"].values())
        assert results[0][case.name]["local_numel"] < total, "the rank holds every parameter whole: nothing was split"


def test_eval_mode_is_the_eval_loss(plans, results):
    """With dropout 0.1, the eval-mode loss is not the train-mode one (so the cases above could tell)."""
    case = Case("t5", "meta-b1", "dp2", dropout=0.1, eval=True)
    train = reference(case.model, plans[case.name].config.micro_batch_size, case.dropout, eval_mode=False)
    assert abs(results[0][case.name]["loss"] - train["loss"]) > 1e-3
