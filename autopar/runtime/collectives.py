"""Tensor-parallel collectives as autograd functions: what a lowered program calls (each a step of
redistribute.py).

This module imports only torch, so that a generated program can carry it as it is.

Every value of a tensor-parallel group of ``t`` ranks is held in one of three placements
(autopar/plan/placement.py): ``R`` (each rank holds all of it), ``S(d)`` (rank ``r`` holds block
``r`` of ``t`` contiguous blocks of dim ``d``) or ``P`` (the value is the sum of what the ranks
hold). Gradients follow one convention, Megatron-LM's: the gradient of an ``R`` value is itself
``R`` (every rank holds the whole of it), of ``S(d)`` is ``S(d)``, and of ``P`` is ``R``. Each
function's backward keeps to it:

==================  =============================  =================================
function            forward                        backward
==================  =============================  =================================
``split``           R -> S(d): this rank's block   all-gather along d
``gather``          S(d) -> R: all-gather          this rank's block
``reduce``          P -> R: all-reduce (``g``)     identity
``reduce_scatter``  P -> S(d)                      all-gather along d
``copy``            identity (``f``)               all-reduce
``gather_partial``  S(d) -> R: all-gather          reduce-scatter along d
``to_partial``      R -> P: rank 0 keeps it        all-reduce
``keep_first``      R -> P: rank 0 keeps it        none (the gradient stays partial)
``reduce_max``      all-reduce max / min           to the rank(s) holding it
==================  =============================  =================================

``copy`` (Megatron's ``f``) marks an ``R`` value that an op reads while its work is split over
the ranks (a column-parallel matmul's input): each rank's gradient of it is a partial sum, and
its backward sums them. ``gather_partial`` is ``gather`` followed by ``copy`` in one collective
(sequence parallelism's all-gather before a column-parallel matmul; its backward is the
reduce-scatter).

gloo has no reduce-scatter: there it is an all-reduce and a slice (the same values, more bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _block(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(_size(group), dim)[_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, op=op, group=group)
    return x


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if dist.get_backend(group) == "gloo":
        return _block(_all_reduce(x, group), dim, group)
    parts = [p.contiguous() for p in x.chunk(_size(group), dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _AlongDim(torch.autograd.Function):
    """A collective along ``dim`` whose backward is another one: ``forward(x, dim, group)`` and
    ``backward(grad, dim, group)`` are the two (the table in the module docstring)."""

    @staticmethod
    def forward(ctx, x, dim, group, forward, backward):
        ctx.dim, ctx.group, ctx.backward_fn = dim, group, backward
        return forward(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.dim, ctx.group), None, None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceMax(torch.autograd.Function):
    """All-reduce max (``largest``) or min; the gradient goes to the elements equal to the result,
    shared evenly among the ranks that hold one (as one process shares it among equal elements)."""

    @staticmethod
    def forward(ctx, x, group, largest):
        out = _all_reduce(x, group, dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN)
        hit = (x == out).to(x.dtype)
        ctx.save_for_backward(hit / _all_reduce(hit, group).clamp_min(1))
        return out

    @staticmethod
    def backward(ctx, grad):
        share, = ctx.saved_tensors
        return grad * share, None, None


def _needs_grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def _along(x: torch.Tensor, dim: int, group, forward, backward) -> torch.Tensor:
    return _AlongDim.apply(x, dim, group, forward, backward) if _needs_grad(x) else forward(x, dim, group)


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """R -> S(dim)."""
    return _along(x, dim, group, _block, _all_gather)


def gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """S(dim) -> R."""
    return _along(x, dim, group, _all_gather, _block)


def gather_partial(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """S(dim) -> R, read by an op whose work is split (backward: reduce-scatter)."""
    return _along(x, dim, group, _all_gather, _reduce_scatter)


def reduce(x: torch.Tensor, group) -> torch.Tensor:
    """P -> R."""
    return _Reduce.apply(x, group) if _needs_grad(x) else _all_reduce(x, group)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """P -> S(dim)."""
    return _along(x, dim, group, _reduce_scatter, _all_gather)


def copy(x: torch.Tensor, group) -> torch.Tensor:
    """R read by an op whose work is split: identity forward, all-reduce of the gradient."""
    return _Copy.apply(x, group) if _needs_grad(x) else x


def keep_first(x: torch.Tensor, group) -> torch.Tensor:
    """R -> P without ``copy``: rank 0 keeps the value, the others hold zeros; the gradient stays
    partial (rank 0's is whole, the others' zero), for a parameter whose gradient is summed once per
    step instead."""
    return x if _rank(group) == 0 else x * 0


def to_partial(x: torch.Tensor, group) -> torch.Tensor:
    """R -> P: rank 0 keeps the value, the others hold zeros."""
    return keep_first(copy(x, group), group)


def reduce_max(x: torch.Tensor, group, largest: bool = True) -> torch.Tensor:
    """Element-wise max (or min) over the ranks."""
    if _needs_grad(x):
        return _ReduceMax.apply(x, group, largest)
    return _all_reduce(x, group, dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN)


def all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the ranks in place (no autograd: a gradient or a statistic)."""
    dist.all_reduce(x, group=group)
    return x
