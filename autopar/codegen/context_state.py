"""The vocabulary of context parallelism shared by the analysis (context.py) and the runner
(layers.py, context_ops.py): value states, per-node steps, and the plan holding both for one graph.

A value is FULL (``None``: the whole sequence, the same on every rank of the group),
:class:`Local` (one dim holds this rank's tokens) or PARTIAL (its true value is the group's mean
of the ranks' values); context.py's docstring gives the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Local:
    """Dim ``dim`` holds this rank's tokens of a sequence of ``seq``, merged as ``(outer, seq, inner)``."""

    dim: int
    seq: int
    outer: int = 1
    inner: int = 1

    def full_size(self) -> int:
        return self.outer * self.seq * self.inner

    def local_size(self, cp: int) -> int:
        return self.outer * (self.seq // cp) * self.inner

    def at(self, dim: int) -> "Local":
        return Local(dim, self.seq, self.outer, self.inner)


class _Partial:
    def __repr__(self) -> str:
        return "PARTIAL"


PARTIAL = _Partial()
FULL = None
State = Any   # Local | PARTIAL | None (FULL)

# A conversion of one input before an op: a chain of ("gather", layout) / ("slice", layout) / ("resolve", None).
Conv = tuple


@dataclass(frozen=True)
class Step:
    """How one node runs: ``mode``, its tensor inputs (value names, argument order) with the
    conversion each needs, its output state, top-level argument rewrites and an output scale."""

    mode: str
    inputs: tuple[str, ...]
    convert: tuple[Conv, ...]
    out: State
    rewrite: tuple[tuple[int, Any], ...] = ()
    scale: float = 1.0


@dataclass
class ContextPlan:
    """The state of every value and the step of every node, for one exported program and ``cp``."""

    cp: int
    states: dict[str, State]
    steps: dict[str, Step]
    inputs: dict[str, Local]          # graph inputs sharded before the first chunk

    def local_shape(self, value: str, shape: Sequence[int]) -> tuple[int, ...]:
        """The local shape of ``value`` whose full shape is ``shape``."""
        state = self.states.get(value)
        out = list(shape)
        if isinstance(state, Local) and out:
            out[state.dim] = state.local_size(self.cp)
        return tuple(out)


def holds_tensor(value: Any) -> bool:
    """A tensor, or a list/tuple holding one (an op's ``meta["val"]``)."""
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class ContextRank:
    """What one rank's generated code needs of context parallelism: the graph's plan, the
    context-parallel group, this rank's index in it and the deadline of each wait (seconds)."""

    plan: ContextPlan
    group: Any
    rank: int
    timeout: float
