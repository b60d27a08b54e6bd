"""Pipeline timeline (Gantt chart) of one optimizer step of a Plan.

Geometry first, drawing second. :func:`build_timeline` replays the plan's schedule
(``runtime.schedules.build``) with ``runtime.schedules.simulate`` (a device starts its next
action once it is free and the action's dependencies have finished; p2p takes no extra wall
time beyond its share of a block), which records when every action starts and ends. Per-action durations come from each
:class:`~autopar.plan.Stage` (seconds per micro-batch, all of a device's chunks together):

- forward  = (fwd_time + its share of tp_comm_time + half of p2p_time) / v
- backward = (recompute_time + bwd_time + the rest of tp_comm and p2p) / v; under a zero-bubble
  schedule its weight gradients (wgrad_time) are the W pass and the rest the input-gradient pass I,
  each with half of recompute_time (a split backward reruns the recomputed forward in both)

with ``v`` the chunks per device (virtual_stages); context- and expert-parallel communication
(cp_comm_time, ep_comm_time) counts with tp_comm, drawn as "TP/CP/EP comm". Tensor-parallel collectives are split
between forward and backward in proportion to their compute (the Stage keeps only their sum);
p2p in halves, because the activation sent forward and its gradient sent back are the same
size. Each device's blocks then add up to ``m * stage.work`` exactly, so for balanced stages
the simulated makespan equals the cost model's pipeline time (compute + recompute + tp_comm +
p2p + bubble). For unbalanced ones the formula is an upper bound when every stage has the same
forward : backward ratio, and can be exceeded slightly otherwise (GPipe, with the longest forward
on one stage and the longest backward on another: the plot shows the simulation, not the formula).

After its last backward every device shows the plan's exposed data-parallel communication
and optimizer step (``plan.breakdown.dp_comm`` / ``.optimizer``, the slowest device's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import SPLIT_BACKWARD, check_int
from ..errors import ConfigError
from ..cost_model.estimator import reruns
from ..runtime.schedules import build, least_micro_batches, simulate
from ._common import DPI, finish, format_time, mix, new_figure, time_unit

FORWARD = "#1f77b4"
BACKWARD = "#ff7f0e"
WEIGHT = "#2ca02c"   # a zero-bubble schedule's weight-gradient passes
COLORS = {"tp_comm": "#6a3d9a", "p2p": "#17becf", "dp_comm": "#d62728", "optimizer": "#4d4d4d",
          "idle": "#ececec"}
LABELS = {"recompute": "recompute", "tp_comm": "TP/CP/EP comm", "p2p": "p2p",
          "dp_comm": "DP comm (exposed)", "optimizer": "optimizer", "idle": "idle (bubble)"}
MAX_LABELS = 4000   # micro-batch numbers written at most (text is the slow part of rendering)
LABEL_PX = 10       # a typical block narrower than this (pixels) gets no number: zoom on the start
ZOOM_BLOCK_PX = 28  # width of a typical block in the zoom panel


@dataclass(frozen=True)
class Block:
    """One forward ("F"), backward ("B"), input-gradient ("I") or weight-gradient ("W") pass of one
    micro-batch through one chunk, in seconds from the start of the step. ``parts`` are (kind,
    seconds) in drawing order, summing to the length: kinds "forward", "backward", "weight",
    "recompute", "tp_comm", "p2p"."""

    device: int
    chunk: int            # the device's own chunk index, 0..v-1
    kind: str
    micro_batch: int
    start: float
    end: float
    parts: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Timeline:
    """Every block of one step, and each device's tail (exposed DP communication, optimizer)."""

    blocks: tuple[Block, ...]
    pipeline_end: tuple[float, ...]   # per device: when its last backward ends, seconds
    dp_comm: float                    # seconds after pipeline_end, every device
    optimizer: float                  # seconds after the DP communication
    micro_batches: int                # micro-batches simulated (fewer than the plan's when truncated)
    virtual_stages: int

    @property
    def makespan(self) -> float:
        """Seconds from the first forward to the last backward."""
        return max(self.pipeline_end)

    @property
    def step_end(self) -> float:
        """Seconds until the last device finishes its optimizer step."""
        return self.makespan + self.dp_comm + self.optimizer


