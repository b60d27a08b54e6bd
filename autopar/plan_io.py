"""Plan <-> JSON dictionaries (the format: docs/plan-format.md)."""

from __future__ import annotations

from typing import Any, Mapping

from .cluster import Cluster
from .config import ParallelConfig, Precision
from .cost_model.memory import MemoryBreakdown
from .errors import AutoparError, PlanFormatError
from .plan import SCHEMA_VERSION, Alternative, Plan, Stage, TimeBreakdown



def _require(data: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(data, Mapping) or key not in data:
        raise PlanFormatError(f"plan file is missing field {where}{key!r}: the file is truncated or was edited; "
                              "re-create it with plan.save()")
    return data[key]


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    """Rebuild a Plan; every missing or malformed field raises PlanFormatError naming it."""
    if not isinstance(data, Mapping):
        raise PlanFormatError(f"a plan file holds a JSON object, got {type(data).__name__}")
    version = _require(data, "schema_version", "")
    if isinstance(version, bool) or not isinstance(version, int):
        raise PlanFormatError(f"plan schema_version {version!r} must be an integer (this autopar writes "
                              f"{SCHEMA_VERSION}): the file was edited; re-create it with plan.save()")
    if version > SCHEMA_VERSION:
        raise PlanFormatError(f"plan schema_version {version!r} is newer than this autopar understands "
                              f"({SCHEMA_VERSION}): upgrade autopar")
    if version < 1:
        raise PlanFormatError(f"plan schema_version {version!r} is not supported (oldest is 1): re-create the plan")
    try:
        stages = tuple(_stage(s, i) for i, s in enumerate(_require(data, "stages", "")))
        b = _require(data, "breakdown", "")
        return Plan(
            model_name=str(_require(data, "model_name", "")), fingerprint=str(_require(data, "fingerprint", "")),
            cluster=Cluster.from_dict(_require(data, "cluster", "")),
            config=ParallelConfig.from_dict(_require(data, "config", "")),
            precision=Precision(**_require(data, "precision", "")),
            global_batch_size=int(_require(data, "global_batch_size", "")),
            micro_batches=int(_require(data, "micro_batches", "")),
            step_time=float(_require(data, "step_time", "")), peak_memory=float(_require(data, "peak_memory", "")),
            throughput=float(_require(data, "throughput", "")), model_flops=float(_require(data, "model_flops", "")),
            hardware_flops=float(_require(data, "hardware_flops", "")),
            breakdown=_breakdown(b, "breakdown."),
            stages=stages, fits=bool(_require(data, "fits", "")), notes=tuple(data.get("notes", ())),
            optimal=data.get("optimal"), schema_version=version, extra=dict(data.get("extra", {})),
            alternatives=tuple(_alternative(a, i) for i, a in enumerate(data.get("alternatives", ()))),
            sharding=tuple(dict(g) for g in data.get("sharding", ())))
    except PlanFormatError:
        raise
    except (AutoparError, TypeError, ValueError, KeyError) as exc:
        raise PlanFormatError(f"plan file has an invalid value: {exc}; re-create it with plan.save()") from None


_OPTIONAL_BREAKDOWN = ("cp_comm", "ep_comm")   # absent in plans written before context/expert parallelism


def _breakdown(b: Mapping[str, Any], where: str) -> TimeBreakdown:
    return TimeBreakdown(**{k: float(b.get(k, 0.0) if k in _OPTIONAL_BREAKDOWN else _require(b, k, where))
                            for k in TimeBreakdown.__annotations__})


def _alternative(a: Mapping[str, Any], i: int) -> Alternative:
    where = f"alternatives[{i}]."
    breakdown = a.get("breakdown")   # absent in plans written before it was recorded
    return Alternative(config=ParallelConfig.from_dict(_require(a, "config", where)),
                       step_time=float(_require(a, "step_time", where)),
                       peak_memory=float(_require(a, "peak_memory", where)), fits=bool(_require(a, "fits", where)),
                       reason=str(_require(a, "reason", where)),
                       breakdown=None if breakdown is None else _breakdown(breakdown, where + "breakdown."))


def _stage(s: Mapping[str, Any], i: int) -> Stage:
    where = f"stages[{i}]."
    mem = _require(s, "memory", where)
    return Stage(
        index=int(_require(s, "index", where)), layers=tuple(_require(s, "layers", where)),
        chunks=tuple(tuple(c) for c in _require(s, "chunks", where)),
        param_count=int(_require(s, "param_count", where)),
        fwd_time=float(_require(s, "fwd_time", where)), bwd_time=float(_require(s, "bwd_time", where)),
        recompute_time=float(_require(s, "recompute_time", where)),
        tp_comm_time=float(_require(s, "tp_comm_time", where)), p2p_time=float(_require(s, "p2p_time", where)),
        in_flight=int(_require(s, "in_flight", where)),
        activation_per_microbatch=float(_require(s, "activation_per_microbatch", where)),
        cp_comm_time=float(s.get("cp_comm_time", 0.0)), ep_comm_time=float(s.get("ep_comm_time", 0.0)),
        expert_param_count=int(s.get("expert_param_count", 0)),
        memory=MemoryBreakdown(**{k: float(_require(mem, k, where + "memory."))
                                  for k in ("params", "grads", "optimizer", "activations", "buffers")}))
