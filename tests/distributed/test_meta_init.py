"""Sharded initialisation: a model built on the meta device, parallelized, trains as one process
trains the same model materialised whole (autopar.init_weights, the same seed): each rank
materialises only the parameters it holds (runtime/sharded_init.py). Tolerances as in
test_parallelize.py; bench/init_memory.py measures the memory it saves."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, check_matches, reference, run_cases  # noqa: E402

BASE = dict(dp=1, tp=1, pp=1, cp=1, ep=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
CASES = {
    2: [Case("gpt-meta-dp2_zero3", "gpt-meta", {**BASE, "dp": 2, "zero": 3}, 2),
        Case("gpt-meta-tp2", "gpt-meta", {**BASE, "tp": 2, "micro_batch_size": 2}, 2),
        Case("gpt-meta-pp2", "gpt-meta", {**BASE, "pp": 2}, 2),
        Case("llama-meta-dp2_zero3", "llama-meta", {**BASE, "dp": 2, "zero": 3}, 2),
        Case("llama-meta-tp2", "llama-meta", {**BASE, "tp": 2, "micro_batch_size": 2}, 2),
        # expert parallelism: each rank materialises its experts, whole (ZeRO-1) or FSDP2-sharded (ZeRO-3)
        Case("moe-meta-ep2_zero1", "moe-meta", {**BASE, "dp": 2, "ep": 2, "zero": 1}, 2),
        Case("moe-meta-ep2_zero3", "moe-meta", {**BASE, "dp": 2, "ep": 2, "zero": 3}, 2)],
    4: [Case("gpt-meta-dp2_tp2_zero3", "gpt-meta", {**BASE, "dp": 2, "tp": 2, "zero": 3}, 4)],
}


@pytest.fixture(scope="module")
def results():
    return {world: run_cases(cases, world) for world, cases in CASES.items()}


@pytest.mark.parametrize("case", [c for cases in CASES.values() for c in cases], ids=lambda c: f"{c.world}x-{c.name}")
def test_meta_model_trains_as_one_process(results, case):
    ref = reference(case)
    for rank, got in enumerate(results[case.world]):
        check_matches(got[case.name], ref, rank)
