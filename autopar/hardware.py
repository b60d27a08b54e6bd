"""Devices and links: what one accelerator and one kind of connection can do.

SI units everywhere: bytes, bytes/s, seconds, FLOP/s. Memory sizes use decimal gigabytes
(80 GB = 80e9 bytes), as the datasheets do. Bandwidths are per device and per direction.
The presets live in presets.py, the topology that puts them together in cluster.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from .config import is_cpu_device
from .errors import ConfigError

MEASURED_SOURCE = "measured by autopar's profiler"
"""How the ``source`` of a Device that ``Cluster.local`` measured begins (profiler/device_fit.py)."""

REQUIRED_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")

def check_number(owner: str, name: str, value: Any, *, allow_zero: bool = False,
                  at_most_one: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a finite real number in the allowed range."""
    rng = ("in [0, 1]" if allow_zero else "in (0, 1]") if at_most_one else (">= 0" if allow_zero else "> 0")
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0) and (not at_most_one or value <= 1))
    if not ok:
        raise ConfigError(f"{owner}.{name}={value!r} is out of range: it must be a finite number {rng}")


def check_count(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name}={value!r} is out of range: it must be an integer >= 1")


def from_dict(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
    return dict(data)


class _FlatRecord:
    """``to_dict`` / ``from_dict`` of a dataclass whose fields are all plain values (Host, Fabric)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        return cls(**from_dict(cls, data))


@dataclass(frozen=True, kw_only=True)
class Host(_FlatRecord):
    """The host side of one accelerator, its share of the machine's CPUs: what offloading (ParallelConfig.offload)
    keeps there and the link it crosses. The machine's figures divided by its accelerators."""

    memory: float
    """Host memory (DRAM) in bytes per accelerator."""
    memory_bandwidth: float
    """Host memory bandwidth in bytes/s per accelerator (the sockets' channels): a CPU optimizer step streams
    its states through it."""
    link_bandwidth: float
    """Achieved bytes/s each way between the accelerator and pinned host memory (PCIe, NVLink-C2C)."""
    source: str
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for name in ("memory", "memory_bandwidth", "link_bandwidth"):
            check_number("Host", name, getattr(self, name))
        if not isinstance(self.source, str):
            raise ConfigError(f"Host.source={self.source!r} must be a string")


@dataclass(frozen=True, kw_only=True)
class Fabric(_FlatRecord):
    """The network above the nodes when it has more than one tier (cost_model/comm.py): ``pod_nodes`` nodes
    under full bisection bandwidth (a pod: the leaf and spine switches of a rail-optimised fat tree), pods
    joined by a tier that carries ``1 / oversubscription`` of the pods' NIC bandwidth (Meta's 24K-GPU RoCE
    cluster: pods of 3,072 GPUs, 1:7 between them). None on a Cluster: one non-blocking tier."""

    pod_nodes: int
    """Nodes (NVLink domains) per pod: consecutive nodes, as ranks fill them."""
    oversubscription: float
    """The pods' NIC bandwidth over what the tier above them carries (1: non-blocking)."""
    source: str
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        check_count("Fabric", "pod_nodes", self.pod_nodes)
        check_number("Fabric", "oversubscription", self.oversubscription)
        if self.oversubscription < 1:
            raise ConfigError(f"Fabric.oversubscription={self.oversubscription!r} must be >= 1 (1: the tier above the "
                              "pods carries all of their NIC bandwidth)")
        if not isinstance(self.source, str):
            raise ConfigError(f"Fabric.source={self.source!r} must be a string")


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
    sm_count: int | None = None
    """Streaming multiprocessors (compute units) a GEMM's output tiles are spread over, one tile per unit
    at a time (cost_model/compute.py: tile and wave quantization): the GPU presets'. None: no quantization,
    for CPUs (their GEMM libraries do not work in waves of tiles) and for a device ``Cluster.local``
    measured, whose fitted efficiency curve is the smooth one (profiler/device_fit.py)."""
    fp8_matmul_efficiency: float | None = None
    """Achieved fraction of the fp8 peak for a large fp8 GEMM whose tiles fill whole waves, in (0, 1] (the
    fp8 GEMM kernels reach a different share of their peak than bf16 ones; cost_model/low_precision.py);
    None: ``matmul_efficiency``."""
    attention_efficiency: float | None = None
    """Achieved fraction of peak for a large fused attention kernel (FlashAttention and its kin, forward
    and backward), in (0, 1]; None: a GEMM's (``matmul_efficiency``). The attention kernel is its own
    code, not cuBLAS, and a generation's may lag its GEMMs (cost_model/compute.py)."""
    memory_efficiency: float
    """Achieved fraction of ``memory_bandwidth`` for streaming kernels, in (0, 1]."""
    kernel_overhead: float
    """Fixed seconds per kernel launch."""
    dispatch_overhead: float = 0.0
    """Extra host seconds per op when the runtime runs it tensor-parallel (reading its arguments through
    the lowering's conversions, the shard's shape check). Measured by the profiler; 0 for presets."""
    dispatch_overhead_backward: float = 0.0
    """The same per op of the backward pass (measured; 0 for presets)."""
    dtensor_step_overhead: float = 0.0
    """Extra host seconds per parameter tensor of an optimizer step on DTensor parameters (FSDP2's, ZeRO-2/3)
    over plain ones: DTensor's dispatch of every op of the update. Measured by the profiler (on a GPU, host
    time that a large model's kernels may hide, priced as exposed); 0 for presets, whose kernels run behind
    the host."""
    threads: int = 0
    """CPU threads per rank the measured figures hold for (profiler, CPU only); 0 when not measured."""
    concurrency_slowdown: float = 1.0
    """How much longer a rank's compute takes when every rank of the machine computes at once than
    when it computes alone (>= 1): ranks that share cores, caches and memory bandwidth slow each
    other down, and a step waits for the slowest. Measured by ``Cluster.local`` (profiler/
    step_conditions.py); 1 for the GPU presets, whose ranks have a device each."""
    overlap_slowdown: float = 0.0
    """Seconds of compute lost per second of a collective it overlaps, in [0, 1): communication
    kernels take SMs and memory bandwidth from the compute beside them, so a hidden collective still
    costs this share of its time (cost_model/step_tail.py). 0: the overlap is free (CPU ranks, whose
    measured ``Link.overlap`` already says what gloo's threads take)."""

    host: Host | None = None
    """The host side (ParallelConfig.offload prices and keeps states there); None: not described, and a plan
    that offloads is refused. A CPU is its own host (cost_model/offload.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.host, Mapping):
            object.__setattr__(self, "host", Host.from_dict(self.host))
        if self.host is not None and not isinstance(self.host, Host):
            raise ConfigError(f"Device.host={self.host!r} must be a Host or None")
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
            check_number("Device", f"peak_flops[{dtype!r}]", value)
        object.__setattr__(self, "peak_flops", MappingProxyType({k: float(v) for k, v in self.peak_flops.items()}))
        for name in ("memory", "memory_bandwidth"):
            check_number("Device", name, getattr(self, name))
        for name in ("matmul_efficiency", "memory_efficiency"):
            check_number("Device", name, getattr(self, name), at_most_one=True)
        for name in ("matmul_half_dim", "kernel_overhead", "dispatch_overhead", "dispatch_overhead_backward",
                     "dtensor_step_overhead"):
            check_number("Device", name, getattr(self, name), allow_zero=True)
        check_number("Device", "overlap_slowdown", self.overlap_slowdown, allow_zero=True, at_most_one=True)
        for name in ("attention_efficiency", "fp8_matmul_efficiency"):
            if getattr(self, name) is not None:
                check_number("Device", name, getattr(self, name), at_most_one=True)
        check_number("Device", "concurrency_slowdown", self.concurrency_slowdown)
        if self.concurrency_slowdown < 1:
            raise ConfigError(f"Device.concurrency_slowdown={self.concurrency_slowdown!r} is out of range: it must be "
                              ">= 1 (1: ranks do not slow each other down)")
        if self.overlap_slowdown >= 1:
            raise ConfigError(f"Device.overlap_slowdown={self.overlap_slowdown!r} is out of range: it must be in [0, 1)")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ConfigError(f"Device.threads={self.threads!r} is out of range: it must be an integer >= 0")
        if self.sm_count is not None:
            check_count("Device", "sm_count", self.sm_count)
        if not isinstance(self.source, str):
            raise ConfigError(f"Device.source={self.source!r} must be a string")

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory, self.memory_bandwidth,
                     self.source, self.matmul_efficiency, self.matmul_half_dim, self.sm_count,
                     self.attention_efficiency, self.fp8_matmul_efficiency, self.memory_efficiency,
                     self.kernel_overhead, self.dispatch_overhead, self.dispatch_overhead_backward,
                     self.dtensor_step_overhead, self.threads, self.overlap_slowdown, self.concurrency_slowdown, self.host))

    @property
    def is_cpu(self) -> bool:
        """A CPU (the "cpu" preset, or a measured "cpu <model> xN thread(s)" device)."""
        return is_cpu_device(self.name)

    def peak(self, dtype: str) -> float:
        """Dense peak in FLOP/s for ``dtype`` ("fp32", "tf32", "bf16", "fp16"; "fp8", "mxfp8", "fp4" on parts
        with such tensor cores; "fp64" where the preset or the profile gives it)."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            hint = (": dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, peak_flops="
                    "{**cluster.device.peak_flops, 'fp64': <FLOP/s>}))" if dtype == "fp64" else "")
            if dtype == "fp64" and self.source.startswith(MEASURED_SOURCE):
                hint = ("; this machine's profile was measured before autopar measured fp64: Cluster.local(refresh="
                        "True) or `autopar profile --refresh` measures it")
            raise ConfigError(f"device {self.name!r} has no peak for dtype {dtype!r} (known: "
                              f"{sorted(self.peak_flops)}): price on a Device whose peak_flops has {dtype!r}{hint}"
                              ) from None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["peak_flops"] = dict(self.peak_flops)
        data["host"] = self.host.to_dict() if self.host is not None else None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Device":
        return cls(**from_dict(cls, data))


