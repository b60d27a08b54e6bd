"""fp8 linear layers at run time: torchao's float8 training on the generated code's linear calls, on shards.

An fp8 plan (``Precision(compute="fp8", recipe=r)``) runs every linear layer ops.runs_in_fp8 names as torchao's
``Float8Linear`` runs it under ``Float8LinearConfig.from_recipe_name(r)`` (the generated code calls
:class:`Float8Linear` where the exported graph has ``linear(x, w, b)``; codegen/layers.py): the same six
operand casts (``x`` and ``W`` for ``y = x W^T``; ``g`` and ``W`` for ``dx = g W``; ``g`` and ``x`` along their
other dims for ``dW = g^T x``, where the recipe casts them), each by torchao's ``hp_tensor_to_float8_dynamic``,
and the products of torchao's float8 tensors. On a device without fp8 GEMMs (CPUs, GPUs before sm89)
torchao emulates them (``emulate=True``): the same casts, the products in the inputs' precision.

A dynamic scale is the amax of its operand over the dims the recipe scales across (the whole tensor for
a tensor-wise scale; one row, token or channel, for an axis-wise one). Under tensor parallelism a rank
holds a shard: when the shard splits a dim a scale spans, the amax is all-reduced (max) over the
tensor-parallel group (torchao's ``reduce_amax``), so every rank casts with the scale one process uses:

    column-parallel (W split along its outputs n): W^T and g are split along n
    row-parallel (W split along its inputs k):     W^T and x are split along k
    split along the tokens (W whole):              x and g are split along the tokens

Scales over the tokens (a tensor-wise scale of ``x`` or ``g``; ``dW``'s axis-wise casts along the tokens) are
taken over the rows a call sees: a rank's micro-batch, where one process sees its whole batch (data
parallelism and micro-batches change them; ``rowwise_with_gw_hp``, whose every scale is one token's or one
channel's, computes what one process does whatever the rows).

**Weights gathered in fp8** (Precision.gathers_fp8: tensor-wise scales under ZeRO 2-3, no tensor
parallelism): the weights only fp8 linear layers read are torchao's ``WeightWithDynamicFloat8CastTensor``
under FSDP2 (:func:`gathered_in_fp8`), whose pre-all-gather hook casts each rank's shard with the whole
weight's scale (its amax all-reduced over the shards) and whose gather moves the fp8 bytes; the linear
takes the gathered fp8 weight as it is (the cast it would make gives the same values). gloo has no fp8
type: :func:`gather_bytes` has FSDP2 move them as bytes there.

Imports torch and torchao only (torchao when an fp8 program is built).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

SPLITS = (None, "column", "row", "tokens")
"""How tensor parallelism splits a linear: not at all, along its weight's outputs, along its inputs, along
the tokens (its activations split, its weight whole, the weight gradient a partial sum)."""


def split_dims(split: str | None, token_dim: int = 0) -> tuple[int | None, ...]:
    """The dim each operand's shard splits under ``split`` (None: whole), for ``x`` (..., k), ``W^T`` (k, n),
    and ``g`` (m, n) and ``x`` (m, k) as the backward flattens them (``token_dim``: the tokens' dim of ``x``)."""
    return {None: (None, None, None, None), "column": (None, 1, 1, None), "row": (-1, 0, None, 1),
            "tokens": (token_dim, None, 0, 0)}[split]


class Float8Linear(nn.Module):
    """``forward(x, weight, bias=None, split=None, token_dim=0)``: ``linear`` as torchao's float8 training runs
    it under ``recipe``, on this rank's shards (``split``: SPLITS, ``token_dim`` the dim of ``x`` a "tokens" split
    cuts; scales all-reduced over ``mesh``, the tensor-parallel DeviceMesh); ``emulate``: emulate the fp8
    GEMMs (devices without them). One per program."""

    def __init__(self, recipe: str, emulate: bool, mesh: Any = None) -> None:
        super().__init__()
        try:
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear as AoLinear
        except ImportError as e:
            raise ImportError("an fp8 plan runs its linear layers through torchao's float8 training: pip install "
                              "torchao (or re-plan with Precision(compute='bf16'))") from e
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        # torchao's own module builds the GEMM configs from the recipe: take them from one (on meta)
        probe = AoLinear.from_float(nn.Linear(16, 16, device="meta"), config=config)
        self.recipe, self.emulate, self.mesh = recipe, emulate, mesh
        self._config, self._mm_config = probe.config, probe.linear_mm_config

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                split: str | None = None, token_dim: int = 0) -> torch.Tensor:
        if split is not None and self.mesh is None:
            raise ValueError(f"a {split}-parallel fp8 linear needs the tensor-parallel mesh its scales reduce over")
        out = _Float8Matmul.apply(x, weight.t(), self._mm_config, self._config, split_dims(split, token_dim),
                                  self.mesh)
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}, emulate={self.emulate}"


