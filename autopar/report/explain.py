"""``Plan.explain()``: why this plan, read from the plan itself (a saved plan explains as well).

Every statement is computed from the plan's own numbers: the step-time breakdown, each
stage's memory by kind, the cluster's links, and the runners-up the search recorded with
their breakdowns. Nothing is re-estimated (a loaded plan has no model graph).
"""

from __future__ import annotations

from typing import Callable

from ..config import SPLIT_BACKWARD, ParallelConfig
from ..plan import Alternative, Plan, TimeBreakdown
from .compare import config_changes
from .format import BREAKDOWN_LABELS, gigabytes, peak_stage, percent, seconds, step_range, throughput

TOP_PARTS = 3
"""How many breakdown parts "where the time goes" names, and how many differences a runner-up shows."""


def explain(plan: Plan) -> str:
    """Paragraphs: the verdict, where the time goes, memory, each parallel choice, the runners-up."""
    warning = plan.cluster.profile_warning
    sections = [_verdict(plan), f"Warning: {warning}." if warning else "", _error_bar(plan), _time(plan),
                _memory(plan), _choices(plan), _runners_up(plan)]
    return "\n\n".join(s for s in sections if s)


def _verdict(plan: Plan) -> str:
    head = (f"{plan.model_name} on {plan.cluster.describe()}, global batch {plan.global_batch_size}:\n"
            f"  {plan.config.short()}: {seconds(plan.step_time)} per step, {throughput(plan)}, "
            f"MFU {percent(plan.mfu)}")
    if plan.optimal is None:
        return head + "\n  This is an estimate of the configuration you gave; autopar.plan() searches for the best."
    s = plan.extra.get("search", {})
    verdict = ("the fastest configuration that fits, under the cost model" if plan.optimal
               else "the best found before the time limit (not proven optimal)")
    fastest, tolerance = s.get("fastest_step_time"), s.get("tie_tolerance")
    if plan.optimal and fastest is not None and fastest < plan.step_time:
        verdict = (f"the configuration with the fewest moving parts among those within {percent(tolerance)} of the "
                   f"fastest that fits ({seconds(fastest)}: a tie under the cost model's error)")
    return (head + f"\n  It is {verdict}: of {s.get('candidates', '?')} configurations, "
            f"{s.get('pruned_by_memory', '?')} were ruled out because their model states alone exceed device memory, "
            f"{s.get('dominated', '?')} are dominated (GPipe holds more than 1F1B in the same time, or a layout "
            f"repeats another), {s.get('evaluated', '?')} were solved exactly (stage partition and recompute per "
            f"stage), and the remaining {s.get('pruned_by_bound', '?')} cannot beat this plan (their lower bound on "
            "step time is higher).")


def _error_bar(plan: Plan) -> str:
    """How far the predicted step time can be trusted: the interval the recorded validation errors give."""
    iv = plan.step_time_interval()
    if not iv.known:
        return (f"How sure: no interval. The step time is the cost model's prediction, and {iv.basis}; measure "
                "a few steps before relying on it.")
    return (f"How sure: a run would measure {step_range(iv)} per step, {iv.coverage:.0%} of the time, if the cost "
            f"model errs here as it did on published runs no constant was fitted on ({iv.basis}); plan.compare() "
            "says whether a difference from another plan is within that error.")


def _time(plan: Plan) -> str:
    parts = sorted(TimeBreakdown.__annotations__, key=lambda k: -getattr(plan.breakdown, k))
    named = [f"{BREAKDOWN_LABELS[k]} {seconds(getattr(plan.breakdown, k))} "
             f"({percent(getattr(plan.breakdown, k) / plan.step_time)})"
             for k in parts[:TOP_PARTS] if getattr(plan.breakdown, k) > 0]
    return "Where the time goes: " + "; ".join(named) + "."


