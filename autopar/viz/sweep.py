"""``Sweep.plot()``: throughput, MFU and time to train (with its cost) against the number of GPUs.

One panel each, GPUs on a log-2 axis labelled with the nodes. Throughput is in tokens/s for a
sequence model (samples/s otherwise), with the line of perfect scaling from the smallest size that
has a plan; the third panel is the time to train the sweep's tokens (its cost on the right axis
when the sweep has a price), or the step time when it has no tokens. Sizes without a plan are
named in the title.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ._common import finish, format_count, new_figure

if TYPE_CHECKING:
    from ..plan.sweep import Sweep

DAY = 86400.0


def plot_sweep(sweep: "Sweep", path: str | os.PathLike | None = None) -> Any:
    """The figure (a ``matplotlib.figure.Figure``); a PNG at ``path`` if given."""
    fig = new_figure(14, 4)
    from matplotlib.ticker import EngFormatter, FuncFormatter
    rows = [r for r in sweep.rows if r.ok]
    missing = [r.nodes for r in sweep.rows if not r.ok]
    title = (f"{sweep.model_name} on nodes of {sweep.devices_per_node} x {sweep.device}, "
             f"global batch {sweep.global_batch_size}")
    if missing:
        title += f"; no plan on {', '.join(map(str, missing))} node(s)"
    fig.suptitle(title)
    axes = fig.subplots(1, 3)
    gpus = [r.gpus for r in rows]

    tokens = sweep.tokens_per_sample is not None
    rate = [r.tokens_per_second if tokens else r.samples_per_second for r in rows]
    unit = "tokens/s" if tokens else "samples/s"
    ax = axes[0]
    ax.plot(gpus, rate, "o-", color="#4c72b0", label="predicted")
    if rows:
        ax.plot(gpus, [rate[0] * g / gpus[0] for g in gpus], "--", color="#999999", label="perfect scaling")
        ax.legend(loc="upper left", fontsize="small")
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_ylabel(unit)
    ax.set_title("throughput")

    ax = axes[1]
    ax.plot(gpus, [r.mfu * 100 for r in rows], "o-", color="#55a868")
    ax.set_ylabel("MFU (%)")
    ax.set_ylim(bottom=0)
    ax.set_title("model FLOPs utilisation")

    ax = axes[2]
    if sweep.tokens is not None:
        name, scale = _span_unit(max((r.train_seconds for r in rows), default=DAY))
        ax.plot(gpus, [r.train_seconds / scale for r in rows], "o-", color="#c44e52")
        ax.set_ylabel(name)
        ax.set_title(f"time to train {format_count(sweep.tokens)} tokens")
        if sweep.price_per_gpu_hour is not None:
            cost = ax.twinx()
            cost.plot(gpus, [r.cost for r in rows], "s--", color="#8172b2")
            # "$" starts mathtext in matplotlib: escaped
            cost.set_ylabel(f"cost at \\${sweep.price_per_gpu_hour:g} per GPU-hour (squares)", color="#8172b2")
            cost.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "\\$" + format_count(v).replace(" ", "")))
            cost.set_ylim(bottom=0)
    else:
        ax.plot(gpus, [r.step_time for r in rows], "o-", color="#c44e52")
        ax.set_ylabel("seconds per step")
        ax.set_title("step time")
    ax.set_ylim(bottom=0)

    ticks = [r.gpus for r in sweep.rows]
    labels = [f"{r.gpus}\n({r.nodes} node{'s' if r.nodes > 1 else ''})" for r in sweep.rows]
    for ax in axes:
        if len(ticks) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels, fontsize="small")
        ax.minorticks_off()
        ax.set_xlabel("GPUs")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return finish(fig, path)


def _span_unit(longest: float) -> tuple[str, float]:
    """The unit to plot training times in (the longest of them decides), and seconds per unit."""
    if longest >= 2 * DAY:
        return "days", DAY
    if longest >= 2 * 3600:
        return "hours", 3600.0
    return "minutes", 60.0
