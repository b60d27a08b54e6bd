"""The B200, GB200 NVL72, H20, H800 and AMD Instinct presets: their datasheet figures, NVLink domains larger
than a machine (a node of the cost model is one domain), Infinity Fabric's switchless mesh, and a plan
that keeps expert parallelism inside a GB200 rack when that is faster."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar import Cluster
from autopar.capture import capture
from autopar.codegen.emit import run_hint
from autopar.cost_model.comm import Collective, GroupPlacement, collective_time, p2p_time
from autopar.cost_model.mesh import mesh_groups
from autopar.errors import ConfigError
from autopar.hardware import Link
from autopar.models.moe import Mixtral, MixtralConfig
from autopar.presets import DEVICE_PRESETS
from autopar.solver import solve


def test_datasheet_peaks_and_memory():
    b200, gb200 = DEVICE_PRESETS["B200"], DEVICE_PRESETS["GB200"]
    assert (b200.peak("bf16"), b200.peak("fp8"), b200.peak("fp4")) == (2.25e15, 4.5e15, 9e15)
    assert (gb200.peak("bf16"), gb200.peak("fp8"), gb200.peak("fp4")) == (2.5e15, 5e15, 10e15)
    assert (b200.memory, gb200.memory, b200.memory_bandwidth) == (180e9, 186e9, 8e12)
    mi300x, mi325x, mi355x = DEVICE_PRESETS["MI300X"], DEVICE_PRESETS["MI325X"], DEVICE_PRESETS["MI355X"]
    assert mi300x.peak("bf16") == mi325x.peak("bf16") == 1307.4e12 and mi300x.peak("fp8") == 2614.9e12
    assert (mi300x.memory, mi325x.memory, mi355x.memory) == (192e9, 256e9, 288e9)
    assert mi355x.peak("fp4") == 10066.3e12
    with pytest.raises(ConfigError, match="tf32"):
        mi355x.peak("tf32")        # CDNA 4 has no tf32 matrix path
    h100, h800, h20 = DEVICE_PRESETS["H100-SXM"], DEVICE_PRESETS["H800"], DEVICE_PRESETS["H20"]
    assert {**h800.peak_flops, "fp64": h100.peak("fp64")} == dict(h100.peak_flops)   # the H100 die's, fp64 aside
    assert h800.matmul_efficiency == h100.matmul_efficiency and "fp64" not in h800.peak_flops
    assert h20.peak("bf16") == 148e12 and h20.memory == 96e9
    assert h100.peak("fp8") == 1979e12   # dense, twice bf16's 989


def test_a_node_is_an_nvlink_domain_of_machines():
    rack = Cluster.from_spec("16x72xGB200")
    assert (rack.nodes, rack.devices_per_node, rack.devices_per_host, rack.host_devices, rack.hosts) == \
        (16, 72, 4, 4, 288)
    assert "288 machines of 4" in rack.describe()
    assert Cluster.from_spec("4x64xGB200").hosts == 64            # 64 of each rack's 72 GPUs
    assert Cluster.from_spec("1x2xGB200").devices_per_host is None   # a domain within one tray
    assert Cluster.from_spec("2x8xB200").host_devices == 8          # a DGX B200 is one machine
    with pytest.raises(ConfigError, match="multiple of 4"):
        Cluster.from_spec("1x6xGB200")
    with pytest.raises(ConfigError, match="devices_per_host=5 does not divide"):
        dataclasses.replace(rack, devices_per_host=5)
    assert Cluster.from_dict(rack.to_dict()) == rack


def test_infinity_fabric_gives_a_group_only_its_own_links():
    mi300x, b200 = Cluster.from_spec("1x8xMI300X"), Cluster.from_spec("1x8xB200")
    assert mi300x.intra_node.peers == 7 and b200.intra_node.peers == 0

    def bandwidth_term(cluster: Cluster, ranks: int) -> float:   # seconds per byte of a large all-reduce
        group = GroupPlacement(size=ranks, ranks_per_node=ranks, groups_per_node=8 // ranks)
        big, bigger = 4e9, 8e9
        return (collective_time(Collective.ALL_REDUCE, bigger, group, cluster)
                - collective_time(Collective.ALL_REDUCE, big, group, cluster)) / (bigger - big)

    # volume 2(n-1)/n per byte: over one link for a pair, over all seven for eight GPUs
    share = (bandwidth_term(mi300x, 8) / (2 * 7 / 8)) / (bandwidth_term(mi300x, 2) / (2 * 1 / 2))
    assert share == pytest.approx(1 / 7, rel=1e-6)
    assert (bandwidth_term(b200, 8) / (2 * 7 / 8)) == pytest.approx(bandwidth_term(b200, 2) / (2 * 1 / 2), rel=1e-6)
    link = mi300x.intra_node
    assert p2p_time(1e9, mi300x, across_nodes=False) == pytest.approx(1e9 / (link.effective_bandwidth / 7)
                                                                     + link.latency)
    with pytest.raises(ConfigError, match="peers"):
        Link(bandwidth=1e9, latency=0.0, peers=-1)


def test_a_gb200_rack_keeps_expert_parallelism_inside_its_domain_when_that_is_faster():
    """64 experts that need ep = 64 to fit (16 GB per device, no pipeline, ZeRO-1): on one NVL72 rack running
    64 GPUs the 64 ranks all-to-all over NVLink; on eight 8-GPU domains over InfiniBand."""
    cfg = MixtralConfig(layers=12, hidden=4096, heads=32, kv_heads=8, ffn_hidden=2048, vocab_size=32000,
                        seq_len=4096, num_experts=64, top_k=8, capacity_factor=1.0)
    with torch.device("meta"):
        model = Mixtral(cfg)
    tokens = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    graph = capture(model, {"input_ids": tokens, "labels": tokens}, progress=False)
    plans = {}
    for spec in ("1x64xGB200", "8x8xGB200"):
        cluster = Cluster.from_spec(spec, device_memory=16e9)
        plans[spec], _ = solve(graph, cluster, 512, fixed={"zero": 1, "pp": 1})
    rack, nodes = plans["1x64xGB200"], plans["8x8xGB200"]
    assert rack.fits and rack.config.tp * rack.config.ep > 8
    groups = mesh_groups(rack.cluster, rack.config)
    assert groups["ep"].nodes == 1 and groups["tp"].nodes == 1
    assert rack.step_time < nodes.step_time
    assert rack.breakdown.ep_comm < nodes.breakdown.ep_comm
    # launched per machine (a compute tray of 4 GPUs), not per NVLink domain
    torchrun = rack.export("megatron").text
    assert "--nnodes 16" in torchrun and "--nproc-per-node 4" in torchrun
    assert "on each of 16 machines: torchrun --nnodes 16 --nproc-per-node 4" in run_hint(rack)