def _memory(plan: Plan) -> str:
    peak = peak_stage(plan)
    m, limit = peak.memory, plan.cluster.device.memory
    state = "fits" if plan.fits else "DOES NOT FIT"
    return (f"Memory: the fullest device (stage {peak.index}) holds {gigabytes(m.total)} of {gigabytes(limit)} "
            f"({state}): parameters {gigabytes(m.params)}, gradients {gigabytes(m.grads)}, optimizer state "
            f"{gigabytes(m.optimizer)}, activations {gigabytes(m.activations)} ({peak.in_flight} micro-batch passes "
            f"held at once), buffers {gigabytes(m.buffers)}.")


def _choices(plan: Plan) -> str:
    lines = ["The choices:"]
    parts = [_tp(plan), _cp(plan), _pp(plan), _dp(plan), _ep(plan), _micro(plan), _recompute(plan), _offload(plan)]
    lines += [f"  - {line}" for line in parts if line]
    return "\n".join(lines)


def _without(plan: Plan, keep: Callable[[ParallelConfig], bool]) -> str:
    """What the search says of plans whose config ``keep`` holds for (without the choice): the best evaluated
    one, else the fastest bound of one that does not fit, else that the bound ruled them all out."""
    plain = [a for a in plan.alternatives if keep(a.config)]
    fitting = [a for a in plain if a.fits]
    if fitting:
        best = min(fitting, key=lambda a: a.step_time)
        return (f"the fastest plan without it the search evaluated, {best.config.short()}, takes "
                f"{seconds(best.step_time)} ({(best.step_time / plan.step_time - 1) * 100:.0f}% slower; the search "
                "stops at the bound, so a pinned search can find a faster one)")
    if plain:
        return f"without it the fastest candidates do not fit ({plain[0].reason})"
    if plan.optimal is None:
        return ""
    return ("no plan without it could be faster: each either does not fit or has a lower bound on step time "
            "above this plan's")


def _offload(plan: Plan) -> str:
    """What the plan keeps in host memory and what its step pays for it (cost_model/offload.py), and what the
    search says of the plans without offload (:func:`_without`)."""
    c, b = plan.config, plan.breakdown
    if c.offload == "none":
        return ""
    held = next((n.split(": ", 1)[1].removesuffix(", the optimizer step on the CPU") for n in plan.notes
                 if n.startswith("offload: ")), "")
    what = ("the optimizer's states and master weights live in host memory and the host's CPU steps them; "
            "each step copies the gradients to the host and the updated weights back" if c.offload == "optimizer"
            else "ZeRO-3's shards of the parameters, their gradients and the optimizer states live in host memory "
                 "and the host's CPU steps them; each shard crosses the host link before its all-gather and after "
                 "its reduce-scatter")
    why = _without(plan, lambda cfg: cfg.offload == "none")
    step = f"the optimizer step takes {seconds(b.optimizer)} ({percent(b.optimizer / plan.step_time)})"
    return f"offload {c.offload}: {what}" + (f" ({held})" if held else "") + f"; {step}" + (f"; {why}." if why else ".")


def _cp(plan: Plan) -> str:
    c, b = plan.config, plan.breakdown
    if c.cp == 1:
        return ""
    tokens = plan.extra.get("sequence_length")
    seq = f"each sequence ({tokens} tokens)" if tokens else "each sequence"
    why = _without(plan, lambda cfg: cfg.cp == 1)
    return (f"context parallel {c.cp}: {seq} is cut into {2 * c.cp} chunks, device r of {c.cp} holding chunks r and "
            f"{2 * c.cp - 1}-r, so every device does the same share of the causal attention and holds 1/{c.cp} of "
            f"the activations; keys and values travel around a ring under the attention compute, and what it does "
            f"not hide costs {seconds(b.cp_comm)} ({percent(b.cp_comm / plan.step_time)})" + (f"; {why}." if why else "."))


