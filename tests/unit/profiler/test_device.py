"""Device profiling: the efficiency fit on synthetic profiles, records, and one real quick measurement."""

from __future__ import annotations

import inspect
import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from autopar.capture.opgraph import Gemm
from autopar.conditions import ProfileConditions
from autopar.hardware import MEASURED_SOURCE, Device
from autopar.cost_model.compute import gemm_efficiency
from autopar.errors import ConfigError
from autopar.profiler import device as dev
from autopar.profiler.database import ProfileDB
from autopar.profiler.device import measure_device
from autopar.profiler.device_profile import (AttentionSample, BandwidthSample, ConvSample, DeviceProfile,
                                             MatmulSample, load_profile, matmul_curve, save_profile)
from autopar.profiler.device_fit import device_fit_errors, fit_device
from autopar.profiler.host import device_name

SHAPES = dev.matmul_shapes(dev.BUDGETS[("cpu", "normal")])
OVERHEAD = 2e-6


def model_seconds(m: int, n: int, k: int, peak: float, e_max: float, half: float, overhead: float = OVERHEAD) -> float:
    """The compute model's time of one (m x k) @ (k x n) product."""
    g = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
    return 2.0 * m * n * k / (peak * e_max * g) + overhead


def synthetic(peaks: dict[str, float], e_max: float, half: float, noise: float, seed: int = 0,
              shapes=SHAPES, **extra) -> DeviceProfile:
    """A profile whose matmul times follow the model, times log-normal noise of relative size ``noise``."""
    rng = np.random.default_rng(seed)
    matmul = {dt: tuple(MatmulSample(m, n, k, model_seconds(m, n, k, p, e_max, half)
                                     * float(np.exp(rng.normal(0.0, noise)))) for m, n, k in shapes)
              for dt, p in peaks.items()}
    conditions = ProfileConditions(part="device", device_type="cpu",
                                   measured_at="2025-01-02T03:04:05+00:00", torch_version="9.9.9",
                                   threads=1, cores=2, load_average=0.1, other_load=0.05, own_load=1.0,
                                   wait_fraction=0.002, spread=0.1)
    fields = dict(device_name="cpu Synthetic x1 thread", device_type="cpu", threads=1, conditions=conditions,
                  memory_bytes=64e9, budget="normal", matmul=matmul,
                  conv=(), attention=(),
                  bandwidth=(BandwidthSample("copy", 2e8, 1e-2), BandwidthSample("add", 3e8, 2e-2)),
                  kernel_overhead_seconds=OVERHEAD, unavailable={})
    return DeviceProfile(**(fields | extra))


# --- The fit -----------------------------------------------------------------------------------
def test_fit_recovers_the_model_constants_from_noisy_times():
    true = {"fp32": 1e11, "bf16": 4e11, "fp16": 4e11}
    e_max, half = 0.8, 48.0
    device, report = fit_device(synthetic(true, e_max, half, noise=0.03))
    # Times fix only peak * e_max per dtype, and d_half.
    for dt, peak in true.items():
        assert device.peak(dt) * device.matmul_efficiency == pytest.approx(peak * e_max, rel=0.05)
    assert device.matmul_half_dim == pytest.approx(half, rel=0.2)
    assert 0 < device.matmul_efficiency <= 1
    assert report.median_relative_error < 0.05 and report.max_relative_error < 0.2
    assert report.samples == 3 * len(SHAPES) and report.fitted_dtypes == ("fp32", "bf16", "fp16")
    assert set(report.per_dtype) == set(true) and not report.fallbacks and not report.excluded


