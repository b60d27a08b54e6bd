"""Running one lowered op (codegen/lower.py) on this rank's shards: its conversions' collectives
(codegen/collectives.py) and the op itself, in the form its :class:`~autopar.codegen.lower.How` says."""

from __future__ import annotations

from typing import Any

import torch

from ..codegen import collectives, shard_ops
from ..codegen.lower import How, Step


def apply_steps(value: torch.Tensor, steps: tuple[Step, ...], group) -> torch.Tensor:
    """``value`` through the collectives of a conversion, in order."""
    for step in steps:
        kind = step.kind
        if kind in ("split", "gather", "gather_partial", "reduce_scatter"):
            value = getattr(collectives, kind)(value, step.dim, group)
        else:   # reduce, copy, to_partial, keep_first
            value = getattr(collectives, kind)(value, group)
    return value


def bind(target: Any, args: tuple | list, kwargs: dict) -> dict[str, Any]:
    """An aten op's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _index(target: Any, name: str) -> int | None:
    return next((i for i, a in enumerate(target._schema.arguments) if a.name == name), None)


def run_op(target: Any, how: How, args: list, kwargs: dict, group) -> Any:
    """One op on this rank's (converted) arguments."""
    if how in (How.LOCAL, How.WHOLE):
        return target(*args, **kwargs)
    if how is How.VOCAB_EMBEDDING:
        a = bind(target, args, kwargs)
        return shard_ops.vocab_embedding(a["weight"], a["indices"], group, a.get("padding_idx", -1))
    if how is How.VOCAB_LOSS:
        a = bind(target, args, kwargs)
        if "label_smoothing" in a:
            return shard_ops.vocab_cross_entropy(a["self"], a["target"], group, a["reduction"], a["ignore_index"],
                                                 a["label_smoothing"])
        return shard_ops.vocab_nll(a["self"], a["target"], group, a["reduction"], a["ignore_index"])
    if how is How.ROW_LOSS:
        return shard_ops.row_loss(target, args, kwargs, group, _index(target, "reduction"),
                                  _index(target, "ignore_index"))
    out = target(*args, **kwargs)
    if how is How.REDUCE_SUM:
        return collectives.reduce(out, group)
    return collectives.reduce_max(out, group, largest=how is How.REDUCE_MAX)