def _ep(plan: Plan) -> str:
    c, b = plan.config, plan.breakdown
    if c.ep == 1:
        return ""
    experts = max((s.expert_param_count for s in plan.stages), default=0)
    why = _without(plan, lambda cfg: cfg.ep == 1)
    return (f"expert parallel {c.ep}: the experts of each MoE layer are split over {c.ep} data-parallel replicas, "
            f"so a device holds 1/{c.ep} of them ({experts / 1e9:.3g}B expert parameters) and runs its experts on "
            f"{c.ep}x larger GEMMs (every replica's tokens for them); the dispatch and combine all-to-alls cost "
            f"{seconds(b.ep_comm)} ({percent(b.ep_comm / plan.step_time)}), and the expert weights synchronise "
            f"only over the {c.expert_replicas} replicas holding the same experts" + (f"; {why}." if why else "."))


def _tp(plan: Plan) -> str:
    c, cluster, b = plan.config, plan.cluster, plan.breakdown
    if c.tp == 1:
        return ("tensor parallel 1: every layer stays whole on its device, so no activation collectives are paid "
                "inside layers.")
    inside = c.tp <= cluster.devices_per_node
    link = cluster.intra_node if inside else cluster.inter_node
    where = (f"inside one node ({link.name or 'intra-node link'}, {link.bandwidth / 1e9:g} GB/s)" if inside
             else f"across nodes ({link.name or 'inter-node link'}, {link.bandwidth / 1e9:g} GB/s): a node has "
                  f"only {cluster.devices_per_node} devices")
    sp = "; sequence parallel shards the norms and dropouts along the sequence too" if c.sequence_parallel else ""
    return (f"tensor parallel {c.tp}: each layer's weights and matmuls split over {c.tp} devices {where}; "
            f"its collectives cost {seconds(b.tp_comm)} per step ({percent(b.tp_comm / plan.step_time)}){sp}.")


def _pp(plan: Plan) -> str:
    c, limit = plan.config, plan.cluster.device.memory
    states = sum(s.memory.params + s.memory.grads + s.memory.optimizer for s in plan.stages)
    holder = "a device" if c.tp == 1 else f"each of {c.tp} tensor-parallel devices"
    whole = (f"{holder} holding every layer would need {gigabytes(states)} for parameters, gradients and "
             "optimizer state alone")
    if c.pp == 1:
        return f"pipeline 1: no pipeline stages; {whole} (device: {gigabytes(limit)})."
    why = (f"{whole}, more than the device's {gigabytes(limit)}" if states > limit
           else f"{whole}, which would fit, but splitting the layers is faster (less data-parallel and "
                "tensor-parallel communication per device)")
    sizes = sorted(len(s.layers) for s in plan.stages)
    bubble = plan.breakdown.bubble
    sched = {"zbh1": "ZB-H1 (zero bubble: each backward split, the weight-gradient passes filling the drain)",
             "zbv": "ZB-V (zero bubble: two chunks per device placed as a V, each backward split)",
             "dualpipev": "DualPipeV (two chunks per device placed as a V, steady pairs of one chunk's forward and "
                          "the other's backward run one after the other, the drain's backwards split)",
             }.get(c.schedule, c.schedule if c.virtual_stages == 1
                   else f"interleaved with {c.virtual_stages} chunks per device")
    return (f"pipeline {c.pp}: {why}. The {c.pp} stages hold {sizes[0]}-{sizes[-1]} layers each "
            f"(an exact partition minimising step time); schedule {sched}; the bubble costs {seconds(bubble)} "
            f"({percent(bubble / plan.step_time)}).")