def test_fit_is_exact_on_noise_free_times_and_folds_e_above_one_into_the_peaks():
    profile = synthetic({"fp32": 2e11, "bf16": 2e11, "fp16": 2e11}, 0.6, 100.0, noise=0.0)
    device, report = fit_device(profile)
    # The best sample sits below the asymptote (g < 1), so the fitted e exceeds 1 and is folded.
    assert device.matmul_efficiency == 1.0
    assert device.peak("fp32") > profile.peak("fp32")
    assert device.peak("fp32") == pytest.approx(2e11 * 0.6, rel=1e-3)
    assert device.matmul_half_dim == pytest.approx(100.0, rel=1e-2)
    assert report.max_relative_error < 1e-3
    assert "times" in device.source and "asymptote" in device.source


def test_fit_predictions_agree_with_the_cost_model():
    profile = synthetic({"fp32": 1e11, "bf16": 3e11, "fp16": 3e11}, 0.7, 30.0, noise=0.02, seed=3)
    device, report = fit_device(profile)
    s = profile.matmul["bf16"][5]
    eff = gemm_efficiency(device, Gemm(1, s.m, s.n, s.k))
    predicted = s.flops / (device.peak("bf16") * eff) + device.kernel_overhead
    assert predicted == pytest.approx(s.seconds, rel=0.1)
    assert device_fit_errors(profile, device).median_relative_error == pytest.approx(report.median_relative_error)


def test_fit_passes_through_the_measured_and_given_figures():
    profile = synthetic({"fp32": 1e11, "bf16": 2e11, "fp16": 2e11}, 0.9, 20.0, noise=0.01)
    device, _ = fit_device(profile, dispatch_overhead=3e-5)
    assert device.memory == 64e9 and device.threads == 1 and device.dispatch_overhead == 3e-5
    assert device.memory_bandwidth == pytest.approx(2e10) and device.memory_efficiency == 1.0
    assert device.kernel_overhead == OVERHEAD and device.name == profile.device_name
    assert "autopar's profiler on 2025-01-02 with torch 9.9.9" in device.source
    assert fit_device(profile, memory=8e9)[0].memory == 8e9
    assert Device.from_dict(device.to_dict()) == device


def test_missing_half_dtypes_fall_back_to_the_fp32_peak_and_say_so():
    profile = synthetic({"fp32": 1e11}, 0.8, 40.0, noise=0.02, unavailable={"fp16": "the GPU has no fp16"})
    device, report = fit_device(profile)
    assert device.peak("bf16") == device.peak("fp16") == device.peak("fp32")
    assert "bf16 not measured, so its peak is the fp32 one" in device.source
    assert "the GPU has no fp16" in device.source
    assert report.fallbacks == {"bf16": "not measured", "fp16": "the GPU has no fp16"}


def test_an_emulated_dtype_keeps_its_peak_but_is_left_out_of_the_fit():
    profile = synthetic({"fp32": 1e11, "bf16": 4e11}, 0.8, 48.0, noise=0.02)
    rng = np.random.default_rng(1)  # fp16 emulated: 20x slower than fp32, times unrelated to the shape
    slow = tuple(MatmulSample(m, n, k, 2.0 * m * n * k / (5e9 * rng.uniform(0.2, 1.0))) for m, n, k in SHAPES[:12])
    profile = replace(profile, matmul=dict(profile.matmul) | {"fp16": slow})
    device, report = fit_device(profile)
    assert report.fitted_dtypes == ("fp32", "bf16") and "emulated" in report.excluded["fp16"]
    assert device.peak("fp16") == pytest.approx(max(s.flops_per_second for s in slow))
    assert device.matmul_half_dim == pytest.approx(48.0, rel=0.2)
    assert "fp16" in report.per_dtype and "fp16 not fitted" in device.source
    forced, forced_report = fit_device(profile, dtypes=("fp32", "bf16", "fp16"))
    assert forced_report.fitted_dtypes == ("fp32", "bf16", "fp16") and not forced_report.excluded
    assert forced_report.median_relative_error > report.median_relative_error


