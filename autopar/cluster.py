"""Hardware description: devices, links and the cluster topology.

SI units everywhere: bytes, bytes/s, seconds, FLOP/s. Memory sizes use decimal
gigabytes (80 GB = 80e9 bytes), as the datasheets do. Bandwidths are per device
and per direction. Every preset number cites its source next to it; the
efficiency constants (achieved fraction of a peak) are grouped per device
family at the top so that calibration can find and revise them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from .config import is_cpu_device
from .errors import ConfigError

# --- Achieved-fraction constants, per device family --------------------------------------------
# matmul_efficiency: fraction of the dense peak a large GEMM reaches; matmul_half_dim: the GEMM
# dimension (elements) at which the per-dim factor d/(d+half) is 1/2; memory_efficiency: fraction
# of HBM bandwidth a streaming kernel reaches; kernel_overhead: fixed seconds per kernel launch.
# Fitted on the two public V100 rows (Shoeybi et al. 2019: a 1.2B GPT-2 on one V100, 8.3B on 512;
# bench/fidelity_published.py). Two rows from one source: the least-supported constant set here.
V100_MATMUL_EFFICIENCY = 0.51
V100_MATMUL_HALF_DIM = 64.0
V100_MEMORY_EFFICIENCY = 0.8
V100_KERNEL_OVERHEAD = 5e-6

# Fitted on the public A100 rows (Megatron SC21 Table 1, the README TP table, MegaScale's Megatron-LM
# run; bench/fidelity_published.py): minimises the mean squared log error of the published metric.
A100_MATMUL_EFFICIENCY = 0.675
A100_MATMUL_HALF_DIM = 64.0
A100_MEMORY_EFFICIENCY = 0.8
A100_KERNEL_OVERHEAD = 5e-6

# H100 SXM and H200 (same compute die): fitted on Meta's three Llama 3 405B rows. 0.57 x 989 is 564
# TFLOP/s, the same three quarters of what cuBLAS reaches on a large bf16 GEMM (about 750) as the
# A100's 0.675 x 312 = 211 is of its (about 280): one stack efficiency on both generations.
H100_MATMUL_EFFICIENCY = 0.57
H100_MATMUL_HALF_DIM = 64.0
H100_MEMORY_EFFICIENCY = 0.8
H100_KERNEL_OVERHEAD = 5e-6

# Meta's Grand Teton H100 (torchtitan's H100 benchmark): the same die, 96 GB of HBM2e at 2.4 TB/s,
# its power capped at 500 W instead of the SXM part's 700 W, which lowers the clocks a long GEMM
# sustains. Its own family: fitted on its own public rows (bench/fidelity_published.py).
H100_500W_MATMUL_EFFICIENCY = 0.5075   # torchtitan's Llama 3.1 8B rows (8 and 128 GPUs, eager and compiled)

# overlap_slowdown: compute lost per second of a collective running beside it. NCCL runs one thread
# block per channel, each holding an SM for the collective's duration; FSDP's all-gather on an H100
# launches 24 (a public Nsight trace, NVIDIA developer forums 2025), so compute beside it loses
# 24 of the SMs: 24/80 (V100), 24/108 (A100), 24/132 (H100). Not fitted (the public step times
# barely depend on it); BENCHMARKS.md lists it among what stays unmeasured.
NCCL_BLOCKS = 24
V100_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 80
A100_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 108
H100_OVERLAP_SLOWDOWN = NCCL_BLOCKS / 132

CPU_MATMUL_EFFICIENCY = 0.5  # placeholders until Cluster.local() profiles this machine
CPU_MATMUL_HALF_DIM = 32.0
CPU_MEMORY_EFFICIENCY = 0.5
CPU_KERNEL_OVERHEAD = 1e-5

REQUIRED_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
_SPEC_FORM = "NODESxDEVICES_PER_NODExDEVICE e.g. 128x8xA100-80GB"


def _check_number(owner: str, name: str, value: Any, *, allow_zero: bool = False,
                  at_most_one: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a finite real number in the allowed range."""
    rng = ("in [0, 1]" if allow_zero else "in (0, 1]") if at_most_one else (">= 0" if allow_zero else "> 0")
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0) and (not at_most_one or value <= 1))
    if not ok:
        raise ConfigError(f"{owner}.{name}={value!r} is out of range: it must be a finite number {rng}")


