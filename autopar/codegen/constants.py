"""The values of the constants a meta model's forward makes from data, without its weights.

A forward that makes a tensor from Python data on a parameter's or an input's device
(``torch.tensor([-1], device=q.device)``: Falcon's and GPT-Neo's attention, CpmAnt's mask) makes it
on the meta device when the model is there, and ``torch.export`` lifts it as a constant with no
value. Its value depends on the data only, not on any weight: ``fill_made_constants`` exports the
model a second time with its parameters and buffers swapped for fake CPU tensors (FakeTensorMode:
shapes and a device, no storage), where the forward makes those constants on the CPU with their
values, and writes the values into the meta program (same forward, same constant names). Nothing
the size of a weight is allocated. Only a program that has such constants pays the second export.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..capture.export import run_export, swapped_tensors


def made_on_meta(program: ExportedProgram) -> list[str]:
    """The program's constants the forward made on the meta device with elements (no value to run with)."""
    return [spec.target for spec in program.graph_signature.input_specs
            if spec.kind is InputKind.CONSTANT_TENSOR and program.constants[spec.target].is_meta
            and program.constants[spec.target].numel() > 0]


def fill_made_constants(program: ExportedProgram, model: nn.Module, inputs: Callable[[torch.device], Any],
                        loss_fn: Any) -> None:
    """Give ``program`` (exported from meta ``model`` on ``inputs(meta)``) the values of the constants its
    forward made on meta (``made_on_meta``), from an export on fake CPU tensors (module docstring). A
    constant the fake export makes without a value stays on meta (meta_buffers then names it)."""
    wanted = made_on_meta(program)
    if not wanted:
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _on_fake_cpu(model, mode):
        with mode:
            example = _fake(inputs(torch.device("cpu")))
        fake_program = run_export(model, example, loss_fn, train_mode=False)
    for target in wanted:
        value = fake_program.constants.get(target)
        if (isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and not value.is_meta
                and value.shape == program.constants[target].shape):
            program.constants[target] = value.detach().clone()


def _fake(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, tree)


def _on_fake_cpu(model: nn.Module, mode: FakeTensorMode) -> contextlib.AbstractContextManager[None]:
    """While open, every parameter and buffer of ``model`` is a fake CPU tensor of its shape (ties kept)."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return swapped_tensors(model, fake)
