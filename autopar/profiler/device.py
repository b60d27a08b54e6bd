"""Device profiling: measured matmul, conv, attention and memory figures (device_fit.py fits a Device to them).

What is measured (:func:`measure_device`, each figure the median of a few timed calls, see host.py):

* matmul: seconds ``t`` of ``(batch x m x k) @ (k x n)`` per dtype at square and thin shapes,
  ``F = 2 * batch * m * n * k`` FLOPs, achieved ``F / t`` FLOP/s;
* conv2d (stride 1, "same" padding): ``F = 2 * N * C_out * H * W * C_in * kh * kw``;
* attention (``scaled_dot_product_attention``, no mask, forward): ``F = 4 * b * h * s^2 * d``;
* memory bandwidth: streaming ops on tensors well beyond the caches, bytes read + written over
  seconds, the best op kept;
* kernel overhead: the median time of a tiny op (an add of one-element tensors).

A growing series of shapes stops once one call would exceed the budget's per-call time cap
(predicted from the rate of the previous shape, checked on a first untimed call), so a dtype
the hardware emulates slowly (fp16 on most CPUs) costs seconds, not minutes.
Memory bandwidth is the best streaming figure measured. SI units throughout: seconds, bytes, bytes/s, FLOP/s.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import math
import os
import time
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..progress import progress_bar
from .host import accelerator, device_name, median_time, torch_threads

TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})
RECORD_KEY = "profile"
"""Key of the profile record in ProfileDB section "device" (see :func:`save_profile`)."""
RECORD_FORMAT = 1


# --- Budgets ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """Which shapes to time and how often. Dimensions in elements, times in seconds, sizes in bytes."""

    squares: tuple[int, ...]
    """Square matmul sizes m = n = k."""
    thin_large: int
    """The two large dimensions of thin matmuls."""
    thin_small: tuple[int, ...]
    """The small dimension of thin matmuls, taken in turn by m, n and k."""
    convs: tuple[tuple[int, int, int, int, int], ...]
    """(N, C_in, C_out, H = W, kernel) of conv2d cases."""
    attentions: tuple[tuple[int, int, int, int], ...]
    """(batch, heads, seq, head_dim) of attention cases."""
    stream_bytes: int
    """Bytes of each tensor of the memory-bandwidth ops."""
    call_cap: float
    """A series stops growing once one call takes (or would take) longer than this."""
    warmup: int
    repeats: int
    tiny_repeats: int
    """Timed calls of the tiny op (kernel overhead)."""


_MIB = 1 << 20
BUDGETS: Mapping[tuple[str, str], Budget] = MappingProxyType({
    ("cpu", "quick"): Budget(
        squares=(64, 128, 256, 512, 768), thin_large=768, thin_small=(16, 64, 128),
        convs=((2, 16, 16, 28, 3), (2, 32, 32, 28, 3)), attentions=((1, 4, 128, 64), (1, 4, 256, 64)),
        stream_bytes=64 * _MIB, call_cap=0.05, warmup=1, repeats=5, tiny_repeats=50),
    ("cpu", "normal"): Budget(
        squares=(64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048), thin_large=1024,
        thin_small=(16, 32, 64, 128, 256, 512),
        convs=((8, 32, 32, 56, 3), (8, 64, 64, 56, 3), (8, 128, 128, 28, 3), (8, 256, 256, 14, 3),
               (8, 64, 256, 56, 1)),
        attentions=((1, 8, 128, 64), (1, 8, 256, 64), (1, 8, 512, 64), (1, 8, 1024, 64), (1, 4, 2048, 64)),
        stream_bytes=128 * _MIB, call_cap=0.2, warmup=1, repeats=5, tiny_repeats=200),
    ("cuda", "quick"): Budget(
        squares=(256, 512, 1024, 2048, 4096), thin_large=4096, thin_small=(16, 64, 256, 1024),
        convs=((16, 64, 64, 56, 3), (16, 256, 256, 14, 3)), attentions=((4, 16, 512, 64), (4, 16, 2048, 128)),
        stream_bytes=256 * _MIB, call_cap=0.2, warmup=3, repeats=5, tiny_repeats=100),
    ("cuda", "normal"): Budget(
        squares=(256, 512, 1024, 2048, 3072, 4096, 6144, 8192), thin_large=8192,
        thin_small=(16, 32, 64, 128, 256, 512, 1024, 2048),
        convs=((32, 64, 64, 56, 3), (32, 128, 128, 28, 3), (32, 256, 256, 14, 3), (32, 512, 512, 7, 3),
               (32, 64, 256, 56, 1)),
        attentions=((8, 16, 512, 64), (8, 16, 1024, 64), (8, 16, 2048, 128), (4, 16, 4096, 128)),
        stream_bytes=1024 * _MIB, call_cap=0.2, warmup=5, repeats=20, tiny_repeats=500),
})


def budget_for(device_type: str, budget: str) -> Budget:
    """The budget named ``budget`` ("quick": seconds, for tests; "normal") for a "cpu" or "cuda" device."""
    names = sorted({b for _, b in BUDGETS})
    if (device_type, budget) not in BUDGETS:
        if budget not in names:
            raise ConfigError(f"budget={budget!r} is unknown: use one of {names}")
        raise ConfigError(f"device type {device_type!r} cannot be profiled: use a 'cpu' or 'cuda' device")
    return BUDGETS[(device_type, budget)]


# --- Samples ----------------------------------------------------------------------------------
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
    torch_version: str
    measured_at: str
    """UTC time of the measurement, ISO 8601."""
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
                "threads": self.threads, "torch_version": self.torch_version, "measured_at": self.measured_at,
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
        _require(r, ("device_name", "device_type", "threads", "torch_version", "measured_at", "memory_bytes",
                     "budget", "matmul", "conv", "attention", "bandwidth", "kernel_overhead_seconds"),
                 "device profile")
        return cls(device_name=str(r["device_name"]), device_type=str(r["device_type"]), threads=int(r["threads"]),
                   torch_version=str(r["torch_version"]), measured_at=str(r["measured_at"]),
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
    """The profile of the device named ``name`` (host.device_name) in ``db``, or None."""
    record = db.get(name, "device", RECORD_KEY)
    return None if record is None else DeviceProfile.from_record(record)


# --- Measuring --------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call, synchronised (wall clock; the first call also pays one-time set-up)."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _time_series(cases: Sequence[Any], flops: Callable[[Any], float], make: Callable[[Any], Callable[[], object]],
                 device: torch.device, budget: Budget) -> list[tuple[Any, float]]:
    """(case, median seconds) for ``cases`` in increasing FLOPs, stopping before a call would exceed the cap.

    The next call's time is predicted from the previous case's achieved rate; a first untimed call
    checks it (and warms up; a second one if the first was over the cap). A case still over the
    cap ends the series; it is kept, at that one call's time, only if it is the first of the
    series (so that a very slow dtype still gets a sample).
    """
    out: list[tuple[Any, float]] = []
    rate = None
    for case in sorted(cases, key=flops):
        if rate is not None and flops(case) / rate > budget.call_cap:
            break
        fn = make(case)
        first = _one_call(fn, device)
        if first > budget.call_cap:  # once more: the first call may have paid a library's set-up
            first = _one_call(fn, device)
        if first > budget.call_cap:
            if not out:
                out.append((case, first))
            break
        repeats = budget.repeats if first < budget.call_cap / 4 else max(1, budget.repeats // 2 + 1)
        seconds = median_time(fn, device, warmup=max(0, budget.warmup - 1), repeats=repeats)
        out.append((case, seconds))
        rate = flops(case) / seconds
    return out


def _rand(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def matmul_shapes(budget: Budget) -> list[tuple[int, int, int]]:
    """(m, n, k) of the budget: the squares, then thin shapes with m, n or k small and the others large."""
    shapes = {(s, s, s) for s in budget.squares}
    big = budget.thin_large
    for s in budget.thin_small:
        shapes |= {(s, big, big), (big, s, big), (big, big, s)}
    return sorted(shapes, key=lambda mnk: (math.prod(mnk), mnk))


def _measure_matmul(name: str, device: torch.device, budget: Budget) -> list[MatmulSample]:
    dtype = TORCH_DTYPES[name]

    def make(mnk: tuple[int, int, int]) -> Callable[[], object]:
        m, n, k = mnk
        a, b = _rand((m, k), dtype, device), _rand((k, n), dtype, device)
        out = torch.empty(m, n, dtype=dtype, device=device)
        return lambda: torch.mm(a, b, out=out)

    rows = _time_series(matmul_shapes(budget), lambda mnk: 2.0 * math.prod(mnk), make, device, budget)
    return [MatmulSample(m, n, k, t) for (m, n, k), t in rows]


def _measure_conv(name: str, device: torch.device, budget: Budget) -> list[ConvSample]:
    dtype = TORCH_DTYPES[name]

    def flops(c: tuple[int, ...]) -> float:
        n, cin, cout, hw, kernel = c
        return 2.0 * n * cout * hw * hw * cin * kernel * kernel

    def make(c: tuple[int, ...]) -> Callable[[], object]:
        n, cin, cout, hw, kernel = c
        x, w = _rand((n, cin, hw, hw), dtype, device), _rand((cout, cin, kernel, kernel), dtype, device)
        return lambda: F.conv2d(x, w, padding=kernel // 2)

    rows = _time_series(budget.convs, flops, make, device, budget)
    return [ConvSample(name, n, cin, cout, hw, hw, kernel, t) for (n, cin, cout, hw, kernel), t in rows]


def _measure_attention(name: str, device: torch.device, budget: Budget) -> list[AttentionSample]:
    dtype = TORCH_DTYPES[name]

    def make(c: tuple[int, ...]) -> Callable[[], object]:
        q, k, v = (_rand(c, dtype, device) for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v)

    rows = _time_series(budget.attentions, lambda c: 4.0 * c[0] * c[1] * c[2] ** 2 * c[3], make, device, budget)
    return [AttentionSample(name, b, h, s, d, t) for (b, h, s, d), t in rows]


def _measure_bandwidth(device: torch.device, budget: Budget) -> list[BandwidthSample]:
    """copy_ (reads and writes N bytes) and add (reads 2N, writes N) on fp32 tensors of N bytes."""
    numel = budget.stream_bytes // 4
    a, b, c = (torch.ones(numel, device=device) for _ in range(3))
    nbytes = float(numel * 4)
    copy = median_time(lambda: c.copy_(a), device, warmup=budget.warmup, repeats=budget.repeats)
    add = median_time(lambda: torch.add(a, b, out=c), device, warmup=budget.warmup, repeats=budget.repeats)
    return [BandwidthSample("copy", 2 * nbytes, copy), BandwidthSample("add", 3 * nbytes, add)]


def _measure_overhead(device: torch.device, budget: Budget) -> float:
    """Median seconds of ``a + b`` on one-element tensors (output allocated, as ops in a model do)."""
    a, b = torch.ones(1, device=device), torch.ones(1, device=device)
    return median_time(lambda: a + b, device, warmup=max(10, budget.warmup), repeats=budget.tiny_repeats)


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why ``name`` cannot be measured on ``device``, or None when a tiny matmul in it works."""
    if device.type == "cuda" and name == "bf16" and not torch.cuda.is_bf16_supported():
        return "the GPU has no bf16 support"
    try:
        x = _rand((8, 8), TORCH_DTYPES[name], device)
        torch.mm(x, x)
        _sync(device)
    except RuntimeError as exc:
        return f"a {name} matmul failed: {exc}"
    return None


