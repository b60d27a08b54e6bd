"""autopar: plan how to train a PyTorch model on a cluster, and run that plan."""

from .api import estimate, plan
from .cluster import Cluster
from .hardware import Device, Link
from .config import ParallelConfig, Precision
from .errors import (AutoparError, CaptureError, ConfigError, InfeasiblePlanError, PlanFormatError,
                     PlanMismatchError, RuntimeFailure)
from .plan import Alternative, Plan, load_plan
from .runtime.checkpoint import load_checkpoint
from .codegen.sharded_init import init_weights
from .runtime.program import Program, parallelize
from .sweep import Sweep, SweepRow, sweep  # autopar.sweep is the function, as autopar.plan is plan()

__all__ = ["plan", "estimate", "sweep", "Sweep", "SweepRow", "parallelize", "Program", "load_checkpoint", "init_weights", "Cluster", "Device", "Link", "ParallelConfig", "Precision", "Plan", "Alternative", "load_plan",
           "AutoparError", "CaptureError", "ConfigError", "InfeasiblePlanError", "PlanFormatError",
           "PlanMismatchError", "RuntimeFailure"]
__version__ = "0.1.0"
