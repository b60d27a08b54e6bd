"""Device profiling: measured matmul, conv, attention and memory figures (the records: device_profile.py;
device_fit.py fits a Device to them).

What is measured (:func:`measure_device`, each figure the median of a few timed calls, see host.py):

* matmul: seconds ``t`` of ``(batch x m x k) @ (k x n)`` per dtype at square and thin shapes,
  ``F = 2 * batch * m * n * k`` FLOPs, achieved ``F / t`` FLOP/s;
* conv2d (stride 1, "same" padding): ``F = 2 * N * C_out * H * W * C_in * kh * kw``;
* attention (``scaled_dot_product_attention``, no mask, forward): ``F = 4 * b * h * s^2 * d``;
* memory bandwidth: streaming ops on tensors well beyond the caches, bytes read + written over
  seconds, the best op kept;
* kernel overhead: the median time of a tiny op (an add of one-element tensors).

It records the conditions it ran under (autopar/conditions.py): the load of other processes while
it ran and how far each kernel's timed repeats spread (:class:`_Timer`).

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
import statistics
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..config import TORCH_DTYPE_NAMES
from ..errors import ConfigError
from ..progress import progress_bar
from .device_profile import AttentionSample, BandwidthSample, ConvSample, DeviceProfile, MatmulSample
from ..conditions import ProfileConditions
from .host import LoadMeter, accelerator, call_times, device_name, relative_spread, torch_threads

TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {name: getattr(torch, torch_name) for name, torch_name in TORCH_DTYPE_NAMES.items()})


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


# --- Measuring --------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Median times of the kernels (host.call_times), keeping each kernel's relative spread of repeats."""

    def __init__(self) -> None:
        self.spreads: list[float] = []

    def median(self, fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> float:
        times = call_times(fn, device, warmup=warmup, repeats=repeats)
        if len(times) >= 3:                      # fewer repeats say nothing of their spread
            self.spreads.append(relative_spread(times))
        return statistics.median(times)

    def spread(self) -> float | None:
        """The median kernel's relative spread (None when no kernel was timed three times)."""
        return statistics.median(self.spreads) if self.spreads else None


def _one_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call, synchronised (wall clock; the first call also pays one-time set-up)."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _time_series(cases: Sequence[Any], flops: Callable[[Any], float], make: Callable[[Any], Callable[[], object]],
                 device: torch.device, budget: Budget, timer: _Timer) -> list[tuple[Any, float]]:
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
        seconds = timer.median(fn, device, warmup=max(0, budget.warmup - 1), repeats=repeats)
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


def _measure_matmul(name: str, device: torch.device, budget: Budget, timer: _Timer) -> list[MatmulSample]:
    dtype = TORCH_DTYPES[name]

    def make(mnk: tuple[int, int, int]) -> Callable[[], object]:
        m, n, k = mnk
        a, b = _rand((m, k), dtype, device), _rand((k, n), dtype, device)
        out = torch.empty(m, n, dtype=dtype, device=device)
        return lambda: torch.mm(a, b, out=out)

    rows = _time_series(matmul_shapes(budget), lambda mnk: 2.0 * math.prod(mnk), make, device, budget, timer)
    return [MatmulSample(m, n, k, t) for (m, n, k), t in rows]


def _measure_conv(name: str, device: torch.device, budget: Budget, timer: _Timer) -> list[ConvSample]:
    dtype = TORCH_DTYPES[name]

    def flops(c: tuple[int, ...]) -> float:
        n, cin, cout, hw, kernel = c
        return 2.0 * n * cout * hw * hw * cin * kernel * kernel

    def make(c: tuple[int, ...]) -> Callable[[], object]:
        n, cin, cout, hw, kernel = c
        x, w = _rand((n, cin, hw, hw), dtype, device), _rand((cout, cin, kernel, kernel), dtype, device)
        return lambda: F.conv2d(x, w, padding=kernel // 2)

    rows = _time_series(budget.convs, flops, make, device, budget, timer)
    return [ConvSample(name, n, cin, cout, hw, hw, kernel, t) for (n, cin, cout, hw, kernel), t in rows]


def _measure_attention(name: str, device: torch.device, budget: Budget, timer: _Timer) -> list[AttentionSample]:
    dtype = TORCH_DTYPES[name]

    def make(c: tuple[int, ...]) -> Callable[[], object]:
        q, k, v = (_rand(c, dtype, device) for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v)

    rows = _time_series(budget.attentions, lambda c: 4.0 * c[0] * c[1] * c[2] ** 2 * c[3], make, device, budget, timer)
    return [AttentionSample(name, b, h, s, d, t) for (b, h, s, d), t in rows]


def _measure_bandwidth(device: torch.device, budget: Budget, timer: _Timer) -> list[BandwidthSample]:
    """copy_ (reads and writes N bytes) and add (reads 2N, writes N) on fp32 tensors of N bytes."""
    numel = budget.stream_bytes // 4
    a, b, c = (torch.ones(numel, device=device) for _ in range(3))
    nbytes = float(numel * 4)
    copy = timer.median(lambda: c.copy_(a), device, warmup=budget.warmup, repeats=budget.repeats)
    add = timer.median(lambda: torch.add(a, b, out=c), device, warmup=budget.warmup, repeats=budget.repeats)
    return [BandwidthSample("copy", 2 * nbytes, copy), BandwidthSample("add", 3 * nbytes, add)]


def _measure_overhead(device: torch.device, budget: Budget, timer: _Timer) -> float:
    """Median seconds of ``a + b`` on one-element tensors (output allocated, as ops in a model do)."""
    a, b = torch.ones(1, device=device), torch.ones(1, device=device)
    return timer.median(lambda: a + b, device, warmup=max(10, budget.warmup), repeats=budget.tiny_repeats)


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
                   dtypes: Sequence[str] = ("fp32", "bf16", "fp16", "fp64"), budget: str = "normal",
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
    timer = _Timer()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    with torch_threads(threads), torch.inference_mode(), _fp32_highest(), LoadMeter() as load:
        unavailable = {n: r for n in names if (r := _unavailable_reason(n, device)) is not None}
        measured = [n for n in names if n not in unavailable]
        steps: list[tuple[tuple[str, str], Callable[[], Any]]] = []
        for n in measured:
            steps += [(("matmul", n), functools.partial(_measure_matmul, n, device, plan, timer)),
                      (("conv", n), functools.partial(_measure_conv, n, device, plan, timer)),
                      (("attention", n), functools.partial(_measure_attention, n, device, plan, timer))]
        steps += [(("bandwidth", ""), functools.partial(_measure_bandwidth, device, plan, timer)),
                  (("overhead", ""), functools.partial(_measure_overhead, device, plan, timer))]
        done = {key: step() for key, step in progress_bar(steps, f"profiling {device}", total=len(steps),
                                                           enabled=progress)}
    conditions = ProfileConditions(part="device", device_type=device.type, measured_at=started,
                                   torch_version=torch.__version__,
                                   threads=threads, cores=os.cpu_count() or 1, load_average=load.load_average,
                                   other_load=load.other_load, own_load=load.own_load,
                                   wait_fraction=load.wait_fraction, spread=timer.spread())
    return DeviceProfile(device_name=device_name(device, threads), device_type=device.type, threads=threads,
                         conditions=conditions, memory_bytes=_total_memory(device), budget=budget,
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
