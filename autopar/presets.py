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
from .hardware import Device, Link, Protocol

# --- Achieved-fraction constants, per device family --------------------------------------------
# matmul_efficiency: fraction of the dense peak a large GEMM whose output tiles fill whole waves of the
# SMs reaches (cost_model/compute.py prices thin GEMMs and partial waves below it); matmul_half_dim: the GEMM
# dimension (elements) at which the per-dim factor d/(d+half) is 1/2; memory_efficiency: fraction
# of HBM bandwidth a streaming kernel reaches; kernel_overhead: fixed seconds per kernel launch.
# Fitted on the two public V100 rows (Shoeybi et al. 2019: a 1.2B GPT-2 on one V100, 8.3B on 512;
# bench/fidelity_published.py). Two rows from one source: the least-supported constant set here.
V100_MATMUL_EFFICIENCY = 0.5575
V100_MATMUL_HALF_DIM = 64.0
V100_MEMORY_EFFICIENCY = 0.8
V100_KERNEL_OVERHEAD = 5e-6

# Fitted on the public A100 rows (Megatron SC21 Table 1, the README TP table, MegaScale's Megatron-LM
# run; bench/fidelity_published.py): minimises the mean squared log error of the published metric.
A100_MATMUL_EFFICIENCY = 0.70
A100_MATMUL_HALF_DIM = 64.0
A100_MEMORY_EFFICIENCY = 0.8
A100_KERNEL_OVERHEAD = 5e-6

# H100 SXM and H200 (same compute die): fitted on Meta's three Llama 3 405B rows, attention priced at
# FlashAttention-2's speed (below). 0.735 x 989 is 727 TFLOP/s, about what cuBLAS reaches on a large
# bf16 GEMM (about 750): Meta's 2024 stack loses little beyond its kernels, where Megatron-LM's 2021
# one ran at three quarters of the A100's (0.70 x 312 = 218 of about 280). Checked out of sample
# on a measured H200 (BENCHMARKS.md, one GPU): eager steps within 5%.
H100_MATMUL_EFFICIENCY = 0.735
H100_MATMUL_HALF_DIM = 64.0
H100_MEMORY_EFFICIENCY = 0.8
H100_KERNEL_OVERHEAD = 5e-6

# Meta's Grand Teton H100 (torchtitan's H100 benchmark): the same die, 96 GB of HBM2e at 2.4 TB/s,
# its power capped at 500 W instead of the SXM part's 700 W, which lowers the clocks a long GEMM
# sustains. Its own family: fitted on its own public rows (bench/fidelity_published.py).
H100_500W_MATMUL_EFFICIENCY = 0.5775   # torchtitan's Llama 3.1 8B rows (8 and 128 GPUs, eager and compiled)

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
# compute.py). Datasheets / whitepapers: V100 SXM2 80 SMs, A100 SXM4 108, H100 SXM5 132 (H200 and the
# 500 W part share the H100 SXM5 die).
SM_COUNT = {"V100": 80, "A100": 108, "H100": 132}

CPU_MATMUL_EFFICIENCY = 0.5  # placeholders until Cluster.local() profiles this machine
CPU_MATMUL_HALF_DIM = 32.0
CPU_MEMORY_EFFICIENCY = 0.5
CPU_KERNEL_OVERHEAD = 1e-5


# --- Device presets (bench/sources.md section 6, vendor datasheets) -----------------------------
def _gpu(name: str, *, bf16: float, fp32: float, tf32: float | None, memory: float, hbm: float, source: str,
         family: str) -> Device:
    consts = {"V100": (V100_MATMUL_EFFICIENCY, V100_MATMUL_HALF_DIM, V100_MEMORY_EFFICIENCY, V100_KERNEL_OVERHEAD,
                       V100_OVERLAP_SLOWDOWN, None),
              "A100": (A100_MATMUL_EFFICIENCY, A100_MATMUL_HALF_DIM, A100_MEMORY_EFFICIENCY, A100_KERNEL_OVERHEAD,
                       A100_OVERLAP_SLOWDOWN, None),
              "H100": (H100_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
                       H100_OVERLAP_SLOWDOWN, H100_ATTENTION_EFFICIENCY),
              "H100-500W": (H100_500W_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY,
                            H100_KERNEL_OVERHEAD, H100_OVERLAP_SLOWDOWN, H100_ATTENTION_EFFICIENCY)}
    mm, half, mem, overhead, slowdown, attention = consts[family]
    sms = SM_COUNT[family.split("-")[0]]
    peaks = {"fp32": fp32, "bf16": bf16, "fp16": bf16}
    if tf32 is not None:
        peaks["tf32"] = tf32
    return Device(name=name, peak_flops=peaks, memory=memory, memory_bandwidth=hbm, source=source,
                  matmul_efficiency=mm, matmul_half_dim=half, sm_count=sms, attention_efficiency=attention,
                  memory_efficiency=mem,
                  kernel_overhead=overhead, overlap_slowdown=slowdown)


