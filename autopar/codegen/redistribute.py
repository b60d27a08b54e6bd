"""Redistribution on a tensor-parallel group: the collectives that take a value held in one placement
to the placement an op reads it in, as typed steps.

:func:`convert` is the placement-to-placement table the sharding ILP priced
(solver/sharding_problem.py ``reshard_comms``), so what is priced is what runs. Each step is a record
naming its function in collectives.py (whose forward and backward keep Megatron's gradient
convention) and the dim it takes; :func:`apply_steps` runs a chain of them, codegen/layers.py
emits them into a layer's graph, codegen/standalone.py into a program's source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..plan.placement import Partial, Placement, Replicate, Shard
from ..runtime import collectives

R, P = Replicate(), Partial()


def split_dim(spec: Placement) -> int | None:
    """The dim of a ``Shard``, else None."""
    return spec.dim if isinstance(spec, Shard) else None


@dataclass(frozen=True)
class Step:
    """One collective of a conversion: each kind is a subclass naming its function in collectives.py
    (``function``), run as ``function(value, *step.args, group)``; ``communicates``: in forward."""

    function: ClassVar[Callable[..., torch.Tensor]]
    communicates: ClassVar[bool] = False

    @property
    def args(self) -> tuple[int, ...]:
        return ()

    def __str__(self) -> str:
        return f"{self.function.__name__}({', '.join(map(str, self.args))})"


@dataclass(frozen=True)
class _AlongDim(Step):
    dim: int

    @property
    def args(self) -> tuple[int, ...]:
        return (self.dim,)


@dataclass(frozen=True)
class Split(_AlongDim):
    """R -> S(dim): this rank's block."""
    function = staticmethod(collectives.split)


@dataclass(frozen=True)
class Gather(_AlongDim):
    """S(dim) -> R: all-gather."""
    function = staticmethod(collectives.gather)
    communicates = True


@dataclass(frozen=True)
class GatherPartial(_AlongDim):
    """S(dim) -> R read by an op whose work is split (backward: reduce-scatter)."""
    function = staticmethod(collectives.gather_partial)
    communicates = True


@dataclass(frozen=True)
class ReduceScatter(_AlongDim):
    """P -> S(dim)."""
    function = staticmethod(collectives.reduce_scatter)
    communicates = True


@dataclass(frozen=True)
class Reduce(Step):
    """P -> R: all-reduce."""
    function = staticmethod(collectives.reduce)
    communicates = True


@dataclass(frozen=True)
class Copy(Step):
    """R read by an op whose work is split: identity forward, all-reduce of the gradient (Megatron's ``f``)."""
    function = staticmethod(collectives.copy)


@dataclass(frozen=True)
class ToPartial(Step):
    """R -> P: rank 0 keeps the value."""
    function = staticmethod(collectives.to_partial)


@dataclass(frozen=True)
class KeepFirst(Step):
    """R -> P without ``copy`` (the gradient stays partial)."""
    function = staticmethod(collectives.keep_first)


def apply_steps(value: torch.Tensor, steps: tuple[Step, ...], group) -> torch.Tensor:
    """``value`` through the collectives of a conversion, in order."""
    for step in steps:
        value = step.function(value, *step.args, group)
    return value


# held spec -> required spec: the steps (``partial``: the reading op's work is split over the ranks)
def convert(src: Placement, dst: Placement, partial: bool) -> tuple[Step, ...]:
    """The collectives taking a value held in ``src`` to ``dst`` (both normalised)."""
    s, d = split_dim(src), split_dim(dst)
    if src == dst:
        return (Copy(),) if dst == R and partial else ()
    if src == R:
        if d is not None:
            return (Split(d),)
        return (ToPartial(),)                                       # R -> P
    if src == P:
        if dst == R:
            return (Reduce(), Copy()) if partial else (Reduce(),)
        return (ReduceScatter(d),)
    # src is S(s)
    if dst == R:
        return (GatherPartial(s),) if partial else (Gather(s),)
    if d is not None:
        return (Gather(s), Split(d))
    return (Gather(s), ToPartial())                                 # S -> P
