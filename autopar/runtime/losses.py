"""The step's micro-batch losses on every rank: one mechanism for both drivers.

Each pipeline's last stage computes its replica's micro-batch losses (its first tensor-parallel rank
owns them; the other tp ranks computed the same values). After a rank's last forward of the step,
:meth:`LossShare.start` puts the owner's losses into their slots of a ``replicas * micro_batches``
vector (fp32, float64 for a float64 model: :func:`loss_dtype`), zeros elsewhere (:func:`loss_slots`),
so that a sum over every rank gives every replica's losses to every rank. That sum is

- nothing, when every rank computed every loss already (tensor parallelism alone:
  ``ParallelConfig.shares_losses`` is False);
- carried in the data-parallel gradients' last bucket when that all-reduce spans every rank
  (``ParallelConfig.losses_ride_gradients``: one collective a step, as DDP's, not two; the
  :class:`~.data_parallel.GradReducer` writes the sums back when it finishes);
- otherwise an all-reduce of its own, started at once so that it runs under the backward passes left.

:meth:`LossShare.result`, after the gradients' reduction finished, waits (with a deadline,
failures.py) and returns the micro-batch losses, divided by the context-parallel degree (each cp
rank reports its share of a sequence's loss). ``autopar.parallelize``'s Program and the standalone
train.py both run this; the cost model prices the same choice (StepTail.loss_share_time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .failures import start, wait_or_fail


def loss_dtype(storage: str) -> torch.dtype:
    """The dtype a step's losses are kept and shared in, for a plan whose weights and activations are in
    ``storage`` (Precision.storage): fp32, which holds a 16-bit loss exactly, or float64 for a float64 plan,
    whose losses fp32 would round."""
    return torch.float64 if storage == "fp64" else torch.float32


def loss_slots(losses: Sequence[torch.Tensor], owner: bool, replicas: int, replica: int, micro_batches: int,
               device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of every replica's micro-batch losses (``replicas * micro_batches`` values of ``dtype``,
    replica-major): the ``owner`` of this replica's (its last pipeline stage's first tensor-parallel rank)
    its losses in its slots, every other value zero, so that a sum over every rank gives them all."""
    per = torch.zeros(replicas * micro_batches, device=device, dtype=dtype)
    if owner:
        per[replica * micro_batches:(replica + 1) * micro_batches] = torch.stack(list(losses)).detach().to(dtype)
    return per


@dataclass
class LossShare:
    """Shares one rank's step losses (see the module's docstring). ``shares`` and ``ride`` are the
    plan's ``ParallelConfig.shares_losses`` and ``losses_ride_gradients``; ``owner``: this rank holds
    its replica's losses (last pipeline stage, tp rank 0); ``dtype``: what they are kept in (:func:`loss_dtype`);
    ``reducer``: the gradients' GradReducer that may carry them (None under ZeRO-2/3 or without replicas)."""
    shares: bool
    ride: bool
    owner: bool
    replicas: int
    replica: int
    micro_batches: int
    cp: int
    device: torch.device
    timeout: float
    dtype: torch.dtype
    reducer: Any = None
    _work: Any = field(default=None, init=False, repr=False)                    # the all-reduce under way
    _values: torch.Tensor | None = field(default=None, init=False, repr=False)  # this step's losses

    def start(self, losses: Sequence[torch.Tensor]) -> None:
        """After this rank's last forward of the step (a PipelineRunner's ``after_forwards``)."""
        self._work = None
        if not self.shares:
            self._values = torch.stack(list(losses)).detach().to(self.dtype).reshape(self.micro_batches)
            return
        self._values = loss_slots(losses, self.owner, self.replicas, self.replica, self.micro_batches, self.device,
                                  self.dtype)
        if not (self.ride and self.reducer is not None and self.reducer.carry(self._values)):
            self._work = start(dist.all_reduce, self._values, async_op=True)

    def result(self) -> torch.Tensor:
        """Every replica's micro-batch losses (replica-major, on the CPU when shared; the local ones on
        this rank's device otherwise), once the gradients' reduction (which may carry them) finished."""
        if self._values is None:
            raise RuntimeError("LossShare.result before start: the step ran no forward of the last stage")
        if not self.shares:
            return self._values
        if self._work is not None:
            wait_or_fail(self._work, self.timeout, "all_reduce of the step's losses")
        return (self._values if self.cp == 1 else self._values / self.cp).cpu()
