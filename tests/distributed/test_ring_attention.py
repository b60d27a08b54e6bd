"""Ring (context-parallel) attention against single-process ``F.scaled_dot_product_attention``.

The session's 4 gloo ranks (worlds.py; cp=4: three ring steps, blocks from both head and tail chunks) runs
every case (cp=2 runs end to end in test_context_expert.py, on GPT, Llama and Mixtral): each rank builds the same full
q, k, v, mask and upstream gradient from a seed, runs the reference on the full tensors, runs
``ring_attention`` on its shard, and records the largest difference of the output and of the
gradients of q, k, v at its positions. Tolerances: float32 1e-5 (rounding of length-16 softmax
sums of O(1) values, summed in another order by the blockwise merge), float64 1e-10 (the same
at double precision, with margin).
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from autopar.errors import ConfigError  # noqa: E402
from autopar.runtime import ring_attention as ra  # noqa: E402

SEQ = 16
HEAD_DIM = 8
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass(frozen=True)
class Case:
    mask: str                 # none | causal | bool | float | causal+bool | bool-deadrow | float-heads
    dtype: torch.dtype
    gqa: bool                 # hq=4, hkv=2 (else hq=hkv=2)

    @property
    def name(self) -> str:
        return f"{self.mask}-{str(self.dtype).split('.')[-1]}-{'gqa' if self.gqa else 'mha'}"


CASES = [Case(m, dt, g) for m in ("none", "causal", "bool", "float", "causal+bool", "bool-deadrow", "float-heads")
         for dt in (torch.float32, torch.float64) for g in (False, True)]


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Full-sequence q, k, v, upstream gradient and mask of a case (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = (4, 2) if case.gqa else (2, 2)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(case.dtype)  # noqa: E731
    q, k, v = rnd(2, hq, SEQ, HEAD_DIM), rnd(2, hkv, SEQ, HEAD_DIM), rnd(2, hkv, SEQ, HEAD_DIM)
    grad = rnd(2, hq, SEQ, HEAD_DIM)
    keep = (torch.rand(2, 1, SEQ, SEQ, generator=g) > 0.4) | torch.eye(SEQ, dtype=torch.bool)  # no empty row
    mask, causal = None, case.mask.startswith("causal")
    if case.mask in ("bool", "causal+bool"):
        mask = keep
    elif case.mask == "bool-deadrow":
        mask = keep.clone()
        mask[:, :, 5] = False  # a query row that sees no key at all: SDPA gives 0, so must ring attention
    elif case.mask == "float":
        mask = rnd(SEQ, SEQ).masked_fill(~keep[0, 0], float("-inf"))
    elif case.mask == "float-heads":
        mask = rnd(1, hq, SEQ, SEQ)
    return dict(q=q, k=k, v=v, grad=grad, mask=mask, causal=causal, gqa=case.gqa)


def reference(inp: dict) -> dict:
    q, k, v = (inp[n].clone().requires_grad_() for n in "qkv")
    mask = inp["mask"]
    if inp["causal"]:  # SDPA's own is_causal + attn_mask combination, spelled out
        tril = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        mask = tril if mask is None else mask & tril
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=inp["gqa"])
    out.backward(inp["grad"])
    return dict(out=out.detach(), q=q.grad, k=k.grad, v=v.grad)


def run_ring(inp: dict, cp: int, rank: int, group=None) -> dict:
    q, k, v = (ra.shard_sequence(inp[n], -2, cp, rank).requires_grad_() for n in "qkv")
    out = ra.ring_attention(q, k, v, group=group, cp=cp, rank=rank, is_causal=inp["causal"], attn_mask=inp["mask"],
                            enable_gqa=inp["gqa"], timeout=60)
    out.backward(ra.shard_sequence(inp["grad"], -2, cp, rank))
    return dict(out=out.detach(), q=q.grad, k=k.grad, v=v.grad)


def case_errors(case: Case, cp: int, rank: int, group=None) -> dict:
    """Largest |ring - reference| of out, dq, dk, dv at this rank's positions; whether any is NaN."""
    inp = make_inputs(case)
    ref, got = reference(inp), run_ring(inp, cp, rank, group)
    errs = {n: (got[n] - ra.shard_sequence(ref[n], -2, cp, rank)).abs().max().item() for n in ref}
    errs["nan"] = any(bool(t.isnan().any()) for t in got.values())
    return errs


