"""Plan exports: a plan written in the configuration each training stack reads.

``export(plan, "torchtitan" | "megatron" | "deepspeed" | "accelerate")`` returns an :class:`Export`:
the file's text (torchtitan's JobConfig TOML, Megatron-LM's command-line arguments as a bash file,
a DeepSpeed config JSON, an accelerate FSDP2 config YAML), every written value as a :class:`Field`
traced to the plan fields it came from and to the stack's documentation of the key, and the warnings:
what the stack cannot express of the plan (per-stage recomputation, a partition it cannot place, ZeRO
with a pipeline where it forbids them, context parallelism where it has none, ...), each saying what
was written instead and what that costs. Nothing of the plan is dropped without a warning; where the
format has comments the warnings open the file too.

One module per stack (torchtitan.py, megatron.py, deepspeed.py, accelerate.py) opens with the
mapping; common.py holds the field type and the facts of a plan they share. ``Plan.export`` and
``autopar export PLAN --to STACK`` call :func:`export`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .common import Export, Field

if TYPE_CHECKING:
    from ..plan import Plan

STACKS: tuple[str, ...] = ("torchtitan", "megatron", "deepspeed", "accelerate")


def export(plan: "Plan", stack: str, path: str | os.PathLike | None = None) -> Export:
    """``plan`` in ``stack``'s configuration; written to ``path`` too when given."""
    from ..plan import Plan
    if not isinstance(plan, Plan):
        raise ConfigError(f"export() takes an autopar.Plan, got {type(plan).__name__}")
    if stack not in STACKS:
        raise ConfigError(f"unknown stack {stack!r}: export to one of {', '.join(STACKS)}")
    if len(plan.stages) != plan.config.pp or any(len(s.chunks) != plan.config.virtual_stages for s in plan.stages):
        raise ConfigError(f"the plan's stages do not match its config ({len(plan.stages)} stages for pp="
                          f"{plan.config.pp}): re-create the plan with autopar.plan or autopar.estimate")
    if plan.precision.storage == "fp64":
        raise ConfigError(f"this plan trains in float64 (Precision(compute='fp64')), which {stack} has no setting "
                          "for (its trainers run fp32, bf16, fp16 or fp8): re-plan with Precision(compute='fp32') to "
                          "export it, or run it as it is with autopar.parallelize or autopar.codegen.emit")
    if stack == "torchtitan":
        from .torchtitan import export as write
    elif stack == "megatron":
        from .megatron import export as write
    elif stack == "deepspeed":
        from .deepspeed import export as write
    else:
        from .accelerate import export as write
    result = write(plan)
    if path is not None:
        result.write(path)
    return result


__all__ = ["STACKS", "Export", "Field", "export"]
