"""The device profile's records: what :func:`autopar.profiler.device.measure_device` measured, as
frozen dataclasses with a JSON record form, and their place in the ProfileDB.

Samples (seconds, FLOPs, bytes; SI units): :class:`MatmulSample`, :class:`ConvSample`,
:class:`AttentionSample`, :class:`BandwidthSample`; :class:`DeviceProfile` holds them all for one
device at one thread count, with the conditions it was measured under (autopar/conditions.py).
device_fit.py fits a Device to a profile.

Record format 2 adds the conditions; a format-1 record (an older autopar) has none, so
:func:`load_profile` treats it as absent and the profile is measured again: it may be exactly the
busy-moment measurement the conditions exist to catch, and measuring costs 10-40 s once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from ..conditions import ProfileConditions
from ..errors import ConfigError

RECORD_KEY = "profile"
"""Key of the profile record in ProfileDB section "device" (see :func:`save_profile`)."""
RECORD_FORMAT = 2
OLD_FORMATS = (1,)
"""Record formats of older autopars, measured again rather than read."""


def _require(record: Mapping[str, Any], keys: Sequence[str], what: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise ConfigError(f"{what} record {dict(record)!r} lacks {missing}: delete the profile database "
                          "entry to measure again")


@dataclass(frozen=True)
class MatmulSample:
    """``batch`` products (m x k) @ (k x n) took ``seconds``."""

    m: int
    n: int
    k: int
    seconds: float
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def flops_per_second(self) -> float:
        return self.flops / self.seconds

    def to_record(self) -> dict[str, Any]:
        return {"m": self.m, "n": self.n, "k": self.k, "batch": self.batch, "seconds": self.seconds,
                "flops": self.flops, "flops_per_second": self.flops_per_second}

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "MatmulSample":
        _require(r, ("m", "n", "k", "seconds"), "matmul sample")
        return cls(int(r["m"]), int(r["n"]), int(r["k"]), float(r["seconds"]), int(r.get("batch", 1)))


class _KernelSample:
    """The record form shared by the kernel samples below: their fields (``dtype`` a string,
    ``seconds`` a float, the sizes integers) plus the derived ``flops`` and ``flops_per_second``."""

    what = "kernel sample"  # for error messages

    @property
    def flops_per_second(self) -> float:
        return self.flops / self.seconds

    def to_record(self) -> dict[str, Any]:
        rec = {f.name: getattr(self, f.name) for f in fields(self)}
        return rec | {"flops": self.flops, "flops_per_second": self.flops_per_second}

    @classmethod
    def from_record(cls, r: Mapping[str, Any]):
        keys = [f.name for f in fields(cls)]
        _require(r, keys, cls.what)
        return cls(**{k: (str(r[k]) if k == "dtype" else float(r[k]) if k == "seconds" else int(r[k]))
                      for k in keys})


@dataclass(frozen=True)
class ConvSample(_KernelSample):
    """conv2d of an (N, C_in, H, W) input by (C_out, C_in, kernel, kernel) weights, stride 1, same padding."""

    what = "conv sample"

    dtype: str
    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    kernel: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.out_channels * self.height * self.width * self.in_channels * self.kernel ** 2


@dataclass(frozen=True)
class AttentionSample(_KernelSample):
    """scaled_dot_product_attention forward of (batch, heads, seq, head_dim) q, k and v, no mask."""

    what = "attention sample"

    dtype: str
    batch: int
    heads: int
    seq: int
    head_dim: int
    seconds: float

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.seq ** 2 * self.head_dim


@dataclass(frozen=True)
class BandwidthSample:
    """A streaming op ("copy": dst.copy_(src); "add": c = a + b) moved ``bytes`` (read + written)."""

    op: str
    bytes: float
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds

    def to_record(self) -> dict[str, Any]:
        return {"op": self.op, "bytes": self.bytes, "seconds": self.seconds, "bytes_per_second": self.bytes_per_second}

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "BandwidthSample":
        _require(r, ("op", "bytes", "seconds"), "bandwidth sample")
        return cls(str(r["op"]), float(r["bytes"]), float(r["seconds"]))


@dataclass(frozen=True)
class DeviceProfile:
    """What :func:`measure_device` measured on one device at one thread count."""

    device_name: str
    device_type: str
    """"cpu" or "cuda"."""
    threads: int
    conditions: ProfileConditions
    """What it was measured under: the date, the torch version, other load, spread of repeats."""
    memory_bytes: float
    """Total memory: RAM on a CPU, the GPU's memory on a GPU."""
    budget: str
    matmul: Mapping[str, tuple[MatmulSample, ...]]
    """Samples per dtype name, in the order measured. Stored read-only."""
    conv: tuple[ConvSample, ...]
    attention: tuple[AttentionSample, ...]
    bandwidth: tuple[BandwidthSample, ...]
    kernel_overhead_seconds: float
    unavailable: Mapping[str, str] = field(default_factory=dict)
    """Dtypes asked for but not measured, with the reason. Stored read-only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "matmul", MappingProxyType({k: tuple(v) for k, v in self.matmul.items()}))
        object.__setattr__(self, "unavailable", MappingProxyType(dict(self.unavailable)))
        for name in ("conv", "attention", "bandwidth"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    __hash__ = None  # type: ignore[assignment]  # holds mappings

    @property
    def best_bandwidth(self) -> float:
        """The best measured streaming bytes/s."""
        if not self.bandwidth:
            raise ConfigError(f"the profile of {self.device_name!r} has no bandwidth samples: measure it again")
        return max(s.bytes_per_second for s in self.bandwidth)

    def peak(self, dtype: str) -> float | None:
        """The highest achieved matmul FLOP/s of ``dtype``, or None when it was not measured."""
        samples = self.matmul.get(dtype, ())
        return max(s.flops_per_second for s in samples) if samples else None

    def to_record(self) -> dict[str, Any]:
        """A JSON-serialisable dict (units in the field names) for ProfileDB section "device"."""
        return {"format": RECORD_FORMAT, "device_name": self.device_name, "device_type": self.device_type,
                "threads": self.threads, "conditions": self.conditions.to_dict(),
                "memory_bytes": self.memory_bytes, "budget": self.budget,
                "matmul": {dt: [s.to_record() for s in ss] for dt, ss in self.matmul.items()},
                "conv": [s.to_record() for s in self.conv],
                "attention": [s.to_record() for s in self.attention],
                "bandwidth": [s.to_record() for s in self.bandwidth],
                "kernel_overhead_seconds": self.kernel_overhead_seconds,
                "unavailable": dict(self.unavailable)}

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "DeviceProfile":
        if not isinstance(r, Mapping) or r.get("format") != RECORD_FORMAT:
            raise ConfigError(f"device profile record is not of format {RECORD_FORMAT}: delete the profile "
                              "database entry to measure again")
        _require(r, ("device_name", "device_type", "threads", "conditions", "memory_bytes",
                     "budget", "matmul", "conv", "attention", "bandwidth", "kernel_overhead_seconds"),
                 "device profile")
        return cls(device_name=str(r["device_name"]), device_type=str(r["device_type"]), threads=int(r["threads"]),
                   conditions=ProfileConditions.from_dict(r["conditions"]),
                   memory_bytes=float(r["memory_bytes"]), budget=str(r["budget"]),
                   matmul={str(dt): tuple(MatmulSample.from_record(s) for s in ss) for dt, ss in r["matmul"].items()},
                   conv=tuple(ConvSample.from_record(s) for s in r["conv"]),
                   attention=tuple(AttentionSample.from_record(s) for s in r["attention"]),
                   bandwidth=tuple(BandwidthSample.from_record(s) for s in r["bandwidth"]),
                   kernel_overhead_seconds=float(r["kernel_overhead_seconds"]),
                   unavailable={str(k): str(v) for k, v in r.get("unavailable", {}).items()})


def matmul_curve(profile: DeviceProfile) -> list[dict[str, Any]]:
    """The matmul samples as JSON rows: dtype, m, n, k, batch, seconds, flops, flops_per_second."""
    return [{"dtype": dt} | s.to_record() for dt, ss in profile.matmul.items() for s in ss]


def save_profile(db: Any, profile: DeviceProfile) -> None:
    """Keep ``profile`` in ``db`` (an autopar.profiler.database.ProfileDB) under section "device"; call db.save()."""
    db.put(profile.device_name, "device", RECORD_KEY, profile.to_record())


def load_profile(db: Any, name: str) -> DeviceProfile | None:
    """The profile of the device named ``name`` (host.device_name) in ``db``, or None (also for a record of an
    older format, which records no conditions: module docstring)."""
    record = db.get(name, "device", RECORD_KEY)
    if record is None or (isinstance(record, Mapping) and record.get("format") in OLD_FORMATS):
        return None
    return DeviceProfile.from_record(record)