def gather_errors(cp: int, rank: int) -> dict:
    """gather_sequence's result is the full tensor; the gradient of a shard sums every rank's use."""
    full = torch.randn(2, SEQ, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = ra.shard_sequence(full, 1, cp, rank).requires_grad_()
    y = ra.gather_sequence(x, -2, cp, rank, None, timeout=60)
    weight = full * 0.5 + 1.0
    (y * weight * (rank + 1)).sum().backward()  # rank r scales its use by r + 1
    want_grad = ra.shard_sequence(weight, 1, cp, rank) * (cp * (cp + 1) / 2)
    return dict(value=(y - full).abs().max().item(), grad=(x.grad - want_grad).abs().max().item())


def run_all(rank: int, world: int) -> dict:
    """Every case and the gather check on this rank of the session's world (worlds.py): name -> errors."""
    results = {}
    for case in CASES:
        try:
            results[case.name] = case_errors(case, world, rank)
        except Exception as exc:  # noqa: BLE001 - reported per case to the parent
            results[case.name] = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    try:
        results["gather"] = gather_errors(world, rank)
    except Exception as exc:  # noqa: BLE001
        results["gather"] = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return results


@pytest.fixture(scope="module", params=[4], ids=lambda w: f"cp{w}")
def spawned(request):
    import worlds
    world = request.param
    return world, worlds.world(world).run("test_ring_attention:run_all")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ring_attention_matches_sdpa(spawned, case):
    world, ranks = spawned
    for rank, res in enumerate(ranks):
        errs = res[case.name]
        assert "error" not in errs, errs.get("error")
        assert not errs["nan"], f"cp={world} rank {rank}: NaN in output or gradients"
        bad = {n: e for n, e in errs.items() if n != "nan" and not e <= TOL[case.dtype]}
        assert not bad, f"cp={world} rank {rank}: |ring - sdpa| above {TOL[case.dtype]:g}: {bad}"


def test_gather_sequence(spawned):
    world, ranks = spawned
    for rank, res in enumerate(ranks):
        assert "error" not in res["gather"], res["gather"].get("error")
        assert res["gather"]["value"] == 0.0 and res["gather"]["grad"] < 1e-12, (world, rank, res["gather"])


# ------------------------------------------------------------------------- no spawn needed

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_indices_partition_and_balance_causal_work(cp):
    parts = [ra.local_indices(SEQ, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(SEQ))
    assert all(bool((p[1:] > p[:-1]).all()) for p in parts)  # local order increases with position
    work = [int((p + 1).sum()) for p in parts]  # query at position i attends to i + 1 keys
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_ring_steps_do_equal_work(cp):
    """Own block: lower triangle; every other block: exactly half of it (the head-tail box)."""
    s_local = SEQ // cp
    for rank in range(cp):
        q_pos = ra.local_indices(SEQ, cp, rank)
        for step in range(cp):
            k_pos = ra.local_indices(SEQ, cp, (rank - step) % cp)
            mask = ra._block_mask(None, q_pos, k_pos, True, torch.float32)
            rows, cols = ra._active_box(mask, s_local, s_local)
            area = (rows.stop - rows.start) * (cols.stop - cols.start)
            assert area == (s_local * s_local if step == 0 else s_local * s_local // 2), (rank, step, rows, cols)


def test_shard_sequence_any_dim():
    t = torch.arange(2 * SEQ * 3).reshape(2, SEQ, 3)
    for dim in (1, -2):
        shards = [ra.shard_sequence(t, dim, 4, r) for r in range(4)]
        order = torch.cat([ra.local_indices(SEQ, 4, r) for r in range(4)])
        assert torch.equal(torch.cat(shards, 1).index_select(1, torch.argsort(order)), t)
    assert torch.equal(ra.shard_sequence(t.transpose(0, 1), 0, 2, 1), t.transpose(0, 1)[[4, 5, 6, 7, 8, 9, 10, 11]])


def test_bad_sequence_length_says_what_to_change():
    with pytest.raises(ConfigError, match="multiple of 8"):
        ra.local_indices(12, 4, 0)
    with pytest.raises(ConfigError, match="multiple of 4"):
        ra.shard_sequence(torch.zeros(1, 6), 1, 2, 0)


def test_bad_arguments_are_config_errors():
    q, kv = torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, 8, 8)
    with pytest.raises(ConfigError, match="enable_gqa=True"):
        ra.ring_attention(q, kv, kv, group=None, cp=1, rank=0)
    with pytest.raises(ConfigError, match="dropout_p=0.0"):
        ra.ring_attention(q, kv, kv, group=None, cp=1, rank=0, enable_gqa=True, dropout_p=0.1)
    with pytest.raises(ConfigError, match="whole sequence"):
        ra.ring_attention(q, kv, kv, group=None, cp=1, rank=0, enable_gqa=True, attn_mask=torch.ones(8, 5) > 0)
    with pytest.raises(ConfigError, match="init_process_group"):
        ra.ring_attention(q, kv, kv, group=None, cp=2, rank=0, enable_gqa=True)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float64], ids=lambda c: c.name)