def _total_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _check_dtypes(dtypes: Iterable[str]) -> tuple[str, ...]:
    if isinstance(dtypes, str):
        raise ConfigError(f"dtypes={dtypes!r} must be a sequence of dtype names, e.g. ('fp32', 'bf16')")
    names = tuple(dict.fromkeys(dtypes))
    unknown = [d for d in names if d not in TORCH_DTYPES]
    if unknown:
        raise ConfigError(f"dtypes {unknown} are unknown: use names from {list(TORCH_DTYPES)}")
    if "fp32" not in names:
        raise ConfigError(f"dtypes={list(names)} must include 'fp32': its peak is the fallback of any dtype "
                          "that cannot be measured")
    return names


def measure_device(device: torch.device | None = None, threads: int = 1, *,
                   dtypes: Sequence[str] = ("fp32", "bf16", "fp16"), budget: str = "normal",
                   progress: bool = True) -> DeviceProfile:
    """Measure ``device`` (default: this machine's accelerator) with ``threads`` torch threads (CPU).

    ``budget`` "normal" takes about 10 s on one CPU core (matmul, conv and attention in each
    dtype, memory bandwidth, kernel overhead); "quick" a few seconds, for tests. A dtype the
    device cannot run is recorded in ``unavailable`` and left out.
    """
    device = accelerator() if device is None else torch.device(device)
    names = _check_dtypes(dtypes)
    plan = budget_for(device.type, budget)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch_threads(threads), torch.inference_mode(), _fp32_highest():
        unavailable = {n: r for n in names if (r := _unavailable_reason(n, device)) is not None}
        measured = [n for n in names if n not in unavailable]
        steps: list[tuple[tuple[str, str], Callable[[], Any]]] = []
        for n in measured:
            steps += [(("matmul", n), functools.partial(_measure_matmul, n, device, plan)),
                      (("conv", n), functools.partial(_measure_conv, n, device, plan)),
                      (("attention", n), functools.partial(_measure_attention, n, device, plan))]
        steps += [(("bandwidth", ""), functools.partial(_measure_bandwidth, device, plan)),
                  (("overhead", ""), functools.partial(_measure_overhead, device, plan))]
        done = {key: step() for key, step in progress_bar(steps, f"profiling {device}", total=len(steps),
                                                           enabled=progress)}
    return DeviceProfile(device_name=device_name(device, threads), device_type=device.type, threads=threads,
                         torch_version=torch.__version__,
                         measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                         memory_bytes=_total_memory(device), budget=budget,
                         matmul={n: tuple(done[("matmul", n)]) for n in measured},
                         conv=tuple(s for n in measured for s in done[("conv", n)]),
                         attention=tuple(s for n in measured for s in done[("attention", n)]),
                         bandwidth=tuple(done[("bandwidth", "")]), kernel_overhead_seconds=done[("overhead", "")],
                         unavailable=unavailable)


@contextlib.contextmanager
def _fp32_highest() -> Iterator[None]:
    """fp32 matmuls in full fp32 (no TF32 / bf16 shortcuts) while measuring, the old setting restored after."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
