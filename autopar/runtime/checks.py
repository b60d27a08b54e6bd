"""What ``parallelize`` checks: a real model, a plan for this world, and the plan's model."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from ..capture import OpGraph, first_difference
from ..errors import ConfigError, PlanMismatchError
from ..plan import Plan


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def check_world(plan: Plan) -> None:
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan must be an autopar.Plan (from autopar.plan or autopar.load_plan), "
                          f"got {type(plan).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("parallelize needs an initialised process group: run under torchrun and call "
                          "torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    if world != plan.devices:
        raise PlanMismatchError(f"the plan is for {plan.devices} devices ({plan.config.short()}) but the process "
                                f"group has {world} ranks: launch {plan.devices} ranks (torchrun --nproc-per-node "
                                f"{plan.devices}) or re-plan for a {world}-device cluster")


def check_structure(plan: Plan, graph: OpGraph) -> None:
    """The model exported here is the one the plan was made for: the same layers, the same ops the plan
    relies on in each, the same parameter names and shapes (capture/structure.py), whatever device,
    example batch and mode each was exported on, at and in."""
    if plan.structure is None:
        raise PlanMismatchError(f"the plan (schema {plan.schema_version}) was made by an older autopar, whose "
                                "model fingerprint this one does not compute: re-plan with autopar.plan")
    if plan.fingerprint == graph.fingerprint:
        return
    where = first_difference(plan.structure, graph.structure) or "their fingerprints differ"
    raise PlanMismatchError(
        f"the plan was made for a model with fingerprint {plan.fingerprint} ({plan.model_name}), but "
        f"{graph.model_name} here has {graph.fingerprint}: {where} (another config, or another loss_fn?); "
        "re-plan with autopar.plan on this model")