_V100_SRC = ("NVIDIA V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor core, 15.7 fp32, 900 GB/s HBM2; V100 has no "
             "bf16, so bf16 is mapped to the fp16 tensor-core peak")
_A100_SRC = "NVIDIA A100 SXM4 datasheet: 312 TFLOP/s bf16/fp16 dense, 156 tf32, 19.5 fp32"
_H100_SRC = "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense, 494 tf32, 66.9 fp32"

DEVICE_PRESETS: Mapping[str, Device] = MappingProxyType({
    "V100-16GB": _gpu("V100-16GB", bf16=125e12, fp32=15.7e12, tf32=None, memory=16e9, hbm=900e9,
                      source=_V100_SRC + "; 16 GB", family="V100"),
    "V100-32GB": _gpu("V100-32GB", bf16=125e12, fp32=15.7e12, tf32=None, memory=32e9, hbm=900e9,
                      source=_V100_SRC + "; 32 GB", family="V100"),
    "A100-40GB": _gpu("A100-40GB", bf16=312e12, fp32=19.5e12, tf32=156e12, memory=40e9, hbm=1555e9,
                      source=_A100_SRC + "; 40 GB HBM2, 1,555 GB/s", family="A100"),
    "A100-80GB": _gpu("A100-80GB", bf16=312e12, fp32=19.5e12, tf32=156e12, memory=80e9, hbm=2039e9,
                      source=_A100_SRC + "; 80 GB HBM2e, 2,039 GB/s", family="A100"),
    "H100-SXM": _gpu("H100-SXM", bf16=989e12, fp32=66.9e12, tf32=494e12, memory=80e9, hbm=3350e9,
                     source=_H100_SRC + "; 80 GB HBM3, 3,350 GB/s", family="H100"),
    "H100-96GB-500W": _gpu("H100-96GB-500W", bf16=989e12, fp32=66.9e12, tf32=494e12, memory=96e9, hbm=2.4e12,
                           source=_H100_SRC + " (the die's peaks); Meta Grand Teton part: 96 GB HBM2e, 2.4 TB/s, "
                                  "500 W (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md)",
                           family="H100-500W"),
    "H200": _gpu("H200", bf16=989e12, fp32=66.9e12, tf32=494e12, memory=141e9, hbm=4800e9,
                 source="NVIDIA H200 SXM datasheet: H100 compute (989 TFLOP/s bf16 dense, 494 tf32, 66.9 fp32); "
                        "141 GB HBM3e, 4,800 GB/s", family="H100"),
    "cpu": Device(name="cpu", peak_flops={"fp32": 1e11, "bf16": 5e10, "fp16": 5e10}, memory=16e9,
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
NET_OVERHEAD = {"intel": 1e-6, "amd": 2e-6}
LL_MAX_BUS_BANDWIDTH = {"intel": 20.4e9, "amd": 19.0e9}
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
    "H100": (_nvlink(450e9, 0.82, sharp_bandwidth=480e9, sharp_latency=70e-6), _ib(50e9, 48 / 50, "intel")),
    # CPU ranks under gloo: shared memory between local processes, 10 GbE between machines
    # (1.25e9 B/s). Placeholders until the profiler measures them.
    "cpu": (Link(bandwidth=5e9, latency=2e-5, efficiency=1.0, name="shm"),
            Link(bandwidth=1.25e9, latency=5e-5, efficiency=1.0, name="Ethernet")),
})
_FAMILY = {"V100-16GB": "V100", "V100-32GB": "V100", "A100-40GB": "A100", "A100-80GB": "A100",
           "H100-SXM": "H100", "H100-96GB-500W": "H100", "H200": "H100", "cpu": "cpu"}


def device_preset(name: str) -> Device:
    """The preset Device called ``name`` (case-insensitive), e.g. ``device_preset("a100-80gb")``."""
    for key, device in DEVICE_PRESETS.items():
        if isinstance(name, str) and key.lower() == name.strip().lower():
            return device
    raise ConfigError(f"unknown device {name!r}; known devices: {', '.join(DEVICE_PRESETS)}")


def link_presets(device_name: str) -> tuple[Link, Link]:
    """(intra-node, inter-node) preset links for the family of the preset device ``device_name``."""
    return _LINKS[_FAMILY[device_preset(device_name).name]]