def test_fit_refuses_what_it_cannot_fit():
    profile = synthetic({"bf16": 1e11}, 0.8, 40.0, noise=0.0)
    with pytest.raises(ConfigError, match="no fp32 matmul samples"):
        fit_device(profile)
    ok = synthetic({"fp32": 1e11}, 0.8, 40.0, noise=0.0)
    with pytest.raises(ConfigError, match=r"\['fp16'\] have no matmul samples"):
        fit_device(ok, dtypes=("fp32", "fp16"))
    with pytest.raises(ConfigError, match="at least 2 matmul samples"):
        fit_device(synthetic({"fp32": 1e11}, 0.8, 40.0, noise=0.0, shapes=SHAPES[:1]))


# --- Records -----------------------------------------------------------------------------------
def rich_profile() -> DeviceProfile:
    return synthetic({"fp32": 1e11, "bf16": 3e11}, 0.8, 40.0, noise=0.02, shapes=SHAPES[:6],
                     conv=(ConvSample("fp32", 8, 64, 64, 56, 56, 3, 1.5e-2),),
                     attention=(AttentionSample("bf16", 1, 8, 512, 64, 3e-3),),
                     unavailable={"fp16": "a fp16 matmul failed: no kernel"})


def test_record_round_trips_through_json_and_the_profile_db(tmp_path):
    profile = rich_profile()
    record = json.loads(json.dumps(profile.to_record()))
    assert DeviceProfile.from_record(record) == profile
    assert record["matmul"]["fp32"][0]["flops_per_second"] == pytest.approx(profile.matmul["fp32"][0].flops_per_second)
    assert record["bandwidth"][0]["bytes_per_second"] == pytest.approx(2e10)
    assert record["conv"][0]["flops"] == 2.0 * 8 * 64 * 56 * 56 * 64 * 9
    assert record["attention"][0]["flops"] == 4.0 * 8 * 512 ** 2 * 64
    db = ProfileDB(tmp_path / "profile.json")
    save_profile(db, profile)
    db.save()
    assert load_profile(ProfileDB(tmp_path / "profile.json"), profile.device_name) == profile
    assert load_profile(db, "another device") is None


def test_matmul_curve_rows_carry_units():
    profile = rich_profile()
    rows = matmul_curve(profile)
    assert len(rows) == 12 and {r["dtype"] for r in rows} == {"fp32", "bf16"}
    assert set(rows[0]) == {"dtype", "m", "n", "k", "batch", "seconds", "flops", "flops_per_second"}
    json.dumps(rows)


def test_from_record_rejects_foreign_or_truncated_records():
    record = rich_profile().to_record()
    with pytest.raises(ConfigError, match="format"):
        DeviceProfile.from_record(record | {"format": 0})
    with pytest.raises(ConfigError, match="lacks"):
        DeviceProfile.from_record({k: v for k, v in record.items() if k != "bandwidth"})
    broken = json.loads(json.dumps(record))
    del broken["matmul"]["fp32"][0]["seconds"]
    with pytest.raises(ConfigError, match="matmul sample"):
        DeviceProfile.from_record(broken)


# --- Measuring ---------------------------------------------------------------------------------
def test_a_series_stops_before_a_call_would_exceed_the_cap(monkeypatch):
    # on a clock that moves only when a case runs (a loaded machine's oversleeping must not move a case
    # across the cap): case c takes 0.04 c s
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def taking(seconds: float):
        def run() -> None:
            now[0] += seconds
        return run
    budget = replace(dev.BUDGETS[("cpu", "quick")], call_cap=0.2, warmup=1, repeats=1)
    cpu = torch.device("cpu")
    rows = dev._time_series([8, 1, 4, 2, 16], float, lambda c: taking(0.04 * c), cpu, budget, dev._Timer())
    assert rows == [(1, pytest.approx(0.04)), (2, pytest.approx(0.08)), (4, pytest.approx(0.16))]   # 8: 0.32 s
    first = dev._time_series([10, 20], float, lambda c: taking(0.03 * c), cpu, budget, dev._Timer())
    assert first == [(10, pytest.approx(0.3))]   # the first case is kept, over the cap