def action_parts(stage: Any, virtual_stages: int, reruns: int = 1) -> dict[str, tuple[tuple[str, float], ...]]:
    """(kind, seconds) parts of one forward ("F"), backward ("B"), input-gradient ("I") and
    weight-gradient ("W") chunk action of ``stage``, whose ``recompute_time`` counts ``reruns`` reruns of the
    recomputed forward per micro-batch (cost_model/estimator.reruns): each backward pass reruns it once."""
    v = virtual_stages
    once = stage.recompute_time / reruns
    compute = stage.fwd_time + stage.bwd_time + stage.recompute_time
    fwd_share = stage.fwd_time / compute if compute > 0 else 0.5
    comm = stage.tp_comm_time + stage.cp_comm_time + stage.ep_comm_time
    backward_rest = (("tp_comm", comm * (1 - fwd_share) / v), ("p2p", stage.p2p_time / 2 / v))
    return {
        "F": (("forward", stage.fwd_time / v), ("tp_comm", comm * fwd_share / v),
              ("p2p", stage.p2p_time / 2 / v)),
        "B": (("recompute", once / v), ("backward", stage.bwd_time / v)) + backward_rest,
        # a split backward reruns the recomputed forward in each of its passes (cost_model/estimator.reruns)
        "I": (("recompute", once / v), ("backward", (stage.bwd_time - stage.wgrad_time) / v)) + backward_rest,
        "W": (("recompute", once / v), ("weight", stage.wgrad_time / v)),
    }


