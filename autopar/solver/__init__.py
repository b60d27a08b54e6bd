"""Solver: the fastest plan that fits (outer search, stage DP, per-op sharding ILP).

- ``plan_search.solve``: wiring, OpGraph + Cluster + global batch -> Plan; ``price``: one
  configuration priced the same way (``solve`` with every field pinned), what ``estimate`` returns;
- ``search``: best-first branch and bound over the configuration space (``space``);
- ``stages``: the exact stage-partition DP with per-stage memory and recompute;
- ``sharding`` (+ ``sharding_problem``, ``sharding_layout``, ``strategies``): the per-op ILP.
"""

from __future__ import annotations

from .plan_search import price, solve
from .sharding_solver import ShardingSolver

__all__ = ["solve", "price", "ShardingSolver"]
