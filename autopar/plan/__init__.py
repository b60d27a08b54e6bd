"""The plan: a typed, frozen, versioned record of how to train a model on a cluster.

``record`` holds :class:`Plan` and its parts, ``io`` the strict JSON reader, ``sharding`` the per-op
tensor-parallel record (OpId, OpSharding, ShardingGroup), ``placement`` the one placement vocabulary
(Replicate, Shard(dim), Partial), ``interval`` the error bars read from the recorded validation residuals
(StepInterval, RatioInterval). ``autopar.plan`` the *function* plans; ``autopar.plan`` the package
is this record (autopar/__init__.py keeps the function the public name).
"""

from .interval import RatioInterval, StepInterval
from .io import load_plan
from .placement import Partial, Placement, Replicate, Shard, placement_from_json
from .record import (SCHEMA_VERSION, Alternative, MemoryBreakdown, Plan, Stage, TimeBreakdown,
                     sequence_tokens)
from .sharding import OpId, OpSharding, ShardingGroup

__all__ = ["SCHEMA_VERSION", "Alternative", "MemoryBreakdown", "OpId", "OpSharding", "Partial", "Placement", "Plan",
           "RatioInterval", "Replicate", "Shard", "ShardingGroup", "Stage", "StepInterval", "TimeBreakdown", "load_plan",
           "placement_from_json", "sequence_tokens"]
