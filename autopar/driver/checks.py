"""What ``parallelize`` checks: a real model and a plan for this world (codegen/split.py: the plan's model)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

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