def _cast(t: torch.Tensor, cast_config: Any, role: Any, axis: int, split: int | None, mm_config: Any,
          config: Any, mesh: Any) -> torch.Tensor:
    """``t`` to torchao's float8 under ``cast_config`` (``axis``: the dim an axis-wise scale spans; ``split``:
    the dim this rank's shard splits, None when whole): its amax reduced over ``mesh`` when the scale spans
    the split dim."""
    from torchao.float8.config import ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    if cast_config.scaling_type is ScalingType.DISABLED or tensor_already_casted_to_fp8(t):
        return t   # a weight FSDP2 gathered in fp8, cast on each shard with the whole weight's scale
    dim = get_maybe_axiswise_dim(axis, cast_config.scaling_granularity)
    reduce = split is not None and (dim is None or dim % t.dim() == split % t.dim())
    return hp_tensor_to_float8_dynamic(t, cast_config.target_dtype, mm_config, reduce_amax=reduce,
                                       gemm_input_role=role, device_mesh=mesh if reduce else None,
                                       scaling_granularity=cast_config.scaling_granularity, axiswise_dim=dim,
                                       round_scales_to_power_of_2=config.round_scales_to_power_of_2)


class _Float8Matmul(torch.autograd.Function):
    """``x @ w_t`` with fp8 operands, as torchao's ``matmul_with_hp_or_float8_args`` (which keeps ``x`` and
    ``w_t`` in their own precision for backward), each cast's amax reduced over the split dims."""

    @staticmethod
    def forward(ctx, x, w_t, mm_config, config, splits, mesh):
        from torchao.float8.float8_training_tensor import GemmInputRole
        ctx.save_for_backward(x, w_t)
        ctx.mm_config, ctx.config, ctx.splits, ctx.mesh = mm_config, config, splits, mesh
        sx, sw, _, _ = splits
        x8 = _cast(x, config.cast_config_input, GemmInputRole.INPUT, -1, sx, mm_config, config, mesh)
        w8 = _cast(w_t, config.cast_config_weight, GemmInputRole.WEIGHT, 0, sw, mm_config, config, mesh)
        shape = x8.shape
        return torch.mm(x8.reshape(-1, shape[-1]), w8).reshape(*shape[:-1], w_t.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        from torchao.float8.float8_training_tensor import GemmInputRole
        x, w_t = ctx.saved_tensors
        c, mm, mesh = ctx.config, ctx.mm_config, ctx.mesh
        sx, sw, sg, sx2 = ctx.splits
        g = grad.reshape(-1, grad.shape[-1])
        g8 = _cast(g, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, sg, mm, c, mesh)
        w8 = _cast(w_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, sw, mm, c, mesh)
        grad_x = torch.mm(g8, w8.t()).reshape(*grad.shape[:-1], w_t.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        g8w = _cast(g, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, sg, mm, c, mesh)
        x8w = _cast(x2, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, sx2, mm, c, mesh)
        grad_w = torch.mm(g8w.t(), x8w)
        return grad_x, grad_w.t(), None, None, None, None


def gathered_in_fp8(param: nn.Parameter, fp8: Float8Linear) -> nn.Parameter:
    """``param`` as torchao's fp8-gathered weight (module docstring), before FSDP2 shards it."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    weight = WeightWithDynamicFloat8CastTensor(param.data, fp8._mm_config, fp8._config.cast_config_weight.target_dtype)
    return nn.Parameter(weight, requires_grad=param.requires_grad)


def fp8_gathered(params: Any) -> list[torch.Tensor]:
    """Of ``params`` (parameters, DTensors under FSDP2), the weights :func:`gathered_in_fp8` made."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    return [p for p in params if isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor)]


@torch.no_grad()
def refresh_scales(weights: list[torch.Tensor], group: Any, fp8: Float8Linear) -> None:
    """Before a step's first gather: every fp8-gathered weight's scale from its amax over all its shards, in one
    all-reduce over the shards' ``group`` (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, which looks
    for its own Float8Linear modules; without it each weight's gather all-reduces its own amax first). The
    scale is torchao's of that amax, as a cast of the whole weight computes it."""
    import torch.distributed as dist
    from torchao.float8.float8_utils import amax_to_scale
    if not weights:
        return
    shards = [getattr(w, "_local_tensor", w) for w in weights]
    amax = torch.stack([s._tensor.abs().max() if s._tensor.numel() else s._tensor.new_zeros(())
                        for s in shards]).float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for s, a in zip(shards, amax):
        s._precomputed_scale = amax_to_scale(a, s._dtype, fp8._config.round_scales_to_power_of_2)


def gather_bytes(module: nn.Module) -> None:
    """Have FSDP2 module ``module`` gather its fp8 weights as bytes when it holds any and the backend has no fp8
    type (gloo; NCCL moves fp8 as it is)."""
    import torch.distributed as dist
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    if dist.get_backend() == "nccl" or not any(
            isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor) for p in module.parameters()):
        return
    if not hasattr(module, "set_custom_all_gather"):
        from .errors import ConfigError
        raise ConfigError(f"gathering fp8 weights over {dist.get_backend()} needs FSDP2's set_custom_all_gather, "
                          f"which this torch ({torch.__version__}) lacks: upgrade torch, or plan with a row-wise recipe")
    module.set_custom_all_gather(_byte_all_gather())


def _byte_all_gather() -> Any:
    """FSDP2's default all-gather with its fp8 buffers viewed as bytes (built on first use: the module holding it
    is FSDP2's own, private, and newer than torch 2.6)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class ByteAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, async_op)
    return ByteAllGather()


def emulated(device: torch.device) -> bool:
    """Whether fp8 GEMMs are emulated on ``device``: no fp8 tensor cores (CPUs; NVIDIA before sm89)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)
