"""The ops whose tensor-parallel shards need more than the op itself (lower.py's special cases).

Like collectives.py this imports only torch. Each function takes this rank's shards and the
tensor-parallel process group:

- :func:`vocab_embedding`: the table split along the vocabulary; each rank looks up the tokens in
  its rows and zeros the others: the output is partial (Megatron's VocabParallelEmbedding);
- :func:`vocab_cross_entropy` / :func:`vocab_nll`: logits (log-probabilities) split along the class
  dim; the loss of every row on every rank, the gradient computed on the shard (Megatron's
  vocab_parallel_cross_entropy, with ignore_index and label smoothing as torch defines them).
  Where Megatron makes three all-reduces of one value per row (the row max, the target logit, the
  sum of exponentials), each rank here shares its shard's max ``m_r``, exponential sum ``s_r`` (about
  ``m_r``), target logit (0 off the shard) and, with label smoothing, logit sum, in one collective;
  every rank then combines them as a streaming softmax does: ``m = max_r m_r``,
  ``S = sum_r s_r exp(m_r - m)``, ``loss = log S + m - x_target``. One latency instead of three: at
  small sizes (and on GPUs, for any layer short enough) that latency is the loss's cost;
- :func:`row_total`: a loss over this rank's rows from its local sum: all-reduces of the sum and,
  for a mean, of the count of terms;
- :func:`expect_shape`: the check a generated program makes of each shard it computes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from . import collectives

MEAN, SUM, NONE = 1, 2, 0   # aten's reduction enum: 0 none, 1 mean, 2 sum


def vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, group, padding_idx: int = -1) -> torch.Tensor:
    """This rank's rows' share of ``embedding(indices)``: a partial value (sum over ranks = lookup)."""
    rows = weight.shape[0]
    start = dist.get_rank(group) * rows
    inside = (indices >= start) & (indices < start + rows)
    local = torch.where(inside, indices - start, torch.zeros_like(indices))
    pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + rows else -1
    out = torch.ops.aten.embedding.default(weight, local, pad)
    return out * inside.unsqueeze(-1).to(out.dtype)


class _VocabCrossEntropy(torch.autograd.Function):
    """Per-row cross entropy of class-last logits ``[N, V/t]`` against class ids ``[N]``."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, smoothing):
        vocab, ranks = logits.shape[-1], dist.get_world_size(group)
        rank = dist.get_rank(group)
        start = rank * vocab
        top = logits.detach().amax(-1)
        shift = torch.where(top.isfinite(), top, torch.zeros_like(top))   # a shard of -inf logits: exp 0
        z = logits - shift.unsqueeze(-1)
        exp = z.exp()
        inside = (target >= start) & (target < start + vocab)
        index = torch.where(inside, target - start, torch.zeros_like(target))
        picked = z.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(inside, picked, torch.zeros_like(picked))
        mine = [top, exp.sum(-1), picked] + ([z.sum(-1)] if smoothing else [])
        # every rank's statistics in one all-reduce, each rank filling its own slot: an all-gather
        # whose backward is nothing (the gradient below is local), priced as the all-reduce it is
        shared = torch.zeros((ranks, len(mine)) + top.shape, dtype=logits.dtype, device=logits.device)
        shared[rank] = torch.stack(mine)
        dist.all_reduce(shared, group=group)
        tops = shared[:, 0]
        best = tops.amax(0)
        scale = (tops - best).exp()   # each rank's exponentials, from its own max to the global one
        total = (shared[:, 1] * scale).sum(0)
        log_total = total.log()       # log sum_j exp(x_j - best)
        owner = (target // vocab).clamp(0, ranks - 1)   # the rank holding each row's target
        target_z = shared[:, 2].sum(0) + tops.gather(0, owner.unsqueeze(0)).squeeze(0) - best   # x_target - best
        loss = log_total - target_z
        full_vocab = vocab * ranks
        if smoothing:   # sum_j (x_j - best), from each rank's sum about its own max
            z_sum = (shared[:, 3] + vocab * (tops - best)).sum(0)
            loss = (1 - smoothing) * loss + smoothing * (log_total - z_sum / full_vocab)
        valid = target != ignore_index
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(exp * (scale[rank] / total).unsqueeze(-1), index, inside, valid)
        ctx.smoothing, ctx.full_vocab = smoothing, full_vocab
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, inside, valid = ctx.saved_tensors
        out = softmax.clone()
        hit = (1 - ctx.smoothing) * inside.to(out.dtype)
        out.scatter_add_(-1, index.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.smoothing:
            out -= ctx.smoothing / ctx.full_vocab
        out *= (grad * valid.to(grad.dtype)).unsqueeze(-1)
        return out, None, None, None, None


def _class_last(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``[N, C, d...]`` (or ``[C]``) as rows ``[M, C]``, and how to put per-row values back."""
    if x.dim() == 1:
        return x.unsqueeze(0), lambda v: v.reshape(())
    moved = x.movedim(1, -1)
    shape = moved.shape[:-1]
    return moved.reshape(-1, moved.shape[-1]), lambda v: v.reshape(shape)


def _reduce(per_row: torch.Tensor, valid: torch.Tensor, reduction: int) -> torch.Tensor:
    if reduction == NONE:
        return per_row
    total = per_row.sum()
    return total / valid.sum().to(total.dtype) if reduction == MEAN else total


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, reduction: int = MEAN,
                        ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """``cross_entropy(logits, target)`` with the logits split along the class dim (dim 1, or 0 unbatched)."""
    rows, back = _class_last(logits)
    flat = target.reshape(-1)
    per_row = _VocabCrossEntropy.apply(rows, flat, group, ignore_index, float(label_smoothing))
    return _reduce(back(per_row), target != ignore_index, reduction)


def vocab_nll(logp: torch.Tensor, target: torch.Tensor, group, reduction: int = MEAN,
              ignore_index: int = -100) -> torch.Tensor:
    """``nll_loss(logp, target)`` with the log-probabilities split along the class dim."""
    rows, back = _class_last(logp)
    flat = target.reshape(-1)
    vocab = rows.shape[-1]
    start = dist.get_rank(group) * vocab
    inside = (flat >= start) & (flat < start + vocab)
    index = torch.where(inside, flat - start, torch.zeros_like(flat))
    picked = -rows.gather(-1, index.unsqueeze(-1)).squeeze(-1) * inside.to(rows.dtype)
    per_row = collectives.reduce(picked, group)
    valid = flat != ignore_index
    per_row = torch.where(valid, per_row, torch.zeros_like(per_row))
    return _reduce(back(per_row), target != ignore_index, reduction)


VOCAB_LOSS_FORMS: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    "cross_entropy": (vocab_cross_entropy, ("reduction", "ignore_index", "label_smoothing")),
    "nll": (vocab_nll, ("reduction", "ignore_index")),
}
"""A vocabulary-parallel loss form (autopar/ops.py's ``VocabLoss.form``) -> its function and the op's
arguments (by schema name) it takes after the logits, the targets and the group."""


def row_total(local_sum: torch.Tensor, group, reduction: int, input: torch.Tensor, target: torch.Tensor | None = None,
              ignore_index: int = -100) -> torch.Tensor:
    """A loss over the rows this rank holds, from its local sum (the op at ``reduction=sum``): all-reduced,
    and for a mean divided by the number of terms over all ranks (the targets not ignored for a class
    loss, given its ``target``; else every element of ``input``)."""
    total = collectives.reduce(local_sum, group)
    if reduction != MEAN:
        return total
    if target is not None:
        count = (target != ignore_index).sum().to(total.dtype)
    else:
        count = torch.tensor(float(input.numel()), dtype=total.dtype, device=total.device)
    collectives.all_reduce_(count, group)
    return total / count


def expect_shape(value: torch.Tensor, shape: tuple[int, ...], node: str, spec: str) -> None:
    """Raise when an op's shard is not the shape the plan's spec gives it on this rank."""
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"tensor parallelism: op {node} gave a shard of shape {tuple(value.shape)} where the "
                         f"plan's spec {spec} needs {tuple(shape)}: the plan's sharding does not fit this op; "
                         "re-plan with fixed={'tp': 1} and report it")
