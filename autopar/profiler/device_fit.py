"""Device fit: the Device whose compute model reproduces a measured DeviceProfile (device.py).

The fit (:func:`fit_device`) gives the constants of the roofline model of
cost_model/compute.py::

    t_pred = F / (P[dtype] * e_mm(m, n, k)) + t_launch
    e_mm(m, n, k) = e_max * g(m) * g(n) * g(k),   g(d) = d / (d + d_half)

``P[dtype]`` starts as the highest achieved matmul FLOP/s of that dtype: a CPU has no
datasheet peak the planner could use (clock, vector width and the library's kernels all
matter), and on a GPU the best achieved figure is what a large GEMM really gets. ``t_launch``
is the measured kernel overhead. One ``(e, d_half)`` per device minimises the squared log error

    L(e, d_half) = sum_i (log t_pred_i - log t_i)^2

over the matmul samples of all fitted dtypes (a grid over both, then golden-section
refinement; ``d_half >= 0``). Times determine only the product ``P * e``; since the best sample
itself has ``g(m) g(n) g(k) < 1``, the fitted ``e`` can exceed 1. Then ``e`` is folded into the
fitted dtypes' peaks (``P <- P * e``, the model's large-GEMM asymptote) and ``e_max = 1``, which
predicts the same times; otherwise ``e_max = e``. A 16-bit dtype far slower than fp32
(emulated, as fp16 on most CPUs) is left out of the fit by default: its curve is not GEMM-shaped.
The report gives the median and maximum relative error ``|t_pred - t| / t``.
Memory bandwidth is the best streaming figure measured, so ``memory_efficiency = 1`` (already
achieved). SI units throughout: seconds, bytes, bytes/s, FLOP/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import numpy as np

from ..hardware import MEASURED_SOURCE, REQUIRED_DTYPES, Device
from ..errors import ConfigError
from .device_profile import DeviceProfile


# --- Fitting ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorStats:
    """Relative errors |t_pred - t| / t of the model over some samples."""

    median: float
    max: float
    samples: int


@dataclass(frozen=True)
class DeviceFitReport:
    """How well a Device's efficiency model reproduces the measured times."""

    matmul_efficiency: float
    matmul_half_dim: float
    median_relative_error: float
    """Over the matmul samples of the fitted dtypes."""
    max_relative_error: float
    samples: int
    fitted_dtypes: tuple[str, ...]
    excluded: Mapping[str, str]
    """Measured dtypes the fit left out, with the reason."""
    per_dtype: Mapping[str, ErrorStats]
    """Matmul errors per measured dtype (fitted or not)."""
    conv: ErrorStats | None
    """conv2d as the implicit GEMM m = N H W, n = C_out, k = C_in kh kw (not fitted; informative)."""
    attention: ErrorStats | None
    """attention as batch * heads GEMMs m = n = seq, k = head_dim, F = 4 b h s^2 d (not fitted)."""
    fallbacks: Mapping[str, str]
    """Dtypes whose peak is the fp32 one, with the reason."""

    __hash__ = None  # type: ignore[assignment]


def _g(d: np.ndarray, half: float) -> np.ndarray:
    return d / (d + half)


def _predict(flops: np.ndarray, peak: np.ndarray, dims: np.ndarray, e_max: float, half: float,
             overhead: float) -> np.ndarray:
    """Model seconds: F / (P * e_max * g(m) g(n) g(k)) + t_launch; ``dims`` is (samples, 3)."""
    return flops / (peak * e_max * np.prod(_g(dims, half), axis=1)) + overhead


def _stats(pred: np.ndarray, meas: np.ndarray) -> ErrorStats | None:
    if len(meas) == 0:
        return None
    rel = np.abs(pred - meas) / meas
    return ErrorStats(float(np.median(rel)), float(np.max(rel)), int(len(meas)))


def _golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 60) -> float:
    """Minimiser of a unimodal ``f`` on [lo, hi] by golden-section search."""
    inv = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - inv * (b - a), a + inv * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - inv * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + inv * (b - a)
            fd = f(d)
    return (a + b) / 2


