"""What a rank of ``parallelize`` needs besides a meta model's values (runtime/sharded_init.py
computes those): the exported program's meta buffers replaced by their values, a rank's piece
of a full value laid out as its DTensor is, and the one conversion from autopar's placements
(autopar/plan/placement.py) to DTensor's (:func:`dtensor_placement`)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard, distribute_tensor
from torch.export import ExportedProgram

from ..plan import placement as plan_placement

from ..runtime.sharded_init import Materializer
from ..codegen.split import empty_like_meta, meta_buffers


def materialize_buffers(program: ExportedProgram, mat: Materializer) -> None:
    """Replace the meta buffers an exported program reads with their materialised values (buffers
    are small: every rank holds every buffer its chunks read, as a real model's ranks do)."""
    for key, fqn in meta_buffers(program, type(mat.model).__name__).values():
        store = program.state_dict if key in program.state_dict else program.constants
        store[key] = mat.tensor(fqn) if fqn is not None else empty_like_meta(store[key])


def dtensor_placement(placement: plan_placement.Placement) -> Placement:
    """autopar's placement as DTensor's (a Partial sums)."""
    if isinstance(placement, plan_placement.Shard):
        return Shard(placement.dim)
    if isinstance(placement, plan_placement.Partial):
        return Partial()
    return Replicate()


def local_view(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's piece of ``full`` laid out by ``placements`` on ``mesh``: a view (no copy) where they
    are Shard and Replicate (DTensor shards with ``torch.chunk``, as FSDP2 does), else DTensor's own
    local split (``_StridedShard``: FSDP2 over a tensor-parallel split of the same dim)."""
    coord = mesh.get_coordinate()
    piece = full
    for i, placement in enumerate(placements):
        if type(placement) is Shard:
            chunks = torch.chunk(piece, mesh.size(i), dim=placement.dim)
            piece = chunks[coord[i]] if coord[i] < len(chunks) else piece.narrow(placement.dim, 0, 0)
        elif not isinstance(placement, Replicate):
            return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    return piece
