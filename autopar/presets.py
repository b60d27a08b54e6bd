"""Device and link presets: datasheet peaks, and the achieved-fraction constants of each family.

Every preset number cites its source next to it; the efficiency constants (achieved fraction of a
peak) are grouped per device family at the top so that calibration can find and revise them
(bench/fidelity_published.py fits ``matmul_efficiency`` on the public rows and fails when a preset
here is not the fit).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .errors import ConfigError
from .hardware import Device, Fabric, Host, Link, Protocol

# --- Achieved-fraction constants, per device family --------------------------------------------
# matmul_efficiency: fraction of the dense peak a large GEMM whose output tiles fill whole waves of the
# SMs reaches (cost_model/compute.py prices thin GEMMs and partial waves below it); matmul_half_dim: the GEMM
# dimension (elements) at which the per-dim factor d/(d+half) is 1/2; memory_efficiency: fraction
# of HBM bandwidth a streaming kernel reaches; kernel_overhead: fixed seconds per kernel launch.
# Fitted on the two public V100 rows (Shoeybi et al. 2019: a 1.2B GPT-2 on one V100, 8.3B on 512;
# bench/fidelity_published.py). Two rows from one source: the least-supported constant set here.
V100_MATMUL_EFFICIENCY = 0.565
V100_MATMUL_HALF_DIM = 64.0
V100_MEMORY_EFFICIENCY = 0.8
V100_KERNEL_OVERHEAD = 5e-6

# Fitted on the public A100 rows (Megatron SC21 Table 1, the README TP table, MegaScale's Megatron-LM
# run; bench/fidelity_published.py): minimises the mean squared log error of the published metric.
A100_MATMUL_EFFICIENCY = 0.71
A100_MATMUL_HALF_DIM = 64.0
A100_MEMORY_EFFICIENCY = 0.8
A100_KERNEL_OVERHEAD = 5e-6

# H100 SXM, H200 and H800 (same compute die): fitted on Meta's three Llama 3 405B rows, attention priced at
# FlashAttention-2's speed (below), gradients accumulated over micro-batches by autograd (a PyTorch FSDP
# stack, whose FSDP gathers the weights under the forward; bench/data/published_runs.json says why). 0.76 x 989 is
# 752 TFLOP/s, 0.946 of the 794.5 a large
# bf16 GEMM reaches at its best shape (the public MAMF table below): Meta's 2024 stack loses little beyond its
# kernels, where Megatron-LM's 2021 one ran at four fifths of the A100's (0.71 x 312 = 222 of its 267.9). Checked out of sample
# on a measured H200 (BENCHMARKS.md, one GPU): eager steps within 5%.
H100_MATMUL_EFFICIENCY = 0.76
H100_MATMUL_HALF_DIM = 64.0
H100_MEMORY_EFFICIENCY = 0.8
H100_KERNEL_OVERHEAD = 5e-6

# Meta's Grand Teton H100 (torchtitan's H100 benchmark): the same die, 96 GB of HBM2e at 2.4 TB/s,
# its power capped at 500 W instead of the SXM part's 700 W, which lowers the clocks a long GEMM
# sustains. Its own family: fitted on its own public rows (bench/fidelity_published.py).
H100_500W_MATMUL_EFFICIENCY = 0.605   # torchtitan's Llama 3.1 8B rows (8 and 128 GPUs, eager and compiled)

# attention_efficiency: what a fused attention kernel sustains, forward and backward, as a fraction of
# peak: FlashAttention-2's published kernel benchmark (Dao 2023, arXiv 2307.08691, section 4.1), not
# fitted. H100: up to 335 TFLOP/s (the Ampere code, without TMA or wgmma) of 989: 0.34, for the SXM
# part and Meta's 500 W one alike (its clocks' effect on this kernel is not published). A100: up to 73%
# of peak forward and 63% backward, so 3.5 / (1/0.73 + 2.5/0.63) = 0.66 over both (a backward counted
# as 2.5 forwards): the A100's GEMM figure, which it keeps (None). V100: no FlashAttention-2 (None).
H100_ATTENTION_EFFICIENCY = 0.34

# overlap_slowdown: compute lost per second of a collective running beside it. NCCL runs one thread
# block per channel, each holding an SM for the collective's duration; FSDP's all-gather on an H100
# launches 24 (a public Nsight trace, NVIDIA developer forums 2025), so compute beside it loses
# 24 of the SMs: 24/80 (V100), 24/108 (A100), 24/132 (H100). Not fitted (the public step times
# barely depend on it); BENCHMARKS.md lists it among what stays unmeasured.
NCCL_BLOCKS = 24
V100_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 80
A100_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 108
H100_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 132

# sm_count: streaming multiprocessors, over which a GEMM's output tiles run in waves (cost_model/
# compute.py). Datasheets / whitepapers: V100 SXM2 80 SMs, A100 SXM4 108, H100 SXM5 132 (H200, H800 and
# the 500 W part share the H100 SXM5 die), B200 148 (GB200's GPUs alike).
SM_COUNT = {"V100": 80, "A100": 108, "H100": 132, "B200": 148}

# --- Families no public training run here calibrates (B200, GB200, H20, MI300X, MI325X, MI355X) ------
# matmul_efficiency: the share of the dense bf16 peak a large GEMM reaches on the part (the "maximum
# achievable matmul FLOPS" table of stas00/ml-engineering, compute/accelerator/README.md: torch.matmul at
# the best of a search over shapes, the mean of 100 runs), times what a training stack keeps of that on the
# one part with both figures: the H100's fitted 0.76 against its 794.5 TFLOP/s of 989 there (STACK_SHARE,
# 0.946). No training run checks these (bench/new_presets.py prints them; BENCHMARKS.md lists them among
# the unmeasured). H800: the H100's die and constants.
STACK_SHARE = H100_MATMUL_EFFICIENCY / (794.5e12 / 989e12)
B200_MATMUL_EFFICIENCY = 1745.0e12 / 2.25e15 * STACK_SHARE      # B200 SXM: 1,745 of 2,250
GB200_MATMUL_EFFICIENCY = 1822.0e12 / 2.5e15 * STACK_SHARE      # GB200: 1,822 of 2,500
MI300X_MATMUL_EFFICIENCY = 668.4e12 / 1307.4e12 * STACK_SHARE   # MI300X: 668.4 of 1,307.4 (TunableOp on)
MI325X_MATMUL_EFFICIENCY = 784.9e12 / 1307.4e12 * STACK_SHARE   # MI325X: 784.9 of 1,307.4 (TunableOp on)
MI355X_MATMUL_EFFICIENCY = 1565.0e12 / 2516.6e12 * STACK_SHARE  # MI355X: 1,565 of 2,516.6 (TunableOp off)
# fp8_matmul_efficiency: the same rule on the table's e4m3 entries (tensor-wise scaled): H100 1,402.6 TFLOP/s
# of 1,979, B200 3,432.5 of 4,500, GB200 3,615.6 of 5,000. The AMD parts have none there: the bf16 constant
# times the fp8/bf16 ratio of one other benchmark of both (AMD's ROCm blog "Measuring max-achievable FLOPs,
# part 2", Table 1, hipblaslt-bench: MI300X 1,273 fp8 and 708 bf16, MI325X 1,519 and 843 TFLOP/s). The 500 W
# H100 keeps the 700 W part's fp8/bf16 ratio (assumed). MI355X, H20: no public fp8 GEMM figure found (None:
# priced at the bf16 share). MXFP8 GEMMs (Blackwell, MI355X) at the fp8 share: no public figure separates them.
H100_FP8_MATMUL_EFFICIENCY = 1402.6e12 / 1979e12 * STACK_SHARE
H100_500W_FP8_MATMUL_EFFICIENCY = H100_500W_MATMUL_EFFICIENCY * H100_FP8_MATMUL_EFFICIENCY / H100_MATMUL_EFFICIENCY
B200_FP8_MATMUL_EFFICIENCY = 3432.5e12 / 4.5e15 * STACK_SHARE
GB200_FP8_MATMUL_EFFICIENCY = 3615.6e12 / 5e15 * STACK_SHARE
MI300X_FP8_MATMUL_EFFICIENCY = MI300X_MATMUL_EFFICIENCY * (1273 / 2614.9) / (708 / 1307.4)
MI325X_FP8_MATMUL_EFFICIENCY = MI325X_MATMUL_EFFICIENCY * (1519 / 2614.9) / (843 / 1307.4)
# H20 (not in that table): 141.86 TFLOP/s of 148 (torch.matmul, square shapes; github.com/zzc0721/
# torch-performance-test-data, database.md): a part capped far below its memory and clocks.
H20_MATMUL_EFFICIENCY = 141.86e12 / 148e12 * STACK_SHARE
# overlap_slowdown as above: NCCL's (RCCL's) 24 blocks of the part's SMs (CUs): B200/GB200 148 SMs,
# MI300X/MI325X 304 CUs, MI355X 256 (AMD datasheets); the H20 the H100's (NVIDIA publishes no SM count).
B200_OVERLAP_SLOWDOWN = NCCL_BLOCKS / SM_COUNT["B200"]
H20_OVERLAP_SLOWDOWN = H100_OVERLAP_SLOWDOWN
MI300_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 304
MI355_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 256

CPU_MATMUL_EFFICIENCY = 0.5  # placeholders until Cluster.local() profiles this machine
CPU_MATMUL_HALF_DIM = 32.0
CPU_MEMORY_EFFICIENCY = 0.5
CPU_KERNEL_OVERHEAD = 1e-5


# --- Hosts: the machine's CPU memory and links over its accelerators (ParallelConfig.offload) ---------
# DRAM bandwidth is the sockets' channels x transfer rate x 8 bytes; a host link's achieved rate is 80% of
# its per-direction rate (pinned copies reach ~25 of PCIe 4.0 x16's 31.5 GB/s and ~50 of 5.0's 63 GB/s,
# NVIDIA's bandwidthTest / nvbandwidth), one x16 link per accelerator (HGX / OAM boards).
PCIE3, PCIE4, PCIE5 = 0.8 * 15.75e9, 0.8 * 31.5e9, 0.8 * 63e9


def _host(dram: float, sockets: int, channels: int, mts: float, link: float, accelerators: int, source: str) -> Host:
    return Host(memory=dram / accelerators, memory_bandwidth=sockets * channels * mts * 1e6 * 8 / accelerators,
                link_bandwidth=link, source=source)


_DGX1 = _host(512e9, 2, 4, 2400, PCIE3, 8, "DGX-1 (V100): 2x Xeon E5-2698 v4, 4 channels of DDR4-2400 each, 512 GB; "
              "PCIe 3.0 x16")
_DGX_A100 = _host(1e12, 2, 8, 3200, PCIE4, 8, "DGX A100: 2x EPYC 7742, 8 channels of DDR4-3200 each, 1 TB (2 TB with "
                  "the 640 GB model); PCIe 4.0 x16")
_DGX_A100_2TB = _host(2e12, 2, 8, 3200, PCIE4, 8, _DGX_A100.source)
_DGX_H100 = _host(2e12, 2, 8, 4800, PCIE5, 8, "DGX H100 / H200: 2x Xeon Platinum 8480C, 8 channels of DDR5-4800 each, "
                  "2 TB; PCIe 5.0 x16")
_DGX_B200 = _host(2e12, 2, 8, 5600, PCIE5, 8, "DGX B200: 2x Xeon Platinum 8570, 8 channels of DDR5-5600 each, 2 TB "
                  "(4 TB option); PCIe 5.0 x16")
# GB200: one Grace per two GPUs, 480 GB LPDDR5X at 512 GB/s, NVLink-C2C 900 GB/s both ways (450 each way)
_GB200_HOST = Host(memory=480e9 / 2, memory_bandwidth=512e9 / 2, link_bandwidth=0.8 * 450e9 / 2,
                   source="GB200 NVL72 datasheet: a Grace per 2 GPUs, 480 GB LPDDR5X at up to 512 GB/s, NVLink-C2C "
                          "900 GB/s bidirectional")
_GENOA = _host(2e12, 2, 12, 4800, PCIE5, 8, "8-GPU MI300X platforms (AMD's reference design; Dell XE9680, Supermicro "
               "AS-8125GS): 2x EPYC 9004, 12 channels of DDR5-4800 each, 2 TB; PCIe 5.0 x16")
_TURIN = _host(2e12, 2, 12, 6000, PCIE5, 8, "8-GPU MI325X / MI355X platforms: 2x EPYC 9005, 12 channels of DDR5-6000 "
               "each, 2 TB; PCIe 5.0 x16")


# --- Device presets (bench/sources.md section 6, vendor datasheets) -----------------------------
def _gpu(name: str, *, peaks: Mapping[str, float | None], memory: float, hbm: float, source: str,
         family: str, host: Host | None = None) -> Device:
    """A GPU preset: dense peaks per dtype (fp16 is bf16's; None: the part has no such tensor core),
    memory, HBM bandwidth, and the achieved-fraction constants of ``family``."""
    mm, half, mem, overhead, slowdown, attention, sms, fp8 = _FAMILY_CONSTANTS[family]
    table = {k: v for k, v in peaks.items() if v is not None}
    table.setdefault("fp16", table["bf16"])
    if "fp4" in table:   # block-scaled tensor cores (Blackwell, CDNA 4): MXFP8 at the fp8 rate (datasheets)
        table.setdefault("mxfp8", table["fp8"])
    return Device(name=name, peak_flops=table, memory=memory, memory_bandwidth=hbm, source=source,
                  matmul_efficiency=mm, matmul_half_dim=half, sm_count=sms, attention_efficiency=attention,
                  fp8_matmul_efficiency=fp8, memory_efficiency=mem, kernel_overhead=overhead,
                  overlap_slowdown=slowdown, host=host)


# family -> (matmul_efficiency, matmul_half_dim, memory_efficiency, kernel_overhead, overlap_slowdown,
#            attention_efficiency, sm_count, fp8_matmul_efficiency)
_FAMILY_CONSTANTS: Mapping[str, tuple] = MappingProxyType({
    "V100": (V100_MATMUL_EFFICIENCY, V100_MATMUL_HALF_DIM, V100_MEMORY_EFFICIENCY, V100_KERNEL_OVERHEAD,
             V100_OVERLAP_SLOWDOWN, None, SM_COUNT["V100"], None),
    "A100": (A100_MATMUL_EFFICIENCY, A100_MATMUL_HALF_DIM, A100_MEMORY_EFFICIENCY, A100_KERNEL_OVERHEAD,
             A100_OVERLAP_SLOWDOWN, None, SM_COUNT["A100"], None),
    "H100": (H100_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
             H100_OVERLAP_SLOWDOWN, H100_ATTENTION_EFFICIENCY, SM_COUNT["H100"], H100_FP8_MATMUL_EFFICIENCY),
    "H100-500W": (H100_500W_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
                  H100_OVERLAP_SLOWDOWN, H100_ATTENTION_EFFICIENCY, SM_COUNT["H100"], H100_500W_FP8_MATMUL_EFFICIENCY),
    # the families below keep the H100's half-dim, memory efficiency and launch overhead (not measured
    # for them), and price attention at their GEMMs' efficiency (no public fused-attention figure used)
    "H20": (H20_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
            H20_OVERLAP_SLOWDOWN, None, None, None),
    "B200": (B200_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
             B200_OVERLAP_SLOWDOWN, None, SM_COUNT["B200"], B200_FP8_MATMUL_EFFICIENCY),
    "GB200": (GB200_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
              B200_OVERLAP_SLOWDOWN, None, SM_COUNT["B200"], GB200_FP8_MATMUL_EFFICIENCY),
    "MI300X": (MI300X_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
               MI300_OVERLAP_SLOWDOWN, None, None, MI300X_FP8_MATMUL_EFFICIENCY),
    "MI325X": (MI325X_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
               MI300_OVERLAP_SLOWDOWN, None, None, MI325X_FP8_MATMUL_EFFICIENCY),
    "MI355X": (MI355X_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
               MI355_OVERLAP_SLOWDOWN, None, None, None),
})

_V100_SRC = ("NVIDIA V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor core, 15.7 fp32, 7.8 fp64, 900 GB/s HBM2; V100 "
             "has no bf16, so bf16 is mapped to the fp16 tensor-core peak")
_A100_SRC = "NVIDIA A100 SXM4 datasheet: 312 TFLOP/s bf16/fp16 dense, 156 tf32, 19.5 fp32, 19.5 fp64 tensor core"
_H100_SRC = ("NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense, 1,979 fp8, 494 tf32, 66.9 fp32, 66.9 fp64 "
             "tensor core")
_H100_PEAKS = {"bf16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 66.9e12}
# fp64 (tensor core) where the datasheet gives it; the H800's and H20's export-compliant parts, the Blackwell and MI355X
# presets carry none here: an fp64 plan on them says so (Device.peak) and takes a Device with peak_flops["fp64"]
_H100_FP64 = {**_H100_PEAKS, "fp64": 66.9e12}
_B200_SRC = ("NVIDIA DGX B200 / HGX B200 datasheet (1,000 W): per GPU 2.25 PFLOP/s bf16/fp16 dense, 4.5 fp8, 9 fp4, "
             "1.1 tf32, 75 TFLOP/s fp32; DGX B200: 1,440 GB HBM3e in 8 GPUs (180 GB), 64 TB/s (8 TB/s each)")
_GB200_SRC = ("NVIDIA GB200 NVL72 datasheet (1,200 W): per GPU (a 72nd of the rack's 180 PFLOP/s bf16 dense, 360 fp8, "
              "720 fp4, 90 tf32, 5,760 TFLOP/s fp32) 2.5 PFLOP/s bf16 dense, 5 fp8, 10 fp4, 1.25 tf32, 80 TFLOP/s "
              "fp32; up to 13.4 TB HBM3e (186 GB per GPU) at 576 TB/s (8 TB/s each); a compute tray holds "
              "2 Grace CPUs and 4 GPUs")
_MI300X_SRC = ("AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s bf16/fp16 dense, 2,614.9 fp8, 653.7 tf32, 163.4 fp32, "
               "163.4 fp64 (matrix); 192 GB HBM3, 5.3 TB/s; 304 CUs")
_MI325X_SRC = ("AMD Instinct MI325X datasheet: 1,307.4 TFLOP/s bf16/fp16 dense, 2,614.9 fp8, 653.7 tf32, 163.4 fp32, "
               "163.4 fp64 (matrix), the MI300X's CDNA 3 die; 256 GB HBM3E, 6 TB/s")
_MI355X_SRC = ("AMD Instinct MI355X datasheet (1,400 W): 2,516.6 TFLOP/s bf16/fp16 dense, 5,033.2 fp8, 10,066.3 "
               "MXFP4, 157.3 fp32 (matrix); CDNA 4 has no tf32 matrix path; 288 GB HBM3E, 8 TB/s; 256 CUs")
_H20_SRC = ("NVIDIA HGX H20 (export-compliant Hopper; product brief as published by NVIDIA's partners): 148 TFLOP/s "
            "bf16/fp16 dense, 296 fp8, 74 tf32, 44 fp32; 96 GB HBM3, 4.0 TB/s; NVLink 900 GB/s")
_H800_SRC = ("NVIDIA H800 SXM5 (export-compliant H100: the H100 SXM5 die and peaks, 989 TFLOP/s bf16 dense, 1,979 "
             "fp8, 494 tf32, 66.9 fp32; 80 GB HBM3, 3.35 TB/s; NVLink cut to 400 GB/s both ways)")

DEVICE_PRESETS: Mapping[str, Device] = MappingProxyType({
    "V100-16GB": _gpu("V100-16GB", peaks={"bf16": 125e12, "fp32": 15.7e12, "fp64": 7.8e12}, memory=16e9, hbm=900e9,
                      source=_V100_SRC + "; 16 GB", family="V100", host=_DGX1),
    "V100-32GB": _gpu("V100-32GB", peaks={"bf16": 125e12, "fp32": 15.7e12, "fp64": 7.8e12}, memory=32e9, hbm=900e9,
                      source=_V100_SRC + "; 32 GB", family="V100", host=_DGX1),
    "A100-40GB": _gpu("A100-40GB", peaks={"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12, "fp64": 19.5e12},
                      memory=40e9, hbm=1555e9, source=_A100_SRC + "; 40 GB HBM2, 1,555 GB/s", family="A100",
                      host=_DGX_A100),
    "A100-80GB": _gpu("A100-80GB", peaks={"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12, "fp64": 19.5e12},
                      memory=80e9, hbm=2039e9, source=_A100_SRC + "; 80 GB HBM2e, 2,039 GB/s", family="A100",
                      host=_DGX_A100_2TB),
    "H100-SXM": _gpu("H100-SXM", peaks=_H100_FP64, memory=80e9, hbm=3350e9,
                     source=_H100_SRC + "; 80 GB HBM3, 3,350 GB/s", family="H100", host=_DGX_H100),
    "H100-96GB-500W": _gpu("H100-96GB-500W", peaks=_H100_FP64, memory=96e9, hbm=2.4e12,
                           source=_H100_SRC + " (the die's peaks); Meta Grand Teton part: 96 GB HBM2e, 2.4 TB/s, "
                                  "500 W (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md)",
                           family="H100-500W"),
    "H200": _gpu("H200", peaks=_H100_FP64, memory=141e9, hbm=4800e9,
                 source="NVIDIA H200 SXM datasheet: H100 compute (989 TFLOP/s bf16 dense, 1,979 fp8, 494 tf32, 66.9 "
                        "fp32, 66.9 fp64 tensor core); 141 GB HBM3e, 4,800 GB/s", family="H100", host=_DGX_H100),
    "H800": _gpu("H800", peaks=_H100_PEAKS, memory=80e9, hbm=3350e9, source=_H800_SRC, family="H100", host=_DGX_H100),
    "H20": _gpu("H20", peaks={"bf16": 148e12, "fp8": 296e12, "tf32": 74e12, "fp32": 44e12}, memory=96e9, hbm=4.0e12,
                source=_H20_SRC, family="H20", host=_DGX_H100),
    "B200": _gpu("B200", peaks={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15, "tf32": 1.1e15, "fp32": 75e12},
                 memory=180e9, hbm=8e12, source=_B200_SRC, family="B200", host=_DGX_B200),
    "GB200": _gpu("GB200", peaks={"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15, "tf32": 1.25e15, "fp32": 80e12},
                  memory=186e9, hbm=8e12, source=_GB200_SRC, family="GB200", host=_GB200_HOST),
    "MI300X": _gpu("MI300X", peaks={"bf16": 1307.4e12, "fp8": 2614.9e12, "tf32": 653.7e12, "fp32": 163.4e12,
                          "fp64": 163.4e12},
                   memory=192e9, hbm=5.3e12, source=_MI300X_SRC, family="MI300X", host=_GENOA),
    "MI325X": _gpu("MI325X", peaks={"bf16": 1307.4e12, "fp8": 2614.9e12, "tf32": 653.7e12, "fp32": 163.4e12,
                          "fp64": 163.4e12},
                   memory=256e9, hbm=6e12, source=_MI325X_SRC, family="MI325X", host=_TURIN),
    "MI355X": _gpu("MI355X", peaks={"bf16": 2516.6e12, "fp8": 5033.2e12, "fp4": 10066.3e12, "fp32": 157.3e12},
                   memory=288e9, hbm=8e12, source=_MI355X_SRC, family="MI355X", host=_TURIN),
    "cpu": Device(name="cpu", peak_flops={"fp32": 1e11, "bf16": 5e10, "fp16": 5e10, "fp64": 5e10}, memory=16e9,
                  memory_bandwidth=2e10, matmul_efficiency=CPU_MATMUL_EFFICIENCY,
                  matmul_half_dim=CPU_MATMUL_HALF_DIM, memory_efficiency=CPU_MEMORY_EFFICIENCY,
                  kernel_overhead=CPU_KERNEL_OVERHEAD,
                  source="placeholder figures for a modest CPU core set; Cluster.local() replaces them by "
                         "profiling this machine"),
})

# --- Link presets per device family (DGX-class nodes of 8 devices) ----------------------------
# NCCL's three ring protocols (its tuning model, src/graph/tuning.cc, documents per-step latencies
# by link type; the values below are ours, checked against bench/sources.md section 5 by
# bench/fidelity_published.py). LL moves 8-byte flag+data words: low latency, a fraction of the
# bandwidth; LL128 128-byte lines; Simple whole chunks at full bandwidth with the most latency.
# - NVLink: per-step 0.6 us (LL), 1.9 us (LL128), 3.4 us (Simple); per call 14 us (LL128) and
#   8.4 us (Simple), from NCCL's model. LL's call latency (5.27 us) and bandwidth share (0.363) are
#   fitted on the 8-byte and 1 MiB rows of the 8 x H100 all-reduce table (13.67 and 27.37 us).
#   The same protocols are assumed on every NVLink generation.
# - InfiniBand: per-step 2.7 us (LL), 4 us (LL128), 9.6 us (Simple), from NCCL's model.
# ``latency`` (one message) is what p2p and the pairwise all-to-all pay per message.
# Across nodes two more terms of NCCL's tuning model (src/graph/tuning.cc, NCCL 2.18 to 2.30), both set
# by the node's host CPU vendor (DGX-1 V100 and DGX H100: Intel Xeon; DGX A100: AMD EPYC 7742, per the
# DGX datasheets):
# - the network post overhead ("Inter-node rings still have to launch nsteps * net overhead",
#   getNetOverhead): every step of a ring spanning nodes, NVLink hops included, takes at least 1 us on
#   Intel hosts and 2 us on AMD ones, three times that with Simple (``Protocol.net_step_floor``);
# - LL's bus bandwidth across more than two nodes is capped (llMaxBws): 20.4 GB/s on Intel hosts,
#   19.0 GB/s on AMD ones (``Protocol.bus_bandwidth_cap``), far below its share of eight NICs.
# Any other host (Grace's Arm cores in a GB200 tray) takes NCCL's default: 1 us, and the Intel row of llMaxBws.
NET_OVERHEAD = {"intel": 1e-6, "amd": 2e-6, "arm": 1e-6}
LL_MAX_BUS_BANDWIDTH = {"intel": 20.4e9, "amd": 19.0e9, "arm": 20.4e9}
_NVLINK_PROTOCOLS = (
    Protocol(name="LL", base_latency=5.27e-6, step_latency=0.6e-6, bandwidth_fraction=0.363),
    Protocol(name="LL128", base_latency=14e-6, step_latency=1.9e-6, bandwidth_fraction=0.92),
    Protocol(name="Simple", base_latency=8.4e-6, step_latency=3.4e-6, bandwidth_fraction=1.0),
)


def _ib_protocols(host: str) -> tuple[Protocol, ...]:
    """NCCL's protocols over InfiniBand from nodes whose host CPU is ``host`` ("intel" | "amd")."""
    post = NET_OVERHEAD[host]
    return (
        Protocol(name="LL", base_latency=5.27e-6, step_latency=2.7e-6, bandwidth_fraction=0.363,
                 net_step_floor=post, bus_bandwidth_cap=LL_MAX_BUS_BANDWIDTH[host]),
        Protocol(name="LL128", base_latency=14e-6, step_latency=4e-6, bandwidth_fraction=0.92, net_step_floor=post),
        Protocol(name="Simple", base_latency=8.4e-6, step_latency=9.6e-6, bandwidth_fraction=1.0,
                 net_step_floor=3 * post),
    )


def _nvlink(bandwidth: float, efficiency: float, **sharp: float) -> Link:
    return Link(bandwidth=bandwidth, latency=1e-6, efficiency=efficiency, name="NVLink", protocols=_NVLINK_PROTOCOLS,
                **sharp)


# RCCL's protocols over xGMI, from its tuning model for MI300X (src/graph/tuning.cc, tuning_model_5, which
# the 8-GPU fully connected topologies select; gfx950's tuning_model_6 has the same latencies and ratios):
# per call 12 us (LL) and 17 us (Simple), per ring step 0.8 us (LL) and 2.1 us (Simple), LL at 0.08 of the
# bandwidth. LL128 is off by default on gfx942 and gfx950 (enabled only with RCCL_LL128_FORCE_ENABLE): not
# offered. Across nodes the InfiniBand protocols below are NCCL's with the AMD host's post overhead: RCCL's
# network row (Simple 320 us per step) is a weight steering its tuner to trees, not a time.
_XGMI_PROTOCOLS = (
    Protocol(name="LL", base_latency=12e-6, step_latency=0.8e-6, bandwidth_fraction=0.08),
    Protocol(name="Simple", base_latency=17e-6, step_latency=2.1e-6, bandwidth_fraction=1.0),
)
XGMI_EFFICIENCY = 318.98 / 448


def _xgmi(bandwidth: float, efficiency: float, links: int) -> Link:
    """AMD Infinity Fabric: ``links`` direct links per GPU, no switch (Link.peers), RCCL's protocols."""
    return Link(bandwidth=bandwidth, latency=1e-6, efficiency=efficiency, name="xGMI", protocols=_XGMI_PROTOCOLS,
                peers=links)


def _ib(bandwidth: float, efficiency: float, host: str) -> Link:
    # 10 us per message (IB RDMA plus NCCL proxy), 5 us of wire latency being the floor
    return Link(bandwidth=bandwidth, latency=1e-5, efficiency=efficiency, name="IB", protocols=_ib_protocols(host))


_LINKS: Mapping[str, tuple[Link, Link]] = MappingProxyType({
    # V100 NVLink2: 300 GB/s both ways per GPU (section 6) = 150e9 per direction; 0.8 achieved
    # (assumed, no public busbw in bench/sources.md). Inter-node: one 100 Gb/s NIC per NODE
    # = 12.5e9 B/s shared by 8 GPUs; 0.92 achieved as for EDR InfiniBand (assumed).
    "V100": (_nvlink(150e9, 0.8), _ib(12.5e9 / 8, 0.92, "intel")),
    # A100 NVLink3: 600 GB/s both ways (section 6) = 300e9 per direction; NCCL all-reduce busbw
    # about 230 GB/s (section 5): 230/300. Inter-node: 8 x HDR 200 Gb/s per DGX node = 25e9 B/s
    # per GPU, about 24 GB/s achieved per NIC (section 5): 24/25.
    "A100": (_nvlink(300e9, 230 / 300), _ib(25e9, 24 / 25, "amd")),
    # H100/H200 NVLink4: 900 GB/s both ways = 450e9 per direction. Ring busbw about 370 GB/s
    # (NCCL maintainers, section 5): 0.82. NVLink SHARP all-reduce about 480 GB/s busbw (the 8 GiB
    # row of the 8 x H100 table: 480.16), 70 us per call beyond that (fitted on its 16 MiB - 1 GiB
    # rows). Inter-node: 8 x NDR 400 Gb/s = 50e9 B/s per GPU, about 48 GB/s achieved: 48/50.
    # H20 nodes: the same NVLink4 and NVSwitch (900 GB/s per GPU), the same NICs.
    "H100": (_nvlink(450e9, 0.82, sharp_bandwidth=480e9, sharp_latency=70e-6), _ib(50e9, 48 / 50, "intel")),
    # H800: NVLink cut to 400 GB/s both ways = 200e9 per direction; DeepSeek-V3's report (arXiv 2412.19437,
    # section 3.2.2) gives 160 GB/s of it achieved (0.8) and its 400 Gb/s InfiniBand NICs 50 GB/s per GPU
    # (taken at the H100's 48/50 achieved). No NVLink SHARP figure is published for it: not priced.
    "H800": (_nvlink(200e9, 0.8), _ib(50e9, 48 / 50, "intel")),
    # Blackwell NVLink5: 1.8 TB/s both ways per GPU = 900e9 per direction, through NVSwitch: 8 GPUs in an
    # HGX/DGX B200, 72 in a GB200 NVL72 rack (one node of the cost model: Cluster.from_spec("16x72xGB200")).
    # Calibrated on one-domain nccl-tests all-reduce rows (bench/new_presets.py holds them, and the multi-node
    # rows that validate): 8 x B200 ring (NVLS off) 682.2 GB/s busbw at 8 GiB, 838.0 with NVLS (stas00/
    # ml-engineering network/README.md, NCCL 2.27.7); a GB200 NVL72 rack's 72 GPUs 834.6 at 8 GB (coreweave/
    # nccl-tests README, NCCL 2.26.2), its ring share taken as the B200's. NVLS's per-call latency: the H100's.
    # NICs: DGX B200 8 x ConnectX-7 400 Gb/s (50e9 per GPU), Intel Xeon hosts; GB200 compute trays 4 x
    # ConnectX-7 400 Gb/s for 4 GPUs (50e9 per GPU), Grace (Arm) hosts.
    "B200": (_nvlink(900e9, 682.2 / 900, sharp_bandwidth=838.0e9, sharp_latency=70e-6), _ib(50e9, 48 / 50, "intel")),
    "GB200": (_nvlink(900e9, 682.2 / 900, sharp_bandwidth=834.6e9, sharp_latency=70e-6), _ib(50e9, 48 / 50, "arm")),
    # MI300X / MI325X: 7 Infinity Fabric (xGMI) links per GPU, 128 GB/s both ways each (AMD datasheet: 896
    # GB/s aggregate), fully connected across the 8 GPUs of a node: 7 x 64e9 = 448e9 per direction, a
    # group of r GPUs reaching (r - 1)/7 of it (Link.peers). MI355X: 7 links of 153.6 GB/s both ways
    # (1,075 GB/s aggregate): 7 x 76.8e9 = 537.6e9 per direction. Achieved share: 8 x MI300X rccl-tests
    # all-reduce 318.98 GB/s busbw at 16 GB (ROCm blog "Understanding RCCL bandwidth and xGMI performance on
    # AMD Instinct MI300X", RCCL 2.22.3): 318.98 / 448; the MI355X's taken alike (no public figure found).
    # NICs: 8 x 400 Gb/s per node (50e9 per GPU; AMD's reference platforms), AMD EPYC hosts.
    "MI300": (_xgmi(448e9, XGMI_EFFICIENCY, 7), _ib(50e9, 48 / 50, "amd")),
    "MI355": (_xgmi(537.6e9, XGMI_EFFICIENCY, 7), _ib(50e9, 48 / 50, "amd")),
    # CPU ranks under gloo: shared memory between local processes, 10 GbE between machines
    # (1.25e9 B/s). Placeholders until the profiler measures them.
    "cpu": (Link(bandwidth=5e9, latency=2e-5, efficiency=1.0, name="shm"),
            Link(bandwidth=1.25e9, latency=5e-5, efficiency=1.0, name="Ethernet")),
})
_FAMILY = {"V100-16GB": "V100", "V100-32GB": "V100", "A100-40GB": "A100", "A100-80GB": "A100",
           "H100-SXM": "H100", "H100-96GB-500W": "H100", "H200": "H100", "H20": "H100", "H800": "H800",
           "B200": "B200", "GB200": "GB200", "MI300X": "MI300", "MI325X": "MI300", "MI355X": "MI355", "cpu": "cpu"}

# Devices one machine drives where an NVLink domain holds several machines (a node of the cost model is the
# domain): a GB200 NVL72 compute tray carries 2 Grace CPUs and 4 GPUs (NVIDIA GB200 NVL72 datasheet).
HOST_DEVICES: Mapping[str, int] = MappingProxyType({"GB200": 4})


def device_preset(name: str) -> Device:
    """The preset Device called ``name`` (case-insensitive), e.g. ``device_preset("a100-80gb")``."""
    for key, device in DEVICE_PRESETS.items():
        if isinstance(name, str) and key.lower() == name.strip().lower():
            return device
    raise ConfigError(f"unknown device {name!r}; known devices: {', '.join(DEVICE_PRESETS)}")


def host_devices(device_name: str) -> int | None:
    """Devices per machine of the preset device ``device_name`` when its NVLink domain spans machines, else None."""
    return HOST_DEVICES.get(device_preset(device_name).name)


def link_presets(device_name: str) -> tuple[Link, Link]:
    """(intra-node, inter-node) preset links for the family of the preset device ``device_name``."""
    return _LINKS[_FAMILY[device_preset(device_name).name]]


# --- Fabrics: networks of more than one tier above the nodes (Cluster.fabric) ------------------------------
FABRICS: Mapping[str, Fabric] = MappingProxyType({
    "llama3-24k-roce": Fabric(
        pod_nodes=384, oversubscription=7.0,
        source="Llama 3 Herd of Models (arXiv 2407.21783) section 3.3.1: Meta's 24K-H100 RoCE cluster, a three-layer "
               "Clos; 192 racks of 16 GPUs form a pod of 3,072 GPUs (384 8-GPU nodes) with full bisection "
               "bandwidth, eight pods joined by aggregation switches at 1:7 oversubscription"),
})
"""Published fabrics by name, for ``Cluster.from_spec(..., fabric=FABRICS[name])``."""
