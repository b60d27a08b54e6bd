"""Solver: the fastest plan that fits (outer search, stage DP, per-op sharding ILP)."""

from __future__ import annotations

from .plan_search import solve

__all__ = ["solve"]
