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
percent of the largest gradient apart.

Tensor parallelism splits a linear's operands; where a scale spans the split dim the runtime all-reduces its
amax over the group, as torchao does, so each rank casts with one process's scale. With ``rowwise_with_gw_hp``
(power-of-2 scales, the weight gradient in high precision) tp=2 matches one process at the tolerances above.
Tensor-wise scales are not rounded to powers of 2: a sum split across ranks (a row-parallel output, a
column-parallel input gradient) can end one ulp away from one process's, which moves a scale by one ulp
and, now and then, rounds a gradient element to the next e5m2 value (2 mantissa bits, 12-25% apart); such
flips compound down the backward. There the test checks what the runtime decides, every cast's scale:
the forward's and the backward's through the head and the last block equal one process's, before any
flip can reach them.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, check_matches, reference, run_cases  # noqa: E402

BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
ROWS = dict(compute="fp8", recipe="rowwise_with_gw_hp", fp8_storage="fp32")   # the fp32 test model
TENSOR = dict(compute="fp8", recipe="tensorwise", fp8_storage="fp32")
EXACT = [
    Case("fp8-rows-dp2", "gpt", {**BASE, "dp": 2}, 2, precision=ROWS),
    Case("fp8-rows-pp2", "gpt", {**BASE, "pp": 2}, 2, precision=ROWS),
    Case("fp8-rows-zero3", "gpt", {**BASE, "dp": 2, "zero": 3}, 2, precision=ROWS),
    Case("fp8-tensor-pp2-whole-batch", "gpt", {**BASE, "pp": 2, "micro_batch_size": 4}, 2, precision=TENSOR),
]
NEAR = [Case("fp8-tensor-dp2", "gpt", {**BASE, "dp": 2, "micro_batch_size": 2}, 2, precision=TENSOR)]
# ZeRO-3 with tensor-wise scales: FSDP2 gathers the linear layers' weights in fp8, each shard cast with the whole
# weight's scale (its amax all-reduced over the shards: one process's), the gathers moving bytes over gloo
GATHERED = Case("fp8-tensor-zero3-gathered", "gpt", {**BASE, "dp": 2, "zero": 3, "micro_batch_size": 2}, 2,
                precision=TENSOR)
# and with the optimizer offloaded (optim.MasterOptimizer's host copies of the fp8-gathered weights' shards)
GATHERED_OFFLOAD = Case("fp8-tensor-zero3-gathered-offload", "gpt", {**GATHERED.fixed, "offload": "optimizer"}, 2,
                        precision=TENSOR)
NEAR += [GATHERED, GATHERED_OFFLOAD]
EXACT += [Case("fp8-rows-tp2", "gpt", {**BASE, "tp": 2, "micro_batch_size": 2}, 2, precision=ROWS),
          Case("fp8-rows-tp2-sp", "gpt", {**BASE, "tp": 2, "micro_batch_size": 2, "sequence_parallel": True}, 2,
               precision=ROWS)]
TENSOR_TP = Case("fp8-tensor-tp2-whole-batch", "gpt", {**BASE, "tp": 2, "micro_batch_size": 4}, 2, precision=TENSOR)


@pytest.fixture(scope="module")
def results():
    out = run_cases([c for c in EXACT + NEAR if c not in (GATHERED, GATHERED_OFFLOAD)], 2)
    for rank, got in enumerate(run_cases([TENSOR_TP], 2, function="test_fp8:run_recording_scales")):
        out[rank].update(got)
    for rank, got in enumerate(run_cases([GATHERED, GATHERED_OFFLOAD], 2, function="test_fp8:run_counting_gathers")):
        out[rank].update(got)
    return out


def _recording(module, log: list):
    """Patch ``module``'s torchao cast to append each cast's scale to ``log``; the undo."""
    original = module.hp_tensor_to_float8_dynamic

    def cast(t, *args, **kwargs):
        out = original(t, *args, **kwargs)
        log.append((str(kwargs.get("gemm_input_role")), out._scale.detach().reshape(-1).clone()))
        return out
    module.hp_tensor_to_float8_dynamic = cast
    return lambda: setattr(module, "hp_tensor_to_float8_dynamic", original)


def run_recording_scales(rank: int, world: int, case: Case, plan_dict: dict) -> dict:
    """harness.run_case, with the scale of every fp8 cast the rank made (runtime/fp8.py calls torchao's cast
    from its module)."""
    import torchao.float8.float8_scaling_utils as utils
    from harness import run_case
    log: list = []
    undo = _recording(utils, log)
    try:
        out = run_case(rank, world, case, plan_dict)
    finally:
        undo()
    return {**out, "scales": log}


