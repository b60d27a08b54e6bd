"""Memory per pipeline device: stacked bars by kind against the device's memory.

One bar per Stage (a pipeline device; with interleaving it holds several chunks), split into
the :class:`~autopar.cost_model.memory.MemoryBreakdown` kinds, in GB (10^9 bytes, as device
datasheets count; MB or KB for small models). The device's memory is a dashed line; bars above
it are outlined in red with their total in red, so a plan that does not fit shows where and by
how much.
"""

from __future__ import annotations

import os
from typing import Any

from ._common import byte_unit, finish, new_figure

KINDS = (("params", "parameters", "#4c72b0"), ("grads", "gradients", "#55a868"),
         ("optimizer", "optimizer state", "#8172b3"), ("activations", "activations", "#dd8452"),
         ("buffers", "buffers", "#937860"))
OVER = "#d62728"


def plot_memory(plan: Any, path: str | os.PathLike | None = None) -> Any:
    """Stacked bars of each pipeline device's memory by kind (GB, or MB for small models), the
    device limit as a dashed line (a note instead when every bar is under a quarter of it), the
    total above each bar, bars over the limit outlined in red. Stays readable for 64+ devices
    (narrower bars, vertical totals, fewer tick labels). Saved as a PNG at ``path`` when given;
    returns the matplotlib Figure."""
    stages = plan.stages
    n = len(stages)
    totals_b = [s.memory.total for s in stages]
    limit_b = plan.cluster.device.memory
    # When the plan uses a small fraction of the device, scale to the bars and note the limit.
    limit_shown = max(totals_b) >= 0.25 * limit_b
    unit, size = byte_unit(max(totals_b + ([limit_b] if limit_shown else [])))
    limit, totals = limit_b / size, [t / size for t in totals_b]
    top = max([limit] + totals) if limit_shown else max(totals)

    fig = new_figure(min(max(7.0, 2.5 + 0.22 * n), 22.0), 4.8)
    ax = fig.add_subplot(1, 1, 1)
    x = list(range(n))
    bar_w = 0.8 if n <= 32 else 0.9
    base = [0.0] * n
    for key, label, color in KINDS:
        values = [getattr(s.memory, key) / size for s in stages]
        if any(v > 0 for v in values):
            ax.bar(x, values, bar_w, bottom=base, color=color, label=label, linewidth=0)
            base = [b + v for b, v in zip(base, values)]

    over = [i for i, t in enumerate(totals_b) if t > limit_b]
    if over:
        ax.bar(over, [totals[i] for i in over], bar_w, fill=False, edgecolor=OVER, linewidth=1.6,
               label="over the device memory")
    device = f"{plan.cluster.device.name}: {limit:.3g} {unit}"
    if limit_shown:
        ax.axhline(limit, color="black", linestyle="--", linewidth=1.2)
        ax.text(1.0, limit, f" {device}", transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=8)
    else:
        ax.text(1.0, 1.0, f"{device}, far above this scale", transform=ax.transAxes, va="top", ha="right",
                fontsize=8)

    vertical = n > 16
    for i, t in enumerate(totals):
        # a white backing keeps a total legible where it crosses the limit line
        ax.text(i, t + top * 0.01, _num(t), ha="center", va="bottom", rotation=90 if vertical else 0,
                fontsize=8 if n <= 32 else 6, color=OVER if i in over else "black",
                fontweight="bold" if i in over else "normal",
                bbox=dict(facecolor="white", edgecolor="none", pad=0.6))

    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, top * (1.22 if vertical else 1.12))
    step = max(1, -(-n // 32))
    ax.set_xticks(x[::step])
    ax.set_xticklabels([str(i) for i in x[::step]], fontsize=8)
    ax.set_xlabel("pipeline device (stage)" + (f"; ticks every {step}" if step > 1 else ""))
    ax.set_ylabel(f"memory per device ({unit})")
    ax.grid(axis="y", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    peak = f"peak {_num(max(totals))} {unit}"
    if over:
        status = f"does NOT fit: {peak} > {limit:.3g} {unit} on {len(over)} of {n} devices"
    elif not plan.fits:
        status = f"does NOT fit by the plan's own check: {peak}"
    else:
        status = f"fits: {peak} of {limit:.3g} {unit}"
    ax.set_title(f"{plan.model_name}: memory per pipeline device — {status}\n{plan.config.short()}",
                 fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.16), ncol=6, fontsize=8, frameon=False)
    return finish(fig, path)


def _num(value: float) -> str:
    """``53.1`` / ``512`` / ``0.94``: a total for a bar label."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2g}"
