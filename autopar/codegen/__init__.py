"""Codegen: a plan as a readable torchrun training script (the per-rank program is runtime/)."""

from .emit import emit, render

__all__ = ["emit", "render"]
