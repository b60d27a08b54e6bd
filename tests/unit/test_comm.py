"""Collective cost model: group placement and alpha-beta collective times."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest

from autopar.cluster import Cluster
from autopar.hardware import Protocol
from autopar.cost_model.comm import (Collective, GroupPlacement, _placement_by_enumeration,
                                     _placement_by_formula, bus_bandwidth, collective_time, p2p_time,
                                     place_axes)
from autopar.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20


def _factorisations(n: int, parts: int):
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorisations(n // d, parts - 1):
                yield (d,) + rest


def _brute_force(nodes: int, per_node: int, degrees: tuple[int, ...]) -> list[GroupPlacement]:
    """Placement by listing every group's ranks, written independently of the module."""
    out = []
    for axis, degree in enumerate(degrees):
        others = [range(d) for i, d in enumerate(degrees) if i != axis]
        counts: dict[tuple[int, int], int] = defaultdict(int)  # (group, node) -> members
        for group_id, coords in enumerate(itertools.product(*others)):
            for k in range(degree):
                full = list(coords)
                full.insert(axis, k)
                rank, scale = 0, 1
                for c, d in zip(full, degrees):
                    rank += c * scale
                    scale *= d
                counts[(group_id, rank // per_node)] += 1
        smallest = min(counts.values())
        r = max(k for k in range(1, degree + 1) if degree % k == 0 and k <= smallest)
        groups_on = defaultdict(int)
        for (_, node) in counts:
            groups_on[node] += 1
        out.append(GroupPlacement(size=degree, ranks_per_node=r, groups_per_node=max(groups_on.values())))
    return out


SHAPES = [(nodes, per_node, degs)
          for devices, layouts in ((16, ((2, 8), (4, 4), (1, 16), (16, 1))), (64, ((8, 8), (16, 4), (4, 16))),
                                   (24, ((3, 8), (6, 4), (2, 12))), (48, ((6, 8),)))
          for nodes, per_node in layouts
          for parts in (1, 2, 3)
          for degs in _factorisations(devices, parts)]


@pytest.mark.parametrize("nodes, per_node, degrees", SHAPES)
def test_place_axes_matches_brute_force(nodes, per_node, degrees):
    cluster = Cluster.from_spec(f"{nodes}x{per_node}xcpu")
    names = [f"a{i}" for i in range(len(degrees))]
    got = place_axes(cluster, list(zip(names, degrees)))
    assert list(got.values()) == _brute_force(nodes, per_node, degrees)


def test_formula_agrees_with_enumeration_when_it_applies():
    checked = 0
    for devices in (16, 64, 96, 128):
        for per_node in (1, 2, 4, 8, 16):
            if devices % per_node:
                continue
            for degrees in _factorisations(devices, 3):
                stride = 1
                for degree in degrees:
                    formula = _placement_by_formula(stride, degree, per_node)
                    if formula is not None:
                        assert formula == _placement_by_enumeration(stride, degree, per_node, devices)
                        checked += 1
                    stride *= degree
    assert checked > 1000  # the formula covers the power-of-two layouts that matter


def test_place_axes_megatron_layout():
    got = place_axes(Cluster.from_spec("128x8xA100-80GB"), [("tp", 8), ("dp", 32), ("pp", 4)])
    assert got["tp"] == GroupPlacement(size=8, ranks_per_node=8, groups_per_node=1)
    assert got["dp"] == GroupPlacement(size=32, ranks_per_node=1, groups_per_node=8)
    assert got["pp"] == GroupPlacement(size=4, ranks_per_node=1, groups_per_node=8)
    assert got["dp"].nodes == 32


def test_irregular_layout_is_conservative():
    # groups of 3 consecutive ranks on nodes of 8: some node holds 1 member of a group
    got = place_axes(Cluster.from_spec("3x8xcpu"), [("a", 3), ("b", 8)])
    assert got["a"] == GroupPlacement(size=3, ranks_per_node=1, groups_per_node=4)


def test_place_axes_errors():
    cluster = Cluster.from_spec("2x8xA100-80GB")
    with pytest.raises(ConfigError) as e:
        place_axes(cluster, [("tp", 8), ("dp", 4)])
    assert "32" in str(e.value) and "16" in str(e.value)
    with pytest.raises(ConfigError):
        place_axes(cluster, [("tp", 4), ("tp", 4)])
    with pytest.raises(ConfigError):
        place_axes(cluster, [("tp", 0), ("dp", 16)])


def test_group_placement_validation():
    with pytest.raises(ConfigError):
        GroupPlacement(size=8, ranks_per_node=3, groups_per_node=1)
    with pytest.raises(ConfigError):
        GroupPlacement(size=0, ranks_per_node=1, groups_per_node=1)
    with pytest.raises(ConfigError):  # does not fit: 8 ranks on a node of 4
        collective_time(Collective.ALL_REDUCE, 1e6, GroupPlacement(size=8, ranks_per_node=8, groups_per_node=1),
                        Cluster.from_spec("2x4xcpu"))
    with pytest.raises(ConfigError):
        collective_time(Collective.ALL_REDUCE, -1.0, GroupPlacement(size=2, ranks_per_node=2, groups_per_node=1),
                        Cluster.from_spec("1x2xcpu"))


CLUSTERS = ["1x8xA100-80GB", "4x8xA100-80GB", "4x8xH100-SXM", "8x8xV100-16GB", "4x4xcpu"]
RING = [Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL,
        Collective.BROADCAST, Collective.P2P]


def _groups(cluster: Cluster):
    """Every placement of some 2- and 3-axis layouts of the cluster."""
    for degrees in itertools.chain(_factorisations(cluster.devices, 2), _factorisations(cluster.devices, 3)):
        yield from place_axes(cluster, [(f"a{i}", d) for i, d in enumerate(degrees)]).values()


@pytest.mark.parametrize("spec", CLUSTERS)
def test_monotone_in_bytes_and_bandwidth(spec):
    cluster = Cluster.from_spec(spec)
    # overridden bandwidths get efficiency 1.0, so doubling the nominal more than doubles the achievable
    faster = Cluster.from_spec(spec, intra_node_bandwidth=2 * cluster.intra_node.bandwidth,
                               inter_node_bandwidth=2 * cluster.inter_node.bandwidth)
    for group in set(_groups(cluster)):
        for kind in RING:
            times = [collective_time(kind, s, group, cluster) for s in (0, 1, 1e3, 1e6, 1e9)]
            assert times == sorted(times), (kind, group)
            assert collective_time(kind, 1e8, group, faster) <= collective_time(kind, 1e8, group, cluster)


def test_one_rank_group_costs_nothing():
    cluster = Cluster.from_spec("2x8xA100-80GB")
    alone = GroupPlacement(size=1, ranks_per_node=1, groups_per_node=8)
    for kind in RING[:-1]:
        assert collective_time(kind, 1e9, alone, cluster) == 0.0
    assert collective_time(Collective.P2P, 1e9, alone, cluster) > 0  # p2p ignores the size


def _ring(link, n: int, volume: float, steps: int) -> float:
    """The module docstring's single-node ring, fastest over the link's protocols (one protocol of
    ``latency`` per step at the full bandwidth when it lists none)."""
    bw = link.bandwidth * link.efficiency
    protocols = link.protocols or (Protocol(name="ring", base_latency=0.0, step_latency=link.latency,
                                            bandwidth_fraction=1.0),)
    return min(p.base_latency + steps * p.step_latency + volume / (bw * p.bandwidth_fraction) for p in protocols)


@pytest.mark.parametrize("spec", ["1x8xA100-80GB", "1x4xcpu", "1x8xH100-SXM"])
@pytest.mark.parametrize("s", [8.0, 1e6, 3.7e8])
def test_single_node_formulas_exact(spec, s):
    cluster = Cluster.from_spec(spec)
    link = cluster.intra_node
    n = cluster.devices_per_node
    group = place_axes(cluster, [("dp", n)])["dp"]
    all_reduce = _ring(link, n, 2 * (n - 1) / n * s, 2 * (n - 1))
    if link.sharp_bandwidth:
        all_reduce = min(all_reduce, link.sharp_latency + 2 * (n - 1) / n * s / link.sharp_bandwidth)
    assert collective_time(Collective.ALL_REDUCE, s, group, cluster) == pytest.approx(all_reduce, rel=1e-12)
    for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        assert collective_time(kind, s, group, cluster) == pytest.approx(_ring(link, n, (n - 1) / n * s, n - 1),
                                                                         rel=1e-12)
    assert collective_time("broadcast", s, group, cluster) == pytest.approx(_ring(link, n, s, n - 1))
    bw = link.bandwidth * link.efficiency   # pairwise exchange and p2p: ``latency`` per message
    assert collective_time(Collective.ALL_TO_ALL, s, group, cluster) == pytest.approx(
        (n - 1) / n * s / bw + (n - 1) * link.latency, rel=1e-12)
    assert collective_time("p2p", s, group, cluster) == pytest.approx(s / bw + link.latency)


def test_a100_node_all_reduce_bus_bandwidth():
    # NCCL maintainers: 8 x A100 SXM NVLink all-reduce about 230 GB/s busbw (bench/sources.md section 5);
    # 2% tolerance: at 1 GiB the latency steps cost 0.2% of the time.
    cluster = Cluster.from_spec("1x8xA100-80GB")
    t = collective_time(Collective.ALL_REDUCE, GiB, place_axes(cluster, [("dp", 8)])["dp"], cluster)
    assert bus_bandwidth(Collective.ALL_REDUCE, GiB, t, 8) == pytest.approx(230e9, rel=0.02)


# nccl-tests all_reduce_perf on 8 H100 SXM (bench/sources.md section 5): NCCL's protocols and NVLS
@pytest.mark.parametrize("nbytes, measured_us", [(8, 13.67), (1048576, 27.37), (16777216, 123.8),
                                                 (67108864, 324.7), (268435456, 1112.5), (1073741824, 4029.4),
                                                 (8589934592, 31307.0)])
def test_h100_node_all_reduce_vs_measured(nbytes, measured_us):
    cluster = Cluster.from_spec("1x8xH100-SXM")
    t = collective_time(Collective.ALL_REDUCE, nbytes, place_axes(cluster, [("dp", 8)])["dp"], cluster)
    assert t * 1e6 == pytest.approx(measured_us, rel=0.10)


def test_small_messages_take_the_low_latency_protocol_and_large_ones_the_full_bandwidth():
    cluster = Cluster.from_spec("1x8xA100-80GB")
    group = place_axes(cluster, [("dp", 8)])["dp"]
    simple = cluster.intra_node.protocols[-1]
    assert simple.name == "Simple" and simple.bandwidth_fraction == 1.0
    ll = cluster.intra_node.protocols[0]
    bw = cluster.intra_node.effective_bandwidth
    assert collective_time(Collective.ALL_REDUCE, 8, group, cluster) == pytest.approx(
        ll.base_latency + 14 * ll.step_latency + 1.75 * 8 / (bw * ll.bandwidth_fraction))
    assert collective_time(Collective.ALL_REDUCE, GiB, group, cluster) == pytest.approx(
        simple.base_latency + 14 * simple.step_latency + 1.75 * GiB / bw)


def test_the_tree_beats_the_ring_at_thousands_of_ranks():
    """A small all-reduce over 1024 nodes: the ring pays 2 x 1023 network steps, the double binary tree
    2 x log2(1024) = 20 levels."""
    cluster = Cluster.from_spec("1024x8xH100-SXM")
    group = place_axes(cluster, [("tp", 8), ("dp", 1024)])["dp"]
    assert group.nodes == 1024 and group.ranks_per_node == 1
    ll = cluster.inter_node.protocols[0]
    t = collective_time(Collective.ALL_REDUCE, 8, group, cluster)
    assert t < 2 * 1023 * ll.step_latency / 10
    assert t >= ll.base_latency + 2 * 10 * ll.step_latency
    # all-gathers have no tree in NCCL: ZeRO-3's per-layer gathers pay the ring's latency
    assert collective_time(Collective.ALL_GATHER, 8, group, cluster) >= 1023 * ll.step_latency


@pytest.mark.parametrize("nodes", [2, 4, 8, 16])
def test_dgx_a100_multi_node_all_reduce_bus_bandwidth(nodes):
    # DGX A100 multi-node (8 x HDR) all-reduce about 192 GB/s busbw (bench/sources.md section 5); 15% because
    # the NIC share is exact but the latency steps grow with the node count.
    cluster = Cluster.from_spec(f"{nodes}x8xA100-80GB")
    n = cluster.devices
    t = collective_time(Collective.ALL_REDUCE, GiB, place_axes(cluster, [("dp", n)])["dp"], cluster)
    assert bus_bandwidth(Collective.ALL_REDUCE, GiB, t, n) == pytest.approx(192e9, rel=0.15)


def test_one_rank_per_node_is_a_plain_inter_node_ring_or_tree():
    cluster = Cluster.from_spec("4x8xA100-80GB")
    dp = place_axes(cluster, [("tp", 8), ("dp", 4)])["dp"]
    inter = cluster.inter_node
    n, bw = 4, inter.bandwidth * inter.efficiency
    for s in (8.0, 1e6, 1e9):
        ring = min(p.base_latency + 2 * (n - 1) * p.step_latency + 2 * (n - 1) / n * s / (bw * p.bandwidth_fraction)
                   for p in inter.protocols)
        tree = min(p.base_latency + 2 * 2 * p.step_latency + 2 * s / (bw * p.bandwidth_fraction)
                   for p in inter.protocols)
        assert collective_time(Collective.ALL_REDUCE, s, dp, cluster) == pytest.approx(min(ring, tree))


@pytest.mark.parametrize("size, per_node", [(16, 8), (16, 4), (8, 4), (8, 1), (32, 8)])
def test_hierarchical_not_cheaper_than_single_node(size, per_node):
    """Bandwidth-bound messages: spreading a group over nodes never helps. (Smaller ones may: the
    double binary tree across nodes has log2(nodes) levels where one flat node's ring has 2(n-1) steps,
    as with NCCL.)"""
    spread = Cluster.from_spec(f"{size // per_node}x{per_node}xA100-80GB")
    one_node = Cluster.from_spec(f"1x{size}xA100-80GB")
    g_spread = place_axes(spread, [("dp", size)])["dp"]
    g_one = place_axes(one_node, [("dp", size)])["dp"]
    assert g_spread.nodes == size // per_node and g_one.nodes == 1
    for kind in RING[:-1]:
        assert collective_time(kind, GiB, g_spread, spread) >= collective_time(kind, GiB, g_one, one_node)


def test_nic_sharing():
    # 4 DP groups of 8 ranks on 4 nodes (tp=2 inside) share the NICs: 2 ranks per node per group
    cluster = Cluster.from_spec("4x8xA100-80GB")
    shared = place_axes(cluster, [("tp", 2), ("dp", 4), ("pp", 4)])["pp"]
    assert shared == GroupPlacement(size=4, ranks_per_node=1, groups_per_node=8)
    alone = GroupPlacement(size=4, ranks_per_node=1, groups_per_node=1)
    assert collective_time("all_reduce", 1e9, alone, cluster) < collective_time("all_reduce", 1e9, shared, cluster)


def test_all_to_all_crosses_nics():
    cluster = Cluster.from_spec("2x8xA100-80GB")
    group = place_axes(cluster, [("ep", 16)])["ep"]
    s = 1e9
    nic = min(cluster.inter_node.bandwidth, cluster.intra_node.bandwidth) * cluster.inter_node.efficiency
    expected = (7 / 16 * s / cluster.intra_node.effective_bandwidth + 8 / 16 * s / nic
                + 7 * cluster.intra_node.latency + 8 * cluster.inter_node.latency)
    assert collective_time(Collective.ALL_TO_ALL, s, group, cluster) == pytest.approx(expected)


def test_p2p_time():
    cluster = Cluster.from_spec("2x8xA100-80GB")
    inter, intra = cluster.inter_node, cluster.intra_node
    assert p2p_time(1e8, cluster, across_nodes=True) == pytest.approx(1e8 / inter.effective_bandwidth + inter.latency)
    assert p2p_time(1e8, cluster, across_nodes=False) == pytest.approx(1e8 / intra.effective_bandwidth + intra.latency)
    pp = place_axes(cluster, [("dp", 8), ("pp", 2)])["pp"]
    assert collective_time(Collective.P2P, 1e8, pp, cluster) == p2p_time(1e8, cluster, across_nodes=True)
    assert math.isclose(p2p_time(0, cluster, across_nodes=True), 0.0)
