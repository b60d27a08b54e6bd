"""Context parallelism (cp) and expert parallelism (ep) compute what one process computes, on 2 and 4 gloo ranks.

The session's world of each size runs every case (tests/distributed/harness.py: the parent plans each
case with every ParallelConfig field pinned and computes the single-process reference; loss and
gradients of step 1, parameters after two AdamW steps). Models (harness.MODELS), all with
8-token sequences, a multiple of 2 cp = 4:

- ``gpt-sdpa``: the hand-written GPT with fused attention (learned positions, tied head);
- ``llama``: Hugging Face Llama (SDPA, rotary tables and mask built whole, GQA, labels shifted
  inside: the shift gathers the labels and the loss masks one position per row);
- ``xattn``: causal self-attention then cross attention to 4 memory tokens (queries local, keys
  gathered, the causal triangle's rows taken);
- ``mixtral``: Hugging Face Mixtral (grouped_mm experts, 4 experts, top-2);
- ``moe``: the hand-written Mixtral (static dispatch, ``capacity_factor=None``);
- ``moe-capacity``: the same with ``capacity_factor=1.0``: which assignments an expert drops
  depends on the tokens of one forward call, so one process on the whole batch computes another
  loss; its expert-parallel runs are compared with the same plan at ``ep=1`` instead (``PAIRS``).

Tolerances (fp32), those of test_parallelize.py and for the same reasons: loss relative error
<= 1e-5 and gradients within 1e-4 of the largest (only the order of additions differs: ring
attention's blockwise softmax, all-reduces, all-to-alls; observed <= 5e-7); parameters after
two AdamW steps (lr 1e-3, eps 1e-4) within 1e-4, 5% of what two steps can move one (AdamW normalises
each element's update, so a rounding-level gradient difference on an element whose gradient is
near zero moves it by a fraction of lr; observed <= 1e-5).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, check_matches, make_plan, reference, run_cases  # noqa: E402
from suite import ALL_CASES  # noqa: E402

BASE = dict(dp=1, tp=1, pp=1, cp=1, ep=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b",
            virtual_stages=1, sequence_parallel=False)
TWO = [
    ("gpt-cp2", "gpt-sdpa", dict(cp=2)),
    ("llama-cp2", "llama", dict(cp=2)),
    ("llama-cp2-zero3", "llama", dict(cp=2, zero=3, micro_batch_size=2)),  # FSDP over the cp ranks
    ("xattn-cp2", "xattn", dict(cp=2, micro_batch_size=2)),     # [batch * seq] merges, cross attention
    ("mixtral-cp2", "mixtral", dict(cp=2)),                      # experts on this rank's tokens
    ("mixtral-ep2", "mixtral", dict(dp=2, ep=2)),
    ("moe-ep2", "moe", dict(dp=2, ep=2)),
    ("mixtral-ep2-zero1", "mixtral", dict(dp=2, ep=2, zero=1)),
    ("moe-ep2-zero3", "moe", dict(dp=2, ep=2, zero=3)),
]
FOUR = [
    ("llama-cp2-dp2", "llama", dict(cp=2, dp=2)),
    ("gpt-cp2-pp2", "gpt-sdpa", dict(cp=2, pp=2)),
    ("llama-cp2-pp2", "llama", dict(cp=2, pp=2)),               # the second stage computes its rotary cos/sin
    ("mixtral-dp2-ep2-tp2", "mixtral", dict(dp=2, ep=2, tp=2)),
    ("moe-dp2-cp2-ep2", "moe", dict(dp=2, cp=2, ep=2)),
    ("moe-dp4-ep2-zero3", "moe", dict(dp=4, ep=2, zero=3)),     # expert weights FSDP-sharded over 2 replicas
    ("llama-cp2-tp2", "llama", dict(cp=2, tp=2)),               # tensor parallelism inside each cp rank
    ("llama-cp2-tp2-sp", "llama", dict(cp=2, tp=2, sequence_parallel=True)),   # and sequence parallelism
]
# Capacity-dropping experts: (expert-parallel case, the same plan without ep), each rank's drops the same.
PAIRS = [
    (Case("moe-capacity-ep2", "moe-capacity", {**BASE, "dp": 2, "ep": 2}, 2),
     Case("moe-capacity-ep1", "moe-capacity", {**BASE, "dp": 2}, 2)),
    (Case("moe-capacity-ep2-mb2", "moe-capacity", {**BASE, "dp": 2, "ep": 2, "micro_batch_size": 2}, 2),
     Case("moe-capacity-ep1-mb2", "moe-capacity", {**BASE, "dp": 2, "micro_batch_size": 2}, 2)),
]
# What the runtime refuses, and the words its ConfigError must say. The planner never makes these plans
# on its own (test_the_planner_refuses_them); a hand-edited plan file could.
REFUSED = [
    (Case("moe-capacity-cp2", "moe-capacity", {**BASE, "dp": 2}, 2, edit={"dp": 1, "cp": 2, "micro_batch_size": 2}),
     "capacity"),
]
# make bench (AUTOPAR_ALL_CASES=1) runs every case; the suite leaves out those another case contains
# (the same layout with ZeRO, sequence parallelism, experts or micro-batch 2 on top; cp x pp on the Llama,
# whose second stage also computes its rotary embedding again, over the GPT's)
CONTAINED = {"llama-cp2", "mixtral-ep2", "moe-ep2", "llama-cp2-tp2", "moe-capacity-ep2", "llama-cp2-dp2",
             "gpt-cp2-pp2"}
if not ALL_CASES:
    TWO = [t for t in TWO if t[0] not in CONTAINED]
    FOUR = [t for t in FOUR if t[0] not in CONTAINED]
    PAIRS = [p for p in PAIRS if p[0].name not in CONTAINED]
CASES = {2: [Case(n, m, {**BASE, **f}, 2) for n, m, f in TWO], 4: [Case(n, m, {**BASE, **f}, 4) for n, m, f in FOUR]}
for case in [c for pair in PAIRS for c in pair] + [c for c, _ in REFUSED]:
    CASES[case.world].append(case)
OTHERS = {c.name for pair in PAIRS for c in pair} | {c.name for c, _ in REFUSED}


@pytest.fixture(scope="module")
def results():
    return {world: run_cases(cases, world) for world, cases in CASES.items()}


@pytest.mark.parametrize("case", [c for cases in CASES.values() for c in cases if c.name not in OTHERS],
                         ids=lambda c: f"{c.world}x-{c.name}")
def test_matches_single_process(results, case):
    ref = reference(case)
    per_rank = [r[case.name] for r in results[case.world]]
    for rank, got in enumerate(per_rank):
        check_matches(got, ref, rank)
    if case.fixed["ep"] > 1 or case.fixed["zero"] >= 2:
        total = sum(p.numel() for p in ref["params"].values())
        assert per_rank[0]["local_numel"] < total, "the rank holds every parameter whole: nothing was split"


@pytest.mark.parametrize("case,same", PAIRS, ids=lambda c: c.name)
def test_capacity_drops_as_without_expert_parallelism(results, case, same):
    for rank, per_rank in enumerate(results[case.world]):
        assert "error" not in per_rank[same.name], per_rank[same.name].get("error")
        check_matches(per_rank[case.name], per_rank[same.name], rank)


@pytest.mark.parametrize("case,words", REFUSED, ids=lambda x: getattr(x, "name", ""))
def test_refused_with_a_config_error(results, case, words):
    for got in results[case.world]:
        error = got[case.name].get("error", "")
        assert "ConfigError" in error and words in error, error[:2000]


@pytest.mark.parametrize("case,words", REFUSED, ids=lambda x: getattr(x, "name", ""))
def test_the_planner_refuses_them(case, words):
    from autopar import AutoparError
    fixed = {**case.fixed, **case.edit}
    with pytest.raises(AutoparError):
        make_plan(Case(case.name, case.model, fixed, case.world))