COLLECTIVE_NAMES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """A measured collective on one link level, as the ring model's two parameters (profiler)."""

    latency: float
    """Seconds per ring step (``a`` in cost_model/comm.py); for p2p, per message."""
    bandwidth: float
    """Achievable bytes/s of one rank's link for this collective (``B``; already the achieved figure)."""

    def __post_init__(self) -> None:
        check_number("CollectiveFit", "latency", self.latency, allow_zero=True)
        check_number("CollectiveFit", "bandwidth", self.bandwidth)


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
    net_step_floor: float = 0.0
    """Of an inter-node link's protocol: seconds every step of a ring that spans nodes takes at least, on
    whichever link the step crosses (the host's proxy posts each step to the network: NCCL's "net
    overhead", cost_model/comm.py); 0: none."""
    bus_bandwidth_cap: float = 0.0
    """Of an inter-node link's protocol: the most bus bandwidth (bytes/s) a ring with this protocol
    reaches across more than two nodes, whatever the links could carry (NCCL's ``llMaxBws`` for LL);
    0: no cap."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Protocol.name={self.name!r} must be a non-empty string")
        check_number("Protocol", "base_latency", self.base_latency, allow_zero=True)
        check_number("Protocol", "step_latency", self.step_latency, allow_zero=True)
        check_number("Protocol", "bandwidth_fraction", self.bandwidth_fraction, at_most_one=True)
        check_number("Protocol", "net_step_floor", self.net_step_floor, allow_zero=True)
        check_number("Protocol", "bus_bandwidth_cap", self.bus_bandwidth_cap, allow_zero=True)


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
    peers: int = 0
    """0: a switched link (NVSwitch): a device reaches every other device of its node at the full
    ``bandwidth``. k > 0: a fully connected mesh without a switch (AMD Infinity Fabric: 7 links to the 7
    other GPUs of a node): ``bandwidth`` is the sum of the device's ``k`` equal links, so a group of ``r``
    ranks inside the node reaches ``(r - 1) / k`` of it (the links to its own members; the collective
    library runs one ring per link) and a point-to-point message ``1 / k`` (cost_model/comm.py)."""

    def __post_init__(self) -> None:
        check_number("Link", "bandwidth", self.bandwidth)
        check_number("Link", "latency", self.latency, allow_zero=True)
        check_number("Link", "efficiency", self.efficiency, at_most_one=True)
        check_number("Link", "overlap", self.overlap, allow_zero=True, at_most_one=True)
        check_number("Link", "context_latency", self.context_latency, allow_zero=True)
        check_number("Link", "context_latency_p2p", self.context_latency_p2p, allow_zero=True)
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
        check_number("Link", "sharp_bandwidth", self.sharp_bandwidth, allow_zero=True)
        check_number("Link", "sharp_latency", self.sharp_latency, allow_zero=True)
        if isinstance(self.peers, bool) or not isinstance(self.peers, int) or self.peers < 0:
            raise ConfigError(f"Link.peers={self.peers!r} is out of range: it must be an integer >= 0 (0: a switch; "
                              "k: a full mesh of k links per device)")

    def __hash__(self) -> int:
        return hash((self.bandwidth, self.latency, self.efficiency, self.overlap, self.context_latency,
                     self.context_latency_p2p, self.name, tuple(sorted(
            (k, v.latency, v.bandwidth) for k, v in self.collectives.items())), self.protocols,
            self.sharp_bandwidth, self.sharp_latency, self.peers))

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

    def group_share(self, ranks: int) -> float:
        """Share of ``bandwidth`` one rank of a group of ``ranks`` on this link reaches: 1 on a switch;
        ``(ranks - 1) / peers`` on a full mesh of ``peers`` links (at least one link's worth)."""
        if self.peers == 0:
            return 1.0
        return min(1.0, max(1, ranks - 1) / self.peers)

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
        return cls(**from_dict(cls, data))
