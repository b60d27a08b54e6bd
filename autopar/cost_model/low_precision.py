r"""FP8 linear layers: which ops run their GEMMs in fp8, and what the casts around them cost.

Under ``Precision(compute="fp8", recipe=r)`` the program converts every ``nn.Linear`` whose in- and
out-features are multiples of 16 to an fp8 linear (torchao's ``convert_to_float8_training``, Transformer
Engine's ``te.Linear``): the three GEMMs of such a layer (forward ``y = x W^T``, input gradient
``dx = g W``, weight gradient ``dW = g^T x``) run on the fp8 tensor cores; attention, norms, the loss,
a mixture-of-experts layer's grouped expert GEMMs and every other op stay in bf16, and the layer saves its
bf16 input for backward (torchao's ``matmul_with_hp_or_float8_args``), so activation memory is bf16's.

**GEMMs.** For a linear of ``m x k`` input, ``k x n`` weight and ``F`` forward FLOPs:

    t_gemm = F (1 + 2) / (P_r * e_8(m, n, k))        (P_r: the recipe's peak, "fp8" or "mxfp8")

with ``e_8`` compute.py's efficiency model at ``Device.fp8_matmul_efficiency`` (the fp8 kernels' share
of their peak) in place of ``matmul_efficiency``. ``rowwise_with_gw_hp`` runs ``dW`` in bf16
(``F / (P_bf16 e)``).

**Casts.** Every fp8 operand is cast from bf16 by a scale: tensor- and row-wise, the amax of the
tensor (row) and a scaled cast; block scaling (MXFP8), each 32-element block's scale inside the cast
kernel. torchao casts six operands per layer and micro-batch: ``x`` and ``W`` for the forward; ``g``,
``W`` again, ``g`` along its other dimension and ``x`` along it for the backward (the layer keeps ``x``
in bf16; ``rowwise_with_gw_hp``: the first four). The bytes per element of one cast:

    fused kernels ("fused", "compiled": torch.compile, which torchao's float8 training is run under): the
        amax reduces what the producing kernel writes, in that kernel; the cast reads 2, writes 1: 3
    MXFP8: one pass, read 2, write 1 and a scale byte per 32-element block: 3 + 1/32
    eager: abs (read 2, write 2) and max (read 2), then multiply, clamp and convert (4 + 4 + 3): 17,
        five kernels

each time at the device's streaming bandwidth, plus a launch per kernel.

**Scales across ranks.** A tensor-wise scale is the amax of the whole logical tensor: when tensor
parallelism shards an operand each cast all-reduces one fp32 scalar over the tensor-parallel group
(torchao under DTensor), priced as ``AMAX_SYNCS`` latency-bound all-reduces per layer and micro-batch
(the three sharded operands' forward and backward casts). Row-wise and block scales are local.

Not priced: delayed scaling (Transformer Engine's amax history; torchao dropped it), the fp8 weight
copies' transient memory, and FSDP2's fp8 all-gather (a tensor-wise plan's ZeRO-3 gathers are priced in
bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from ..capture.opgraph import Gemm, OpKind, OpNode
from ..config import Precision
from ..errors import ConfigError
from ..hardware import Device
from ..ops import runs_in_fp8

BLOCK = 32              # MXFP8 scale block (elements)
AMAX_SYNCS = 4          # tensor-wise scalar all-reduces per sharded fp8 linear and micro-batch


@dataclass(frozen=True)
class Recipe:
    """One fp8 scaling recipe: the peak its GEMMs run at, how many operands it casts per layer and
    micro-batch (forward, backward), whether the weight gradient stays bf16, and its scale's reach."""

    name: str
    peak: str                   # Device.peak_flops key of its GEMMs
    casts_fwd: int
    casts_bwd: int
    hp_grad_weight: bool = False
    block_scaled: bool = False  # scale per 32-element block, computed in the cast kernel
    tensor_scale: bool = False  # one scale per tensor: a sharded operand all-reduces its amax


RECIPES: Mapping[str, Recipe] = MappingProxyType({
    "tensorwise": Recipe("tensorwise", "fp8", 2, 4, tensor_scale=True),
    "rowwise": Recipe("rowwise", "fp8", 2, 4),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp", "fp8", 2, 2, hp_grad_weight=True),
    "mxfp8": Recipe("mxfp8", "mxfp8", 2, 4, block_scaled=True),
})


def recipe_of(precision: Precision) -> Recipe | None:
    """The fp8 recipe ``precision`` runs its linear layers with, or None (no fp8)."""
    return RECIPES[precision.recipe] if precision.compute == "fp8" else None


def check_device(device: Device, precision: Precision) -> None:
    """Raise ConfigError when ``device`` has no tensor cores for ``precision``'s fp8 recipe."""
    recipe = recipe_of(precision)
    if recipe is not None and recipe.peak not in device.peak_flops:
        have = [r for r, rec in RECIPES.items() if rec.peak in device.peak_flops]
        fix = (f"use recipe {' / '.join(map(repr, have))} on it" if have else
               "plan in bf16 (Precision(compute=\"bf16\")), or on a device with fp8 tensor cores (H100 and later, "
               "MI300X and later)")
        raise ConfigError(f"Precision(compute=\"fp8\", recipe={recipe.name!r}) needs {recipe.peak} tensor cores, "
                          f"which {device.name} does not have (its peaks: {', '.join(sorted(device.peak_flops))}): "
                          f"{fix}")


def is_fp8_linear(node: OpNode) -> bool:
    """Whether an fp8 program runs this op's GEMMs in fp8 (ops.runs_in_fp8: what ``parallelize`` converts)."""
    g = node.gemm
    return (node.kind is OpKind.MATMUL and bool(node.params) and g is not None and g.batch == 1
            and runs_in_fp8(node.target, node.module_type, g.k, g.n))


def cast_bytes_per_element(recipe: Recipe, kernels: str) -> float:
    """Bytes one cast of a bf16 operand to fp8 moves per element (module docstring)."""
    if recipe.block_scaled:
        return 3 + 1 / BLOCK
    return 3.0 if kernels != "eager" else 17.0


def cast_kernels(recipe: Recipe, kernels: str) -> int:
    """Kernel launches of one cast."""
    return 1 if recipe.block_scaled or kernels != "eager" else 5


def cast_seconds(recipe: Recipe, kernels: str, gemm: Gemm, device: Device) -> tuple[float, float]:
    """(forward, backward) seconds of one fp8 linear's casts for the GEMM ``gemm`` (this rank's shard)."""
    x, w, g = gemm.m * gemm.k, gemm.k * gemm.n, gemm.m * gemm.n
    per, launch = cast_bytes_per_element(recipe, kernels), cast_kernels(recipe, kernels) * device.kernel_overhead
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    fwd = (x + w) * per / bandwidth + 2 * launch
    operands = (g, w) if recipe.hp_grad_weight else (g, w, g, x)
    bwd = sum(operands) * per / bandwidth + len(operands) * launch
    return fwd, bwd
