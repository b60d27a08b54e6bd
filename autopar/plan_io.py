"""Plan <-> JSON dictionaries, and the plain-text summary."""

from __future__ import annotations

from typing import Any, Mapping

from .cluster import Cluster
from .config import ParallelConfig, Precision
from .cost_model.memory import MemoryBreakdown
from .errors import AutoparError, PlanFormatError
from .plan import SCHEMA_VERSION, Alternative, Plan, Stage, TimeBreakdown

_GB = 1e9


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
    if not isinstance(version, int) or version > SCHEMA_VERSION:
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
            breakdown=TimeBreakdown(**{k: float(_require(b, k, "breakdown.")) for k in TimeBreakdown.__annotations__}),
            stages=stages, fits=bool(_require(data, "fits", "")), notes=tuple(data.get("notes", ())),
            optimal=data.get("optimal"), schema_version=version, extra=dict(data.get("extra", {})),
            alternatives=tuple(_alternative(a, i) for i, a in enumerate(data.get("alternatives", ()))),
            sharding=tuple(dict(g) for g in data.get("sharding", ())))
    except PlanFormatError:
        raise
    except (AutoparError, TypeError, ValueError, KeyError) as exc:
        raise PlanFormatError(f"plan file has an invalid value: {exc}; re-create it with plan.save()") from None


def _alternative(a: Mapping[str, Any], i: int) -> Alternative:
    where = f"alternatives[{i}]."
    return Alternative(config=ParallelConfig.from_dict(_require(a, "config", where)),
                       step_time=float(_require(a, "step_time", where)),
                       peak_memory=float(_require(a, "peak_memory", where)), fits=bool(_require(a, "fits", where)),
                       reason=str(_require(a, "reason", where)))


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
        memory=MemoryBreakdown(**{k: float(_require(mem, k, where + "memory."))
                                  for k in ("params", "grads", "optimizer", "activations", "buffers")}))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.1f} ms"


def _layer_span(names: tuple[str, ...]) -> str:
    """"blocks.0 .. blocks.7 (8 layers)" for a contiguous run; interleaved stages show one per chunk."""
    if not names:
        return "-"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} layers)"


def _sharding_lines(plan: Plan) -> list[str]:
    """One line per layer group: each weight-bearing op's tensor-parallel strategy."""
    if not plan.sharding:
        return []
    lines = [f"  tensor-parallel sharding (tp={plan.config.tp}):"]
    for group in plan.sharding:
        layers = group.get("layers", [])
        prefix = layers[0] + "." if layers else ""
        ops = []
        for op in group.get("ops", []):
            params = list(op.get("params", {}))
            if not params:
                continue
            module = op.get("module") or params[0].rsplit(".", 1)[0]
            module = module[len(prefix):] if module.startswith(prefix) else module
            ops.append(f"{module}={op.get('strategy')}")
        span = _layer_span(tuple(layers))
        lines.append(f"    {span}: {', '.join(dict.fromkeys(ops)) or 'no weights'}")
    return lines


def summarize(plan: Plan) -> str:
    """A plain-text table: configuration, step time breakdown, memory per stage."""
    c, b = plan.config, plan.breakdown
    lines = [
        f"autopar plan for {plan.model_name} on {plan.cluster.describe()}",
        f"  config      {c.short()}",
        f"  batch       global {plan.global_batch_size}, {plan.micro_batches} micro-batches of {c.micro_batch_size} "
        f"per pipeline, precision {plan.precision.compute}",
        f"  step time   {plan.step_time:.4g} s   throughput {plan.throughput:.4g} samples/s   "
        f"{plan.tflops_per_device:.1f} TFLOP/s per device   MFU {plan.mfu * 100:.1f}%",
        f"  peak memory {plan.peak_memory / _GB:.2f} GB of {plan.cluster.device.memory / _GB:.0f} GB"
        + ("" if plan.fits else "   DOES NOT FIT"),
        "  step time breakdown (critical path):",
    ]
    for name in TimeBreakdown.__annotations__:
        value = getattr(b, name)
        share = value / plan.step_time * 100 if plan.step_time else 0.0
        lines.append(f"    {name:<10} {_ms(value)}  {share:5.1f}%")
    lines.append("  stages (per device, memory in GB):")
    lines.append(f"    {'stage':>5}  {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'buffers':>7} "
                 f"{'total':>7}  {'in-flight':>9}  layers")
    for s in plan.stages:
        m = s.memory
        lines.append(f"    {s.index:>5}  {m.params / _GB:7.2f} {m.grads / _GB:7.2f} {m.optimizer / _GB:7.2f} "
                     f"{m.activations / _GB:7.2f} {m.buffers / _GB:7.2f} {m.total / _GB:7.2f}  {s.in_flight:>9}  "
                     f"{' | '.join(_layer_span(c) for c in s.chunks if c) or _layer_span(s.layers)}")
    if plan.optimal is not None:
        search = plan.extra.get("search", {})
        lines.append(f"  search      {'optimal under the cost model' if plan.optimal else 'best found, NOT proven optimal'}"
                     f"; layout {plan.extra.get('layout', '?')}; {search.get('candidates', '?')} candidates, "
                     f"{search.get('evaluated', '?')} evaluated")
    lines.extend(_sharding_lines(plan))
    if plan.alternatives:
        lines.append("  alternatives considered:")
        for a in plan.alternatives:
            lines.append(f"    {a.config.short():<60} {a.reason}")
    for note in plan.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
