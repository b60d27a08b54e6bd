"""Plots of a Plan: the timeline's block geometry (checked against the schedule's dependencies
and the cost model's pipeline time), and every plot rendered to a real PNG of the expected size
with the expected colours in it."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

import autopar
from autopar import Cluster, ConfigError, ParallelConfig
from autopar.cost_model import estimate_plan
from autopar.solver import price
from autopar.cost_model.schedule import pipeline_time
from autopar.models import registry
from autopar.config import SPLIT_BACKWARD
from autopar.cost_model.estimator import reruns
from autopar.runtime.schedules import GRADIENT, Action, build, dependencies, kinds_of, simulate
from autopar.viz import plot_memory, plot_partition, plot_timeline
from autopar.viz import _common
from autopar.viz.partition import layer_positions, run_labels
from autopar.viz.timeline import BACKWARD, COLORS, FORWARD, build_timeline, chunk_colors

mpl_image = pytest.importorskip("matplotlib.image", reason="the plots need matplotlib (pip install matplotlib)")

NODE = Cluster.from_spec("1x8xA100-80GB")
# A device 1000x slower in compute and memory: the tiny GPT's matmuls cost enough there that the
# sharding ILP splits them at tp=2 (on an A100 it rightly keeps them whole: a collective costs more).
SLOW_NODE = dataclasses.replace(NODE, device=dataclasses.replace(
    NODE.device, peak_flops={k: v / 1000 for k, v in NODE.device.peak_flops.items()},
    memory_bandwidth=NODE.device.memory_bandwidth / 1000))
# name -> (ParallelConfig fields, global batch size); the conftest's PLAN_GPT has 8 blocks
CASES = {
    "pp1": (dict(dp=8), 64),
    "1f1b": (dict(dp=2, pp=4), 32),
    "gpipe": (dict(dp=2, pp=4, schedule="gpipe"), 32),
    "interleaved": (dict(dp=2, pp=4, schedule="interleaved", virtual_stages=2), 32),
    "tp_recompute": (dict(dp=1, tp=2, pp=4, recompute="full"), 16),
    "zbh1": (dict(dp=2, pp=4, schedule="zbh1"), 32),
    "zbv": (dict(dp=4, pp=2, schedule="zbv", virtual_stages=2), 32),
    "dualpipev": (dict(dp=4, pp=2, schedule="dualpipev", virtual_stages=2, recompute="full"), 32),
}


@pytest.fixture(scope="module")
def plans(plan_graph):
    return {name: price(plan_graph, SLOW_NODE if cfg.get("tp", 1) > 1 else NODE, ParallelConfig(**cfg), gbs)
            for name, (cfg, gbs) in CASES.items()}


def balanced(plan):
    """``plan`` with every stage given stage 1's costs (same chunk count): the case in which the
    cost model's pipeline formula is exact for every schedule."""
    ref = plan.stages[1 if len(plan.stages) > 1 else 0]
    stages = tuple(dataclasses.replace(s, fwd_time=ref.fwd_time, bwd_time=ref.bwd_time,
                                       recompute_time=ref.recompute_time, tp_comm_time=ref.tp_comm_time,
                                       p2p_time=ref.p2p_time, wgrad_time=ref.wgrad_time) for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


# --- geometry -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_blocks_complete_ordered_and_dependencies_respected(plans, name):
    plan = plans[name]
    tl = build_timeline(plan)
    pp, v, m = plan.config.pp, plan.config.virtual_stages, plan.micro_batches
    assert tl.micro_batches == m and tl.virtual_stages == v
    end = {}
    ways = {"".join(sorted(w)) for w in kinds_of(plan.config.schedule)}
    for d in range(pp):
        mine = [b for b in tl.blocks if b.device == d]
        ran = {}
        for b in mine:
            ran[(b.chunk, b.micro_batch)] = "".join(sorted(ran.get((b.chunk, b.micro_batch), "") + b.kind))
        assert set(ran) == {(c, i) for c in range(v) for i in range(m)} and set(ran.values()) <= ways
        mine.sort(key=lambda b: b.start)
        for a, b in zip(mine, mine[1:]):
            assert b.start >= a.end - 1e-12 * a.end        # one action at a time per device
        stage = plan.stages[d]
        for b in mine:
            assert b.end - b.start == pytest.approx(sum(t for _, t in b.parts), rel=1e-12)
            for kind_ in (b.kind, GRADIENT) if b.kind in "BI" else (b.kind,):   # a B or I is its chunk's input gradient
                end[Action(plan.config.device_chunks(d)[b.chunk], kind_, b.micro_batch)] = (b.start, b.end)
        # the device's blocks add up to m micro-batches of its whole work, and DualPipeV's split passes (its
        # priced work counts one rerun of the recomputed forward a pass) another rerun each
        busy = sum(b.end - b.start for b in mine)
        again = sum(1 for b in mine if b.kind == "W") * stage.recompute_time / v if plan.config.schedule == "dualpipev" else 0.0
        assert busy == pytest.approx(m * stage.work + again, rel=1e-9)
        assert tl.pipeline_end[d] == pytest.approx(mine[-1].end, rel=1e-15)
    for action, (start, _) in end.items():
        for dep in dependencies(action, pp * v) if action.kind != GRADIENT else ():
            assert start >= end[dep][1] - 1e-12 * start, (action, dep)


@pytest.mark.parametrize("name", list(CASES))
def test_makespan_agrees_with_schedule_simulation_and_cost_model(plans, name):
    plan = plans[name]
    pp, v, m, kind = plan.config.pp, plan.config.virtual_stages, plan.micro_batches, plan.config.schedule
    tl = build_timeline(plan)
    lengths = {(b.device, b.kind): b.end - b.start for b in tl.blocks}
    reference = simulate(build(kind, pp, m, v), v, lambda a: lengths[(plan.config.chunk_device(a.stage), a.kind)])
    # the same rule; durations re-derived as end - start: float rounding only
    assert tl.makespan == pytest.approx(reference.makespan, rel=1e-9)
    b = plan.breakdown
    formula = b.compute + b.recompute + b.tp_comm + b.p2p + b.bubble
    # Unequal stages: the cost model's formula is an upper bound when every stage has the same
    # forward : backward ratio (runtime/schedules.py). Here the embedding and head stages do not
    # (stage 0 has the longest forward, stage 3 the longest backward), and GPipe, which runs every
    # forward before any backward, is bounded by its two phases apart instead: each takes at most
    # (m - 1) x its slowest stage's block + one block of every stage.
    bound = formula
    if kind in SPLIT_BACKWARD:   # its formula is not an upper bound on unequal stages (cost_model/schedule.py)
        bound = float("inf")
    if kind == "gpipe":
        slowest = {k: max(t for (_, kind_), t in lengths.items() if kind_ == k) for _, k in lengths}
        bound = max(formula, (m - 1) * sum(slowest.values()) + sum(lengths.values()))
    assert m * max(s.work for s in plan.stages) * (1 - 1e-12) <= tl.makespan <= bound * (1 + 1e-9)
    if kind == "dualpipev":   # priced by the simulation of its order, the split passes' second rerun in it
        assert plan.breakdown.recompute > 0
    assert tl.step_end == pytest.approx(tl.makespan + b.dp_comm + b.optimizer, rel=1e-12)
    # balanced stages: exact for every schedule (float summation order only)
    even = balanced(plan)
    passes = [((s.fwd_time + s.tp_comm_time * s.fwd_time / (s.fwd_time + s.bwd_time + s.recompute_time)
                + s.p2p_time / 2), 0.0, s.wgrad_time) for s in even.stages]
    passes = [(f, s.work - f - w, w) for (f, _, w), s in zip(passes, even.stages)]
    expected = pipeline_time([s.work for s in even.stages], m, kind, v, passes,
                             [s.recompute_time / reruns(plan.config) for s in even.stages]).total
    # the V-shaped schedules' priced bubbles round the pass shares to 0.1%
    assert build_timeline(even).makespan == pytest.approx(expected, rel=1e-3 if plan.config.v_shaped else 1e-9)


def test_balanced_1f1b_step_matches_the_plans_step_time(plans):
    plan = plans["1f1b"]
    even = balanced(plan)
    work = even.stages[0].work
    # the plan's own breakdown priced the slowest stage; rebuild it for the balanced stages
    pipe = pipeline_time([work] * 4, plan.micro_batches, "1f1b", 1).total
    tl = build_timeline(even)
    assert tl.step_end == pytest.approx(pipe + plan.breakdown.dp_comm + plan.breakdown.optimizer, rel=1e-9)
    assert tl.makespan == pytest.approx((plan.micro_batches + 3) * work, rel=1e-9)


def test_pp1_is_one_row_of_alternating_blocks(plans):
    plan = plans["pp1"]
    tl = build_timeline(plan)
    assert {b.device for b in tl.blocks} == {0}
    assert [b.kind for b in tl.blocks] == ["F", "B"] * plan.micro_batches
    assert tl.makespan == pytest.approx(plan.micro_batches * plan.stages[0].work, rel=1e-12)


def test_parts_split_communication_and_keep_recompute_in_the_backward(plans):
    plan = plans["tp_recompute"]
    block = {b.kind: dict(b.parts) for b in build_timeline(plan).blocks if b.device == 1}
    s = plan.stages[1]
    assert block["F"]["forward"] == s.fwd_time and "recompute" not in block["F"]
    assert block["B"]["recompute"] == s.recompute_time > 0 and block["B"]["backward"] == s.bwd_time
    assert block["F"]["tp_comm"] + block["B"]["tp_comm"] == pytest.approx(s.tp_comm_time, rel=1e-12)
    assert block["F"]["tp_comm"] > 0 and block["B"]["tp_comm"] > block["F"]["tp_comm"]
    assert block["F"]["p2p"] == block["B"]["p2p"] == pytest.approx(s.p2p_time / 2)


def test_interleaved_divides_a_device_over_its_chunks(plans):
    plan = plans["interleaved"]
    s = plan.stages[2]
    for b in build_timeline(plan).blocks:
        if b.device == 2 and b.kind == "F":
            assert dict(b.parts)["forward"] == pytest.approx(s.fwd_time / 2, rel=1e-15)


def test_max_micro_batches_truncates_and_is_validated(plans):
    tl = build_timeline(plans["1f1b"], max_micro_batches=3)
    assert tl.micro_batches == 3 and len(tl.blocks) == 2 * 3 * 4
    # interleaved needs a multiple of pp: rounded up
    assert build_timeline(plans["interleaved"], max_micro_batches=5).micro_batches == 8
    assert build_timeline(plans["1f1b"], max_micro_batches=10_000).micro_batches == plans["1f1b"].micro_batches
    for bad in (0, 2.5, "3"):
        with pytest.raises(ConfigError, match="max_micro_batches"):
            build_timeline(plans["1f1b"], max_micro_batches=bad)


def test_partition_layers_in_model_order(plans, plan_graph):
    names = [layer.name for layer in plan_graph.layers]
    for name in ("pp1", "1f1b", "interleaved"):
        assert [n for n, _, _ in layer_positions(plans[name])] == names
    positions = layer_positions(plans["interleaved"])
    # interleaved: model chunk g is on device g mod 4, as that device's chunk g // 4
    assert [(d, c) for _, d, c in positions] == [
        (g % 4, g // 4) for g in range(8) for _ in plans["interleaved"].stages[g % 4].chunks[g // 4]]
    assert run_labels(("blocks.48", "blocks.49", "blocks.53")) == ["blocks.48–53", "48–53", "3 layers", "3"]
    assert run_labels(("embed.tok", "blocks.0")) == ["embed.tok–blocks.0", "2 layers", "2"]


# --- rendering ----------------------------------------------------------------------------------
def read_png(path):
    """(RGB pixels as uint8, height, width) of the PNG at ``path``, after checking its signature."""
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = mpl_image.imread(str(path))
    return np.round(pixels[..., :3] * 255).astype(np.uint8), pixels.shape[0], pixels.shape[1]


def axes_pixels(fig, rgb):
    """The part of a saved image inside the figure's first axes (legends and titles excluded)."""
    import matplotlib
    box = fig.get_tightbbox(fig.canvas.get_renderer())          # inches
    pad = matplotlib.rcParams["savefig.pad_inches"]
    ext = fig.axes[0].get_window_extent()                         # pixels at fig.dpi == _common.DPI
    left, top = (box.x0 - pad) * fig.dpi, (box.y1 + pad) * fig.dpi
    return rgb[int(top - ext.y1) + 2:int(top - ext.y0) - 2, int(ext.x0 - left) + 2:int(ext.x1 - left) - 2]


def expected_size(fig):
    """Pixel size savefig(bbox_inches="tight") gives: the tight box plus the default padding."""
    import matplotlib
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    pad = matplotlib.rcParams["savefig.pad_inches"]
    return (box.height + 2 * pad) * _common.DPI, (box.width + 2 * pad) * _common.DPI


def has_color(rgb, color, tol=3):
    """Whether some pixel is within ``tol`` (0..255 per channel) of ``color``."""
    from matplotlib.colors import to_rgb
    target = np.round(np.array(to_rgb(color)) * 255)
    return bool((np.abs(rgb.astype(int) - target).max(axis=-1) <= tol).any())


def render(fn, plan, path, **kwargs):
    fig = fn(plan, path, **kwargs)
    rgb, h, w = read_png(path)
    eh, ew = expected_size(fig)
    # the tight box is measured again here: pixel rounding only
    assert abs(h - eh) <= 2 and abs(w - ew) <= 2, ((h, w), (eh, ew))
    packed = (rgb[..., 0].astype(np.int32) << 16) | (rgb[..., 1].astype(np.int32) << 8) | rgb[..., 2]
    assert len(np.unique(packed)) > 20     # not a blank or single-colour image
    return fig, axes_pixels(fig, rgb)


@pytest.mark.parametrize("name", list(CASES))
def test_every_plot_renders_with_its_colours(plans, name, tmp_path):
    plan = plans[name]
    v = plan.config.virtual_stages
    fig, rgb = render(plot_timeline, plan, tmp_path / "timeline.png")
    assert fig.axes[0].get_ylim() == (plan.config.pp - 0.5, -0.5)
    assert len(fig.axes[0].get_yticks()) == plan.config.pp
    for c in range(v):
        assert has_color(rgb, chunk_colors(FORWARD, v)[c]) and has_color(rgb, chunk_colors(BACKWARD, v)[c])
    assert has_color(rgb, COLORS["idle"]) == (plan.config.pp > 1)   # bubbles only with a pipeline
    assert has_color(rgb, COLORS["tp_comm"]) == (plan.config.tp > 1)
    _, rgb = render(plot_memory, plan, tmp_path / "memory.png")
    assert not has_color(rgb, "#d62728")                         # nothing over the limit
    fig, rgb = render(plot_partition, plan, tmp_path / "partition.png")
    assert has_color(rgb, "#1f77b4")                              # device 0's cells (tab10)


@pytest.mark.parametrize("plot", [plot_partition, plot_timeline, plot_memory])
def test_legend_does_not_cover_the_title(plan_graph, plot):
    """An interleaved plan's legend (the partition chart's chunks, above its strips) and the title, long as a
    factory's model name and four chunks make them, do not overlap in the rendered figure."""
    plan = price(plan_graph, NODE, ParallelConfig(dp=4, pp=2, schedule="interleaved", virtual_stages=4), 32)
    plan = dataclasses.replace(plan, model_name="mypackage.models.gpt:build_gpt3_175b")
    fig = plot(plan)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        titles = [t for t in (ax.title, *ax.texts, *(a for a in ax.get_children() if hasattr(a, "get_text")))
                  if hasattr(t, "get_text") and t.get_text() in {ax.get_title(loc) for loc in ("left", "center",
                                                                                               "right")} - {""}]
        assert titles, "the axes has a legend but no title to check against"
        for title in titles:
            assert not box.overlaps(title.get_window_extent(renderer)), (title.get_text(), box)


def test_figures_grow_with_the_pipeline(plans):
    one, four = plot_timeline(plans["pp1"]), plot_timeline(plans["1f1b"])
    assert four.get_figheight() > one.get_figheight()
    assert plot_partition(plans["1f1b"]).get_figheight() > plot_partition(plans["pp1"]).get_figheight()


def test_memory_over_the_limit_is_marked(plans, tmp_path, plan_graph):
    base = plans["1f1b"]
    totals = [s.memory.total for s in base.stages]
    small = dataclasses.replace(NODE.device, memory=(min(totals) + max(totals)) / 2)
    plan = estimate_plan(plan_graph, dataclasses.replace(NODE, device=small), base.config, base.global_batch_size)
    assert not plan.fits
    fig, rgb = render(plot_memory, plan, tmp_path / "memory.png")
    assert has_color(rgb, "#d62728")
    ax = fig.axes[0]
    assert "does NOT fit" in ax.get_title(loc="left")
    # the dashed limit line at the device memory, in the plot's unit (MB for this small model)
    unit, size = _common.byte_unit(max([s.memory.total for s in plan.stages] + [small.memory]))
    assert unit == "MB" and ax.get_ylabel() == "memory per device (MB)"
    assert any(line.get_linestyle() == "--" and line.get_ydata()[0] == pytest.approx(small.memory / size)
               for line in ax.get_lines())


def test_dense_timeline_draws_blocks_in_bulk_and_zooms_on_its_start(plan_graph, tmp_path):
    """3072 blocks (192 micro-batches x 8 devices, forward and backward) drawn as a few collections,
    not an artist or a text per block (what made dense timelines slow: counted, not timed)."""
    plan = estimate_plan(plan_graph, NODE, ParallelConfig(pp=8), 192)
    fig, _ = render(plot_timeline, plan, tmp_path / "dense.png")
    main, zoom = fig.axes
    assert len(main.collections) + len(main.patches) + len(main.texts) < 50
    assert zoom.get_xlim()[1] < main.get_xlim()[1] / 3
    assert "enlarged" in zoom.get_title(loc="left")
    assert len(zoom.texts) > 20 and len(main.texts) == 0       # numbers only where they fit
    assert len(plot_timeline(plan, max_micro_batches=8).axes) == 1


def test_truncated_timeline_says_so(plans, tmp_path):
    fig, _ = render(plot_timeline, plans["interleaved"], tmp_path / "t.png", max_micro_batches=4)
    assert "showing 4 of 16 micro-batches" in fig.axes[0].get_title(loc="left")


def test_public_estimate_and_json_reload_draw_the_same(tmp_path):
    model, inputs = registry.build("gpt-tiny", device="meta")
    plan = autopar.estimate(model, NODE, inputs, ParallelConfig(dp=4, pp=2), global_batch_size=16)
    plan.save(tmp_path / "plan.json")
    again = autopar.load_plan(tmp_path / "plan.json")
    for fn in (plot_timeline, plot_memory, plot_partition):
        _, first = render(fn, plan, tmp_path / "a.png")
        _, second = render(fn, again, tmp_path / "b.png")
        assert np.array_equal(first, second), fn.__name__


def test_no_file_without_path_and_an_agg_canvas(plans, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fig = plot_memory(plans["pp1"])
    assert list(tmp_path.iterdir()) == []
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"


def test_missing_matplotlib_says_how_to_install(plans, monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)     # None: "import matplotlib..." raises ImportError
    for fn in (plot_timeline, plot_memory, plot_partition):
        with pytest.raises(ConfigError, match="pip install matplotlib"):
            fn(plans["1f1b"])
