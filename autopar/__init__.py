"""autopar: plan how to train a PyTorch model on a cluster, and run that plan.

The public names below load on first use (PEP 562), as do the subpackages (``autopar.codegen``), so ``import autopar`` and the ``autopar``
command's ``--help`` import no torch; ``autopar.plan``, ``from autopar import Plan`` and
``dir(autopar)`` work as for names bound at import. This facade is the one place where a name is
imported lazily on purpose (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_SOURCES: dict[str, str] = {
    "plan": "api", "estimate": "api", "sweep": "sweep", "Sweep": "plan.sweep", "SweepRow": "plan.sweep",
    "parallelize": "driver.program", "Program": "driver.program", "load_checkpoint": "driver.checkpoint",
    "init_weights": "runtime.sharded_init", "Cluster": "cluster", "Device": "hardware", "Link": "hardware",
    "ParallelConfig": "config", "Precision": "config", "Plan": "plan", "Alternative": "plan", "load_plan": "plan",
    **{name: "errors" for name in ("AutoparError", "CaptureError", "ConfigError", "InfeasiblePlanError",
                                   "PlanFormatError", "PlanMismatchError", "RuntimeFailure", "NoisyProfileError",
                                   "NoisyProfileWarning")},
}
"""Each public name and the module (under autopar) that defines it."""

__all__ = list(_SOURCES)

if TYPE_CHECKING:   # what type checkers and IDEs see: the same names, bound eagerly
    from .api import estimate, plan
    from .cluster import Cluster
    from .runtime.sharded_init import init_weights
    from .config import ParallelConfig, Precision
    from .errors import (AutoparError, CaptureError, ConfigError, InfeasiblePlanError, NoisyProfileError,
                         NoisyProfileWarning, PlanFormatError, PlanMismatchError, RuntimeFailure)
    from .hardware import Device, Link
    from .plan import Alternative, Plan, load_plan
    from .driver.checkpoint import load_checkpoint
    from .driver.program import Program, parallelize
    from .plan.sweep import Sweep, SweepRow
    from .sweep import sweep


def __getattr__(name: str) -> Any:
    """A public name, loaded from its module; or a subpackage (``autopar.codegen.emit``), imported."""
    source = _SOURCES.get(name)
    if source is not None:
        value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")   # the import binds it on this package
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))


class _Facade(types.ModuleType):
    """``autopar.plan`` and ``autopar.sweep`` are functions that share their names with the submodules
    autopar/plan.py and autopar/sweep.py. Importing a submodule binds it on its package; for these two
    names the function stays the public name (``from autopar.plan import Plan`` still reads the module)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SOURCES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
