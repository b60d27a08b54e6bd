"""Layer-to-stage assignment: which layers each pipeline device holds, in model order.

A staircase of strips: one row per pipeline device, the x axis the model's layers in order
(taken from the stages' chunks: chunk ``g`` of the model is chunk ``g // pp`` of device
``g mod pp``), one cell per layer coloured by device and, when interleaved, lighter for the
device's later chunks. Each run of cells is labelled with its layer names (or their count) when it is wide
enough; each row ends with the device's parameter count and per-micro-batch forward and
backward time.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._common import chunk_order, finish, format_count, format_time, mix, new_figure

LEGEND_ROW = 0.3   # inches of figure height for the chunks' legend (one row at font size 8, with its spacing)
CHAR_PX = 6.5   # width of one character at font size 7 and the figure's dpi (measured for DejaVu Sans)


def layer_positions(plan: Any) -> list[tuple[str, int, int]]:
    """(layer name, device, device's chunk) of every layer, in model order."""
    return [(name, d, c) for d, c in chunk_order(plan) for name in plan.stages[d].chunks[c]]


def device_colors(pp: int) -> list[Any]:
    """A distinct colour per device: tab10 / tab20 when they suffice, else a continuous map."""
    from matplotlib import colormaps
    if pp <= 10:
        return [colormaps["tab10"](i) for i in range(pp)]
    if pp <= 20:
        return [colormaps["tab20"](i) for i in range(pp)]
    return [colormaps["turbo"](0.05 + 0.9 * i / (pp - 1)) for i in range(pp)]


def run_labels(names: tuple[str, ...] | list[str]) -> list[str]:
    """Labels of a run of layers, longest first, for the widest that fits: ``blocks.48–53``,
    ``48–53`` (only when both ends share ``blocks.``), ``6 layers``, ``6``."""
    first, last = names[0], names[-1]
    if len(names) == 1:
        return [first, "1"]
    out = [f"{first}–{last}"]
    head_a, _, tail_a = first.rpartition(".")
    head_b, _, tail_b = last.rpartition(".")
    if head_a and head_a == head_b:
        out = [f"{head_a}.{tail_a}–{tail_b}", f"{tail_a}–{tail_b}"]
    return out + [f"{len(names)} layers", str(len(names))]


def plot_partition(plan: Any, path: str | os.PathLike | None = None) -> Any:
    """The layer-to-stage assignment of ``plan`` (see the module docstring). Saved as a PNG at
    ``path`` when given; returns the matplotlib Figure."""
    layers = layer_positions(plan)
    pp, n = len(plan.stages), len(layers)
    v = max(len(s.chunks) for s in plan.stages)
    ax_w = 12.0
    row_h = 0.42 if pp <= 16 else max(0.16, 6.7 / pp)
    ax_h = max(1.2, row_h * pp)
    legend_h = LEGEND_ROW if v > 1 else 0.0   # inches: the chunks' legend has a row of its own under the title
    fig_w, fig_h = ax_w + 3.4, ax_h + 1.6 + legend_h
    fig = new_figure(fig_w, fig_h)   # first: it says how to install matplotlib if missing

    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch
    colors = device_colors(pp)

    def shade(d: int, c: int) -> Any:
        return mix(colors[d], "white", 0.5 * c / max(v - 1, 1))

    ax = fig.add_axes((0.9 / fig_w, 0.7 / fig_h, ax_w / fig_w, ax_h / fig_h))
    px_per_layer = ax_w * fig.dpi / n

    x = np.arange(n, dtype=float)
    y = np.array([d for _, d, _ in layers], dtype=float)
    h = 0.8
    verts = np.stack([np.stack([x, y - h / 2], 1), np.stack([x + 1, y - h / 2], 1),
                      np.stack([x + 1, y + h / 2], 1), np.stack([x, y + h / 2], 1)], 1)
    faces = [shade(d, c) for _, d, c in layers]
    # Layer separators a little lighter than the cell, so that run labels over them stay legible.
    outline = px_per_layer >= 5
    ax.add_collection(PolyCollection(verts, facecolors=faces,
                                     edgecolors=[mix(f, "white", 0.4) for f in faces] if outline else "none",
                                     linewidths=0.8 if outline else 0))

    start = 0
    for d, c in chunk_order(plan):
        names = plan.stages[d].chunks[c]
        width_px = len(names) * px_per_layer
        for text in run_labels(names):
            if len(text) * CHAR_PX + 6 <= width_px:
                ax.text(start + len(names) / 2, d, text, ha="center", va="center", fontsize=7,
                        color="white" if c == 0 and _dark(colors[d]) else "black")
                break
        start += len(names)

    for s in plan.stages:
        ax.text(1.005, s.index, f"{format_count(s.param_count)} params · fwd {format_time(s.fwd_time)} · "
                f"bwd {format_time(s.bwd_time)}", transform=ax.get_yaxis_transform(), va="center", ha="left",
                fontsize=8 if pp <= 32 else 6)

    ax.set_xlim(0, n)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"device {d}" for d in range(pp)], fontsize=8 if pp <= 32 else 6)
    ax.set_xlabel(f"layer, in model order ({n} layers)")
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    pad = 6.0   # points between the strips and the title (matplotlib's default)
    if v > 1:   # the legend sits on the strips, the title above the legend: neither covers the other
        legend = ax.legend(handles=[Patch(facecolor=shade(0, c), label=f"chunk {c}" + (" (lighter)" if c else ""))
                                    for c in range(v)], loc="lower left", bbox_to_anchor=(0.0, 1.0),
                           ncol=v, fontsize=8, frameon=False, borderaxespad=0.2, borderpad=0.0)
        pad += legend.get_window_extent(fig.canvas.get_renderer()).height * 72 / fig.dpi + 2
    chunks = f" × {v} chunks (interleaved)" if v > 1 else ""
    ax.set_title(f"{plan.model_name}: {n} layers over {pp} pipeline devices{chunks}\n{plan.config.short()} · "
                 "times per micro-batch", fontsize=10, loc="left", pad=pad)
    return finish(fig, path)


def _dark(color: Any) -> bool:
    """Whether white text reads better than black on ``color`` (relative luminance below 0.5)."""
    from matplotlib.colors import to_rgb
    r, g, b = to_rgb(color)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5
