"""Device / Link / Cluster: presets, spec parsing, overrides, validation, JSON round trip."""

from __future__ import annotations

import json

import pytest

from autopar.cluster import Cluster
from autopar.hardware import Device, Link
from autopar.presets import DEVICE_PRESETS, device_preset
from autopar.errors import ConfigError

GB = 1e9


@pytest.mark.parametrize("name, bf16, fp32, tf32, memory, hbm", [
    # bench/sources.md section 6 (vendor datasheets)
    ("V100-16GB", 125e12, 15.7e12, None, 16 * GB, 900 * GB),
    ("V100-32GB", 125e12, 15.7e12, None, 32 * GB, 900 * GB),
    ("A100-40GB", 312e12, 19.5e12, 156e12, 40 * GB, 1555 * GB),
    ("A100-80GB", 312e12, 19.5e12, 156e12, 80 * GB, 2039 * GB),
    ("H100-SXM", 989e12, 66.9e12, 494e12, 80 * GB, 3350 * GB),
    ("H200", 989e12, 66.9e12, 494e12, 141 * GB, 4800 * GB),
    ("H100-96GB-500W", 989e12, 66.9e12, 494e12, 96 * GB, 2400 * GB),
])
def test_gpu_presets(name, bf16, fp32, tf32, memory, hbm):
    d = device_preset(name)
    assert d.name == name
    assert d.peak("bf16") == bf16 and d.peak("fp16") == bf16 and d.peak("fp32") == fp32
    if tf32 is None:
        assert "tf32" not in d.peak_flops
    else:
        assert d.peak("tf32") == tf32
    assert d.memory == memory and d.memory_bandwidth == hbm
    assert d.source
    assert 0 < d.matmul_efficiency <= 1 and 0 < d.memory_efficiency <= 1


def test_v100_bf16_mapping_is_documented():
    assert "bf16" in device_preset("V100-32GB").source


def test_efficiency_constants_are_one_set_per_family():
    """bench/fidelity_published.py fits matmul_efficiency per family (and fails when a preset drifts
    from its fit); every part of a family shares the family's constants."""
    def constants(name):
        d = device_preset(name)
        return (d.matmul_efficiency, d.matmul_half_dim, d.memory_efficiency, d.kernel_overhead, d.overlap_slowdown)
    for family in (("V100-16GB", "V100-32GB"), ("A100-40GB", "A100-80GB"), ("H100-SXM", "H200")):
        assert len({constants(name) for name in family}) == 1, family
    for name in ("V100-16GB", "A100-40GB", "H100-SXM", "H200", "H100-96GB-500W"):
        d = device_preset(name)
        assert (d.matmul_half_dim, d.memory_efficiency, d.kernel_overhead) == (64, 0.8, 5e-6)
    cpu = device_preset("cpu")
    assert cpu.peak_flops == {"fp32": 1e11, "bf16": 5e10, "fp16": 5e10, "fp64": 5e10}
    assert (cpu.memory, cpu.memory_bandwidth, cpu.matmul_efficiency, cpu.matmul_half_dim,
            cpu.memory_efficiency, cpu.kernel_overhead) == (16e9, 2e10, 0.5, 32, 0.5, 1e-5)
    assert "placeholder" in cpu.source


def test_device_preset_case_insensitive_and_unknown():
    assert device_preset("a100-80gb") is DEVICE_PRESETS["A100-80GB"]
    assert device_preset("CPU").name == "cpu"
    with pytest.raises(ConfigError) as e:
        device_preset("TPUv4")
    assert "TPUv4" in str(e.value) and "A100-80GB" in str(e.value)


def test_peak_unknown_dtype():
    with pytest.raises(ConfigError) as e:
        device_preset("V100-16GB").peak("tf32")
    assert "tf32" in str(e.value) and "fp32" in str(e.value)


def test_peak_flops_is_read_only_and_device_hashable():
    d = device_preset("H100-SXM")
    with pytest.raises(TypeError):
        d.peak_flops["bf16"] = 1.0  # type: ignore[index]
    assert hash(d) == hash(Device.from_dict(d.to_dict()))


@pytest.mark.parametrize("spec, nodes, per_node, device", [
    ("128x8xA100-80GB", 128, 8, "A100-80GB"),
    ("1x2xcpu", 1, 2, "cpu"),
    ("2X4XH100-SXM", 2, 4, "H100-SXM"),
    ("8xA100-80GB", 1, 8, "A100-80GB"),
    ("4x8xh200", 4, 8, "H200"),
    (" 16x8xV100-32GB ", 16, 8, "V100-32GB"),
])
def test_from_spec_good(spec, nodes, per_node, device):
    c = Cluster.from_spec(spec)
    assert (c.nodes, c.devices_per_node, c.device.name) == (nodes, per_node, device)
    assert c.devices == nodes * per_node


@pytest.mark.parametrize("spec, token", [
    ("128x8", "128x8"),
    ("cpu", "cpu"),
    ("0x8xA100-80GB", "'0'"),
    ("4x-2xcpu", "'-2'"),
    ("2x1.5xcpu", "'1.5'"),
    ("ax8xcpu", "ax8xcpu"),
    ("x8xcpu", "x8xcpu"),
    ("1x2x3xcpu", "1x2x3xcpu"),
    ("4x8xFOO", "'FOO'"),
    ("4x8xA100-80GBx", "A100-80GBx"),
    ("", "''"),
])
def test_from_spec_bad(spec, token):
    with pytest.raises(ConfigError) as e:
        Cluster.from_spec(spec)
    msg = str(e.value)
    assert token in msg
    assert "NODESxDEVICES_PER_NODExDEVICE e.g. 128x8xA100-80GB" in msg
    assert "A100-80GB" in msg and "cpu" in msg  # lists the known devices


