"""The mesh of a parallel configuration: its degrees, rank <-> coordinates, and its process groups.

One :class:`Mesh` (torchtitan's ``ParallelDims`` is the model) is what the cost model prices
(cost_model/mesh.py places its groups on the cluster), what ``autopar.parallelize``'s ranks build
their groups from (driver/assembly.py), what the standalone folder's ``train.py`` builds its
groups from (this file is copied beside it), and what the profiler's tensor-parallel mesh is.

Layout. Ranks are numbered tp innermost, then cp, then dp, pp outermost::

    rank = tp + TP * (cp + CP * (dp + DP * pp))

(Megatron-LM's order: the tensor-parallel ranks, which talk most, are neighbours on one node). Expert
parallelism splits the data-parallel axis: the ``EP`` consecutive dp ranks ``o * EP + e`` (``e < EP``)
with the same pp, cp and tp coordinates hold different experts (``ep = dp mod EP``).

Groups, named as the cost model names them (each a set of ranks that differ only in some coordinates):

- ``tp``, ``cp``, ``pp``: the ranks along that axis;
- ``dp``: the ``DP * CP`` ranks holding the same dense weights (the data- and context-parallel
  replicas: their gradients are averaged over it, ZeRO shards over it);
- ``ep``: the ``EP`` ranks of one expert group (their experts together are the layer's);
- ``edp``: the ``DP * CP / EP`` ranks holding the same experts (the expert weights' gradient and
  ZeRO group).

Each group is given as runs ``(size, stride)`` of the rank numbering, innermost first
(:meth:`Mesh.runs`): its members are ``base + sum_k i_k * stride_k`` for ``0 <= i_k < size_k``, the
first run varying fastest. That is the one formula from which coordinates, group members and
the order of every group's members follow here, and from which the cost model places groups.

:meth:`Mesh.build` creates every process group in one deterministic order (``new_group`` is
collective: every rank must create every group, in the same order) and returns them as a
:class:`MeshGroups`. This module imports the standard library and errors.py only (torch.distributed
inside :meth:`Mesh.build` and :meth:`MeshGroups.submesh`), so that the cost model prices with it
without torch and a standalone folder runs it with torch alone.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .errors import ConfigError

AXES = ("pp", "dp", "cp", "tp")
"""The mesh's axes, outermost first (the order of the device mesh's dimensions)."""

GROUPS = ("tp", "cp", "ep", "dp", "edp", "pp")
"""The groups a mesh names (see the module docstring)."""

Run = tuple[int, int]
"""``(size, stride)``: ``size`` ranks ``stride`` apart."""


class MeshError(ConfigError):
    """Degrees or coordinates that do not make a mesh; the message says what to change (a ConfigError, so a
    ValueError too)."""


@dataclass(frozen=True, kw_only=True)
class Coords:
    """A rank's place on the mesh: its coordinate on each axis, and ``ep = dp mod EP``."""

    pp: int
    dp: int
    cp: int
    tp: int
    ep: int


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The degrees of a parallel configuration, validated: ``pp * dp * cp * tp`` ranks, ``ep`` dividing ``dp``."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in (*AXES, "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MeshError(f"mesh degree {name}={value!r} must be an integer >= 1: pass {name}=1 for no "
                                f"{name} parallelism")
        if self.dp % self.ep:
            raise MeshError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism splits the experts over "
                            "data-parallel replicas; raise dp to a multiple of ep or lower ep")

    @classmethod
    def of(cls, config: Any) -> "Mesh":
        """The mesh of anything with ``pp``, ``dp``, ``cp``, ``tp``, ``ep`` degrees (a ParallelConfig)."""
        return cls(pp=config.pp, dp=config.dp, cp=config.cp, tp=config.tp, ep=config.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def __str__(self) -> str:
        return " x ".join(f"{a}={getattr(self, a)}" for a in AXES) + (f" (ep={self.ep})" if self.ep > 1 else "")

    # --- the layout ---------------------------------------------------------------------------
    def runs(self, group: str) -> tuple[Run, ...]:
        """The runs ``(size, stride)`` of ``group``'s members, innermost first; adjacent runs that
        continue each other are joined and runs of one rank left out (so a group of one rank has none)."""
        tp, cp, dp, ep = self.tp, self.cp, self.dp, self.ep
        parts: dict[str, tuple[Run, ...]] = {
            "tp": ((tp, 1),),
            "cp": ((cp, tp),),
            "ep": ((ep, tp * cp),),
            "dp": ((cp, tp), (dp, tp * cp)),
            "edp": ((cp, tp), (dp // ep, tp * cp * ep)),
            "pp": ((self.pp, tp * cp * dp),),
        }
        if group not in parts:
            raise MeshError(f"unknown mesh group {group!r}: name one of {', '.join(GROUPS)}")
        out: list[Run] = []
        for size, stride in parts[group]:
            if size == 1:
                continue
            if out and out[-1][0] * out[-1][1] == stride:
                out[-1] = (out[-1][0] * size, out[-1][1])
            else:
                out.append((size, stride))
        return tuple(out)

    def size(self, group: str) -> int:
        """Ranks in each of ``group``'s groups."""
        return math.prod(size for size, _ in self.runs(group))

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank!r} is not on the mesh {self}: ranks are 0 .. {self.world_size - 1}")

    def coords(self, rank: int) -> Coords:
        """``rank``'s coordinates."""
        self._check_rank(rank)
        c = {}
        for axis in AXES:
            size, stride = self._axis_run(axis)
            c[axis] = (rank // stride) % size
        return Coords(**c, ep=c["dp"] % self.ep)

    def _axis_run(self, axis: str) -> Run:
        stride = math.prod(getattr(self, a) for a in AXES[AXES.index(axis) + 1:])
        return getattr(self, axis), stride

    def rank(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The rank at those coordinates."""
        out = 0
        for axis, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            size, stride = self._axis_run(axis)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise MeshError(f"coordinate {axis}={value!r} is off the mesh {self}: it must be in 0 .. {size - 1}")
            out += value * stride
        return out

    def group_ranks(self, group: str, rank: int) -> tuple[int, ...]:
        """The members of ``rank``'s ``group``, in the group's order (the first run fastest)."""
        self._check_rank(rank)
        runs = self.runs(group)
        base = rank - sum(((rank // stride) % size) * stride for size, stride in runs)
        return _members(base, runs)

    def groups(self, group: str) -> list[tuple[int, ...]]:
        """Every ``group`` of the mesh (they partition the ranks), ordered by their lowest rank."""
        seen: set[int] = set()
        out = []
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.group_ranks(group, rank)
                seen.update(members)
                out.append(members)
        return out

    def stage_groups(self, stages: Sequence[int]) -> list[tuple[int, ...]]:
        """For pipeline stages ``stages`` (a tied parameter's holders), the group of their ranks at
        every (dp, cp, tp) position, ordered by position."""
        stages = tuple(stages)
        for s in stages:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.pp:
                raise MeshError(f"pipeline stage {s!r} is not on the mesh {self}: stages are 0 .. {self.pp - 1}")
        _, stride = self._axis_run("pp")
        return [tuple(base + s * stride for s in stages) for base in range(stride)]

    def grid(self, groups: Sequence[str], rank: int) -> list:
        """The ranks of ``rank``'s ``groups`` as a nested list, the first group outermost: e.g. for
        ``("ep", "edp")`` a row per member of its ep group, each that member's edp group (the ``mesh``
        argument of ``DeviceMesh.from_group``)."""
        if not groups:
            return rank
        return [self.grid(groups[1:], r) for r in self.group_ranks(groups[0], rank)]

    # --- process groups -----------------------------------------------------------------------
    def build(self, device_type: str, *, experts: bool = False, tied: Iterable[Sequence[int]] = ()) -> "MeshGroups":
        """Every process group this mesh runs over, created on every rank in one order: the device
        mesh ``(pp, dp, cp, tp)`` (its tp dimension is what DTensors shard over, its flattened
        ``dp x cp`` what FSDP2 shards over); with ``experts``, the ep groups and the edp groups (with
        ep == 1 the edp group is the dp group, whose mesh serves); then
        for each set of pipeline stages in ``tied`` (sorted), a group at every (dp, cp, tp) position.
        Collective: every rank calls it with the same arguments."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        world = dist.get_world_size()
        if world != self.world_size:
            raise MeshError(f"the mesh {self} has {self.world_size} ranks but {world} were launched: launch "
                            f"{self.world_size} processes (torchrun --nproc-per-node ...), or re-plan for {world}")
        rank = dist.get_rank()
        root = init_device_mesh(device_type, tuple(getattr(self, a) for a in AXES), mesh_dim_names=AXES)
        dp = root["dp"] if self.cp == 1 else root["dp", "cp"]._flatten("dp_cp")
        created: dict[str, Any] = {}
        if experts and self.ep > 1:
            for name in ("ep", "edp"):
                for members in self.groups(name):
                    group = dist.new_group(list(members))
                    if rank in members:
                        created[name] = group
        ep_group = created.get("ep")
        edp = DeviceMesh.from_group(created["edp"], device_type) if "edp" in created else dp if experts else None
        out_tied = {}
        for stages in sorted({tuple(s) for s in tied}):
            for members in self.stage_groups(stages):
                group = dist.new_group(list(members))
                if rank in members:
                    out_tied[stages] = group
        return MeshGroups(mesh=self, rank=rank, device_type=device_type, device_mesh=root,
                          tp=root["tp"] if self.tp > 1 else None, dp=dp, ep=ep_group, edp=edp, tied=out_tied)


def _members(base: int, runs: Sequence[Run]) -> tuple[int, ...]:
    ranges = [range(0, size * stride, stride) for size, stride in reversed(runs)]
    return tuple(base + sum(offsets) for offsets in itertools.product(*ranges))


@dataclass(frozen=True, kw_only=True)
class MeshGroups:
    """One rank's process groups of a :class:`Mesh` (:meth:`Mesh.build`)."""

    mesh: Mesh
    rank: int
    device_type: str
    device_mesh: Any
    """The ``(pp, dp, cp, tp)`` DeviceMesh."""
    tp: Any
    """Its tp dimension (a 1-D DeviceMesh, what tensor-parallel DTensors live on); None when tp == 1."""
    dp: Any
    """The 1-D DeviceMesh of the ``dp`` group (the dp x cp replicas: FSDP2 shards dense weights over it)."""
    ep: Any
    """The ep process group; None when ep == 1 or experts were not asked for."""
    edp: Any
    """The 1-D DeviceMesh of the edp group (FSDP2 shards expert weights over it); None without experts."""
    tied: Mapping[tuple[int, ...], Any] = field(default_factory=dict)
    """Pipeline stages -> the process group of their ranks at this rank's (dp, cp, tp) position."""

    @property
    def coords(self) -> Coords:
        return self.mesh.coords(self.rank)

    def group(self, name: str) -> Any:
        """The process group of this rank's ``name`` group ("tp", "cp", "dp", "pp", "ep", "edp"); None
        when that group is this rank alone (no collective to run) or was not built (ep, edp without
        ``experts``)."""
        return None if self.mesh.size(name) == 1 else self._built(name)

    def _built(self, name: str) -> Any:
        if name == "ep":
            return self.ep
        if name in ("dp", "edp"):
            mesh = getattr(self, name)
            return None if mesh is None else mesh.get_group()
        if name not in AXES:
            raise MeshError(f"unknown mesh group {name!r}: name one of {', '.join(GROUPS)}")
        return self.device_mesh[name].get_group()

    def ranks(self, name: str) -> tuple[int, ...]:
        """The members of this rank's ``name`` group."""
        return self.mesh.group_ranks(name, self.rank)

    def submesh(self, names: Sequence[str]) -> Any:
        """A DeviceMesh over this rank's ``names`` groups, the first outermost, from the groups built
        (``DeviceMesh.from_group``: no new process group)."""
        from torch.distributed.device_mesh import DeviceMesh
        groups = [self._built(n) for n in names]
        if any(g is None for g in groups):
            raise MeshError(f"a device mesh over {tuple(names)} needs each of those groups built (mesh {self.mesh}: "
                            "build(..., experts=True) for ep and edp)")
        return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], self.device_type,
                                     mesh=self.mesh.grid(names, self.rank), mesh_dim_names=tuple(names))