def build_timeline(plan: Any, max_micro_batches: int | None = None) -> Timeline:
    """Simulate the plan's schedule and place every action in time (see the module docstring).

    ``max_micro_batches`` (optional) simulates a shorter step of that many micro-batches (rounded
    up to a multiple of pp for the interleaved schedule, which needs it), to see the schedule's
    shape when the plan has hundreds."""
    cfg, pp = plan.config, len(plan.stages)
    v = cfg.virtual_stages
    if pp != cfg.pp or any(len(s.chunks) != v for s in plan.stages):
        raise ConfigError(f"plan has {pp} stages with {[len(s.chunks) for s in plan.stages]} chunks but its config "
                          f"says pp={cfg.pp}, virtual_stages={v}: re-create the plan with autopar.estimate/plan")
    m = plan.micro_batches
    if max_micro_batches is not None:
        check_int("max_micro_batches", max_micro_batches, 1)
        step = pp if cfg.schedule == "interleaved" else 1
        m = min(m, max(-(-max_micro_batches // step) * step, least_micro_batches(cfg.schedule, pp)))
    parts = [action_parts(s, v, reruns(cfg)) for s in plan.stages]
    lengths = [{k: sum(t for _, t in p) for k, p in d.items()} for d in parts]
    schedule = build(cfg.schedule, pp, m, v)
    times = simulate(schedule, v, lambda a: lengths[cfg.chunk_device(a.stage)][a.kind]).times
    blocks = tuple(Block(device=d, chunk=cfg.device_chunks(d).index(a.stage), kind=a.kind, micro_batch=a.micro_batch,
                         start=times[a][0], end=times[a][1], parts=parts[d][a.kind])
                   for d, actions in enumerate(schedule) for a in actions)
    ends = tuple(times[actions[-1]][1] for actions in schedule)
    return Timeline(blocks, ends, plan.breakdown.dp_comm, plan.breakdown.optimizer, m, v)


# --- drawing ----------------------------------------------------------------------------------
def chunk_colors(base: str, v: int) -> list[tuple[float, float, float]]:
    """``v`` shades of ``base``: chunk 0 full colour, later chunks lighter."""
    return [mix(base, "white", 0.55 * c / max(v - 1, 1)) for c in range(v)]


def plot_timeline(plan: Any, path: str | os.PathLike | None = None, *,
                  max_micro_batches: int | None = None) -> Any:
    """A Gantt chart of one step of ``plan``: one row per pipeline device, a block per forward /
    backward of each micro-batch (shaded by chunk when interleaved; TP and p2p communication as
    tails of their own colour; recomputation darker, and hatched where blocks are wide), idle
    time light grey, then exposed DP communication and the optimizer. Micro-batch numbers are
    written in blocks wide enough for them; when the whole step is too dense for that (hundreds
    of micro-batches), a second panel zooms on its start. ``max_micro_batches`` shows a shorter
    step instead (see :func:`build_timeline`). Saved as a PNG at ``path`` when given; returns
    the matplotlib Figure."""
    tl = build_timeline(plan, max_micro_batches)
    pp, v = len(plan.stages), tl.virtual_stages
    truncated = tl.micro_batches < plan.micro_batches
    right = (tl.step_end if truncated else max(tl.step_end, plan.step_time)) * 1.01

    ax_w = 13.0                                         # inches; the figure is laid out in inches
    ax_h = 0.5 * pp if pp <= 16 else 8.0 + 0.2 * (pp - 16)
    width_px = ax_w * DPI
    block = float(np.median([b.end - b.start for b in tl.blocks]))
    zoom = width_px * block / ZOOM_BLOCK_PX if block * width_px / right < LABEL_PX else None
    if zoom is not None and zoom > right / 3:
        zoom = None
    top, gap, bottom = 0.9, 0.8, 1.0   # inches: title; zoom panel's title; axis label and legend
    fig_w = ax_w + 1.2
    fig_h = top + ax_h + bottom + (gap + ax_h if zoom else 0.0)
    fig = new_figure(fig_w, fig_h)

    def axes(y_inches: float) -> Any:
        return fig.add_axes((1.0 / fig_w, y_inches / fig_h, ax_w / fig_w, ax_h / fig_h))

    main = axes(bottom + (ax_h + gap if zoom else 0.0))
    colors = _Colors(chunk_colors(FORWARD, v), chunk_colors(BACKWARD, v), chunk_colors(WEIGHT, v))
    hatched = _draw(main, plan, tl, right, width_px, colors, step_line=not truncated)
    b = plan.breakdown
    title = (f"{plan.model_name}: pipeline timeline of one step — predicted {format_time(plan.step_time)}\n"
             f"{plan.config.short()} · {plan.micro_batches} micro-batches · "
             f"bubble {100 * b.bubble / plan.step_time:.1f}% of the step")
    if truncated:
        title += (f"\nshowing {tl.micro_batches} of {plan.micro_batches} micro-batches "
                  f"(re-simulated as a {tl.micro_batches}-micro-batch step)")
    main.set_title(title, fontsize=10, loc="left")
    last = main
    if zoom:
        from matplotlib.patches import Rectangle
        unit, k = time_unit(right)
        main.add_patch(Rectangle((0, -0.5), zoom * k, pp, fill=False, edgecolor="black", linestyle="--",
                                 linewidth=1.0))
        last = axes(bottom)
        hatched = _draw(last, plan, tl, zoom, width_px, colors, step_line=False) or hatched
        last.set_title(f"the first {format_time(zoom)} enlarged (dashed box above): numbers are micro-batches",
                       fontsize=9, loc="left")
    _legend(last, plan, colors, truncated, hatched, 0.45 / ax_h)
    return finish(fig, path)


@dataclass(frozen=True)
class _Colors:
    """Block colours per chunk."""

    fwd: list
    bwd: list
    weight: list

    @property
    def rec(self) -> list:
        return [mix(c, "black", 0.3) for c in self.bwd]


def _draw(ax: Any, plan: Any, tl: Timeline, right: float, width_px: float, colors: _Colors, *,
          step_line: bool) -> bool:
    """Draw the rows of ``tl`` from 0 to ``right`` seconds on ``ax`` (``width_px`` wide); returns
    whether blocks were wide enough to get outlines and hatching."""
    pp = len(tl.pipeline_end)
    unit, k = time_unit(right)
    px_per_s = width_px / right
    shown = [b for b in tl.blocks if b.start < right]
    rec = colors.rec
    rects: dict[str, tuple[list, list]] = {}

    def add(kind: str, x0: float, width: float, row: int, color: Any) -> None:
        if width > 0 and x0 < right:
            xs, cs = rects.setdefault(kind, ([], []))
            xs.append((x0 * k, width * k, row))
            cs.append(color)

    for d in range(pp):
        add("idle", 0.0, tl.pipeline_end[d], d, COLORS["idle"])
        add("dp_comm", tl.pipeline_end[d], tl.dp_comm, d, COLORS["dp_comm"])
        add("optimizer", tl.pipeline_end[d] + tl.dp_comm, tl.optimizer, d, COLORS["optimizer"])
    for b in shown:
        x = b.start
        for kind, t in b.parts:
            color = {"forward": colors.fwd[b.chunk], "backward": colors.bwd[b.chunk],
                     "recompute": rec[b.chunk], "weight": colors.weight[b.chunk]}.get(kind)
            add(kind, x, t, b.device, COLORS[kind] if color is None else color)
            x += t

    widths = [(b.end - b.start) * px_per_s for b in shown]
    wide = bool(widths) and float(np.median(widths)) >= 8   # room for outlines and hatching
    height = 0.8
    for kind in ("idle", "forward", "backward", "weight", "recompute", "tp_comm", "p2p", "dp_comm", "optimizer"):
        if kind in rects:
            xs, cs = rects[kind]
            hatch = "////" if kind == "recompute" and wide else None
            edge = [mix(c, "white", 0.35) for c in cs] if hatch else "none"
            ax.add_collection(_rectangles(xs, height, cs, edge, hatch))
    if wide:
        outline = [(b.start * k, (b.end - b.start) * k, b.device) for b in shown]
        ax.add_collection(_rectangles(outline, height, "none", "white", None, linewidth=0.6))
    _label_blocks(ax, shown, widths, k)

    if step_line:
        ax.axvline(plan.step_time * k, color="black", linestyle=":", linewidth=1.2)
    ax.set_xlim(0, right * k)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"device {d}" for d in range(pp)], fontsize=8 if pp <= 32 else 6)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#cccccc", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return wide


def _rectangles(xs: list, height: float, faces: Any, edges: Any, hatch: str | None, linewidth: float = 0.0):
    """A PolyCollection of (x0, width, row) rectangles, ``height`` tall and centred on the row."""
    from matplotlib.collections import PolyCollection
    a = np.asarray(xs, dtype=float).reshape(-1, 3)
    x0, x1 = a[:, 0], a[:, 0] + a[:, 1]
    y0, y1 = a[:, 2] - height / 2, a[:, 2] + height / 2
    verts = np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y1], 1),
                      np.stack([x0, y1], 1)], 1)
    return PolyCollection(verts, facecolors=faces, edgecolors=edges, linewidths=linewidth, hatch=hatch)


