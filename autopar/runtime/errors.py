"""The error types the runtime library raises: autopar's own (autopar/errors.py, stdlib only).

A standalone folder's copy of the library (``autopar_runtime/``, :func:`autopar.runtime.vendor`) gets
autopar/errors.py itself in this module's place, so the same failures raise the same types there."""

from ..errors import AutoparError, ConfigError, PlanMismatchError, RuntimeFailure

__all__ = ["AutoparError", "ConfigError", "PlanMismatchError", "RuntimeFailure"]
