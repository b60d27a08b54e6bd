"""A ring that spans many nodes (cost_model/comm.py, "A ring across nodes at scale"): every step pays at
least the network post overhead, LL's bus bandwidth is capped beyond two nodes, and ZeRO's exposed
time includes the step's last reduce-scatter. Expected values are computed by hand from NCCL's tuning
model constants (presets.py), not from the code under test."""

from __future__ import annotations

import numpy as np
import pytest

from autopar import Cluster, ParallelConfig, Precision
from autopar.cost_model.comm import Collective, collective_time, place_axes
from autopar.cost_model.step_tail import StepTail

US = 1e-6
# A100 (DGX A100: AMD EPYC hosts): NVLink 300e9 x 230/300 = 230 GB/s; HDR NIC 25e9 x 0.96 = 24 GB/s per GPU.
# protocol: (call latency, NVLink step, IB step, bandwidth share, net step floor, bus bandwidth cap or None)
A100 = {"LL": (5.27 * US, 0.6 * US, 2.7 * US, 0.363, 2 * US, 19.0e9),
        "LL128": (14 * US, 1.9 * US, 4 * US, 0.92, 2 * US, None),
        "Simple": (8.4 * US, 3.4 * US, 9.6 * US, 1.0, 6 * US, None)}


def _by_hand(n: int, nodes: int, nbytes: float) -> float:
    """An all-gather (or reduce-scatter) over ``n`` ranks, 8 a node, fastest protocol."""
    best = float("inf")
    for base, a_nvl, a_ib, share, floor, cap in A100.values():
        bw = min(230e9 * share, 8 * 24e9 * share)
        if cap is not None and nodes > 2:
            bw = min(bw, cap)
        steps = (n - nodes) * max(a_nvl, floor) + (nodes - 1) * a_ib
        best = min(best, base + steps + (n - 1) / n * nbytes / bw)
    return best


@pytest.mark.parametrize("nodes", [2, 48, 280])
@pytest.mark.parametrize("nbytes", [1.0, 1e5, 1e8, 1e10])
def test_all_gather_over_many_nodes_by_hand(nodes, nbytes):
    cluster = Cluster.from_spec(f"{nodes}x8xA100-80GB")
    n = cluster.devices
    group = place_axes(cluster, [("dp", n)])["dp"]
    for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        assert collective_time(kind, nbytes, group, cluster) == pytest.approx(_by_hand(n, nodes, nbytes), rel=1e-12)


def test_latency_at_2240_ranks_is_the_network_post_overhead():
    # 1 byte over 2,240 A100 (280 nodes): LL, 1,960 NVLink steps at the 2 us floor (not 0.6 us) and 279
    # network steps at 2.7 us: 5.27 + 3920 + 753.3 us = 4.679 ms (the NVLink latency alone gave 1.93 ms)
    cluster = Cluster.from_spec("280x8xA100-80GB")
    group = place_axes(cluster, [("dp", 2240)])["dp"]
    t = collective_time(Collective.ALL_GATHER, 1.0, group, cluster)
    assert t == pytest.approx((5.27 + 1960 * 2.0 + 279 * 2.7) * US, rel=1e-6)


def test_ll_bandwidth_capped_beyond_two_nodes():
    # 100 MB over 2,240 ranks: LL would take 4.68 ms + 100e6 x 2239/2240 / 19 GB/s = 9.94 ms, LL128
    # 5.05 ms + 0.566 ms = 5.61 ms, Simple 14.4 ms + 0.52 ms: LL128 wins. Uncapped, LL (69.7 GB/s) won at 6.11 ms
    cluster = Cluster.from_spec("280x8xA100-80GB")
    group = place_axes(cluster, [("dp", 2240)])["dp"]
    ll128 = (14 + 1960 * 2.0 + 279 * 4.0) * US + 100e6 * 2239 / 2240 / (0.92 * 192e9)
    assert collective_time(Collective.ALL_GATHER, 100e6, group, cluster) == pytest.approx(ll128, rel=1e-9)


def test_h100_intel_hosts_floor_is_one_microsecond():
    # DGX H100 (Intel Xeon hosts): LL's NVLink step 0.6 us is raised to 1 us across nodes
    cluster = Cluster.from_spec("4x8xH100-SXM")
    group = place_axes(cluster, [("dp", 32)])["dp"]
    t = collective_time(Collective.ALL_GATHER, 1.0, group, cluster)
    assert t == pytest.approx((5.27 + 28 * 1.0 + 3 * 2.7) * US, rel=1e-5)   # 1 byte: bandwidth term 4e-11 s


def test_all_gather_efficiency_falls_with_ranks():
    """A 100 MB unit: the share of the time that is bytes at the ring's full bandwidth falls with n."""
    def efficiency(nodes: int) -> float:
        cluster = Cluster.from_spec(f"{nodes}x8xA100-80GB")
        group = place_axes(cluster, [("dp", cluster.devices)])["dp"]
        n = cluster.devices
        return (n - 1) / n * 100e6 / 192e9 / collective_time(Collective.ALL_GATHER, 100e6, group, cluster)
    eff = [efficiency(nodes) for nodes in (8, 48, 96, 192, 280)]
    assert all(np.diff(eff) < 0)
    assert eff[-1] < 0.15 < eff[1]   # 0.09 at 2,240 ranks, 0.35 at 384 (by hand: see the test above)


def test_zero3_exposes_the_last_reduce_scatter():
    """With compute far longer than every collective, ZeRO-3 still exposes the un-hidden share (1 - o)
    of each and the hidden share o of the step's first gather and last reduce-scatter (one unit each), and
    FSDP2's copies on the compute stream: each gather's copy-out, twice, and the reduce-scatter's copy-in (a
    gather's copy-in runs on its stream, before it)."""
    cluster = Cluster.from_spec("48x8xA100-80GB")
    cfg = ParallelConfig(dp=384, zero=3)
    groups = place_axes(cluster, [("tp", 1), ("cp", 1), ("dp", 384), ("pp", 1)])
    groups = {"dp": groups["dp"], "edp": groups["dp"], "tp": groups["tp"]}
    precision = Precision(compute="bf16", grads="bf16")
    tail = StepTail(cluster, precision)
    params, units = 1.3e9, 25
    got = float(tail.dp_time(cfg, 1, groups, params, 1e3, 1e3, 0.0, 0.0, 0.0, units))
    o = tail.overlap(groups["dp"])
    ag = float(tail.collective(Collective.ALL_GATHER, params * 2, groups["dp"], units)
               + tail.passes(2 * params * 2 / 384, units))
    rs = float(tail.collective(Collective.REDUCE_SCATTER, params * 2, groups["dp"], units))
    copies = float(2 * tail.passes(2 * params * 2, units) + tail.passes(params * (2 + 2), units))
    bandwidth = cluster.device.memory_bandwidth * cluster.device.memory_efficiency
    assert copies == pytest.approx(12 * params / bandwidth + 3 * units * cluster.device.kernel_overhead)
    expected = (1 - o) * (2 * ag + rs) + o * (ag + rs) / units + copies
    assert got == pytest.approx(expected, rel=1e-9)
