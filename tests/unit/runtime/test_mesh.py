"""autopar.runtime.mesh: the one Mesh (degrees, rank <-> coordinates, groups) the cost model prices,
the runtime and the standalone folder build their process groups from."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.cost_model.comm import GroupPlacement
from autopar.cost_model.mesh import mesh_groups
from autopar.errors import ConfigError
from autopar.runtime.mesh import GROUPS, Mesh, MeshError


def _meshes(world: int):
    """Every mesh of ``world`` ranks: each (pp, dp, cp, tp) factorisation, each ep dividing dp."""
    for pp, dp, cp in itertools.product(range(1, world + 1), repeat=3):
        if world % (pp * dp * cp) == 0:
            tp = world // (pp * dp * cp)
            for ep in range(1, dp + 1):
                if dp % ep == 0:
                    yield Mesh(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)


SMALL = [m for world in (1, 2, 4, 6, 8, 12) for m in _meshes(world)]

# the coordinates each group's members share (written apart from the module: what each group means)
SAME = {"tp": ("pp", "dp", "cp"), "cp": ("pp", "dp", "tp"), "pp": ("dp", "cp", "tp"), "dp": ("pp", "tp"),
        "ep": ("pp", "cp", "tp", "expert_block"), "edp": ("pp", "tp", "ep")}


def _key(mesh: Mesh, rank: int, names) -> tuple:
    c = mesh.coords(rank)
    return tuple(c.dp // mesh.ep if n == "expert_block" else getattr(c, n) for n in names)


@pytest.mark.parametrize("mesh", SMALL, ids=str)
def test_coordinates_round_trip(mesh):
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        assert mesh.rank(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp) == rank
        # tp innermost, then cp, dp, pp outermost (Megatron-LM's order, what the cost model places)
        assert rank == c.tp + mesh.tp * (c.cp + mesh.cp * (c.dp + mesh.dp * c.pp))
        assert c.ep == c.dp % mesh.ep


@pytest.mark.parametrize("mesh", SMALL, ids=str)
def test_groups_partition_the_world(mesh):
    for name in GROUPS:
        groups = mesh.groups(name)
        members = [r for g in groups for r in g]
        assert sorted(members) == list(range(mesh.world_size)), name
        for g in groups:
            assert len(g) == mesh.size(name)
            for r in g:
                assert mesh.group_ranks(name, r) == g   # every member sees the same group, in one order
                assert _key(mesh, r, SAME[name]) == _key(mesh, g[0], SAME[name])   # differ only along the group
    sizes = {"tp": mesh.tp, "cp": mesh.cp, "pp": mesh.pp, "dp": mesh.dp * mesh.cp, "ep": mesh.ep,
             "edp": mesh.dp * mesh.cp // mesh.ep}
    assert {n: mesh.size(n) for n in GROUPS} == sizes


def test_group_orders():
    mesh = Mesh(pp=2, dp=4, cp=2, tp=2, ep=2)
    assert mesh.group_ranks("dp", 13) == (1, 3, 5, 7, 9, 11, 13, 15)   # dp-major, cp inner: the flattened (dp, cp)
    assert mesh.group_ranks("edp", 13) == (5, 7, 13, 15)   # the dp ranks with ep coordinate 1, each with its cp ranks
    assert mesh.group_ranks("ep", 13) == (9, 13)
    assert mesh.grid(("ep", "edp"), 13) == [[1, 3, 9, 11], [5, 7, 13, 15]]
    assert mesh.stage_groups((0, 1))[:2] == [(0, 16), (1, 17)]


def _placement(groups, per_node: int) -> GroupPlacement:
    """Where a list of groups lands on nodes of ``per_node`` ranks, counted rank by rank."""
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for gid, g in enumerate(groups):
        for r in g:
            counts[(gid, r // per_node)] += 1
    size = len(groups[0])
    r = max(k for k in range(1, size + 1) if size % k == 0 and k <= min(counts.values()))
    per = defaultdict(int)
    for _, node in counts:
        per[node] += 1
    return GroupPlacement(size=size, ranks_per_node=r, groups_per_node=max(per.values()))


@pytest.mark.parametrize("spec", ["2x4xcpu", "4x2xcpu", "3x4xcpu", "2x6xcpu", "1x8xcpu", "8x1xcpu"])
def test_cost_model_prices_the_ranks_the_runtime_groups(spec):
    """mesh_groups places exactly the groups Mesh builds: every group that is one run of the rank
    numbering (all but the edp group with cp > 1 and dp > ep > 1, which it spreads evenly)."""
    cluster = Cluster.from_spec(spec)
    checked = 0
    for mesh in _meshes(cluster.devices):
        cfg = ParallelConfig(pp=mesh.pp, dp=mesh.dp, cp=mesh.cp, tp=mesh.tp, ep=mesh.ep)
        priced = mesh_groups(cluster, cfg)
        assert set(priced) == set(GROUPS)
        for name in GROUPS:
            built = _placement(mesh.groups(name), cluster.devices_per_node)
            if len(mesh.runs(name)) <= 1:
                assert priced[name] == built, (str(mesh), name)
                checked += 1
            else:   # priced as one run of its size over the same span (cost_model/mesh.py)
                assert priced[name].size == built.size, (str(mesh), name)
    assert checked > 50


def test_edp_of_context_parallel_experts_is_priced_where_it_is():
    """dp = ep with cp > 1: each rank's experts are held by its cp ranks alone, neighbours on one
    node; the cost model used to price them as if ``tp * ep`` ranks apart (on other nodes)."""
    cluster = Cluster.from_spec("2x8xcpu")
    mesh = Mesh(dp=8, cp=2, ep=8)
    assert mesh.group_ranks("edp", 0) == (0, 1)
    priced = mesh_groups(cluster, ParallelConfig(dp=8, cp=2, ep=8))["edp"]
    assert priced == GroupPlacement(size=2, ranks_per_node=2, groups_per_node=4)


def test_validation_says_what_to_change():
    with pytest.raises(MeshError, match="ep=2 must divide dp=3"):
        Mesh(dp=3, ep=2)
    with pytest.raises(MeshError, match="tp=0 must be an integer >= 1: pass tp=1"):
        Mesh(tp=0)
    with pytest.raises(MeshError, match="pp=True"):
        Mesh(pp=True)
    mesh = Mesh(dp=2, tp=2)
    with pytest.raises(MeshError, match="ranks are 0 .. 3"):
        mesh.coords(4)
    with pytest.raises(MeshError, match=r"tp=2 is off the mesh .* 0 \.\. 1"):
        mesh.rank(tp=2)
    with pytest.raises(MeshError, match="unknown mesh group 'world'"):
        mesh.group_ranks("world", 0)
    with pytest.raises(MeshError, match="stages are 0 .. 0"):
        mesh.stage_groups((0, 1))
    assert issubclass(MeshError, ConfigError) and issubclass(MeshError, ValueError)


def test_of_a_config():
    cfg = ParallelConfig(dp=4, tp=2, pp=2, cp=1, ep=2)
    assert Mesh.of(cfg) == Mesh(pp=2, dp=4, cp=1, tp=2, ep=2)
    assert Mesh.of(cfg).world_size == cfg.devices


# --- the process groups, built in one process on torch's fake backend (no ranks) -----------------
@pytest.fixture
def fake_world():
    dist = pytest.importorskip("torch.distributed")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


BUILT = [Mesh(pp=2, dp=2, cp=1, tp=2), Mesh(pp=1, dp=4, cp=2, tp=1, ep=2), Mesh(pp=2, dp=2, cp=2, tp=1, ep=2),
         Mesh(pp=1, dp=2, cp=2, tp=2, ep=1)]


@pytest.mark.parametrize("mesh", BUILT, ids=str)
def test_built_groups_hold_the_mesh_ranks(fake_world, mesh):
    import torch.distributed as dist
    for rank in range(mesh.world_size):
        fake_world(rank, mesh.world_size)
        groups = mesh.build("cpu", experts=True, tied=[(0, mesh.pp - 1)] if mesh.pp > 1 else ())
        assert groups.coords == mesh.coords(rank)
        for name in GROUPS:
            group = groups.group(name)
            if mesh.size(name) == 1:
                assert group is None
            else:
                assert tuple(dist.get_process_group_ranks(group)) == mesh.group_ranks(name, rank), name
        assert tuple(groups.dp.mesh.flatten().tolist()) == mesh.group_ranks("dp", rank)
        assert tuple(groups.edp.mesh.flatten().tolist()) == mesh.group_ranks("edp", rank)
        if mesh.tp > 1:
            assert tuple(groups.tp.mesh.tolist()) == mesh.group_ranks("tp", rank)
        if mesh.pp > 1:
            assert tuple(dist.get_process_group_ranks(groups.tied[(0, 1)])) == mesh.group_ranks("pp", rank)
        if mesh.ep > 1:
            grid = groups.submesh(("ep", "edp"))
            assert grid.mesh.tolist() == mesh.grid(("ep", "edp"), rank)


def test_build_refuses_another_world(fake_world):
    fake_world(0, 4)
    with pytest.raises(MeshError, match="has 2 ranks but 4 were launched"):
        Mesh(tp=2).build("cpu")
