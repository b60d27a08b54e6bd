"""``Plan._repr_html_``: the summary and the pipeline timeline in a notebook."""

from __future__ import annotations

import base64
import html
import io

from ..errors import ConfigError
from ..plan import Plan, TimeBreakdown
from .format import (BREAKDOWN_LABELS, GB, gigabytes, heading, interval_line, percent, seconds, stage_layers,
                     throughput)

TIMELINE_MAX_MICRO_BATCHES = 32
"""The notebook timeline draws at most this many micro-batches (a 192-micro-batch Gantt chart is a grey wall)."""


def plan_html(plan: Plan) -> str:
    """Headline figures, the breakdown with bars, memory per stage, and the timeline (when matplotlib is there)."""
    return "".join([_headline(plan), _breakdown(plan), _stages(plan), _timeline(plan)])


def _headline(plan: Plan) -> str:
    e = html.escape
    device = plan.cluster.device
    fits = "" if plan.fits else " <b style='color:#b00'>DOES NOT FIT</b>"
    return (f"<p><b>{heading(plan)}</b> for {e(plan.model_name)} on {e(plan.cluster.describe())}<br>"
            f"<code>{e(plan.config.short())}</code><br>"
            f"step {e(seconds(plan.step_time))} &middot; {e(throughput(plan))} &middot; "
            f"MFU {e(percent(plan.mfu))} &middot; peak {e(gigabytes(plan.peak_memory))} of "
            f"{e(gigabytes(device.memory))}{fits}<br>step {e(interval_line(plan.step_time_interval()))}</p>")


def _breakdown(plan: Plan) -> str:
    rows = []
    for name in TimeBreakdown.__annotations__:
        value = getattr(plan.breakdown, name)
        share = value / plan.step_time if plan.step_time else 0.0
        rows.append(f"<tr><td style='text-align:left'>{BREAKDOWN_LABELS[name]}</td><td>{seconds(value)}</td>"
                    f"<td>{percent(share)}</td><td style='text-align:left'><div style='background:#4c72b0;"
                    f"height:0.8em;width:{share * 200:.0f}px'></div></td></tr>")
    return f"<table><caption>step time breakdown</caption>{''.join(rows)}</table>"


def _stages(plan: Plan) -> str:
    limit = plan.cluster.device.memory
    head = "".join(f"<th>{h}</th>" for h in ("stage", "params", "grads", "optim", "activ", "buffers", "total GB",
                                             "of device", "in flight", "layers"))
    rows = []
    for s in plan.stages:
        m = s.memory
        style = " style='background:#fbb'" if m.total > limit else ""
        cells = [str(s.index)] + [f"{v / GB:.2f}" for v in (m.params, m.grads, m.optimizer, m.activations,
                                                            m.buffers, m.total)]
        cells += [f"{m.total / limit:.0%}", str(s.in_flight), html.escape(stage_layers(plan, s.index))]
        rows.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><caption>memory per device by stage</caption><tr>{head}</tr>{''.join(rows)}</table>"


def _timeline(plan: Plan) -> str:
    try:
        from ..viz import plot_timeline
        figure = plot_timeline(plan, max_micro_batches=TIMELINE_MAX_MICRO_BATCHES)
    except (ImportError, ConfigError) as exc:      # matplotlib missing: the tables alone
        return f"<p><i>(no timeline: {html.escape(str(exc))})</i></p>"
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"<img alt='pipeline timeline' src='data:image/png;base64,{data}'>"