def test_single_rank_ring_equals_sdpa(case):
    errs = case_errors(case, 1, 0)
    assert not errs["nan"] and max(v for n, v in errs.items() if n != "nan") <= TOL[case.dtype], errs


def _block_inputs(dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(4))
    keep = torch.rand(2, 1, 6, 6, generator=g) > 0.5
    keep[:, :, 2] = False  # fully masked rows
    keep[1, :, 4] = False
    return q, k, v, dout, keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["none", "bool", "float"])
def test_block_kernel_matches_math_with_fully_masked_rows(dtype, kind):
    """The fused CPU kernel (used here) and the math path agree, rows with no key give out 0,
    lse -inf and zero gradients, and nothing is NaN. Tolerance: float32 rounding (1e-5)."""
    assert ra._fused_ok(torch.zeros(1, dtype=dtype))
    q, k, v, dout, keep = _block_inputs(dtype)
    mask = {"none": None, "bool": keep, "float": ra._additive(keep, dtype) + 0.3 * torch.ones(6, 6, dtype=dtype)}[kind]
    scale = 0.4
    out, lse = ra.block_attention(q, k, v, mask, scale)
    add = ra._additive(mask, dtype)
    ref_out, ref_lse = ra.block_attention_math(q, k, v, add, scale)
    tol = TOL[dtype]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(out, ref_out, atol=tol, rtol=0) and torch.allclose(_fin(lse), _fin(ref_lse), atol=tol, rtol=0)
    grads = ra.block_attention_backward(dout, q, k, v, out, lse, mask, scale)
    ref_grads = ra.block_attention_backward_math(dout, q, k, v, ref_out, ref_lse, add, scale)
    for got, want in zip(grads, ref_grads):
        assert not got.isnan().any() and torch.allclose(got, want, atol=tol, rtol=0)
    if kind != "none":
        assert bool((lse[:, :, 2] == float("-inf")).all()) and bool((out[:, :, 2] == 0).all())
        assert bool((grads[0][:, :, 2] == 0).all())
        # and the math path equals SDPA (which also gives 0 for a row with no key)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        assert torch.allclose(ref_out, sdpa, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_blocks_merge_to_full_attention(dtype):
    """Split the keys in two blocks, merge forward with the log-sum-exp rule, sum the blockwise
    backward (with the merged out and lse): equals SDPA over all keys, with a row empty in one block."""
    q, k, v, dout, keep = _block_inputs(dtype)
    keep[:, :, 2, :3] = True  # row 2 has keys only in the first block; rows of batch 1, 4 none at all
    add = ra._additive(keep, dtype)
    scale = 1 / math.sqrt(8)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype)
    halves = (slice(0, 3), slice(3, 6))
    for cols in halves:
        o, l_ = ra.block_attention(q, k[..., cols, :], v[..., cols, :], add[..., cols], scale)
        ra._merge(out, lse, o, l_, slice(0, 6))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=keep, scale=scale)
    ref.backward(dout)
    tol = TOL[dtype]
    assert torch.allclose(out, ref.detach(), atol=tol, rtol=0)
    dq = torch.zeros_like(q)
    for cols in halves:
        dqb, dkb, dvb = ra.block_attention_backward(dout, q, k[..., cols, :], v[..., cols, :], out, lse,
                                                    add[..., cols], scale)
        dq += dqb
        assert torch.allclose(dkb, kk.grad[..., cols, :], atol=tol, rtol=0)
        assert torch.allclose(dvb, vv.grad[..., cols, :], atol=tol, rtol=0)
    assert torch.allclose(dq, qq.grad, atol=tol, rtol=0)


def _fin(t):
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))