def _arrays(profile: DeviceProfile, peaks: Mapping[str, float],
            dtypes: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(flops, peak, dims (samples x 3), seconds) of the matmul samples of ``dtypes``."""
    rows = [(s.flops, peaks[dt], s.m, s.n, s.k, s.seconds) for dt in dtypes for s in profile.matmul.get(dt, ())]
    arr = np.array(rows, dtype=float).reshape(-1, 6)
    return arr[:, 0], arr[:, 1], arr[:, 2:5], arr[:, 5]


def fit_efficiency(flops: np.ndarray, peak: np.ndarray, dims: np.ndarray, seconds: np.ndarray,
                   overhead: float) -> tuple[float, float]:
    """(e, d_half) minimising sum_i (log t_pred_i - log t_i)^2 over e > 0 and d_half >= 0.

    ``e`` may come out above 1: with ``peak`` the best achieved FLOP/s, the model's asymptote
    ``peak * e`` then lies above the best sample (fit_device folds it into the peaks). A grid
    over log e x d_half (0, then geometric up to 4x the largest dimension), then golden-section
    search of d_half between the best grid point's neighbours, with e golden-searched (in log,
    within its grid bracket) for each d_half.
    """
    if len(seconds) < 2:
        raise ConfigError(f"the efficiency fit needs at least 2 matmul samples, got {len(seconds)}: measure "
                          "with a larger budget")
    log_t = np.log(seconds)

    def loss(e: float, h: float) -> float:
        return float(np.sum((np.log(_predict(flops, peak, dims, e, h, overhead)) - log_t) ** 2))

    halves = np.concatenate([[0.0], np.geomspace(0.5, 4.0 * float(dims.max()), 120)])
    log_es = np.linspace(math.log(1e-4), math.log(16.0), 121)
    grid = np.array([[loss(math.exp(u), float(h)) for u in log_es] for h in halves])
    i, j = np.unravel_index(int(np.argmin(grid)), grid.shape)
    u_lo, u_hi = float(log_es[max(j - 1, 0)]), float(log_es[min(j + 1, len(log_es) - 1)])

    def best_e(h: float) -> float:
        return math.exp(_golden(lambda u: loss(math.exp(u), h), u_lo, u_hi, iters=40))

    h_lo, h_hi = float(halves[max(i - 1, 0)]), float(halves[min(i + 1, len(halves) - 1)])
    half = _golden(lambda h: loss(best_e(h), h), h_lo, h_hi, iters=40)
    e = best_e(half)
    if loss(e, half) > grid[i, j]:  # the refinement never loses to the grid
        e, half = math.exp(float(log_es[j])), float(halves[i])
    return float(e), float(max(half, 0.0))


def device_fit_errors(profile: DeviceProfile, device: Device,
                      dtypes: Sequence[str] | None = None) -> DeviceFitReport:
    """The relative errors of ``device``'s model (peaks, e_max, d_half, kernel overhead) on ``profile``.

    ``dtypes``: the dtypes the headline median and max cover (default: those fit_device fits).
    """
    fitted, excluded = _fit_dtypes(profile, dtypes)
    peaks = dict(device.peak_flops)
    args = dict(e_max=device.matmul_efficiency, half=device.matmul_half_dim, overhead=device.kernel_overhead)
    flops, peak, dims, secs = _arrays(profile, peaks, fitted)
    overall = _stats(_predict(flops, peak, dims, **args), secs)
    per_dtype = {}
    for dt, samples in profile.matmul.items():
        if samples and dt in peaks:
            f, p, d, t = _arrays(profile, peaks, [dt])
            per_dtype[dt] = _stats(_predict(f, p, d, **args), t)
    conv = [(c.flops, peaks[c.dtype], c.batch * c.height * c.width, c.out_channels,
             c.in_channels * c.kernel ** 2, c.seconds) for c in profile.conv if c.dtype in peaks]
    attn = [(a.flops, peaks[a.dtype], a.seq, a.seq, a.head_dim, a.seconds)
            for a in profile.attention if a.dtype in peaks]
    extra = []
    for rows in (conv, attn):
        arr = np.array(rows, dtype=float).reshape(-1, 6)
        extra.append(_stats(_predict(arr[:, 0], arr[:, 1], arr[:, 2:5], **args), arr[:, 5]))
    fallbacks = {dt: _fallback_reason(profile, dt) for dt in REQUIRED_DTYPES if not profile.matmul.get(dt)}
    return DeviceFitReport(matmul_efficiency=device.matmul_efficiency, matmul_half_dim=device.matmul_half_dim,
                           median_relative_error=overall.median, max_relative_error=overall.max,
                           samples=overall.samples, fitted_dtypes=tuple(fitted),
                           excluded=MappingProxyType(excluded), per_dtype=MappingProxyType(per_dtype),
                           conv=extra[0], attention=extra[1], fallbacks=MappingProxyType(fallbacks))


EMULATED_FRACTION = 0.5
"""A 16-bit dtype whose best matmul FLOP/s is below this fraction of fp32's is taken as emulated
(converted to fp32 in software, as fp16 on most CPUs): its time curve is not GEMM-shaped, so the
default fit leaves it out (its own peak still holds)."""


def _fit_dtypes(profile: DeviceProfile, dtypes: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """The dtypes the efficiency fit uses (``dtypes``, else the measured ones not emulated) and the left-out ones."""
    measured = [dt for dt, ss in profile.matmul.items() if ss]
    if dtypes is not None:
        if isinstance(dtypes, str) or not dtypes:
            raise ConfigError(f"fit dtypes={dtypes!r} must be a non-empty sequence of dtype names, e.g. ('fp32',)")
        missing = [dt for dt in dtypes if dt not in measured]
        if missing:
            raise ConfigError(f"fit dtypes {missing} have no matmul samples in the profile of "
                              f"{profile.device_name!r}; measured: {measured}")
        return list(dict.fromkeys(dtypes)), {dt: "not asked for" for dt in measured if dt not in dtypes}
    fp32 = profile.peak("fp32")
    excluded = {}
    if "fp64" in measured:   # a GPU's fp64 runs on other units (1/64 of fp32 on most): its curve is not the others'
        excluded["fp64"] = "fp64: priced at its own best matmul, left out of the training dtypes' fit"
    for dt in measured:
        if dt == "fp64":
            continue
        best = profile.peak(dt)
        if dt != "fp32" and fp32 is not None and best is not None and best < EMULATED_FRACTION * fp32:
            excluded[dt] = (f"emulated: its best matmul ({best / 1e9:.3g} GFLOP/s) is below "
                            f"{EMULATED_FRACTION:g}x fp32's ({fp32 / 1e9:.3g} GFLOP/s)")
    return [dt for dt in measured if dt not in excluded], excluded


def _fallback_reason(profile: DeviceProfile, dtype: str) -> str:
    return profile.unavailable.get(dtype, "not measured")


def fit_device(profile: DeviceProfile, *, memory: float | None = None, dispatch_overhead: float = 0.0,
               dtypes: Sequence[str] | None = None) -> tuple[Device, DeviceFitReport]:
    """The Device whose compute model (cost_model/compute.py) best reproduces ``profile``, and the fit's errors.

    ``peak_flops[dtype]`` is the highest achieved matmul FLOP/s of that dtype: there is no
    datasheet peak for a CPU (nor one a GPU's GEMMs reach). Only ``peak * e_max`` is identifiable
    from times, so: one ``(e, d_half)`` is fitted to the matmul samples of ``dtypes`` (default:
    every measured dtype but fp64 and emulated ones, see EMULATED_FRACTION) by least squared log error of
    time; if ``e <= 1`` it is ``matmul_efficiency``; if ``e > 1`` (the model's large-GEMM
    asymptote lies above the best sample, as it must when ``d_half > 0`` and the best sample
    is the largest) the fitted dtypes' peaks are multiplied by ``e`` and ``matmul_efficiency``
    is 1, which predicts the same times. A required dtype that was not measured gets the fp32
    peak, which ``source`` says. ``memory_bandwidth`` is the best measured streaming bandwidth
    (so ``memory_efficiency`` = 1), ``kernel_overhead`` the tiny-op time, ``memory`` the
    device's total memory (RAM on a CPU) unless given, in bytes.
    """
    fp32 = profile.peak("fp32")
    if fp32 is None:
        raise ConfigError(f"the profile of {profile.device_name!r} has no fp32 matmul samples: measure with "
                          "'fp32' in dtypes")
    fitted, excluded = _fit_dtypes(profile, dtypes)
    best = {dt: p for dt in profile.matmul if (p := profile.peak(dt)) is not None}
    e, half = fit_efficiency(*_arrays(profile, best, fitted), profile.kernel_overhead_seconds)
    scale = max(e, 1.0)
    peaks = {dt: p * scale if dt in fitted else p for dt, p in best.items()}
    notes = [f"{dt} not fitted ({why})" for dt, why in excluded.items()]
    for dt in REQUIRED_DTYPES:
        if dt not in peaks:
            peaks[dt] = peaks["fp32"]
            notes.append(f"{dt} {_fallback_reason(profile, dt)}, so its peak is the fp32 one")
    cpu = profile.device_type == "cpu"
    scaled = f" times {scale:.4g} (the fitted large-GEMM asymptote)" if scale > 1 else ""
    measured = profile.conditions
    source = (f"{MEASURED_SOURCE} on {measured.measured_at.split('T')[0]} with torch "
              f"{measured.torch_version} ({profile.budget} budget{f', {profile.threads} thread(s)' if cpu else ''}): "
              f"peaks are the best achieved matmul FLOP/s{scaled}, no datasheet figure; matmul_efficiency and "
              f"matmul_half_dim fitted to the {'/'.join(fitted)} matmul times; memory_bandwidth the best "
              "streaming op")
    if notes:
        source += "; " + "; ".join(notes)
    device = Device(name=profile.device_name, peak_flops=peaks,
                    memory=profile.memory_bytes if memory is None else memory,
                    memory_bandwidth=profile.best_bandwidth, source=source, matmul_efficiency=min(e, 1.0),
                    matmul_half_dim=half, memory_efficiency=1.0, kernel_overhead=profile.kernel_overhead_seconds,
                    dispatch_overhead=dispatch_overhead, threads=profile.threads if cpu else 0)
    return device, device_fit_errors(profile, device, dtypes)
