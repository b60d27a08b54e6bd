"""The autopar error hierarchy.

Every message names the offending value, node, field or rank and says what to
change. Callers catch :class:`AutoparError` for anything autopar raises on
purpose; anything else escaping is a bug.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class ConfigError(AutoparError, ValueError):
    """A configuration, cluster spec or argument value is invalid."""


class CaptureError(AutoparError):
    """The model could not be captured into an OpGraph (export failed, inputs do not fit)."""


class InfeasiblePlanError(AutoparError):
    """No parallel plan fits the cluster (memory, divisibility)."""


class PlanFormatError(AutoparError):
    """A plan file is malformed, truncated or of an unsupported schema version."""


class PlanMismatchError(AutoparError):
    """A plan was made for another model or another number of devices."""


class RuntimeFailure(AutoparError):
    """A distributed run failed: a rank died, a collective timed out, a loss was not finite."""


class NoisyProfileError(AutoparError):
    """A measurement of this machine was taken under other processes' load (``strict=True`` refuses it)."""


class NoisyProfileWarning(UserWarning):
    """A measurement of this machine was taken under other processes' load, so the plans priced with it
    may be off (autopar/conditions.py says when a measurement is noisy). Turn it into an error with
    ``warnings.simplefilter("error", autopar.NoisyProfileWarning)`` or ``strict=True``."""
