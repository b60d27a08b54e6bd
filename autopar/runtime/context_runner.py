"""Runs the nodes of a graph under context parallelism as context.py's analysis decided.

For each node, :class:`ContextRunner` converts its inputs (gathers a Local value whole with
:func:`.ring_attention.gather_sequence`, slices a whole one with :func:`.ring_attention.shard_sequence`,
resolves a PARTIAL one with :class:`_Resolve`, an all-reduce mean), caches each conversion in the
layer's environment, rewrites shape arguments to local shapes, and runs the op, ring attention,
attention of local queries over whole keys, or the mean loss over the group's count of targets.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .context_state import Conv, ContextPlan, Local, holds_tensor
from .failures import wait_or_fail
from .ring_attention import gather_sequence, local_indices, ring_attention, shard_sequence
from ..codegen.layers import bind


class ContextRunner:
    """Runs nodes under a :class:`ContextPlan` on this rank of the context-parallel ``group``."""

    def __init__(self, plan: ContextPlan, group: Any, rank: int, timeout: float) -> None:
        self.plan = plan
        self.cp = plan.cp
        self.group = group
        self.rank = rank
        self.timeout = timeout

    def shard_input(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A graph input of the micro-batch, sharded when it starts Local."""
        s = self.plan.inputs.get(name)
        return value if s is None or not isinstance(value, torch.Tensor) else shard_sequence(value, s.dim, self.cp,
                                                                                             self.rank)

    def run(self, node: torch.fx.Node, env: dict, load: Callable[[torch.fx.Node], Any],
            compute: Callable[..., Any] | None = None) -> Any:
        """The node's value on this rank; ``compute`` replaces the op (an MoE region on its inputs)."""
        step = self.plan.steps[node.name]
        if node.target is operator.getitem:
            return node.target(*torch.fx.node.map_arg(node.args, load))
        values = [self._convert(env, name, conv) for name, conv in zip(step.inputs, step.convert)]
        if compute is not None:
            return compute(*values)
        args, kwargs = _substitute(node, values, load)
        for pos, value in step.rewrite:
            args = args[:pos] + (value,) + args[pos + 1:]
        if step.mode == "ring":
            return self._ring(node, args, kwargs)
        if step.mode == "local_query":
            return self._local_query(node, args, kwargs)
        if step.mode == "loss_mean":
            return self._loss_mean(node, args, kwargs)
        out = node.target(*args, **kwargs)
        if step.scale != 1.0:   # a sum over the group's tokens: cp times this rank's (integers stay integers)
            out = out * (step.scale if out.is_floating_point() else int(step.scale))
        return out

    # --- conversions ----------------------------------------------------------------------------
    def _convert(self, env: dict, name: str, conv: Conv) -> Any:
        if not conv:
            return env[name]
        key = ("cp", name, conv)
        if key not in env:
            value = env[name]
            for kind, layout in conv:
                if kind == "gather":
                    value = self.gather(value, layout)
                elif kind == "slice":
                    value = self.slice(value, layout)
                else:
                    value = _Resolve.apply(value, self.cp, self.group, self.timeout)
            env[key] = value
        return env[key]

    def gather(self, t: torch.Tensor, s: Local) -> torch.Tensor:
        """A Local value made whole (all-gather; its backward sums the ranks' gradients, sliced)."""
        x = t.unflatten(s.dim, (s.outer, s.seq // self.cp, s.inner))
        x = gather_sequence(x, s.dim + 1, self.cp, self.rank, self.group, self.timeout)
        return x.flatten(s.dim, s.dim + 2)

    def slice(self, t: torch.Tensor, s: Local) -> torch.Tensor:
        """This rank's tokens of a whole value."""
        x = t.unflatten(s.dim, (s.outer, s.seq, s.inner))
        return shard_sequence(x, s.dim + 1, self.cp, self.rank).flatten(s.dim, s.dim + 2)

    # --- special ops ------------------------------------------------------------------------------
    def _ring(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
        a = bind(node.target, args, kwargs)
        return ring_attention(a["query"], a["key"], a["value"], group=self.group, cp=self.cp, rank=self.rank,
                              is_causal=bool(a.get("is_causal", False)), attn_mask=a.get("attn_mask"),
                              dropout_p=float(a.get("dropout_p") or 0.0), scale=a.get("scale"),
                              enable_gqa=bool(a.get("enable_gqa", False)), timeout=self.timeout)

    def _local_query(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
        """Attention of this rank's queries over whole keys (another sequence): the mask's (and the
        causal triangle's) rows of those queries."""
        a = bind(node.target, args, kwargs)
        q, k = a["query"], a["key"]
        s_q, s_k = q.shape[-2] * self.cp, k.shape[-2]
        rows = local_indices(s_q, self.cp, self.rank).to(q.device)
        mask = a.get("attn_mask")
        if mask is not None:
            m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
            mask = m.expand(*m.shape[:-2], s_q, s_k).index_select(-2, rows)
        if a.get("is_causal"):
            keep = rows[:, None] >= torch.arange(s_k, device=q.device)[None, :]
            if mask is None:
                mask = keep
            elif mask.dtype == torch.bool:
                mask = mask & keep
            else:
                mask = mask.masked_fill(~keep, float("-inf"))
        return F.scaled_dot_product_attention(q, k, a["value"], attn_mask=mask, dropout_p=0.0, is_causal=False,
                                              scale=a.get("scale"), enable_gqa=bool(a.get("enable_gqa", False)))

    def _loss_mean(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
        """``cp * sum_local / N``, ``N`` the group's count of targets not ignored."""
        a = bind(node.target, args, kwargs)
        a["reduction"] = 2
        schema = node.target._schema
        total = node.target(*[a[arg.name] for arg in schema.arguments])
        target = a["target"]
        if target.is_floating_point():   # class probabilities: the mean is over the rows
            count = torch.tensor([target.numel() // target.shape[1]], dtype=torch.float64, device=target.device)
        else:
            count = (target != int(a.get("ignore_index", -100))).sum().to(torch.float64).reshape(1)
        work = dist.all_reduce(count, group=self.group, async_op=True)
        wait_or_fail(work, self.timeout, f"all_reduce of the target count of loss {node.name}", self.group)
        return total * (self.cp / count.to(total.dtype)).reshape(())


def _substitute(node: torch.fx.Node, values: Sequence[Any], load: Callable[[torch.fx.Node], Any]) -> tuple[tuple, dict]:
    """The node's args and kwargs with its tensor inputs replaced by ``values`` (in ``tensor_args`` order)."""
    it = iter(values)

    def leaf(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return next(it) if holds_tensor(arg.meta.get("val")) else load(arg)
        return arg

    def one(arg: Any) -> Any:   # lists one level deep, as tensor_args flattens them
        return type(arg)(leaf(x) for x in arg) if isinstance(arg, (list, tuple)) else leaf(arg)

    args = tuple(one(a) for a in node.args)
    kwargs = {k: one(v) for k, v in node.kwargs.items()}
    return args, kwargs


class _Resolve(torch.autograd.Function):
    """A PARTIAL value made whole: the mean over the group, forward and backward (module docstring)."""

    @staticmethod
    def forward(ctx, t, cp, group, timeout):  # type: ignore[override]
        ctx.cp, ctx.group, ctx.timeout = cp, group, timeout
        out = t.detach().clone().contiguous()
        wait_or_fail(dist.all_reduce(out, group=group, async_op=True), timeout,
                     "all_reduce of a context-parallel partial value", group)
        return out / cp if out.is_floating_point() else out // cp   # an integer sum divides exactly

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous().clone()
        wait_or_fail(dist.all_reduce(grad, group=ctx.group, async_op=True), ctx.timeout,
                     "all_reduce of a context-parallel partial value's gradient", ctx.group)
        return grad / ctx.cp, None, None, None
