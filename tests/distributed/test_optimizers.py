"""What the optimizer step reads of the whole model, on ranks that hold parts and copies of it.

- An optimizer that is not element-wise (Adafactor, whose second moment of a matrix is factored) trains as one
  process where every rank steps whole parameters (plain data parallelism, ZeRO-1, pipeline stages), and is
  refused, saying what to change, where ranks would step parts of them (tensor parallelism, the experts of a
  stacked expert weight under expert parallelism, ZeRO-3): each part's update would differ from the whole's,
  with no error (runtime/optim.py's probe, driver/assembly.py's check; the probe itself:
  tests/unit/runtime/test_optim_elementwise.py).
- Gradient clipping by the model's total norm (``Program.clip_grad_norm_``, ``train_step(max_grad_norm=)``)
  gives one process's norm and clipped gradients under every way a rank holds its gradients: tensor-parallel
  splits and replicas, data-parallel replicas (the mean everywhere, or on ZeRO-1's owner only), FSDP2's
  shards, pipeline stages with a weight tied over them, expert-parallel experts. SGD steps them, so a wrong
  factor shows in the parameters too (AdamW's step all but ignores a gradient's scale).
- A learning-rate scheduler (torch's LambdaLR) built on ``program.optimizer`` sets the user's optimizer's rate
  under every plan, also where the program wraps it (ZeRO-1's partition, the offloaded optimizer)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, check_matches, reference, run_cases  # noqa: E402

BASE = dict(dp=1, tp=1, pp=1, cp=1, ep=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b",
            virtual_stages=1, sequence_parallel=False)
WHOLE = [Case("adafactor-dp2", "mlp", {**BASE, "dp": 2}, 2, optimizer="adafactor"),
         Case("adafactor-dp2_zero1", "mlp", {**BASE, "dp": 2, "zero": 1}, 2, optimizer="adafactor"),
         Case("adafactor-pp2", "mlp", {**BASE, "pp": 2}, 2, optimizer="adafactor")]
PARTS = {"adafactor-tp2": ("mlp", {**BASE, "tp": 2, "micro_batch_size": 2}, "tensor parallelism (tp=2) splits"),
         "adafactor-dp2_zero3": ("mlp", {**BASE, "dp": 2, "zero": 3},
                                 "ZeRO-3 shards every parameter over its 2 data-parallel"),
         "adafactor-ep2": ("moe", {**BASE, "dp": 2, "ep": 2, "zero": 1},
                           "expert parallelism (ep=2) splits the experts' stacked weights")}
REFUSED = [Case(name, model, fields, 2, optimizer="adafactor") for name, (model, fields, _) in PARTS.items()]
CLIP = 1e-2   # below every case's first norm: every step is clipped
CLIPPED = {2: [Case(f"clip-{model}-{name}", model, {**BASE, **fields}, 2, optimizer="sgd", clip=CLIP)
               for model, name, fields in [
                   ("gpt", "dp2", {"dp": 2}), ("gpt", "dp2_zero1", {"dp": 2, "zero": 1}),
                   ("gpt", "dp2_zero3", {"dp": 2, "zero": 3}), ("gpt", "tp2", {"tp": 2, "micro_batch_size": 2}),
                   ("gpt", "tp2_sp", {"tp": 2, "micro_batch_size": 2, "sequence_parallel": True}),
                   ("gpt", "pp2", {"pp": 2}), ("moe", "dp2_ep2_zero1", {"dp": 2, "ep": 2, "zero": 1})]],
           4: [Case(f"clip-gpt-{name}", "gpt", {**BASE, **fields}, 4, optimizer="sgd", clip=CLIP)
               for name, fields in [("dp2_tp2_zero1", {"dp": 2, "tp": 2, "zero": 1}),
                                    ("tp2_pp2", {"tp": 2, "pp": 2, "micro_batch_size": 2}),
                                    ("dp2_tp2_zero3", {"dp": 2, "tp": 2, "zero": 3})]]}


@pytest.fixture(scope="module")
def results():
    return run_cases(WHOLE + REFUSED, 2)


# a learning-rate schedule built on the program's optimizer: the user's own (dp2), or the ZeRO-1 partition and the
# offloaded optimizer around it, which must be torch optimizers sharing its groups for torch's schedulers
SCHEDULED = [Case(f"decay-gpt-{name}", "gpt", {**BASE, **fields}, 2, optimizer="sgd", decay=0.1)
             for name, fields in [("dp2", {"dp": 2}), ("dp2_zero1", {"dp": 2, "zero": 1}),
                                  ("dp2_zero1_offload", {"dp": 2, "zero": 1, "offload": "optimizer"}),
                                  ("dp2_zero3_offload", {"dp": 2, "zero": 3, "offload": "optimizer"})]]


@pytest.fixture(scope="module")
def stepped():
    return {world: run_cases(cases + (SCHEDULED if world == 2 else []), world) for world, cases in CLIPPED.items()}


@pytest.mark.parametrize("case", WHOLE, ids=lambda c: c.name)
def test_whole_parameters_step_as_one_process(results, case):
    ref = reference(case)
    for rank, got in enumerate(results):
        check_matches(got[case.name], ref, rank)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_parts_of_parameters_are_refused_saying_why(results, case):
    for rank, got in enumerate(results):
        error = got[case.name].get("error", "")
        assert "ConfigError: the optimizer does not step each element on its own" in error, (rank, error[:500])
        assert PARTS[case.name][2] in error and "fixed=dict(tp=1, ep=1, zero=1)" in error, (rank, error[:500])


@pytest.mark.parametrize("case", [c for cases in CLIPPED.values() for c in cases], ids=lambda c: f"{c.world}x-{c.name}")
def test_clipping_by_the_total_norm_equals_one_process(stepped, case):
    ref = reference(case)
    assert ref["norm"] > 2 * CLIP, ref["norm"]   # the clip acts
    for rank, got in enumerate(stepped[case.world]):
        check_matches(got[case.name], ref, rank)


@pytest.mark.parametrize("case", SCHEDULED, ids=lambda c: c.name)
def test_a_learning_rate_schedule_on_the_programs_optimizer(stepped, case):
    ref = reference(case)
    for rank, got in enumerate(stepped[2]):
        check_matches(got[case.name], ref, rank)
