"""What a layer's generated code calls under context parallelism (context.py decided where).

Each rank of a context-parallel group of ``cp`` holds, of a Local value, its tokens
(:func:`.ring_attention.local_indices`) along one dim merged as ``(outer, seq, inner)``
(context_state.Local). The layer's code (layers.py) converts an op's inputs with:

- :func:`gather`: a Local value made whole (all-gather; backward: the sum of the ranks'
  gradients, this rank's tokens of it);
- :func:`take_tokens`: this rank's tokens of a whole value (backward: zeros elsewhere);
- :func:`resolve`: a PARTIAL value (the group's mean is its true value) made whole: an
  all-reduce mean, forward and backward;

and runs the ops whose local form is more than the op on local inputs with:

- :func:`ring`: ``scaled_dot_product_attention`` of this rank's queries over the whole
  sequence's keys by ring attention (ring_attention.py);
- :func:`local_query`: attention of this rank's queries over whole keys (another sequence):
  the rows of the mask, and of the causal triangle, of those queries;
- :func:`target_mean`: a mean loss from this rank's sum, ``cp * sum_local / N`` with ``N`` the
  group's count of targets not ignored (its mean over the group is the exact mean);
- :func:`scaled`: a sum over the group's tokens, ``cp`` times this rank's (context.py).

Every wait has the run's deadline (failures.py), so a dead peer fails the step naming it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .context_state import Local
from .failures import start, wait_or_fail
from .ring_attention import gather_sequence, local_indices, ring_attention, shard_sequence


def gather(t: torch.Tensor, dim: int, seq: int, outer: int, inner: int, cp: int, rank: int, group: Any,
           timeout: float) -> torch.Tensor:
    """A Local value ``(dim, seq, outer, inner)`` made whole on every rank of the group."""
    x = t.unflatten(dim, (outer, seq // cp, inner))
    x = gather_sequence(x, dim + 1, cp, rank, group, timeout)
    return x.flatten(dim, dim + 2)


def take_tokens(t: torch.Tensor, dim: int, seq: int, outer: int, inner: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of a whole value, laid out ``(dim, seq, outer, inner)``."""
    x = t.unflatten(dim, (outer, seq, inner))
    return shard_sequence(x, dim + 1, cp, rank).flatten(dim, dim + 2)


def shard_inputs(inputs: Mapping[str, Any], layouts: Mapping[str, Local], cp: int, rank: int) -> dict[str, Any]:
    """A micro-batch's graph inputs, each one that starts Local cut to this rank's tokens."""
    out = dict(inputs)
    for name, s in layouts.items():
        if isinstance(out.get(name), torch.Tensor):
            out[name] = shard_sequence(out[name], s.dim, cp, rank)
    return out


def resolve(t: torch.Tensor, cp: int, group: Any, timeout: float) -> torch.Tensor:
    """A PARTIAL value made whole: the group's mean."""
    return _Resolve.apply(t, cp, group, timeout)


def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
         scale: float | None, enable_gqa: bool, cp: int, rank: int, group: Any, timeout: float) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence (keys of this rank's tokens go round)."""
    return ring_attention(q, k, v, group=group, cp=cp, rank=rank, is_causal=bool(is_causal), attn_mask=attn_mask,
                          scale=scale, enable_gqa=bool(enable_gqa), timeout=timeout)


def local_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                scale: float | None, enable_gqa: bool, cp: int, rank: int) -> torch.Tensor:
    """Attention of this rank's queries over whole keys of another sequence."""
    s_q, s_k = q.shape[-2] * cp, k.shape[-2]
    rows = local_indices(s_q, cp, rank).to(q.device)
    mask = attn_mask
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
        mask = m.expand(*m.shape[:-2], s_q, s_k).index_select(-2, rows)
    if is_causal:
        keep = rows[:, None] >= torch.arange(s_k, device=q.device)[None, :]
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scale,
                                          enable_gqa=bool(enable_gqa))


def target_mean(total: torch.Tensor, target: torch.Tensor, ignore_index: int, cp: int, group: Any,
                timeout: float) -> torch.Tensor:
    """``cp * total / N`` for this rank's summed loss ``total``, ``N`` the group's count of targets not
    ignored (rows of class probabilities when ``target`` is floating point)."""
    if target.is_floating_point():
        count = torch.tensor([target.numel() // target.shape[1]], dtype=torch.float64, device=target.device)
    else:
        count = (target != int(ignore_index)).sum().to(torch.float64).reshape(1)
    work = start(dist.all_reduce, count, group=group, async_op=True)
    wait_or_fail(work, timeout, "all_reduce of a context-parallel loss's target count", group)
    return total * (cp / count.to(total.dtype)).reshape(())


def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``factor`` times ``t`` (integers stay integers)."""
    return t * (factor if t.is_floating_point() else int(factor))


class _Resolve(torch.autograd.Function):
    """The mean over the group, forward and backward (context.py's gradient convention)."""

    @staticmethod
    def forward(ctx, t, cp, group, timeout):  # type: ignore[override]
        ctx.cp, ctx.group, ctx.timeout = cp, group, timeout
        out = t.detach().clone().contiguous()
        wait_or_fail(start(dist.all_reduce, out, group=group, async_op=True), timeout,
                     "all_reduce of a context-parallel partial value", group)
        return out / cp if out.is_floating_point() else out // cp   # an integer sum divides exactly

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous().clone()
        wait_or_fail(start(dist.all_reduce, grad, group=ctx.group, async_op=True), ctx.timeout,
                     "all_reduce of a context-parallel partial value's gradient", ctx.group)
        return grad / ctx.cp, None, None, None