def test_measure_device_refuses_bad_arguments():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="must include 'fp32'"):
        measure_device(cpu, dtypes=("bf16",), budget="quick", progress=False)
    with pytest.raises(ConfigError, match="unknown"):
        measure_device(cpu, dtypes=("fp32", "fp8"), budget="quick", progress=False)
    with pytest.raises(ConfigError, match="sequence of dtype names"):
        measure_device(cpu, dtypes="fp32", budget="quick", progress=False)
    with pytest.raises(ConfigError, match="budget='slow' is unknown"):
        measure_device(cpu, budget="slow", progress=False)
    with pytest.raises(ConfigError, match="threads"):
        measure_device(cpu, threads=0, dtypes=("fp32",), budget="quick", progress=False)


@pytest.fixture(scope="module")
def quick_cpu_profile() -> DeviceProfile:
    return measure_device(torch.device("cpu"), threads=1, dtypes=("fp32", "fp64"), budget="quick", progress=False)


def test_quick_cpu_measurement_gives_a_valid_device(quick_cpu_profile):
    profile = quick_cpu_profile
    assert profile.device_name == device_name(torch.device("cpu"), 1) and profile.threads == 1
    assert list(profile.matmul) == ["fp32", "fp64"] and min(len(v) for v in profile.matmul.values()) >= 5
    assert all(s.seconds > 0 and s.flops_per_second > 0 for s in profile.matmul["fp32"])
    assert profile.conv and profile.attention and all(s.flops_per_second > 0 for s in profile.conv + profile.attention)
    assert profile.best_bandwidth > 1e8 and 0 < profile.kernel_overhead_seconds < 1e-3
    device, report = fit_device(profile)
    assert isinstance(device, Device) and Device.from_dict(device.to_dict()) == device
    assert device.threads == 1 and device.memory > 1e8 and device.peak("bf16") == device.peak("fp32")
    # How close the fit comes on a real machine is timing, measured by bench/device_fit.py: here only
    # that the fit is a fit (finite errors over every fitted sample, an efficiency in (0, 1]).
    assert math.isfinite(report.median_relative_error) and math.isfinite(report.max_relative_error)
    assert report.samples == len(profile.matmul["fp32"]) and 0 < device.matmul_efficiency <= 1   # fp64: not fitted
    assert DeviceProfile.from_record(json.loads(json.dumps(profile.to_record()))) == profile
    # fp64 is measured like the others (Cluster.local's default dtypes), so an fp64 plan prices on this machine
    assert "fp64" in inspect.signature(measure_device).parameters["dtypes"].default
    assert device.peak("fp64") == max(s.flops_per_second for s in profile.matmul["fp64"])


def test_a_profile_measured_without_fp64_says_how_to_measure_it(quick_cpu_profile):
    device, _ = fit_device(quick_cpu_profile)
    older = replace(device, peak_flops={k: v for k, v in device.peak_flops.items() if k != "fp64"})
    assert older.source.startswith(MEASURED_SOURCE)
    with pytest.raises(ConfigError, match=r"Cluster.local\(refresh=True\)"):
        older.peak("fp64")


def test_measuring_restores_the_thread_count_and_fp32_precision(quick_cpu_profile):
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    measure_device(torch.device("cpu"), threads=1, dtypes=("fp32",), budget="quick", progress=False)
    assert torch.get_num_threads() == threads and torch.get_float32_matmul_precision() == precision


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_gpu_measurement_gives_a_valid_device():
    profile = measure_device(torch.device("cuda"), dtypes=("fp32", "bf16"), budget="quick", progress=False)
    assert profile.device_type == "cuda" and profile.matmul["fp32"]
    device, report = fit_device(profile)
    assert device.threads == 0 and device.peak("bf16") > 0 and report.samples > 0
