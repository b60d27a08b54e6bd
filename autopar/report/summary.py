"""``Plan.summary()``: the plan as a plain-text table."""

from __future__ import annotations

from ..plan import Plan, TimeBreakdown
from .format import (BREAKDOWN_LABELS, GB, OPTIONAL_BREAKDOWN, flops_rate, gigabytes, heading, interval_line,
                     layer_span, percent, seconds, stage_layers, throughput)

BAR_WIDTH = 20


def summarize(plan: Plan) -> str:
    """Configuration; step time, its error bar and its breakdown on the critical path; memory per stage by kind
    against the device's memory; MFU; the search; the per-op sharding; runners-up; notes."""
    lines = _header(plan) + _breakdown(plan) + _memory(plan) + _search(plan) + _sharding(plan)
    if plan.cluster.profile_warning:
        lines.insert(1, f"  WARNING        {plan.cluster.profile_warning}")
    if plan.alternatives:
        lines.append("runners-up (plan.explain() says why each lost):")
        lines += [f"  {a.config.short():<62} {a.reason}" for a in plan.alternatives]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _header(plan: Plan) -> list[str]:
    c = plan.config
    device = plan.cluster.device
    fits = "" if plan.fits else f"   DOES NOT FIT ({gigabytes(plan.peak_memory - device.memory)} over)"
    return [
        f"{heading(plan)} for {plan.model_name} on {plan.cluster.describe()}",
        f"  configuration  {c.short()}",
        f"  batch          global {plan.global_batch_size} = dp {c.dp} x {plan.micro_batches} micro-batches x "
        f"{c.micro_batch_size} per micro-batch; precision {plan.precision.compute}, {plan.precision.kernels_name} kernels",
        f"  step time      {seconds(plan.step_time)}   throughput {throughput(plan)}   "
        f"{flops_rate(plan.tflops_per_device * 1e12)} per device   MFU {percent(plan.mfu)}",
        f"  error bar      {interval_line(plan.step_time_interval())}",
        f"  peak memory    {gigabytes(plan.peak_memory)} of {gigabytes(device.memory)} per device "
        f"({percent(plan.peak_memory / device.memory)}){fits}",
    ]


def _breakdown(plan: Plan) -> list[str]:
    lines = ["step time breakdown (the critical path: the slowest pipeline device):"]
    for name in TimeBreakdown.__annotations__:
        value = getattr(plan.breakdown, name)
        if name in OPTIONAL_BREAKDOWN and not value:
            continue
        share = value / plan.step_time if plan.step_time else 0.0
        bar = "#" * round(share * BAR_WIDTH)
        lines.append(f"  {BREAKDOWN_LABELS[name]:<38} {seconds(value):>10} {percent(share):>6}  {bar}")
    return lines


def _memory(plan: Plan) -> list[str]:
    limit = plan.cluster.device.memory
    lines = [f"memory per device by stage (GB; each device has {limit / GB:.0f} GB):",
             f"  {'stage':>5} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'buffers':>7} {'total':>7} "
             f"{'of dev':>6} {'in-flight':>9}  layers"]
    for s in plan.stages:
        m = s.memory
        over = "  OVER" if m.total > limit else ""
        lines.append(f"  {s.index:>5} {m.params / GB:7.2f} {m.grads / GB:7.2f} {m.optimizer / GB:7.2f} "
                     f"{m.activations / GB:7.2f} {m.buffers / GB:7.2f} {m.total / GB:7.2f} {m.total / limit:6.0%} "
                     f"{s.in_flight:>9}  {stage_layers(plan, s.index)}{over}")
    return lines


def _search(plan: Plan) -> list[str]:
    if plan.optimal is None:
        return ["search         none: an estimate of the configuration given"]
    search = plan.extra.get("search", {})
    verdict = "optimal under the cost model" if plan.optimal else "best found, NOT proven optimal"
    return [f"search         {verdict}; layout {plan.extra.get('layout', '?')}; "
            f"{search.get('candidates', '?')} candidates, {search.get('evaluated', '?')} evaluated, "
            f"{search.get('pruned_by_bound', '?')} pruned by the step-time bound, "
            f"{search.get('pruned_by_memory', '?')} by the memory bound"]


def _sharding(plan: Plan) -> list[str]:
    """One line per layer group: each weight-bearing op's tensor-parallel strategy."""
    if not plan.sharding:
        return []
    lines = [f"tensor-parallel sharding (tp={plan.config.tp}):"]
    for group in plan.sharding:
        ops = [f"{op.id.module.removeprefix('*.') if op.id.module != '*' else op.id.layer}={op.strategy}"
               for op in group.ops if op.params]
        lines.append(f"  {layer_span(group.layers)}: {', '.join(dict.fromkeys(ops)) or 'no weights'}")
    return lines
