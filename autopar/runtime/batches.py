"""Batches of a plan's inputs: zero-filled example inputs rebuilt from the plan's record of them, and
the rows of a global batch that one micro-batch takes.

Imports only torch: the standalone folder (standalone.py) runs this file beside its train.py, as the
in-process runtime does through codegen/inputs.py, so that both build and slice batches one way.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


def example_at(record: Mapping[str, Any], batch_size: int, device: torch.device | str = "cpu") -> Any:
    """Zero-filled inputs shaped like ``record`` (``plan.extra["inputs"]``: codegen/inputs.py) with
    dim 0 of every batched tensor set to ``batch_size``. A malformed record raises ValueError."""
    def make(spec: Any) -> Any:
        if spec is None:
            return None
        shape = list(spec["shape"])
        if shape:
            shape[0] = batch_size
        return torch.zeros(shape, dtype=getattr(torch, spec["dtype"]), device=device)

    kind = record.get("kind")
    if kind == "tensor":
        return make(record["args"][0])
    if kind == "kwargs":
        return {k: make(v) for k, v in record["kwargs"].items()}
    if kind == "args":
        return tuple(make(v) for v in record["args"])
    raise ValueError(f"malformed inputs record {record!r}")


def slice_batch(batch: Any, start: int, stop: int, global_batch: int) -> Any:
    """Rows ``start:stop`` of every tensor of the batch whose dim 0 is the global batch size."""
    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == global_batch:
            return t[start:stop]
        return t

    if isinstance(batch, torch.Tensor):
        return cut(batch)
    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items()}
    return tuple(cut(v) for v in batch)


def replica_micro_batches(batch: Any, replica: int, replicas: int, micro_batch_size: int, micro_batches: int,
                          global_batch: int) -> list[Any]:
    """Data-parallel replica ``replica``'s micro-batches of the global ``batch``: it takes the
    ``global_batch / replicas`` rows from ``replica * global_batch / replicas`` on, in
    ``micro_batches`` consecutive runs of ``micro_batch_size`` rows (the whole batch unsliced when a
    micro-batch is the global batch). Both drivers cut a step's batch with this."""
    if micro_batch_size == global_batch:
        return [batch]
    per = global_batch // replicas
    return [slice_batch(batch, replica * per + i * micro_batch_size, replica * per + (i + 1) * micro_batch_size,
                        global_batch) for i in range(micro_batches)]