def _check_count(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name}={value!r} is out of range: it must be an integer >= 1")


def _from_dict(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
    return dict(data)


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or CPU socket set): peaks, memory and achieved-fraction constants."""

    name: str
    """Preset name, e.g. "A100-80GB"."""
    peak_flops: Mapping[str, float]
    """Dense FLOP/s per dtype name ("fp32", "bf16", "fp16" required; "tf32" optional). Stored read-only."""
    memory: float
    """Device memory in bytes."""
    memory_bandwidth: float
    """Main-memory (HBM) bandwidth in bytes/s."""
    source: str
    """Where the numbers come from (datasheet citation)."""
    matmul_efficiency: float
    """Achieved fraction of peak for large GEMMs, in (0, 1]."""
    matmul_half_dim: float
    """GEMM dimension (elements) at which the per-dim efficiency factor d / (d + half) is 1/2."""
    memory_efficiency: float
    """Achieved fraction of ``memory_bandwidth`` for streaming kernels, in (0, 1]."""
    kernel_overhead: float
    """Fixed seconds per kernel launch."""
    dispatch_overhead: float = 0.0
    """Extra seconds per op when the runtime runs it as a DTensor (tensor parallelism): sharding
    propagation and redistribution checks on the host. Measured by the profiler; 0 for presets."""
    dispatch_overhead_backward: float = 0.0
    """The same per op of the backward pass (measured; 0 for presets)."""
    threads: int = 0
    """CPU threads per rank the measured figures hold for (profiler, CPU only); 0 when not measured."""
    concurrency_slowdown: float = 1.0
    """How much longer a rank's compute takes when every rank of the machine computes at once than
    when it computes alone (>= 1): ranks that share cores, caches and memory bandwidth slow each
    other down, and a step waits for the slowest. Measured by ``Cluster.local`` (profiler/
    link_timing.py); 1 for the GPU presets, whose ranks have a device each."""
    overlap_slowdown: float = 0.0
    """Seconds of compute lost per second of a collective it overlaps, in [0, 1): communication
    kernels take SMs and memory bandwidth from the compute beside them, so a hidden collective still
    costs this share of its time (cost_model/estimator.py). 0: the overlap is free (CPU ranks, whose
    measured ``Link.overlap`` already says what gloo's threads take)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Device.name={self.name!r} must be a non-empty string")
        if not isinstance(self.peak_flops, Mapping):
            raise ConfigError(f"Device.peak_flops={self.peak_flops!r} must be a mapping dtype name -> FLOP/s")
        missing = [d for d in REQUIRED_DTYPES if d not in self.peak_flops]
        if missing:
            raise ConfigError(f"Device.peak_flops of {self.name!r} lacks {missing}: give a FLOP/s peak for "
                              f"each of {list(REQUIRED_DTYPES)}")
        for dtype, value in self.peak_flops.items():
            if not isinstance(dtype, str):
                raise ConfigError(f"Device.peak_flops key {dtype!r} must be a dtype name string")
            _check_number("Device", f"peak_flops[{dtype!r}]", value)
        object.__setattr__(self, "peak_flops", MappingProxyType({k: float(v) for k, v in self.peak_flops.items()}))
        for name in ("memory", "memory_bandwidth"):
            _check_number("Device", name, getattr(self, name))
        for name in ("matmul_efficiency", "memory_efficiency"):
            _check_number("Device", name, getattr(self, name), at_most_one=True)
        for name in ("matmul_half_dim", "kernel_overhead", "dispatch_overhead", "dispatch_overhead_backward"):
            _check_number("Device", name, getattr(self, name), allow_zero=True)
        _check_number("Device", "overlap_slowdown", self.overlap_slowdown, allow_zero=True, at_most_one=True)
        _check_number("Device", "concurrency_slowdown", self.concurrency_slowdown)
        if self.concurrency_slowdown < 1:
            raise ConfigError(f"Device.concurrency_slowdown={self.concurrency_slowdown!r} is out of range: it must be "
                              ">= 1 (1: ranks do not slow each other down)")
        if self.overlap_slowdown >= 1:
            raise ConfigError(f"Device.overlap_slowdown={self.overlap_slowdown!r} is out of range: it must be in [0, 1)")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ConfigError(f"Device.threads={self.threads!r} is out of range: it must be an integer >= 0")
        if not isinstance(self.source, str):
            raise ConfigError(f"Device.source={self.source!r} must be a string")

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory, self.memory_bandwidth,
                     self.source, self.matmul_efficiency, self.matmul_half_dim, self.memory_efficiency,
                     self.kernel_overhead, self.dispatch_overhead, self.dispatch_overhead_backward, self.threads,
                     self.overlap_slowdown, self.concurrency_slowdown))

    @property
    def is_cpu(self) -> bool:
        """A CPU (the "cpu" preset, or a measured "cpu <model> xN thread(s)" device)."""
        return is_cpu_device(self.name)

    def peak(self, dtype: str) -> float:
        """Dense peak in FLOP/s for ``dtype`` ("fp32", "tf32", "bf16", "fp16")."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(f"device {self.name!r} has no peak for dtype {dtype!r}; "
                              f"known dtypes: {sorted(self.peak_flops)}") from None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["peak_flops"] = dict(self.peak_flops)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Device":
        return cls(**_from_dict(cls, data))


COLLECTIVE_NAMES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """A measured collective on one link level, as the ring model's two parameters (profiler)."""

    latency: float
    """Seconds per ring step (``a`` in cost_model/comm.py); for p2p, per message."""
    bandwidth: float
    """Achievable bytes/s of one rank's link for this collective (``B``; already the achieved figure)."""

    def __post_init__(self) -> None:
        _check_number("CollectiveFit", "latency", self.latency, allow_zero=True)
        _check_number("CollectiveFit", "bandwidth", self.bandwidth)


