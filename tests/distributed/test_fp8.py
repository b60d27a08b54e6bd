"""An fp8 plan trains as one process whose linear layers torchao's float8 training converted alike, on 2 gloo
ranks (the fp8 GEMMs emulated on this CPU: the same casts to fp8, the products in fp32).

The hand-written GPT (every linear 32 x 96, 32 x 32, 32 x 128, 128 x 32 and the 32 x 64 head: multiples of
16, so all run in fp8) under data parallelism, a pipeline and ZeRO-3. With ``rowwise_with_gw_hp`` every
scale belongs to one token (activations, gradients) or one channel (weights), so which rows share a rank
or a micro-batch changes nothing: the tolerances are test_parallelize.py's (loss relative 1e-5,
gradients 1e-4 of the largest, parameters after two AdamW steps 1e-4; only the order of additions
differs). A tensor-wise scale is the amax of what a call sees: a pipeline whose one micro-batch is the
whole batch matches one process at the same tolerances, and data parallelism (each rank's half batch has
its own amax) is one process that runs each rank's rows as a call of its own, at the same tolerances; on
the whole batch at once, one process rounds to other scales (fp8 e4m3 keeps 3 mantissa bits), several
percent of the largest gradient apart. Tensor parallelism splits a linear's operands, whose scales would have to be
all-reduced across the group: the runtime refuses it, saying so.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, check_matches, reference, run_cases  # noqa: E402

BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
ROWS = dict(compute="fp8", recipe="rowwise_with_gw_hp")
TENSOR = dict(compute="fp8", recipe="tensorwise")
EXACT = [
    Case("fp8-rows-dp2", "gpt", {**BASE, "dp": 2}, 2, precision=ROWS),
    Case("fp8-rows-pp2", "gpt", {**BASE, "pp": 2}, 2, precision=ROWS),
    Case("fp8-rows-zero3", "gpt", {**BASE, "dp": 2, "zero": 3}, 2, precision=ROWS),
    Case("fp8-tensor-pp2-whole-batch", "gpt", {**BASE, "pp": 2, "micro_batch_size": 4}, 2, precision=TENSOR),
]
NEAR = [Case("fp8-tensor-dp2", "gpt", {**BASE, "dp": 2, "micro_batch_size": 2}, 2, precision=TENSOR)]
REFUSED = [Case("fp8-rows-tp2", "gpt", {**BASE, "tp": 2, "micro_batch_size": 2}, 2, precision=ROWS)]


@pytest.fixture(scope="module")
def results():
    return run_cases(EXACT + NEAR + REFUSED, 2)


@pytest.mark.parametrize("case", EXACT, ids=lambda c: c.name)
def test_matches_one_process_converted_alike(results, case):
    ref = reference(case)
    for rank, per_rank in enumerate(results):
        check_matches(per_rank[case.name], ref, rank)


def test_fp8_is_what_ran(results):
    """The converted reference is far from the unconverted one, beyond the tolerances above: they would catch a
    program that ran its linear layers in fp32."""
    case = EXACT[0]
    plain, fp8 = reference(Case(case.name, case.model, case.fixed, 2)), reference(case)
    largest = max(g.abs().max().item() for g in fp8["grads"].values() if g.numel())
    apart = max((plain["grads"][n] - g).abs().max().item() for n, g in fp8["grads"].items() if g.numel())
    assert apart > 1e-2 * largest, apart / largest
    got = results[0][case.name]["grads"]
    assert max((got[n] - g).abs().max().item() for n, g in fp8["grads"].items() if g.numel()) < 1e-3 * apart


def per_call_reference(case: Case, calls: int) -> dict:
    """One process converted alike, running each step's batch as ``calls`` calls of its consecutive rows (their
    mean loss, gradients accumulated): the rows each dynamic tensor-wise scale is taken over in a program of
    ``calls`` data-parallel ranks or micro-batches."""
    import torch
    from harness import batches, call_loss, fresh, loss_fn_of, one_process, to_fp8
    from autopar.runtime.batches import slice_batch
    model = fresh(case.model)
    to_fp8(model, case.precision["recipe"])
    loss_fn, rows = loss_fn_of(case.model), case.global_batch
    per = rows // calls

    def step_loss(batch):
        return torch.stack([call_loss(model, slice_batch(batch, i * per, (i + 1) * per, rows), loss_fn)
                            for i in range(calls)]).mean()
    return one_process(model, batches(case.model, case.steps, case.global_batch), step_loss)


@pytest.mark.parametrize("case", NEAR, ids=lambda c: c.name)
def test_tensorwise_scales_are_taken_over_each_ranks_rows(results, case):
    """Data parallelism with tensor-wise scales is one process running each rank's rows as its own call."""
    ref = per_call_reference(case, case.fixed["dp"])
    for rank, per_rank in enumerate(results):
        check_matches(per_rank[case.name], ref, rank)
    whole = reference(case)   # the whole batch in one call: other scales, another result
    largest = max(g.abs().max().item() for g in whole["grads"].values() if g.numel())
    assert max((ref["grads"][n] - g).abs().max().item() for n, g in whole["grads"].items()) > 1e-3 * largest


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_tensor_parallel_fp8_is_refused(results, case):
    for per_rank in results:
        error = per_rank[case.name].get("error", "")
        assert "ConfigError" in error and "tensor-parallel group" in error and "fixed={'tp': 1}" in error, error[:2000]
