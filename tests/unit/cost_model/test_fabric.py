"""A fabric of more than one tier (Cluster.fabric, hardware.Fabric): pods of nodes under full bisection, 1:sigma
between them; collectives priced per tier (cost_model/comm.py)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import Cluster
from autopar.cost_model.comm import Collective, collective_lines, collective_time, place_axes, place_run
from autopar.errors import ConfigError
from autopar.hardware import Fabric
from autopar.presets import FABRICS

META = FABRICS["llama3-24k-roce"]


def _clusters(nodes: int = 1024, fabric: Fabric = META) -> tuple[Cluster, Cluster]:
    return Cluster.from_spec(f"{nodes}x8xH100-SXM"), Cluster.from_spec(f"{nodes}x8xH100-SXM", fabric=fabric)


def _widest(kind, group, cluster) -> float:
    """The least seconds per byte of any way ``kind`` runs over ``group`` (its bandwidth at large sizes)."""
    return min(beta for _, beta in collective_lines(kind, group, cluster))


def test_fabric_validates_round_trips_and_is_described():
    with pytest.raises(ConfigError, match="must be >= 1"):
        Fabric(pod_nodes=4, oversubscription=0.5, source="")
    with pytest.raises(ConfigError, match="pod_nodes"):
        Fabric(pod_nodes=0, oversubscription=2.0, source="")
    with pytest.raises(ConfigError, match="must be a Fabric"):
        dataclasses.replace(Cluster.from_spec("2x8xH100-SXM"), fabric={"pod_nodes": 1})
    _, cluster = _clusters()
    assert Cluster.from_dict(cluster.to_dict()) == cluster and cluster.to_dict()["fabric"] == META.to_dict()
    assert Cluster.from_dict({k: v for k, v in cluster.to_dict().items() if k != "fabric"}).fabric is None
    assert "pods of 384 nodes, 1:7 between them" in cluster.describe()


def test_groups_inside_a_pod_or_without_a_fabric_are_priced_as_before():
    plain, tiered = _clusters()
    axes = [("tp", 8), ("dp", 128), ("pp", 8)]   # dp spans 128 consecutive nodes: inside one pod of 384
    before, after = place_axes(plain, axes), place_axes(tiered, axes)
    assert after["dp"].pods == 1 and after["tp"].pods == 1 and after["pp"].pods == 3
    for name in ("tp", "dp"):
        assert after[name] == before[name]
    with pytest.raises(ConfigError, match="no fabric of pods"):   # a placement priced on another cluster
        collective_time(Collective.ALL_REDUCE, 1e6, after["pp"], plain)
    small_plain, small = _clusters(nodes=256)   # the cluster fits in one pod: nothing changes
    assert place_axes(small, axes[:2] + [("pp", 2)]) == place_axes(small_plain, axes[:2] + [("pp", 2)])


def test_a_ring_across_pods_gets_its_nodes_share_of_the_tier_above():
    """One ring edge leaves each pod; the group's N / P nodes there own (N / P) r b of the pod's NICs, of which
    the tier above carries 1 / sigma: the ring's bandwidth is the least of that and its own. A data-parallel
    ring over every node keeps its bandwidth (341 nodes a pod, far above sigma = 7); a pipeline's 8 ranks, one
    node in each of 3 pods' groups of 8 / 3, are cut by 8 / 3 / 7."""
    plain, tiered = _clusters()
    dp = place_run(tiered, 1024, 8)
    assert dp.pods == 3 and _widest(Collective.ALL_REDUCE, dp, tiered) == \
        _widest(Collective.ALL_REDUCE, place_run(plain, 1024, 8), plain)
    pp_plain, pp = place_run(plain, 8, 1024), place_run(tiered, 8, 1024)   # ranks 1,024 apart: 128 nodes apart
    assert pp.pods == 3 and pp.nodes == 8 and pp.ranks_per_node == 1
    ratio = _widest(Collective.ALL_REDUCE, pp, tiered) / _widest(Collective.ALL_REDUCE, pp_plain, plain)
    assert ratio == pytest.approx(META.oversubscription / (pp.nodes / pp.pods))
    assert collective_time(Collective.ALL_GATHER, 1e9, pp, tiered) > collective_time(Collective.ALL_GATHER, 1e9,
                                                                                      pp_plain, plain)


def test_all_to_all_sends_its_cross_pod_share_over_the_tier_above():
    """Pairwise exchange: of a rank's n - 1 peers, r - 1 share its node, n / P - r its pod off the node, and
    n - n / P sit in other pods, whose share of the data crosses the tier above at 1 / sigma of the NICs."""
    plain, tiered = _clusters()
    group = place_run(tiered, 1024, 8)   # one rank per node, over 3 pods
    n, r, pods = group.size, group.ranks_per_node, group.pods
    off_node = _widest(Collective.ALL_TO_ALL, place_run(plain, 1024, 8), plain)   # (n - r) / n / b
    b = (n - r) / n / off_node
    expected = (n / pods - r) / n / b + (n - n / pods) / n / (b / META.oversubscription)
    assert _widest(Collective.ALL_TO_ALL, group, tiered) == pytest.approx(expected)


def test_plans_carry_the_fabric_and_price_data_parallelism_across_pods():
    """Every node its own pod, 1:8 above: a data-parallel ring over nodes is cut eightfold; the plan's cluster
    keeps the fabric through its file."""
    import autopar
    from autopar import ParallelConfig
    from autopar.models import build
    from autopar.plan import Plan

    model, inputs = build("gpt-tiny", batch_size=1)
    fabric = Fabric(pod_nodes=1, oversubscription=8.0, source="every node its own pod")
    plain, tiered = (Cluster.from_spec("4x1xH100-SXM", fabric=f) for f in (None, fabric))
    cfg = ParallelConfig(dp=4, micro_batch_size=2)
    kept, cut = (autopar.estimate(model, c, inputs, cfg, global_batch_size=8) for c in (plain, tiered))
    assert cut.breakdown.dp_comm > kept.breakdown.dp_comm and cut.breakdown.compute == kept.breakdown.compute
    chosen = autopar.plan(model, tiered, inputs, global_batch_size=8)
    assert Plan.from_dict(chosen.to_dict()).cluster.fabric == fabric
