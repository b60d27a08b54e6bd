"""fp8 linear layers at run time: torchao's float8 training on the generated code's linear calls.

An fp8 plan (``Precision(compute="fp8", recipe=r)``) runs every linear layer ops.runs_in_fp8 names through
torchao's own ``matmul_with_hp_or_float8_args`` under ``Float8LinearConfig.from_recipe_name(r)``, the function
torchao's ``Float8Linear.forward`` calls, so that a rank computes what a model converted by
``torchao.float8.convert_to_float8_training`` computes on the same rows (the generated code calls
:class:`Float8Linear` where the exported graph has ``linear(x, w, b)``; codegen/layers.py). On a device
without fp8 GEMMs (CPUs, GPUs before sm89) torchao emulates them (``emulate=True``): the same casts to
fp8, the products in the input's precision.

The dynamic scales are computed from what a rank holds. Row-wise scales (per token of an activation or
gradient, per channel of a weight: ``rowwise``, ``rowwise_with_gw_hp``'s forward and input gradient) do not
depend on which other rows share the rank, so data and pipeline parallelism compute exactly what one
process does; a tensor-wise scale (``tensorwise``, and the weight gradient's casts of ``rowwise``, along
the tokens) is taken over a rank's micro-batch, which one process computes over its whole batch instead.
Tensor parallelism splits a linear's operands, whose scales torchao would all-reduce across the group;
the runtime does not, and refuses such plans (driver/program.py).

Imports torch and torchao only (torchao when an fp8 program is built).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


class Float8Linear(nn.Module):
    """``forward(x, weight, bias)``: torchao's float8 ``linear`` under ``recipe`` (one instance per program,
    shared by its layers' calls); ``emulate``: emulate the fp8 GEMMs (devices without them)."""

    def __init__(self, recipe: str, emulate: bool) -> None:
        super().__init__()
        try:
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear as AoLinear
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        except ImportError as e:
            raise ImportError("an fp8 plan runs its linear layers through torchao's float8 training: pip install "
                              "torchao (or re-plan with Precision(compute='bf16'))") from e
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        # torchao's own module builds the GEMM configs from the recipe: take them from one (on meta)
        probe = AoLinear.from_float(nn.Linear(16, 16, device="meta"), config=config)
        self.recipe, self.emulate = recipe, emulate
        self._config, self._mm_config, self._matmul = probe.config, probe.linear_mm_config, matmul_with_hp_or_float8_args

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._matmul.apply(x, weight.t(), self._mm_config, self._config)   # as torchao's Float8Linear.forward
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}, emulate={self.emulate}"


def emulated(device: torch.device) -> bool:
    """Whether fp8 GEMMs are emulated on ``device``: no fp8 tensor cores (CPUs; NVIDIA before sm89)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)