def _dp(plan: Plan) -> str:
    c, b = plan.config, plan.breakdown
    if c.grad_replicas == 1:
        return "data parallel 1: one model replica, so no gradient reduction."
    n = c.grad_replicas
    over = f"{n} replicas" if c.cp == 1 else f"{n} data- and context-parallel devices"
    zero = {0: "every replica keeps its full optimizer state",
            1: f"ZeRO-1 shards the optimizer state over the {over}",
            2: f"ZeRO-2 shards optimizer state and gradients over the {over}",
            3: f"ZeRO-3 shards optimizer state, gradients and parameters over the {over} "
               "(parameters are gathered layer by layer)"}[c.zero]
    what = "the pipeline" if c.pp > 1 else ("the tensor-parallel group" if c.tp > 1 else "the model")
    return (f"data parallel {c.dp}: {c.dp} replicas of {what}, each taking "
            f"{plan.global_batch_size // c.dp} samples; {zero}; the gradient communication not hidden behind "
            f"backward costs {seconds(b.dp_comm)} ({percent(b.dp_comm / plan.step_time)}).")


def _micro(plan: Plan) -> str:
    c, m = plan.config, plan.micro_batches
    text = f"micro-batches: {m} of {c.micro_batch_size} sample(s) per pipeline and step"
    if c.pp > 1 and c.schedule in SPLIT_BACKWARD:
        share = plan.breakdown.bubble / max(plan.step_time - plan.breakdown.bubble, 1e-30)
        text += (f"; the bubble left ({percent(share)} of the work) is the pipeline's fill and what the weight-gradient "
                 "passes do not cover, and shrinks with more of them")
    elif c.pp > 1:
        ideal = (c.pp - 1) / (c.virtual_stages * m)
        text += (f"; more of them shrink the bubble (about (p-1)/(v m) = {percent(ideal)} of the work) but hold "
                 "more activations in flight on the first stages")
    elif m > 1:
        text += "; accumulated one after another, so the activations of only one are held at a time"
    return text + "."


def _recompute(plan: Plan) -> str:
    c = plan.config
    modes = [c.stage_mode(s.index) for s in plan.stages]
    cost = plan.breakdown.recompute
    if set(modes) == {"none"}:
        return "recompute none: the activations fit, so nothing is computed twice."
    which = (modes[0] if len(set(modes)) == 1
             else ", ".join(f"stage {i} {m}" for i, m in enumerate(modes)))
    return (f"recompute {which}: without it the activations of the micro-batches in flight would not fit (or "
            f"would force a slower configuration); recomputing costs {seconds(cost)} per step "
            f"({percent(cost / plan.step_time)}).")


def _runners_up(plan: Plan) -> str:
    if not plan.alternatives:
        if plan.optimal is None:
            return ""
        return ("Runners-up: none evaluated. Every other configuration either does not fit or has a lower bound on "
                "step time above this plan's, so it cannot be faster.")
    lines = ["Runners-up and why each lost:"]
    for i, alt in enumerate(plan.alternatives, 1):
        lines.append(f"  {i}. {alt.config.short()} ({config_changes(plan.config, alt.config)}): {_why_lost(plan, alt)}")
    return "\n".join(lines)


def _why_lost(plan: Plan, alt: Alternative) -> str:
    if not alt.fits:
        return alt.reason
    if alt.breakdown is None:
        return alt.reason
    deltas = sorted(((getattr(alt.breakdown, k) - getattr(plan.breakdown, k), k) for k in TimeBreakdown.__annotations__),
                    key=lambda d: -abs(d[0]))
    shown = [f"{BREAKDOWN_LABELS[k]} {'+' if d > 0 else '-'}{seconds(abs(d))}" for d, k in deltas[:TOP_PARTS]
             if abs(d) > 1e-3 * plan.step_time]
    if shown:
        return f"{alt.reason} ({', '.join(shown)})"
    slower = alt.step_time - plan.step_time
    memory = f"peak memory {gigabytes(alt.peak_memory)} against {gigabytes(plan.peak_memory)}"
    if slower < 0:
        return alt.reason
    if slower > 0:
        return f"slower by only {seconds(slower)} ({slower / plan.step_time * 100:.2g}%); {memory}"
    if alt.peak_memory != plan.peak_memory:
        return f"as fast; a tie goes to the leaner plan: {memory}"
    return "as fast and as lean; the tie goes to the smaller configuration"