def test_link_presets_a100():
    c = Cluster.from_spec("128x8xA100-80GB")
    assert c.intra_node.bandwidth == 300e9
    # NCCL 8 x A100 all-reduce busbw about 230 GB/s (bench/sources.md section 5)
    assert c.intra_node.effective_bandwidth == pytest.approx(230e9)
    assert c.inter_node.bandwidth == 25e9  # 8 x HDR 200 Gb/s per node
    assert c.inter_node.effective_bandwidth == pytest.approx(24e9)
    assert c.describe() == "128 x 8 x A100-80GB (1024 devices; NVLink 300 GB/s, IB 25 GB/s per device)"


def test_link_presets_other_families():
    h = Cluster.from_spec("2x8xH100-SXM")
    assert (h.intra_node.bandwidth, h.inter_node.bandwidth) == (450e9, 50e9)
    assert h.inter_node.effective_bandwidth == pytest.approx(48e9)
    assert Cluster.from_spec("2x8xH200").intra_node == h.intra_node
    v = Cluster.from_spec("2x8xV100-16GB")
    assert v.intra_node.bandwidth == 150e9 and v.intra_node.efficiency == 0.8
    assert v.inter_node.bandwidth == pytest.approx(12.5e9 / 8)
    cpu = Cluster.from_spec("1x2xcpu")
    assert (cpu.intra_node.bandwidth, cpu.intra_node.latency) == (5e9, 2e-5)
    assert (cpu.inter_node.bandwidth, cpu.inter_node.latency) == (1.25e9, 5e-5)


def test_overrides():
    c = Cluster.from_spec("2x8xA100-80GB", intra_node_bandwidth=100e9, inter_node_latency=3e-6)
    assert c.intra_node.bandwidth == 100e9 and c.intra_node.efficiency == 1.0  # user gives achievable bw
    assert c.inter_node.latency == 3e-6 and c.inter_node.efficiency == pytest.approx(0.96)
    c = Cluster.from_spec("2x8xA100-80GB", inter_node_bandwidth=10e9, intra_node_latency=0.0)
    assert c.inter_node.bandwidth == 10e9 and c.inter_node.efficiency == 1.0
    assert c.intra_node.latency == 0.0


@pytest.mark.parametrize("kwargs, field", [
    ({"intra_node_bandwidth": 0}, "intra_node_bandwidth"),
    ({"inter_node_bandwidth": -1e9}, "inter_node_bandwidth"),
    ({"intra_node_latency": -1e-6}, "intra_node_latency"),
    ({"inter_node_latency": float("nan")}, "inter_node_latency"),
])
def test_bad_overrides(kwargs, field):
    with pytest.raises(ConfigError) as e:
        Cluster.from_spec("2x8xA100-80GB", **kwargs)
    assert field in str(e.value)


def _device(**changes):
    data = device_preset("A100-80GB").to_dict()
    data.update(changes)
    return Device.from_dict(data)


@pytest.mark.parametrize("changes, field", [
    ({"memory": 0}, "memory"),
    ({"memory_bandwidth": -5.0}, "memory_bandwidth"),
    ({"peak_flops": {"fp32": 1e12, "bf16": 0.0, "fp16": 1e12}}, "peak_flops['bf16']"),
    ({"peak_flops": {"fp32": 1e12}}, "peak_flops"),
    ({"matmul_efficiency": 0.0}, "matmul_efficiency"),
    ({"matmul_efficiency": 1.5}, "matmul_efficiency"),
    ({"memory_efficiency": -0.1}, "memory_efficiency"),
    ({"kernel_overhead": -1e-6}, "kernel_overhead"),
    ({"matmul_half_dim": -1}, "matmul_half_dim"),
    ({"name": ""}, "name"),
])
def test_device_validation(changes, field):
    with pytest.raises(ConfigError) as e:
        _device(**changes)
    assert field in str(e.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"bandwidth": 0, "latency": 1e-6}, "bandwidth"),
    ({"bandwidth": -1.0, "latency": 1e-6}, "bandwidth"),
    ({"bandwidth": 1e9, "latency": -1e-6}, "latency"),
    ({"bandwidth": 1e9, "latency": 0, "efficiency": 0}, "efficiency"),
    ({"bandwidth": 1e9, "latency": 0, "efficiency": 1.01}, "efficiency"),
])
def test_link_validation(kwargs, field):
    with pytest.raises(ConfigError) as e:
        Link(**kwargs)
    assert field in str(e.value)
    assert Link(bandwidth=1e9, latency=0).efficiency == 1.0  # latency 0 is allowed


def test_cluster_validation():
    base = Cluster.from_spec("2x8xcpu")
    for field, value in (("nodes", 0), ("devices_per_node", -1), ("nodes", 1.5)):
        data = base.to_dict()
        data[field] = value
        with pytest.raises(ConfigError) as e:
            Cluster.from_dict(data)
        assert field in str(e.value) and str(value) in str(e.value)
    with pytest.raises(ConfigError):
        Cluster.from_dict({**base.to_dict(), "extra": 1})


def test_json_round_trip():
    c = Cluster.from_spec("4x8xH100-SXM", inter_node_bandwidth=40e9)
    again = Cluster.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.describe() == c.describe()
