"""Where a tensor's elements live across a tensor-parallel group: the one placement vocabulary.

The solver's strategies, the cost model, plan files and the compiler all speak it (DTensor's
vocabulary, without importing torch, so a plan file reads without it):

- ``Replicate()``: every rank holds the whole tensor;
- ``Shard(dim)``: rank ``r`` of ``t`` holds the ``r``-th of ``t`` contiguous blocks along ``dim``;
- ``Partial()``: every rank holds a summand; the tensor is their sum.

In JSON a placement is its short text, ``"R"``, ``"S(1)"``, ``"P"``, read back by
:func:`placement_from_json`, which names a malformed value. A plan's sharding also writes ``"C"``
for what an op the solver ran as a batch-independent constant (a mask, a rotary table) reads and
makes: every rank computes it whole, so it reads back as ``Replicate()``; whether a value is such
a constant is the graph's to say (``OpNode.batch_dependent``), not a fourth placement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from ..errors import PlanFormatError


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Split along ``dim`` in contiguous blocks, one per rank."""

    dim: int

    def __post_init__(self) -> None:
        if type(self.dim) is not int:
            raise TypeError(f"Shard(dim) takes an int dim, not {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand of the tensor (a reduction is owed)."""

    def __str__(self) -> str:
        return "P"


Placement = Union[Replicate, Shard, Partial]

_SHARD = re.compile(r"S\((-?\d+)\)")


_CONSTANT = "C"   # version-2 plans wrote it for what a batch-independent constant op reads and makes


def normal(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` of a 3-D tensor -> ``Shard(2)``; other placements unchanged."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim % max(ndim, 1))
    return placement


def placement_from_json(text: object, where: str = "placement") -> Placement:
    """``"R"`` / ``"S(d)"`` / ``"P"`` (and a version-2 plan's ``"C"``, a constant: Replicate) -> the placement; anything else
    is a PlanFormatError naming ``where``."""
    if text == "R" or text == _CONSTANT:
        return Replicate()
    if text == "P":
        return Partial()
    match = _SHARD.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise PlanFormatError(f"{where} = {text!r} is not a placement: expected \"R\", \"P\" or \"S(dim)\"")
    return Shard(int(match.group(1)))


def placement_to_json(placement: Placement) -> str:
    """The placement's text: ``"R"``, ``"S(d)"``, ``"P"``."""
    return str(placement)
