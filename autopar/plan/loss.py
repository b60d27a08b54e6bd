"""How a plan's loss was made (:class:`LossSource`): the record plans carry (capture/loss.py checks it).

- ``"model"``: the model's own loss (``output.loss``: a Hugging Face model given ``labels``), or a
  scalar the model returns;
- ``"loss_fn"``: ``loss_fn(output, inputs)``, named by its qualified name ``module:qualname``;
- ``"stand-in"``: the mean of the model's (first) floating output, when it returns no loss and no
  ``loss_fn`` was given: fine to plan with, not to train on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

MODEL, LOSS_FN, STAND_IN = "model", "loss_fn", "stand-in"
KINDS = (MODEL, LOSS_FN, STAND_IN)
PARALLELIZE, EMIT = "parallelize", "emit"   # where a loss_fn is passed to train (check_loss's ``to``)

HOW_TO_PLAN = ("plan with labels in example_inputs (a Hugging Face model computes its own loss from them) "
               "or with loss_fn=pkg.mod:fn (loss_fn(output, inputs) -> scalar; inputs are the example inputs, "
               "keys forward does not take included)")


@dataclass(frozen=True)
class LossSource:
    """How the loss a plan was priced with was made: ``kind`` one of ``KINDS``; ``name`` the
    ``module:qualname`` of a ``loss_fn`` (None for the other kinds)."""

    kind: str
    name: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind {self.kind!r} must be one of {', '.join(map(repr, KINDS))}")
        if self.kind == LOSS_FN and not (isinstance(self.name, str) and self.name):
            raise ValueError(f"loss.name {self.name!r} must name the loss_fn ('module:qualname')")
        if self.kind != LOSS_FN and self.name is not None:
            raise ValueError(f"loss.name must be null for loss.kind {self.kind!r}, got {self.name!r}")

    @classmethod
    def of(cls, loss_fn: Any) -> "LossSource":
        """The record of a ``loss_fn`` callable."""
        return cls(LOSS_FN, qualified_name(loss_fn))

    def describe(self) -> str:
        return {MODEL: "the model's own loss", LOSS_FN: f"loss_fn={self.name}",
                STAND_IN: "a stand-in loss (the mean of the model's output: the model returned no loss and no "
                          "loss_fn was given)"}[self.kind]

    @property
    def note(self) -> str | None:
        """What a plan priced with this loss says in its notes (a stand-in only)."""
        if self.kind != STAND_IN:
            return None
        return (f"priced with {self.describe()}; a plan of it cannot train (parallelize and codegen.emit refuse "
                f"it): {HOW_TO_PLAN}, and pass the same loss_fn to parallelize")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LossSource":
        """Raises ValueError naming the field (autopar/plan/io.py turns it into a PlanFormatError)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"loss = {data!r} must be an object with 'kind' and 'name'")
        if set(data) != {"kind", "name"}:
            raise ValueError(f"loss = {dict(data)!r} must have exactly the keys 'kind' and 'name'")
        return cls(data["kind"], data["name"])


def qualified_name(fn: Any) -> str:
    """``module:qualname`` of a function (of a callable object: of its class). A script's functions are
    ``__main__``'s in the process that runs it and ``__mp_main__``'s in the processes multiprocessing's
    spawn starts from it (torch.multiprocessing included): the same module, named ``__main__`` in both."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    module = "__main__" if module == "__mp_main__" else module
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}"
