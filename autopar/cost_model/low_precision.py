r"""FP8 linear layers: which ops run their GEMMs in fp8, and what those GEMMs and the casts around them cost.

Under ``Precision(compute="fp8", recipe=r)`` the program converts every ``nn.Linear`` whose in- and
out-features are multiples of 16 to an fp8 linear (torchao's ``convert_to_float8_training``, Transformer
Engine's ``te.Linear``): the three GEMMs of such a layer (forward ``y = x W^T``, input gradient
``dx = g W``, weight gradient ``dW = g^T x``) run on the fp8 tensor cores; attention, norms, the loss,
a mixture-of-experts layer's grouped expert GEMMs and every other op stay in bf16, and the layer saves its
bf16 input for backward (torchao's ``matmul_with_hp_or_float8_args``), so activation memory is bf16's.

**GEMMs.** For a linear of ``m x k`` input, ``k x n`` weight and ``F`` forward FLOPs:

    t_fwd  = F / (P_r * e_8(m, n, k) * s_r)           (P_r: the recipe's peak, "fp8" or "mxfp8")
    t_grad = 2F / (P_r * e_8(m, n, k))                (dx = g W and dW = g^T x)

with ``e_8`` compute.py's efficiency model at ``Device.fp8_matmul_efficiency`` (the tensor-wise scaled
kernels' share of their peak: cuBLAS, the table presets.py takes it from) in place of
``matmul_efficiency``, and ``s_r`` the recipe's ``gemm_share``: the throughput of the kernel its forward
GEMM runs on as a share of the tensor-wise kernel's (``ROWWISE_GEMM_SHARE`` for the row-wise recipes, 1
for the others). Only the forward GEMM runs row-wise: torchao's float8 linear runs ``y`` with fast
accumulation and ``dx``, ``dW`` without (``Float8LinearConfig``'s gemm configs), and a row-wise GEMM
without fast accumulation runs cuBLAS's tensor-wise kernel at unit scales and multiplies its output by
the outer product of the two scale vectors afterwards (``addmm_float8_unwrapped``: the CUTLASS row-wise
kernel is slower still there), so the backward's GEMMs take the tensor-wise time and each adds that
rescale pass (below). ``rowwise_with_gw_hp`` runs ``dW`` in bf16 (``F / (P_bf16 e)``), its ``dx``
row-wise (the tensor-wise weight scale repeated along the row: ``preprocess_addmm``), rescaled. One
share at every shape: the public figures are large-shape ones (the slow tail on small and skewed shapes
is not tabulated), and H100 ones, assumed on every device (ROWWISE_GEMM_SHARE says where from).
compute.py prices the GEMMs (ComputeModel._fp8_linear); :func:`cast_seconds` the casts and rescales.

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

**Rescales.** A row-wise GEMM run on the tensor-wise kernel (``dx`` and ``dW`` under "rowwise", ``dx``
under "rowwise_with_gw_hp") multiplies its bf16 output by the scales' outer product in a kernel of its
own (torchao's issue #2184: at least one extra kernel per GEMM under torch.compile), bytes per output
element:

    fused kernels: read 2, write 2: 4, one kernel
    eager: the outer product of the two scale vectors written in fp32 (4), then the multiply reads the
        output and it and writes the output (2 + 4 + 2): 12, two kernels

**Scales across ranks.** A tensor-wise scale is the amax of the whole logical tensor: when tensor
parallelism shards an operand each cast all-reduces one fp32 scalar over the tensor-parallel group
(torchao under DTensor), priced as ``AMAX_SYNCS`` latency-bound all-reduces per layer and micro-batch
(the three sharded operands' forward and backward casts). Row-wise and block scales are local.

**Weights gathered in fp8** (Precision.gathers_fp8: tensor-wise, ZeRO 2-3 over replicas, no tensor
parallelism; torchao's ``enable_fsdp_float8_all_gather``): the weights :func:`gathered_weights` names (read
by fp8 linear layers alone) are cast on each rank's shard before FSDP2 gathers them, one byte an element
where bf16 moves two, with the whole weight's scale: each step starts with every such weight's amax over
its shards, one all-reduce of one fp32 scalar a weight (torchao's ``precompute_float8_dynamic_scale_for_fsdp``;
runtime/fp8.refresh_scales). step_tail.py prices the gathers' bytes, that all-reduce and the read of the
shards it takes, which nothing hides.

Not priced: delayed scaling (Transformer Engine's amax history; torchao dropped it), the fp8 weight
copies' transient memory; with weights gathered in fp8, the casts are still priced as the whole weight's
twice a micro-batch (the gathered path casts each shard once a gather: less), and the gathered weights'
buffers at their bf16 size (one byte an element held: less).
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
# A row-wise GEMM without fast accumulation (torchao's dx and dW) runs cuBLAS's tensor-wise kernel at unit scales
# and multiplies its output by the scales' outer product after: torchao/float8/float8_ops.py,
# addmm_float8_unwrapped (since pytorch/ao#1325); one extra kernel per GEMM under torch.compile (pytorch/ao#2184).
# Bytes per output element and kernels of that rescale, fused (torch.compile) and eager (module docstring):
RESCALE_BYTES: Mapping[str, float] = MappingProxyType({"fused": 4.0, "eager": 12.0})
RESCALE_KERNELS: Mapping[str, int] = MappingProxyType({"fused": 1, "eager": 2})

# ROWWISE_GEMM_SHARE: a row-wise scaled fp8 GEMM's throughput as a share of the tensor-wise one's, at large
# shapes on an H100 (torch._scaled_mm with fast accumulation, the kernel torchao's row-wise recipes run their
# forward GEMM on: CUTLASS, or cuBLAS's "outer vector" kernel in builds on CUDA 12.9 and later, which
# pytorch/pytorch#157905 measured level with it on a 700 W H100). Sources:
#   github.com/pytorch/pytorch/issues/147971 (2025-02-26, H100, the CUTLASS row-wise kernel after the tile
#     heuristics of pytorch/pytorch#134781, against cuBLAS tensor-wise, both fast-accum): "Most shapes are
#     within 90-100% of tensor-wise efficiency, but there's a long tail going down to 50%"; 0.95 is the
#     middle of that band.
#   github.com/pytorch/FBGEMM/pull/2764 (2024-06-21, H100): median microseconds of cuBLAS tensor-wise and of
#     FBGEMM's CUTLASS row-wise kernel (which PyTorch's RowwiseScaledMM.cu was ported from), m x n x k:
#     4176x12288x4096 310.3 / 317.5 (0.977), 4176x4096x12288 330.4 / 363.5 (0.909), 3456x6144x4096
#     131.9 / 132.1 (0.999), 3456x4096x6144 138.7 / 140.4 (0.987): mean 0.968, within the band.
# The slow tail (small and skewed shapes) is not tabulated in text anywhere public, so it is not modelled.
# No public kernel figure for another device (B200's sm100 CUTLASS row-wise template, MI300X's hipBLASLt):
# the H100 share is assumed there (their published end-to-end row-wise gains are lower still: bench/fp8.py).
ROWWISE_GEMM_SHARE = 0.95


@dataclass(frozen=True)
class Recipe:
    """One fp8 scaling recipe: the peak its GEMMs run at, how many operands it casts per layer and
    micro-batch (forward, backward), whether the weight gradient stays bf16, its scale's reach, its forward
    GEMM kernel's throughput against the tensor-wise one's and how many backward GEMM outputs it rescales
    in a pass of their own (module docstring)."""

    name: str
    peak: str                   # Device.peak_flops key of its GEMMs
    casts_fwd: int
    casts_bwd: int
    hp_grad_weight: bool = False
    block_scaled: bool = False  # scale per 32-element block, computed in the cast kernel
    tensor_scale: bool = False  # one scale per tensor: a sharded operand all-reduces its amax
    gemm_share: float = 1.0     # the forward GEMM's kernel throughput / the tensor-wise kernel's
    rescaled_grads: int = 0     # backward GEMMs run on the tensor-wise kernel, outputs rescaled after: dx (, dW)


RECIPES: Mapping[str, Recipe] = MappingProxyType({
    "tensorwise": Recipe("tensorwise", "fp8", 2, 4, tensor_scale=True),
    "rowwise": Recipe("rowwise", "fp8", 2, 4, gemm_share=ROWWISE_GEMM_SHARE, rescaled_grads=2),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp", "fp8", 2, 2, hp_grad_weight=True,
                                 gemm_share=ROWWISE_GEMM_SHARE, rescaled_grads=1),
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


def gathered_weights(graph) -> frozenset[str]:
    """The parameters FSDP2 gathers in fp8 when a plan gathers so (Precision.gathers_fp8): the weights every
    reader of which is an fp8 linear layer reading it as its weight (a tied embedding's is read otherwise, a
    bias is not a weight). codegen's CompiledProgram.fp8_gathered is the runtime's reading of the same rule."""
    fp8, other = set(), set()
    for node in graph.nodes:
        if is_fp8_linear(node):
            fp8.add(node.params[0])
            other.update(node.params[1:])
        else:
            other.update(node.params)
    return frozenset(fp8 - other)


def cast_bytes_per_element(recipe: Recipe, kernels: str) -> float:
    """Bytes one cast of a bf16 operand to fp8 moves per element (module docstring)."""
    if recipe.block_scaled:
        return 3 + 1 / BLOCK
    return 3.0 if kernels != "eager" else 17.0


def cast_kernels(recipe: Recipe, kernels: str) -> int:
    """Kernel launches of one cast."""
    return 1 if recipe.block_scaled or kernels != "eager" else 5


def casts(recipe: Recipe, kernels: str, gemm: Gemm, device: Device) -> tuple[float, float]:
    """(forward, backward) seconds of one fp8 linear's operand casts for the GEMM ``gemm`` (this rank's shard)."""
    x, w, g = gemm.m * gemm.k, gemm.k * gemm.n, gemm.m * gemm.n
    per, launch = cast_bytes_per_element(recipe, kernels), cast_kernels(recipe, kernels) * device.kernel_overhead
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    fwd = (x + w) * per / bandwidth + 2 * launch
    operands = (g, w) if recipe.hp_grad_weight else (g, w, g, x)
    bwd = sum(operands) * per / bandwidth + len(operands) * launch
    return fwd, bwd


def rescale_seconds(recipe: Recipe, kernels: str, gemm: Gemm, device: Device) -> float:
    """Backward seconds of the passes that rescale the outputs of a row-wise recipe's backward GEMMs (run on
    the tensor-wise kernel): ``dx`` (``m x k``), and ``dW`` (``k x n``) unless it runs in bf16."""
    if not recipe.rescaled_grads:
        return 0.0
    mode = "eager" if kernels == "eager" else "fused"
    outputs = (gemm.m * gemm.k, gemm.k * gemm.n)[:recipe.rescaled_grads]
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    launches = len(outputs) * RESCALE_KERNELS[mode]
    return sum(outputs) * RESCALE_BYTES[mode] / bandwidth + launches * device.kernel_overhead


def cast_seconds(recipe: Recipe, kernels: str, gemm: Gemm, device: Device) -> tuple[float, float]:
    """(forward, backward) seconds one fp8 linear adds to its GEMMs for the GEMM ``gemm`` (this rank's shard;
    ComputeModel._fp8_linear adds them): its operands' casts (:func:`casts`) and the rescales of its backward
    GEMMs' outputs (:func:`rescale_seconds`)."""
    fwd, bwd = casts(recipe, kernels, gemm, device)
    return fwd, bwd + rescale_seconds(recipe, kernels, gemm, device)
