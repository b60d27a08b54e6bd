"""The shape of a model's inputs, recorded in the plan, and example inputs rebuilt from it.

``autopar.plan`` / ``autopar.estimate`` store ``plan.extra["inputs"]``: how the example inputs
were passed (a tensor, positional tensors or keyword tensors) with each tensor's shape and
dtype. ``parallelize`` rebuilds zero-filled inputs of one micro-batch from it to export the
model again (export traces fake tensors, so values never matter), and checks real batches
against it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from ..errors import ConfigError, PlanMismatchError
from ..runtime import batches


def describe_inputs(example_inputs: Any) -> dict[str, Any]:
    """JSON-native record of the inputs' structure, shapes and dtypes."""
    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        return None

    if isinstance(example_inputs, torch.Tensor):
        return {"kind": "tensor", "args": [leaf(example_inputs)]}
    if isinstance(example_inputs, Mapping):
        return {"kind": "kwargs", "kwargs": {k: leaf(v) for k, v in example_inputs.items()}}
    return {"kind": "args", "args": [leaf(v) for v in example_inputs]}


def with_inputs(plan: Any, example_inputs: Any) -> Any:
    """``plan`` (an autopar.Plan) with ``extra["inputs"]`` recording ``example_inputs``."""
    return dataclasses.replace(plan, extra={**plan.extra, "inputs": describe_inputs(example_inputs)})


def example_at(record: Mapping[str, Any], batch_size: int, device: torch.device | str = "cpu") -> Any:
    """Zero-filled inputs shaped like ``record`` with dim 0 of every batched tensor set to ``batch_size``
    (runtime/batches.py); a malformed record is refused as a PlanMismatchError."""
    try:
        return batches.example_at(record, batch_size, device)
    except ValueError as exc:
        raise PlanMismatchError(f"plan.extra['inputs'] is malformed ({record!r}): re-plan, or pass "
                                "example_inputs=") from exc


def check_batch(batch: Any, record: Mapping[str, Any] | None, global_batch: int) -> None:
    """Refuse a batch whose structure or batch size is not the plan's."""
    leaves = [batch] if isinstance(batch, torch.Tensor) else list(batch.values()) if isinstance(batch, Mapping) \
        else list(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim()}
    if global_batch not in sizes:
        raise ConfigError(f"the batch's tensors have dim-0 sizes {sorted(sizes)}, but the plan's global batch size "
                          f"is {global_batch}: pass the whole global batch (every rank the same) to the program")
    if record is None:
        return
    if record.get("kind") == "kwargs":
        if not isinstance(batch, Mapping) or set(batch) != set(record["kwargs"]):
            got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ConfigError(f"the batch has keys {got}, the plan's inputs are {sorted(record['kwargs'])}: "
                              "pass the same keys as the example inputs")
        pairs = [(repr(k), batch[k], spec) for k, spec in record["kwargs"].items()]
    elif record.get("kind") in ("args", "tensor"):
        pairs = [(f"input {i}", t, spec) for i, (t, spec) in enumerate(zip(leaves, record.get("args") or []))]
    else:
        return
    for name, tensor, spec in pairs:
        # the program was exported at the plan's sizes: only the batch dim may differ from the example's
        if isinstance(tensor, torch.Tensor) and spec and tensor.dim() and list(tensor.shape[1:]) != spec["shape"][1:]:
            raise ConfigError(f"the batch's {name} is {list(tensor.shape)}, but the plan was made for "
                              f"[batch, {', '.join(map(str, spec['shape'][1:]))}]: pass inputs of the plan's sizes "
                              "(sequence length, image size...) or re-plan with example inputs of these")
