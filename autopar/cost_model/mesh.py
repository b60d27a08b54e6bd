"""A configuration on a cluster: whether it is valid for the model and batch (:func:`check_config`),
and the communication groups of its mesh placed on the topology (:func:`mesh_groups`), which the
estimator prices and the search's placement check (solver/space.py) reads."""

from __future__ import annotations

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import ParallelConfig
from ..errors import ConfigError
from . import context_parallel, expert_parallel
from ..runtime.mesh import GROUPS, Mesh
from ..runtime.schedules import check_micro_batches
from .comm import GroupPlacement, place_run


def check_config(graph: OpGraph, cluster: Cluster, cfg: ParallelConfig, global_batch_size: int) -> int:
    """Validate the config against cluster and batch; return micro-batches per pipeline."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size!r} must be a positive integer")
    if cfg.devices != cluster.devices:
        raise ConfigError(f"dp*cp*tp*pp = {cfg.dp}*{cfg.cp}*{cfg.tp}*{cfg.pp} = {cfg.devices} devices, but the "
                          f"cluster {cluster.describe()} has {cluster.devices}: make the product equal the device count")
    for reason in (context_parallel.unsupported(graph, cfg.cp), expert_parallel.unsupported(graph, cfg.ep)):
        if reason is not None:
            raise ConfigError(reason)
    per_step = cfg.dp * cfg.micro_batch_size
    if global_batch_size % per_step:
        raise ConfigError(f"global_batch_size={global_batch_size} does not divide into dp={cfg.dp} replicas x "
                          f"micro_batch_size={cfg.micro_batch_size}: use a global batch that is a multiple of "
                          f"{per_step}, or change dp / micro_batch_size")
    chunks = cfg.pp * cfg.virtual_stages
    blocks = sum(1 for layer in graph.layers if layer.is_block)
    if cfg.virtual_stages > 1 and chunks > blocks:
        raise ConfigError(f"{cfg.schedule} schedule with pp={cfg.pp} x virtual_stages={cfg.virtual_stages} = {chunks} "
                          f"chunks, but the model has only {blocks} repeated layers: pick virtual_stages of at most "
                          f"{max(1, blocks // cfg.pp)} so that every chunk holds one")
    m = global_batch_size // per_step
    check_micro_batches(cfg.schedule, cfg.pp, m)
    if chunks > len(graph.layers):
        raise ConfigError(f"pp*virtual_stages = {chunks} chunks but the model has only {len(graph.layers)} layers: "
                          "lower pp or virtual_stages")
    return global_batch_size // per_step


def mesh_groups(cluster: Cluster, cfg: ParallelConfig) -> dict[str, GroupPlacement]:
    """Every group a config communicates over, as :class:`autopar.runtime.mesh.Mesh` names and lays
    them out (the runtime builds the same ranks): "tp", "cp", "ep", "pp", "dp" (the ``dp * cp`` ranks
    reducing dense gradients) and "edp" (the ``dp * cp / ep`` ranks holding the same experts), each
    placed on the topology by :func:`.comm.place_run`.

    A group that is one run of the rank numbering is placed as it is. One that is not (the edp
    group with cp > 1 and ep > 1: runs of cp ranks, ``ep * cp`` apart) is placed as one run of its
    size over the same span, its ranks evenly apart: never closer than they are."""
    mesh = Mesh.of(cfg)
    if mesh.world_size != cluster.devices:
        raise ConfigError(f"mesh degrees {mesh} multiply to {mesh.world_size} but the cluster has "
                          f"{cluster.devices} devices: choose degrees whose product is {cluster.devices}")
    out = {}
    for name in GROUPS:
        runs = mesh.runs(name)
        size = mesh.size(name)
        stride = runs[-1][0] * runs[-1][1] // size if runs else 1
        out[name] = place_run(cluster, size, stride)
    return out