def _label_blocks(ax: Any, blocks: list[Block], widths: list[float], k: float) -> None:
    """Write the micro-batch number in every block wide enough for it (about 6 px a digit)."""
    wide = [(b, w) for b, w in zip(blocks, widths) if w >= 6 * len(str(b.micro_batch)) + 4]
    if len(wide) > MAX_LABELS:
        return
    for b, _ in wide:
        color = "white" if b.chunk == 0 else "black"
        ax.text((b.start + b.end) / 2 * k, b.device, str(b.micro_batch), ha="center", va="center",
                fontsize=7, color=color, clip_on=True)


def _legend(ax: Any, plan: Any, colors: _Colors, truncated: bool, hatched: bool, below: float) -> None:
    """The legend under the x axis label, ``below`` axes heights beneath the axes."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles, v, rec = [], len(colors.fwd), colors.rec
    for c in range(v):
        suffix = f", chunk {c}" if v > 1 else ""
        handles.append(Patch(facecolor=colors.fwd[c], label=f"forward{suffix}"))
        split = plan.config.schedule in SPLIT_BACKWARD
        handles.append(Patch(facecolor=colors.bwd[c], label=f"{'input gradient' if split else 'backward'}{suffix}"))
        if split:
            handles.append(Patch(facecolor=colors.weight[c], label=f"weight gradient{suffix}"))
    b = plan.breakdown
    present = {"recompute": b.recompute, "tp_comm": b.tp_comm + b.cp_comm + b.ep_comm, "p2p": b.p2p, "dp_comm": b.dp_comm,
               "optimizer": b.optimizer, "idle": b.bubble}
    for kind, amount in present.items():
        if amount > 0:
            if kind == "recompute":
                handles.append(Patch(facecolor=rec[0], edgecolor=mix(rec[0], "white", 0.35),
                                     hatch="////" if hatched else None, linewidth=0, label=LABELS[kind]))
            else:
                handles.append(Patch(facecolor=COLORS[kind], label=LABELS[kind]))
    if not truncated:
        handles.append(Line2D([], [], color="black", linestyle=":", label="predicted step (cost model)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -below),
              ncol=min(len(handles), 6), fontsize=8, frameon=False)