@dataclass(frozen=True, kw_only=True)
class Protocol:
    """One of a collective library's ways of moving a ring's data over a link (NCCL's LL, LL128 and
    Simple): seconds a call costs before any byte moves, seconds each ring step adds, and the share
    of the link's achievable bandwidth it reaches. The cost model prices every call with the
    fastest protocol, as NCCL's tuner does (cost_model/comm.py)."""

    name: str
    base_latency: float
    """Seconds per call."""
    step_latency: float
    """Seconds per ring step (per tree level for a tree)."""
    bandwidth_fraction: float
    """Share of the link's achievable bandwidth, in (0, 1]."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Protocol.name={self.name!r} must be a non-empty string")
        _check_number("Protocol", "base_latency", self.base_latency, allow_zero=True)
        _check_number("Protocol", "step_latency", self.step_latency, allow_zero=True)
        _check_number("Protocol", "bandwidth_fraction", self.bandwidth_fraction, at_most_one=True)


@dataclass(frozen=True, kw_only=True)
class Link:
    """A communication path, per device and per direction."""

    bandwidth: float
    """Nominal bytes/s per device, one direction."""
    latency: float
    """Seconds per message (alpha); 0 allowed."""
    efficiency: float = 1.0
    """Achieved fraction of ``bandwidth`` for large collectives (measured busbw / nominal), in (0, 1]."""
    name: str = ""
    """Short label for summaries, e.g. "NVLink" or "IB"."""
    overlap: float = 1.0
    """Fraction of a collective's time that computation issued meanwhile hides, in [0, 1]: 1 for NCCL
    on GPUs (its kernels run beside the compute); measured by the profiler (gloo's threads share
    the CPU cores with the compute ranks)."""
    context_latency: float = 0.0
    """Extra seconds per collective issued between compute rather than back to back (the backend's
    threads wake up, the ranks arrive apart); measured by the profiler, 0 for presets."""
    context_latency_p2p: float = 0.0
    """The same for a point-to-point message."""
    collectives: Mapping[str, CollectiveFit] = field(default_factory=dict)
    """Measured fits per collective (keys from COLLECTIVE_NAMES) that replace ``latency`` and
    ``bandwidth * efficiency`` for that collective; empty for presets. Stored read-only."""
    protocols: tuple[Protocol, ...] = ()
    """The ring protocols of the link's collective library (GPU presets: NCCL's LL, LL128, Simple);
    empty: one protocol of ``latency`` per step at the full achievable bandwidth (gloo, measured
    links, a user's alpha-beta). A collective with a measured fit uses the fit."""
    sharp_bandwidth: float = 0.0
    """All-reduce bus bandwidth (bytes/s, achieved) of in-switch reduction inside one node (NVLink
    SHARP, NCCL's NVLS); 0 when the link has none."""
    sharp_latency: float = 0.0
    """Seconds per in-switch all-reduce call beyond its bandwidth term."""

    def __post_init__(self) -> None:
        _check_number("Link", "bandwidth", self.bandwidth)
        _check_number("Link", "latency", self.latency, allow_zero=True)
        _check_number("Link", "efficiency", self.efficiency, at_most_one=True)
        _check_number("Link", "overlap", self.overlap, allow_zero=True, at_most_one=True)
        _check_number("Link", "context_latency", self.context_latency, allow_zero=True)
        _check_number("Link", "context_latency_p2p", self.context_latency_p2p, allow_zero=True)
        if not isinstance(self.name, str):
            raise ConfigError(f"Link.name={self.name!r} must be a string")
        if not isinstance(self.collectives, Mapping):
            raise ConfigError(f"Link.collectives={self.collectives!r} must be a mapping collective -> CollectiveFit")
        fits = {}
        for kind, fit in self.collectives.items():
            if kind not in COLLECTIVE_NAMES:
                raise ConfigError(f"Link.collectives has unknown collective {kind!r}; known: {list(COLLECTIVE_NAMES)}")
            fits[kind] = CollectiveFit(**fit) if isinstance(fit, Mapping) else fit
            if not isinstance(fits[kind], CollectiveFit):
                raise ConfigError(f"Link.collectives[{kind!r}]={fit!r} must be a CollectiveFit")
        object.__setattr__(self, "collectives", MappingProxyType(fits))
        if not isinstance(self.protocols, (tuple, list)):
            raise ConfigError(f"Link.protocols={self.protocols!r} must be a sequence of Protocol")
        protocols = tuple(Protocol(**p) if isinstance(p, Mapping) else p for p in self.protocols)
        if not all(isinstance(p, Protocol) for p in protocols):
            raise ConfigError(f"Link.protocols={self.protocols!r} must be a sequence of Protocol")
        if len({p.name for p in protocols}) != len(protocols):
            raise ConfigError(f"Link.protocols {[p.name for p in protocols]} repeat a name: give each protocol once")
        object.__setattr__(self, "protocols", protocols)
        _check_number("Link", "sharp_bandwidth", self.sharp_bandwidth, allow_zero=True)
        _check_number("Link", "sharp_latency", self.sharp_latency, allow_zero=True)

    def __hash__(self) -> int:
        return hash((self.bandwidth, self.latency, self.efficiency, self.overlap, self.context_latency,
                     self.context_latency_p2p, self.name, tuple(sorted(
            (k, v.latency, v.bandwidth) for k, v in self.collectives.items())), self.protocols,
            self.sharp_bandwidth, self.sharp_latency))

    @property
    def effective_bandwidth(self) -> float:
        """Achievable bytes/s: ``bandwidth * efficiency``."""
        return self.bandwidth * self.efficiency

    def achievable(self, collective: str) -> float:
        """Achievable bytes/s for ``collective`` (a name in COLLECTIVE_NAMES): measured, else the nominal figure."""
        fit = self.collectives.get(collective)
        return fit.bandwidth if fit is not None else self.effective_bandwidth

    def step_latency(self, collective: str) -> float:
        """Seconds per ring step (per message for p2p) of ``collective``: measured, else ``latency``."""
        fit = self.collectives.get(collective)
        return fit.latency if fit is not None else self.latency

    def ring_protocols(self, collective: str) -> tuple[Protocol, ...]:
        """The protocols a ring ``collective`` may run with on this link: the measured fit's, else
        ``protocols``, else one of ``latency`` per step at the full achievable bandwidth."""
        fit = self.collectives.get(collective)
        if fit is not None or not self.protocols:
            return (Protocol(name="ring", base_latency=0.0, step_latency=self.step_latency(collective),
                             bandwidth_fraction=1.0),)
        return self.protocols

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["collectives"] = {k: {"latency": v.latency, "bandwidth": v.bandwidth}
                               for k, v in self.collectives.items()}
        data["protocols"] = [dataclasses.asdict(p) for p in self.protocols]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Link":
        return cls(**_from_dict(cls, data))


# --- Device presets (calibration.md section 6, vendor datasheets) -----------------------------
def _gpu(name: str, *, bf16: float, fp32: float, tf32: float | None, memory: float, hbm: float, source: str,
         family: str) -> Device:
    consts = {"V100": (V100_MATMUL_EFFICIENCY, V100_MATMUL_HALF_DIM, V100_MEMORY_EFFICIENCY, V100_KERNEL_OVERHEAD,
                       V100_OVERLAP_SLOWDOWN),
              "A100": (A100_MATMUL_EFFICIENCY, A100_MATMUL_HALF_DIM, A100_MEMORY_EFFICIENCY, A100_KERNEL_OVERHEAD,
                       A100_OVERLAP_SLOWDOWN),
              "H100": (H100_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY, H100_KERNEL_OVERHEAD,
                       H100_OVERLAP_SLOWDOWN),
              "H100-500W": (H100_500W_MATMUL_EFFICIENCY, H100_MATMUL_HALF_DIM, H100_MEMORY_EFFICIENCY,
                            H100_KERNEL_OVERHEAD, H100_OVERLAP_SLOWDOWN)}
    mm, half, mem, overhead, slowdown = consts[family]
    peaks = {"fp32": fp32, "bf16": bf16, "fp16": bf16}
    if tf32 is not None:
        peaks["tf32"] = tf32
    return Device(name=name, peak_flops=peaks, memory=memory, memory_bandwidth=hbm, source=source,
                  matmul_efficiency=mm, matmul_half_dim=half, memory_efficiency=mem, kernel_overhead=overhead,
                  overlap_slowdown=slowdown)


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
# by link type; the values below are ours, checked against calibration.md section 5 by
# bench/fidelity_published.py). LL moves 8-byte flag+data words: low latency, a fraction of the
# bandwidth; LL128 128-byte lines; Simple whole chunks at full bandwidth with the most latency.
# - NVLink: per-step 0.6 us (LL), 1.9 us (LL128), 3.4 us (Simple); per call 14 us (LL128) and
#   8.4 us (Simple), from NCCL's model. LL's call latency (5.27 us) and bandwidth share (0.363) are
#   fitted on the 8-byte and 1 MiB rows of the 8 x H100 all-reduce table (13.67 and 27.37 us).
#   The same protocols are assumed on every NVLink generation.
# - InfiniBand: per-step 2.7 us (LL), 4 us (LL128), 9.6 us (Simple), from NCCL's model.
# ``latency`` (one message) is what p2p and the pairwise all-to-all pay per message.
_NVLINK_PROTOCOLS = (
    Protocol(name="LL", base_latency=5.27e-6, step_latency=0.6e-6, bandwidth_fraction=0.363),
    Protocol(name="LL128", base_latency=14e-6, step_latency=1.9e-6, bandwidth_fraction=0.92),
    Protocol(name="Simple", base_latency=8.4e-6, step_latency=3.4e-6, bandwidth_fraction=1.0),
)
_IB_PROTOCOLS = (
    Protocol(name="LL", base_latency=5.27e-6, step_latency=2.7e-6, bandwidth_fraction=0.363),
    Protocol(name="LL128", base_latency=14e-6, step_latency=4e-6, bandwidth_fraction=0.92),
    Protocol(name="Simple", base_latency=8.4e-6, step_latency=9.6e-6, bandwidth_fraction=1.0),
)


def _nvlink(bandwidth: float, efficiency: float, **sharp: float) -> Link:
    return Link(bandwidth=bandwidth, latency=1e-6, efficiency=efficiency, name="NVLink", protocols=_NVLINK_PROTOCOLS,
                **sharp)


def _ib(bandwidth: float, efficiency: float) -> Link:
    # 10 us per message (IB RDMA plus NCCL proxy), 5 us of wire latency being the floor
    return Link(bandwidth=bandwidth, latency=1e-5, efficiency=efficiency, name="IB", protocols=_IB_PROTOCOLS)


_LINKS: Mapping[str, tuple[Link, Link]] = MappingProxyType({
    # V100 NVLink2: 300 GB/s both ways per GPU (section 6) = 150e9 per direction; 0.8 achieved
    # (assumed, no public busbw in the calibration set). Inter-node: one 100 Gb/s NIC per NODE
    # = 12.5e9 B/s shared by 8 GPUs; 0.92 achieved as for EDR InfiniBand (assumed).
    "V100": (_nvlink(150e9, 0.8), _ib(12.5e9 / 8, 0.92)),
    # A100 NVLink3: 600 GB/s both ways (section 6) = 300e9 per direction; NCCL all-reduce busbw
    # about 230 GB/s (section 5): 230/300. Inter-node: 8 x HDR 200 Gb/s per DGX node = 25e9 B/s
    # per GPU, about 24 GB/s achieved per NIC (section 5): 24/25.
    "A100": (_nvlink(300e9, 230 / 300), _ib(25e9, 24 / 25)),
    # H100/H200 NVLink4: 900 GB/s both ways = 450e9 per direction. Ring busbw about 370 GB/s
    # (NCCL maintainers, section 5): 0.82. NVLink SHARP all-reduce about 480 GB/s busbw (the 8 GiB
    # row of the 8 x H100 table: 480.16), 70 us per call beyond that (fitted on its 16 MiB - 1 GiB
    # rows). Inter-node: 8 x NDR 400 Gb/s = 50e9 B/s per GPU, about 48 GB/s achieved: 48/50.
    "H100": (_nvlink(450e9, 0.82, sharp_bandwidth=480e9, sharp_latency=70e-6), _ib(50e9, 48 / 50)),
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


def _spec_error(spec: Any, reason: str) -> ConfigError:
    return ConfigError(f"cluster spec {spec!r} is malformed: {reason}; expected {_SPEC_FORM}; "
                       f"known devices: {', '.join(DEVICE_PRESETS)}")


def _parse_spec(spec: str) -> tuple[int, int, str]:
    """Split "NODESxPER_NODExDEVICE" (or "PER_NODExDEVICE") into counts and a device name."""
    if not isinstance(spec, str):
        raise _spec_error(spec, "it must be a string")
    text = spec.strip()
    # The device part starts at the first letter that is not the separator 'x'.
    start = next((i for i, c in enumerate(text) if c.isalpha() and c.lower() != "x"), None)
    if start is None:
        raise _spec_error(spec, "no device name")
    if start == 0 or text[start - 1].lower() != "x":
        raise _spec_error(spec, f"missing the device count before {text[start:]!r}")
    tokens = re.split("[xX]", text[:start - 1])
    if len(tokens) > 2:
        raise _spec_error(spec, f"too many counts {tokens}")
    counts = []
    for token in tokens:
        if not re.fullmatch(r"\s*[+-]?\d+\s*", token):
            raise _spec_error(spec, f"count {token!r} is not an integer")
        if int(token) < 1:
            raise _spec_error(spec, f"count {token!r} must be >= 1")
        counts.append(int(token))
    nodes, per_node = counts if len(counts) == 2 else (1, counts[0])
    device = text[start:]
    if device.lower() not in {k.lower() for k in DEVICE_PRESETS}:
        raise _spec_error(spec, f"unknown device {device!r}")
    return nodes, per_node, device


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` identical nodes of ``devices_per_node`` devices each.

    ``inter_node`` is per device: a node's total NIC bandwidth is
    ``devices_per_node * inter_node.bandwidth``.
    """

    nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link

    def __post_init__(self) -> None:
        _check_count("Cluster", "nodes", self.nodes)
        _check_count("Cluster", "devices_per_node", self.devices_per_node)
        if not isinstance(self.device, Device):
            raise ConfigError(f"Cluster.device={self.device!r} must be a Device")
        for name in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, name), Link):
                raise ConfigError(f"Cluster.{name}={getattr(self, name)!r} must be a Link")

    @property
    def devices(self) -> int:
        """Total number of devices (``nodes * devices_per_node``)."""
        return self.nodes * self.devices_per_node

    @classmethod
    def from_spec(cls, spec: str, *, intra_node_bandwidth: float | None = None,
                  inter_node_bandwidth: float | None = None, intra_node_latency: float | None = None,
                  inter_node_latency: float | None = None, device_memory: float | None = None) -> "Cluster":
        """Build a cluster from "NODESxDEVICES_PER_NODExDEVICE" (e.g. "128x8xA100-80GB", "1x2xcpu").

        "8xA100-80GB" means one node. The device name is case-insensitive. Links come
        from the device family's presets. The keyword overrides are per device and per
        direction, in bytes/s and seconds; an overridden bandwidth is taken as the
        achievable number and so gets ``efficiency=1.0`` (an overridden latency keeps
        the preset efficiency). ``device_memory`` (bytes) replaces the preset's memory per device,
        e.g. to keep a reserve for the framework: ``device_memory=70e9`` on an 80 GB part.
        """
        nodes, per_node, device_name = _parse_spec(spec)
        device = device_preset(device_name)
        if device_memory is not None:
            _check_number("Cluster.from_spec", "device_memory", device_memory)
            device = dataclasses.replace(device, memory=float(device_memory))
        intra, inter = link_presets(device.name)
        intra = _override(intra, "intra_node", intra_node_bandwidth, intra_node_latency)
        inter = _override(inter, "inter_node", inter_node_bandwidth, inter_node_latency)
        return cls(nodes=nodes, devices_per_node=per_node, device=device, intra_node=intra, inter_node=inter)

    @classmethod
    def local(cls, nprocs: int | None = None, threads_per_rank: int | None = None, *,
              profile_db: str | None = None, refresh: bool = False, progress: bool = True) -> "Cluster":
        """This machine with measured device and links (the profiler), loaded from the profile cache
        (``profile_db``, default ``~/.cache/autopar/profile.json``) when it was measured before.

        GPUs: one rank per GPU (``nprocs`` of them, default all), NCCL. CPU: ``nprocs`` gloo ranks of
        ``threads_per_rank`` threads (default one-thread ranks on every core; given ``nprocs``
        alone, the cores shared out). ``refresh=True`` measures again. First run: about 10-40 s.
        """
        from .profiler.local import local_cluster
        return local_cluster(nprocs, threads_per_rank, profile_db=profile_db, refresh=refresh, progress=progress)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "devices_per_node": self.devices_per_node, "device": self.device.to_dict(),
                "intra_node": self.intra_node.to_dict(), "inter_node": self.inter_node.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Cluster":
        data = _from_dict(cls, data)
        for key, kind in (("device", Device), ("intra_node", Link), ("inter_node", Link)):
            if isinstance(data.get(key), Mapping):
                data[key] = kind.from_dict(data[key])
        return cls(**data)

    def describe(self) -> str:
        """E.g. "128 x 8 x A100-80GB (1024 devices; NVLink 300 GB/s, IB 25 GB/s per device)"."""
        intra = f"{self.intra_node.name or 'intra-node'} {self.intra_node.bandwidth / 1e9:g} GB/s"
        inter = f"{self.inter_node.name or 'inter-node'} {self.inter_node.bandwidth / 1e9:g} GB/s"
        return (f"{self.nodes} x {self.devices_per_node} x {self.device.name} "
                f"({self.devices} devices; {intra}, {inter} per device)")


def _override(link: Link, which: str, bandwidth: float | None, latency: float | None) -> Link:
    if bandwidth is not None:
        _check_number("Cluster.from_spec", f"{which}_bandwidth", bandwidth)
        link = Link(bandwidth=bandwidth, latency=link.latency, efficiency=1.0, name=link.name)
    if latency is not None:
        _check_number("Cluster.from_spec", f"{which}_latency", latency, allow_zero=True)
        link = Link(bandwidth=link.bandwidth, latency=latency, efficiency=link.efficiency, name=link.name)
    return link
