"""GEMM tile and wave quantization (cost_model/compute.py): whole waves of 256 x 128 output tiles over
the device's SMs, split-K for GEMMs of fewer tiles than SMs, nothing of it on a CPU or for attention."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autopar.capture.opgraph import Gemm
from autopar.cost_model.compute import SPLIT_K, TILE, gemm_efficiency
from autopar.presets import DEVICE_PRESETS

A100 = DEVICE_PRESETS["A100-80GB"]


def smooth(device, gemm: Gemm) -> float:
    half = device.matmul_half_dim
    return device.matmul_efficiency * math.prod(d / (d + half) for d in (gemm.m, gemm.n, gemm.k))


def test_presets_carry_their_sm_counts():
    assert {name: d.sm_count for name, d in DEVICE_PRESETS.items()} == {
        "V100-16GB": 80, "V100-32GB": 80, "A100-40GB": 108, "A100-80GB": 108, "H100-SXM": 132,
        "H100-96GB-500W": 132, "H200": 132, "H800": 132, "B200": 148, "GB200": 148, "cpu": None,
        # no SM count published by NVIDIA (H20); AMD's GEMM libraries' tiling is not modelled (CUs differ)
        "H20": None, "MI300X": None, "MI325X": None, "MI355X": None}


def test_one_full_wave_is_the_smooth_efficiency_and_one_tile_more_takes_a_second_wave():
    tm, tn = TILE
    full = Gemm(1, 12 * tm, 9 * tn, 4096)            # 108 tiles: one wave on 108 SMs
    assert gemm_efficiency(A100, full) == pytest.approx(smooth(A100, full), rel=1e-12)
    over = Gemm(1, 12 * tm, 9 * tn + 1, 4096)        # 12 x 10 = 120 tiles: two waves, the second 12 tiles
    fill = over.m * over.n / (2 * 108 * tm * tn)
    assert gemm_efficiency(A100, over) == pytest.approx(smooth(A100, over) * fill, rel=1e-12)
    assert gemm_efficiency(A100, over) < 0.6 * gemm_efficiency(A100, full)


def test_few_tiles_split_along_k():
    """8 tiles on 108 SMs: split-K into 8 (64 tiles) beats 16 (128 tiles, two waves) and no split."""
    tm, tn = TILE
    g = Gemm(1, 2 * tm, 4 * tn, 16384)
    half = A100.matmul_half_dim

    def at(s: int) -> float:
        waves = math.ceil(8 * s / 108)
        return (A100.matmul_efficiency * g.m / (g.m + half) * g.n / (g.n + half) * (g.k / s) / (g.k / s + half)
                * 8 * s * tm * tn / (waves * 108 * tm * tn))

    assert 8 in SPLIT_K and at(8) > max(at(1), at(16))
    assert gemm_efficiency(A100, g) == pytest.approx(at(8), rel=1e-12)


def test_no_quantization_on_a_cpu_for_attention_or_when_asked():
    g = Gemm(1, 300, 200, 100)
    cpu = DEVICE_PRESETS["cpu"]
    assert gemm_efficiency(cpu, g) == pytest.approx(smooth(cpu, g), rel=1e-12)
    assert gemm_efficiency(A100, g, waves=False) == pytest.approx(smooth(A100, g), rel=1e-12)
    assert gemm_efficiency(A100, g) < gemm_efficiency(A100, g, waves=False)
    attention = dataclasses.replace(A100, attention_efficiency=0.5)
    assert gemm_efficiency(attention, g, attention=True) == pytest.approx(
        smooth(dataclasses.replace(attention, matmul_efficiency=0.5), g), rel=1e-12)
