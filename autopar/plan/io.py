"""Plan <-> JSON dictionaries (the format: docs/plan-format.md).

Loading is strict: every field must have its documented JSON type (``"fits": "false"`` is
refused, not read as True), numbers must be finite and non-negative, and the parts must agree
with each other (the config's devices with the cluster's, the batch with the micro-batches, one
stage per pipeline stage). A file that breaks any of this was truncated or hand-edited, and
raises :class:`PlanFormatError` naming the field.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from .loss import LossSource
from .structure import ModelStructure
from ..cluster import Cluster
from ..config import ParallelConfig, Precision
from ..errors import AutoparError, PlanFormatError
from .sharding import ShardingGroup, group_from_dict, group_from_v2
from .record import SCHEMA_VERSION, Alternative, MemoryBreakdown, Plan, Stage, TimeBreakdown

_FIX = "the file is truncated or was edited; re-create it with plan.save()"


def _require(data: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise PlanFormatError(f"plan field {where.rstrip('.') or '(top level)'} must be a JSON object, got "
                              f"{type(data).__name__}: {_FIX}")
    if key not in data:
        raise PlanFormatError(f"plan file is missing field {where}{key!r}: {_FIX}")
    return data[key]


def _bad(where: str, key: str, value: Any, expected: str) -> PlanFormatError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return PlanFormatError(f"plan field {where}{key} = {shown} must be {expected}: {_FIX}")


def _int(data: Mapping[str, Any], key: str, where: str, default: Any = ..., low: int = 0) -> int:
    value = _require(data, key, where) if default is ... else data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(where, key, value, f"an integer >= {low}")
    return value


def _float(data: Mapping[str, Any], key: str, where: str, default: Any = ...) -> float:
    value = _require(data, key, where) if default is ... else data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _bad(where, key, value, "a finite number >= 0")
    return float(value)


def _bool(data: Mapping[str, Any], key: str, where: str, optional: bool = False) -> bool | None:
    value = data.get(key) if optional else _require(data, key, where)
    if not isinstance(value, bool) and not (optional and value is None):
        raise _bad(where, key, value, "true or false" + (" or null" if optional else ""))
    return value


def _str(data: Mapping[str, Any], key: str, where: str) -> str:
    value = _require(data, key, where)
    if not isinstance(value, str):
        raise _bad(where, key, value, "a string")
    return value


def _strings(value: Any, where: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(where, key, value, "a list of strings")
    return tuple(value)


def _list(data: Mapping[str, Any], key: str, where: str, optional: bool = True) -> list:
    value = data.get(key, []) if optional else _require(data, key, where)
    if not isinstance(value, list):
        raise _bad(where, key, value, "a list")
    return value


def _object(value: Any, where: str, key: str) -> dict:
    if not isinstance(value, Mapping):
        raise _bad(where, key, value, "a JSON object")
    return dict(value)


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    """Rebuild a Plan; every missing, mistyped or inconsistent field raises PlanFormatError naming it."""
    if not isinstance(data, Mapping):
        raise PlanFormatError(f"a plan file holds a JSON object, got {type(data).__name__}: {_FIX}")
    version = _require(data, "schema_version", "")
    if isinstance(version, bool) or not isinstance(version, int):
        raise PlanFormatError(f"plan schema_version {version!r} must be an integer (this autopar writes "
                              f"{SCHEMA_VERSION}): {_FIX}")
    if version > SCHEMA_VERSION:
        raise PlanFormatError(f"plan schema_version {version!r} is newer than this autopar understands "
                              f"({SCHEMA_VERSION}): upgrade autopar (pip install -U autopar) to load it")
    if version < 1:
        raise PlanFormatError(f"plan schema_version {version!r} is not supported (oldest is 1): re-create the plan")
    try:
        plan = _plan(data, version)
    except PlanFormatError:
        raise
    except (AutoparError, TypeError, ValueError, KeyError) as exc:
        raise PlanFormatError(f"plan file has an invalid value: {exc}; {_FIX}") from None
    _check_consistent(plan)
    return plan


def _plan(data: Mapping[str, Any], version: int) -> Plan:
    gap = data.get("gap")
    if gap is not None:
        gap = _float(data, "gap", "")
    return Plan(
        model_name=_str(data, "model_name", ""), fingerprint=_str(data, "fingerprint", ""),
        cluster=Cluster.from_dict(_object(_require(data, "cluster", ""), "", "cluster")),
        config=ParallelConfig.from_dict(_object(_require(data, "config", ""), "", "config")),
        precision=Precision(**_object(_require(data, "precision", ""), "", "precision")),
        global_batch_size=_int(data, "global_batch_size", "", low=1),
        micro_batches=_int(data, "micro_batches", "", low=1),
        step_time=_float(data, "step_time", ""), peak_memory=_float(data, "peak_memory", ""),
        throughput=_float(data, "throughput", ""), model_flops=_float(data, "model_flops", ""),
        hardware_flops=_float(data, "hardware_flops", ""),
        breakdown=_breakdown(_require(data, "breakdown", ""), "breakdown."),
        stages=tuple(_stage(s, i) for i, s in enumerate(_list(data, "stages", "", optional=False))),
        fits=_bool(data, "fits", ""), notes=_strings(data.get("notes", []), "", "notes"),
        optimal=_bool(data, "optimal", "", optional=True), gap=gap, schema_version=version,
        extra=_object(data.get("extra", {}), "", "extra"),
        alternatives=tuple(_alternative(a, i) for i, a in enumerate(_list(data, "alternatives", ""))),
        sharding=_sharding(data, version),
        structure=_structure(data, version), loss=_loss(data))


def _sharding(data: Mapping[str, Any], version: int) -> tuple[ShardingGroup, ...]:
    """Schema 3's typed groups; a file of schema 2 or older may hold schema 2's (ops named by ``node``: see
    plan/sharding.py ``group_from_v2``) or, written back by this autopar, typed ones."""
    out = []
    for i, g in enumerate(_list(data, "sharding", "")):
        old = version < 3 and isinstance(g, Mapping) and any(
            isinstance(op, Mapping) and "node" in op for op in g.get("ops", ()) or ())
        out.append(group_from_v2(g, f"sharding[{i}]") if old else group_from_dict(g, f"sharding[{i}]"))
    return tuple(out)


def _structure(data: Mapping[str, Any], version: int) -> ModelStructure | None:
    """Required from schema 2 on; a plan of schema 1 has none (its fingerprint hashed the exported graph)."""
    if version < 2:
        return None
    try:
        return ModelStructure.from_dict(_require(data, "structure", ""))
    except ValueError as exc:
        raise PlanFormatError(f"plan field {exc}: {_FIX}") from None


def _loss(data: Mapping[str, Any]) -> LossSource | None:
    """Optional: plans written before it was recorded have none (parallelize then refuses only a stand-in,
    which the rank's own export shows)."""
    loss = data.get("loss")
    if loss is None:
        return None
    try:
        return LossSource.from_dict(loss)
    except ValueError as exc:
        raise PlanFormatError(f"plan field {exc}: {_FIX}") from None


def _check_consistent(plan: Plan) -> None:
    """The parts of a plan agree with each other (a hand edit of one field breaks this)."""
    cfg = plan.config
    if cfg.devices != plan.cluster.devices:
        raise PlanFormatError(f"plan config {cfg.short()} uses dp*cp*tp*pp = {cfg.devices} devices but its cluster "
                              f"({plan.cluster.describe()}) has {plan.cluster.devices}: {_FIX}")
    if cfg.dp * cfg.micro_batch_size * plan.micro_batches != plan.global_batch_size:
        raise PlanFormatError(f"plan global_batch_size={plan.global_batch_size} is not dp={cfg.dp} x "
                              f"micro_batch_size={cfg.micro_batch_size} x micro_batches={plan.micro_batches}: {_FIX}")
    if plan.structure is not None and plan.structure.fingerprint != plan.fingerprint:
        raise PlanFormatError(f"plan fingerprint {plan.fingerprint} is not its structure's "
                              f"({plan.structure.fingerprint}): {_FIX}")
    if len(plan.stages) != cfg.pp:
        raise PlanFormatError(f"plan has {len(plan.stages)} stages but its config has pp={cfg.pp}: {_FIX}")
    for i, stage in enumerate(plan.stages):
        if stage.index != i:
            raise PlanFormatError(f"plan field stages[{i}].index is {stage.index}, expected {i}: {_FIX}")
        if len(stage.chunks) != cfg.virtual_stages:
            raise PlanFormatError(f"plan field stages[{i}].chunks has {len(stage.chunks)} chunks but the config has "
                                  f"virtual_stages={cfg.virtual_stages}: {_FIX}")


_OPTIONAL_BREAKDOWN = ("cp_comm", "ep_comm")   # absent in plans written before context/expert parallelism


def _breakdown(b: Any, where: str) -> TimeBreakdown:
    b = _object(b, "", where.rstrip("."))
    return TimeBreakdown(**{k: _float(b, k, where, 0.0) if k in _OPTIONAL_BREAKDOWN else _float(b, k, where)
                            for k in TimeBreakdown.__annotations__})


def _alternative(a: Any, i: int) -> Alternative:
    where = f"alternatives[{i}]."
    a = _object(a, "", where.rstrip("."))
    breakdown = a.get("breakdown")   # absent in plans written before it was recorded
    return Alternative(config=ParallelConfig.from_dict(_object(_require(a, "config", where), where, "config")),
                       step_time=_float(a, "step_time", where), peak_memory=_float(a, "peak_memory", where),
                       fits=_bool(a, "fits", where), reason=_str(a, "reason", where),
                       breakdown=None if breakdown is None else _breakdown(breakdown, where + "breakdown."))


def _stage(s: Any, i: int) -> Stage:
    where = f"stages[{i}]."
    s = _object(s, "", where.rstrip("."))
    mem = _object(_require(s, "memory", where), where, "memory")
    chunks = _list(s, "chunks", where, optional=False)
    return Stage(
        index=_int(s, "index", where), layers=_strings(_require(s, "layers", where), where, "layers"),
        chunks=tuple(_strings(c, where, f"chunks[{k}]") for k, c in enumerate(chunks)),
        param_count=_int(s, "param_count", where),
        fwd_time=_float(s, "fwd_time", where), bwd_time=_float(s, "bwd_time", where),
        recompute_time=_float(s, "recompute_time", where),
        tp_comm_time=_float(s, "tp_comm_time", where), p2p_time=_float(s, "p2p_time", where),
        in_flight=_int(s, "in_flight", where),
        activation_per_microbatch=_float(s, "activation_per_microbatch", where),
        cp_comm_time=_float(s, "cp_comm_time", where, 0.0), ep_comm_time=_float(s, "ep_comm_time", where, 0.0),
        expert_param_count=_int(s, "expert_param_count", where, 0),
        wgrad_time=_float(s, "wgrad_time", where, 0.0),
        memory=MemoryBreakdown(**{k: _float(mem, k, where + "memory.")
                                  for k in ("params", "grads", "optimizer", "activations", "buffers")}))


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a plan written by :meth:`Plan.save`; malformed or unsupported files raise PlanFormatError."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise PlanFormatError(f"cannot read plan file {os.fspath(path)!r}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFormatError(f"{os.fspath(path)!r} is not valid JSON (truncated or edited?) at line "
                              f"{exc.lineno} column {exc.colno}: {exc.msg}") from None
    return plan_from_dict(data)