def run_counting_gathers(rank: int, world: int, case: Case, plan_dict: dict) -> dict:
    """harness.run_case, with the weights FSDP2 gathered in fp8: each cast torchao's pre-all-gather hook made (the
    shape of the shard it cast, the dtype it gathered, whether it had the step's precomputed scale)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight
    from harness import run_case
    original, log = Weight.fsdp_pre_all_gather, []

    def pre(self, mesh):   # FSDP2 checks the hook's signature
        out = original(self, mesh)
        log.append((tuple(self._tensor.shape), str(out[0][0].dtype), self._precomputed_scale is not None))
        return out
    Weight.fsdp_pre_all_gather = pre
    try:
        out = run_case(rank, world, case, plan_dict)
    finally:
        Weight.fsdp_pre_all_gather = original
    return {**out, "gathered": log}


def reference_scales(case: Case) -> list:
    """The scales of one process's first forward and backward, converted alike (torchao's Float8Linear)."""
    import torchao.float8.float8_linear as linear
    from harness import batches, call_loss, fresh, loss_fn_of, to_fp8
    model = fresh(case.model)
    to_fp8(model, case.precision["recipe"])
    log: list = []
    undo = _recording(linear, log)
    try:
        call_loss(model, batches(case.model, 1, case.global_batch)[0], loss_fn_of(case.model)).backward()
    finally:
        undo()
    return log


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



def test_zero3_tensorwise_gathers_the_linear_weights_in_fp8(results):
    """The plan's weights FSDP2 gathers in fp8 (Precision.gathers_fp8, CompiledProgram.fp8_gathered): every block's
    four linear weights (32 x 96, 32 x 32, 32 x 128, 128 x 32, sharded in two along their rows) each gathered in
    fp8 e4m3 once a micro-batch in forward and again in backward, cast with the step's precomputed scale; the
    tied embedding and head (read by the embedding too) gathered as held. It trains as one process running
    each rank's rows (test_tensorwise_scales_are_taken_over_each_ranks_rows)."""
    for rank, per_rank in enumerate(results):
        for case in (GATHERED, GATHERED_OFFLOAD):
            got = per_rank[case.name]["gathered"]
            assert got and {dtype for _, dtype, _ in got} == {"torch.float8_e4m3fn"}, (rank, case.name, got[:4])
            assert {shape for shape, _, _ in got} == {(48, 32), (16, 32), (64, 32), (16, 128)}, (rank, sorted(set(got)))
            # every cast with the scale the step's one amax all-reduce gave (runtime/fp8.refresh_scales), none
            # all-reducing its own amax
            assert all(scaled for _, _, scaled in got), (rank, case.name)


def test_tensor_parallel_tensorwise_casts_use_one_process_scales(results):
    """Each linear casts x and W in its forward, g and W for the input gradient and g and x for the weight
    gradient: every rank's scales equal one process's in the forward (17 linears, 34 casts; a split operand's
    own amax differs from the whole tensor's in most) and in the backward of the head and the last block (5
    linears, 20 casts, among them the column-parallel gradients' all-reduced amaxes), whose gradients match
    at the usual tolerances; the loss matches, and both ranks hold the same gradients."""
    import math
    ref = reference_scales(TENSOR_TP)
    linears = len(ref) // 6
    checked = 2 * linears + 4 * 5
    ref_grads = reference(TENSOR_TP)["grads"]
    largest = max(g.abs().max().item() for g in ref_grads.values() if g.numel())
    for rank, per_rank in enumerate(results):
        got = per_rank[TENSOR_TP.name]
        assert "error" not in got, got.get("error")
        assert math.isclose(got["loss"], reference(TENSOR_TP)["loss"], rel_tol=1e-5), (rank, got["loss"])
        scales = got["scales"][:len(ref)]
        assert [role for role, _ in scales] == [role for role, _ in ref], rank
        for i, ((role, mine), (_, one)) in enumerate(zip(scales[:checked], ref[:checked])):
            assert mine.shape == one.shape and torch.allclose(mine, one, rtol=1e-6, atol=0), (rank, i, role, mine, one)
        for name, g in ref_grads.items():
            if name.startswith(("blocks.3.", "final_norm.")):
                assert (got["grads"][name] - g).abs().max().item() <= 1e-4 * largest, (rank, name)
            assert torch.equal(got["grads"][name], results[0][TENSOR_TP.name]["grads"][name]), (rank, name)
