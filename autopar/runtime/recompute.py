"""Per-op selective recomputation (recompute "op"): which op outputs a layer keeps for its backward.

torchtitan's ``selective_ac_option = "op"`` policy, made a mode of its own: inside a checkpointed
layer, keep the output of every odd-numbered matrix product (the 1st, 3rd, ... in the order the
forward runs them), of fused attention, and of reduce-scatters; recompute everything else in the
backward (the even-numbered matrix products, norms, activations, rotary embeddings, ...). A
Llama block's seven projections keep q, v, the gate and down outputs and recompute k, o and
up; the attention's output is never recomputed. The cost model prices the same rule on the
captured graph (cost_model/memory.py ``op_kept``): one capture node per product or attention.

It counts what torchtitan counts plus the products with a bias (``addmm``) and batched products
(``bmm``), so that a model whose linears carry a bias (GPT-2's Conv1D, BERT) keeps half of them
too. Imports only torch: the standalone folder (codegen/standalone.py) runs a copy of it.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

_aten = torch.ops.aten
PRODUCTS = frozenset((_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default))
"""The matrix products the policy counts: every second one is kept."""


def _always_kept() -> frozenset:
    ops = {getattr(_aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
        if hasattr(_aten, name)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


ALWAYS_KEPT = _always_kept()
"""Ops whose outputs are always kept: fused attention (each kernel torch has) and functional reduce-scatters."""


def op_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: the forward and recompute contexts of the
    per-op policy, with their own count of matrix products (the forward's and the recompute's
    counts agree, so both keep the same products)."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in PRODUCTS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = func in ALWAYS_KEPT
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def run_layer(run, values, mode: str):
    """``run(*values)``, a layer's forward, checkpointed when ``mode`` recomputes the whole layer ("full") or
    per op ("op"; "selective" checkpoints inside the layer's code instead) and autograd records."""
    if mode in ("full", "op") and torch.is_grad_enabled():
        return checkpoint(run, *values, use_reentrant=False, context_fn=op_context if mode == "op" else noop_context_fn)
    return run(*values)
