"""The vocabulary of context parallelism shared by the analysis (context.py) and the runner
(layers.py, context_ops.py): value states, the conversions of an op's inputs, how each node runs
(:class:`ContextOp`), and the plan holding them for one graph.

A value is :data:`FULL` (the whole sequence, the same on every rank of the group), :class:`Local`
(one dim holds this rank's tokens) or :data:`PARTIAL` (its true value is the group's mean of the
ranks' values); context.py's docstring gives the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence, Union

import torch


@dataclass(frozen=True)
class Full:
    """The whole sequence in its original order, the same on every rank of the group."""

    def __repr__(self) -> str:
        return "FULL"


@dataclass(frozen=True)
class PartialMean:
    """A value whose true value is the group's mean of the ranks' values."""

    def __repr__(self) -> str:
        return "PARTIAL"


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


FULL, PARTIAL = Full(), PartialMean()
State = Union[Full, Local, PartialMean]


@dataclass(frozen=True)
class GatherTokens:
    """A Local value (``layout``) made whole: context_ops.gather."""

    layout: Local


@dataclass(frozen=True)
class TakeTokens:
    """A whole value cut to this rank's tokens along ``layout``: context_ops.take_tokens."""

    layout: Local


@dataclass(frozen=True)
class Resolve:
    """A PARTIAL value made whole (the group's mean): context_ops.resolve."""


Conversion = Union[GatherTokens, TakeTokens, Resolve]
Conv = tuple   # one input's conversion: a chain of Conversion, applied in order


class Mode(Enum):
    """How a node runs under context parallelism (context.py's rules)."""

    FULL = "full"                 # as is, on whole inputs
    PARTIAL = "partial"           # linear in its PARTIAL inputs: they stay PARTIAL
    LOCAL = "local"               # token-wise on this rank's tokens
    REDUCE = "reduce"             # a sum / mean over the Local dim: this rank's part, PARTIAL
    RING = "ring"                 # ring attention over the group's keys and values
    LOCAL_QUERY = "local_query"   # attention of this rank's queries against whole keys and values
    LOSS_MEAN = "loss_mean"       # a mean loss over the group's targets

    @property
    def replaces_op(self) -> bool:
        """Whether the node runs as another op than its own (attention, the mean loss)."""
        return self in (Mode.RING, Mode.LOCAL_QUERY, Mode.LOSS_MEAN)


@dataclass(frozen=True)
class ContextOp:
    """How one node runs: ``mode``, its tensor inputs (value names, argument order) with the
    conversion each needs, its output state, top-level argument rewrites and an output scale."""

    mode: Mode
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
    steps: dict[str, ContextOp]
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
