"""The zero-bubble schedules (ZB-H1, ZB-V, DualPipeV): torch.distributed.pipelining's orders, accepted by the
checker, priced as the published formulas on even stages (DualPipeV: as the simulation of the order torch's
runtime runs), held in memory as their orders hold, and searched."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re

import numpy as np
import pytest

from autopar import Cluster, ConfigError, InfeasiblePlanError, ParallelConfig
from autopar.capture import capture
from autopar.cost_model import estimate_plan
from autopar.cost_model.memory import chunk_passes, in_flight, order_peak
from autopar.cost_model.schedule import AFFINE_FROM, pipeline_time, split_bubble
from autopar.models import GPTConfig, build_gpt
from autopar.runtime.schedules import Action, build, check, device_of, simulate
from autopar.solver import price, solve

KINDS = (("zbh1", 1), ("zbv", 2), ("dualpipev", 2))


def _torch_order(kind: str, p: int, m: int) -> list[tuple] | None:
    """torch's own order for every rank (its schedule classes' per-rank calculation, without stages), or None
    where this torch does not expose it."""
    from torch.distributed.pipelining import schedules as ts
    cls = {"zbh1": getattr(ts, "ScheduleInterleavedZeroBubble", None), "zbv": getattr(ts, "ScheduleZBVZeroBubble", None),
           "dualpipev": getattr(ts, "ScheduleDualPipeV", None)}[kind]
    if cls is None:
        return None
    obj = cls.__new__(cls)
    local = 1 if kind == "zbh1" else 2
    rounds = max(1, m // p)
    obj.__dict__.update(pp_group_size=p, _n_microbatches=m, n_local_stages=local, num_stages=p * local,
                        number_of_rounds=rounds, microbatches_per_round=m // rounds)
    try:
        out = []
        for rank in range(p):
            ops = [a for a in obj._calculate_single_rank_operations(rank) if a is not None]
            # DualPipeV's OVERLAP_F_B pairs: their forward then their backward, as its runtime runs them
            ops = [sub for a in ops for sub in (a.sub_actions if _kind(a) == "pair" else (a,))]
            out.append(tuple((a.stage_index, _kind(a), a.microbatch_index) for a in ops))
        return out
    except (AttributeError, TypeError, KeyError):
        return None


def _kind(action) -> str:
    name = action.computation_type.name   # FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD, OVERLAP_F_B
    return {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B",
            "OVERLAP_F_B": "pair"}[name]


@pytest.mark.parametrize("kind,v", KINDS)
def test_orders_are_torchs_and_pass_the_checker(kind, v):
    for p in range(2, 6):
        for m in range(1, 3 * p + 1):
            if kind == "zbh1" and m % max(1, m // p):   # torch's rounds: m a multiple of its rounds
                continue
            if kind == "dualpipev" and m < 2 * p:   # torch's ScheduleDualPipeV refuses fewer
                with pytest.raises(ConfigError, match="at least 2 x pp"):
                    build(kind, p, m, v)
                continue
            schedule = build(kind, p, m, v)
            check(schedule, m, v, kind)
            theirs = _torch_order(kind, p, m)
            if theirs is None:
                pytest.skip("this torch does not expose its zero-bubble orders")
            assert [tuple((a.stage, a.kind, a.micro_batch) for a in d) for d in schedule] == theirs, (kind, p, m)


def test_the_checker_refuses_a_weight_pass_before_its_input_pass_and_a_misplaced_v():
    schedule = build("zbh1", 2, 2)
    swapped = list(schedule[0])
    i, w = swapped.index(Action(0, "I", 0)), swapped.index(Action(0, "W", 0))
    swapped[i], swapped[w] = swapped[w], swapped[i]
    with pytest.raises(ConfigError, match="deadlock"):
        check((tuple(swapped), schedule[1]), 2, 1, "zbh1")
    swap = {2: 3, 3: 2}   # ZB-V's order with the chunks placed looped (device 0 holding chunk 2, not 3)
    looped = tuple(tuple(Action(swap.get(a.stage, a.stage), a.kind, a.micro_batch) for a in d)
                   for d in build("zbv", 2, 2, 2))
    with pytest.raises(ConfigError, match="does not hold"):
        check(looped, 2, 2, "zbv")
    with pytest.raises(ConfigError, match="exactly once"):
        check(build("1f1b", 2, 2), 2, 1, "zbh1")   # whole backwards where the split ones are expected
    order = build("dualpipev", 2, 4, 2)   # DualPipeV: a pass is a B or an I and a W, never both
    doubled = (order[0] + (Action(0, "B", 3),), order[1])
    assert any(a == Action(0, "I", 3) for a in order[0])
    with pytest.raises(ConfigError, match="chunk 0 micro-batch 3 ran"):
        check(doubled, 4, 2, "dualpipev")
    assert [device_of("zbv", s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [ParallelConfig(pp=3, schedule="zbv", virtual_stages=2).device_chunks(d) for d in range(3)] == \
        [(0, 5), (1, 4), (2, 3)]


def _passes(kind: str, f: float, i: float, w: float, r: float = 0.0):
    """Chunk action durations of even devices whose passes are f, i, w (``r``: DualPipeV's rerun of the
    recomputed forward, in ``i`` once, which a whole backward pays once and a split pass's W again)."""
    v = 2 if kind in ("zbv", "dualpipev") else 1
    return lambda a: {"F": f, "I": i, "W": w + r, "B": i + w}[a.kind] / v


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbh1_bubble_is_the_published_formula_on_even_stages(p):
    """Qi et al. (ICLR 2024) Table 2: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W), T_B the input gradient, when
    W <= min(F, I); the cost model's equals the simulated makespan's for any passes with m >= p."""
    rng = random.Random(p)
    for m in (p, p + 1, 2 * p, 4 * p):
        for f, i, w in [(1.0, 1.0, 1.0), (1.0, 1.3, 0.8), (1.2, 2.0, 0.9)]:
            published = (p - 1) * (f + i - w)
            priced = pipeline_time([f + i + w] * p, m, "zbh1", 1, [(f, i, w)] * p)
            assert priced.bubble == pytest.approx(published, rel=1e-12)
            sim = simulate(build("zbh1", p, m), 1, _passes("zbh1", f, i, w))
            assert sim.makespan == pytest.approx(priced.total, rel=1e-12)
        for _ in range(10):   # any passes, weight gradients larger than a forward too
            f, i, w = (rng.uniform(0.1, 2.0) for _ in range(3))
            sim = simulate(build("zbh1", p, m), 1, _passes("zbh1", f, i, w))
            assert sim.makespan == pytest.approx(pipeline_time([f + i + w] * p, m, "zbh1", 1, [(f, i, w)] * p).total,
                                                 rel=1e-12)
        # against 1F1B's (p - 1)(F + B): a third of it at F = I = W
        one_f_one_b = pipeline_time([3.0] * p, m, "1f1b", 1)
        assert pipeline_time([3.0] * p, m, "zbh1", 1, [(1.0, 1.0, 1.0)] * p).bubble == \
            pytest.approx(one_f_one_b.bubble / 3)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbv_is_zero_bubble_per_device_and_priced_as_its_simulation(p):
    """Published: ZB-V has no bubble at F = I = W: every device works without a gap from its first pass to
    its last. What the step waits for is the makespan, which adds the fill: (p - 1) chunk forwards; the
    cost model prices that simulation for any passes (shares rounded to 0.1%)."""
    m = 2 * p
    sim = simulate(build("zbv", p, m, 2), 2, _passes("zbv", 1.0, 1.0, 1.0))
    for d, actions in enumerate(build("zbv", p, m, 2)):
        start, end = sim.times[actions[0]][0], sim.times[actions[-1]][1]
        busy = sum(sim.times[a][1] - sim.times[a][0] for a in actions)
        assert end - start - busy == pytest.approx(0.0, abs=1e-12), d
    assert sim.makespan - 3 * m == pytest.approx((p - 1) * 0.5)
    rng = random.Random(p)
    for m in (p, 2 * p - 1, 2 * p, 3 * p + 1):
        for _ in range(6):
            f, i, w = (round(rng.uniform(0.1, 2.0), 2) for _ in range(3))
            x = f + i + w
            sim = simulate(build("zbv", p, m, 2), 2, _passes("zbv", f, i, w))
            priced = pipeline_time([x] * p, m, "zbv", 2, [(f, i, w)] * p)
            assert priced.total == pytest.approx(sim.makespan, rel=2e-3), (m, f, i, w)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_dualpipev_is_priced_as_the_simulation_of_the_order_torch_runs(p):
    """DualPipeV's published bubble, (PP/2 - 1)(F&B + B - 3W), prices its F&B pairs overlapped as DeepSeek's
    kernels run them; torch's runtime runs a pair's two passes one after the other, and the cost model prices
    that order's simulation: for any passes and recomputation (a whole backward reruns the forward once, a
    split pass twice), and any m >= 2p (each micro-batch past 2p one more steady pair of exactly the work x).
    At F = I = W without recomputation its bubble is ZB-V's, the fill (p - 1) F / 2; it holds one chunk pass
    more (test_memory_is_what_the_order_holds)."""
    rng = random.Random(p)
    for m in (2 * p, 2 * p + 1, 3 * p + 1, 4 * p):
        for _ in range(6):
            f, i, w = (round(rng.uniform(0.1, 2.0), 2) for _ in range(3))
            r = round(rng.choice([0.0, rng.uniform(0.1, 0.6) * f]), 2)
            x = f + i + w
            sim = simulate(build("dualpipev", p, m, 2), 2, _passes("dualpipev", f, i, w, r))
            priced = pipeline_time([x] * p, m, "dualpipev", 2, [(f, i, w)] * p, [r] * p)
            assert priced.total == pytest.approx(sim.makespan, rel=2e-3), (m, f, i, w, r)
            assert priced.bubble >= 0
        equal = pipeline_time([3.0] * p, m, "dualpipev", 2, [(1.0, 1.0, 1.0)] * p)
        assert equal.bubble == pytest.approx(pipeline_time([3.0] * p, m, "zbv", 2, [(1.0, 1.0, 1.0)] * p).bubble)
        assert equal.bubble == pytest.approx((p - 1) * 0.5, rel=3e-3)   # the shares rounded to 0.1%


def test_zbv_bubble_is_at_least_its_fill():
    """The even split's bound (solver/even_split.py) counts on it: a V's priced bubble (ZB-V's, DualPipeV's) is
    at least (p - 1)/2 of a device's forward, for every share of forward, weight gradient and rerun."""
    for p, m in itertools.product((2, 3, 5, 8), (1, 3, 8, 16)):
        for f in np.linspace(0.0, 1.0, 11):
            for w in np.linspace(0.0, 1.0 - f, 6):
                assert split_bubble("zbv", p, m, round(f, 3), round(w, 3)) >= (p - 1) * round(f, 3) / 2 - 1e-12
                if m >= 2 * p:
                    for r in (0.0, round(f / 3, 3)):
                        assert split_bubble("dualpipev", p, m, round(f, 3), round(w, 3), r) >= \
                            (p - 1) * round(f, 3) / 2 - 1e-12


@pytest.mark.parametrize("kind,v", KINDS)
def test_memory_is_what_the_order_holds(kind, v):
    """A pass holds its activations from its forward to its weight-gradient pass (or its whole backward). ZB-H1
    holds min(m, p) passes on every device (1F1B's first device's); ZB-V 2p chunk passes (as many layers);
    DualPipeV 2p + 1 (DeepSeek's "PP + 1", PP its chunks); the walk of min(m, 2p) micro-batches is the long
    step's."""
    rng = random.Random(0)
    for p in range(2, 7):
        cfg = ParallelConfig(pp=p, schedule=kind, virtual_stages=v)
        for m in range(2 * p if kind == "dualpipev" else 1, 4 * p):
            sim = simulate(build(kind, p, m, v), v, lambda a: 1.0)
            assert list(sim.peak_in_flight) == [in_flight(cfg, d, m) for d in range(p)]
            if kind == "zbh1":
                assert all(in_flight(cfg, d, m) == min(m, p) for d in range(p))
            elif kind == "dualpipev":
                assert all(in_flight(cfg, d, m) == 2 * p + 1 for d in range(p))
            elif m >= 2 * p:
                assert [chunk_passes(cfg, d, m) for d in range(p)] == [(2 * p - 1 - d, d + 1) for d in range(p)]
            sizes = [rng.uniform(0.1, 4.0) for _ in range(v)]
            for d, actions in enumerate(build(kind, p, m, v)):
                held = peak = 0.0
                for a in actions:
                    size = sizes[cfg.device_chunks(d).index(a.stage)]
                    held += size if a.kind == "F" else -size if a.kind in "BW" else 0.0
                    peak = max(peak, held)
                assert order_peak(cfg, d, m, sizes) == pytest.approx(peak)


@pytest.fixture(scope="module")
def gpt_graph():
    model, inputs = build_gpt(GPTConfig(vocab_size=256, seq_len=128, hidden=256, heads=4, layers=16), batch_size=1,
                              device="meta")
    return capture(model, inputs, progress=False)


def test_estimate_splits_each_device_into_its_passes(gpt_graph):
    """A stage's weight gradients are half of its matrix products' backward and all of the embedding's; the
    plan records them (Stage.wgrad_time), the loss's device is the last chunk's (device 0 under ZB-V), and
    ZB-V's turn (two chunks on the last device) sends nothing."""
    cluster = Cluster.from_spec("1x8xA100-80GB")
    base = dict(dp=2, pp=4, micro_batch_size=1)
    one = estimate_plan(gpt_graph, cluster, ParallelConfig(**base), 32)
    zbh1 = estimate_plan(gpt_graph, cluster, ParallelConfig(**base, schedule="zbh1"), 32)
    zbv = estimate_plan(gpt_graph, cluster, ParallelConfig(**base, schedule="zbv", virtual_stages=2), 32)
    for s in zbh1.stages:
        assert 0 < s.wgrad_time < s.bwd_time
    assert [s.work for s in zbh1.stages] == pytest.approx([s.work for s in one.stages])
    assert zbh1.breakdown.bubble < one.breakdown.bubble and zbv.breakdown.bubble < one.breakdown.bubble
    assert zbh1.step_time < one.step_time
    assert [s.in_flight for s in zbh1.stages] == [4, 4, 4, 4] and [s.in_flight for s in one.stages] == [4, 3, 2, 1]
    assert zbv.stages[0].chunks[0][0] == one.stages[0].layers[0] and zbv.stages[0].chunks[1][-1] == one.stages[-1].layers[-1]
    assert zbv.stages[-1].p2p_time < zbv.stages[1].p2p_time   # the turn is in memory


def _leanest(graph, pins: dict, schedule: str, v: int) -> float:
    """The least peak memory per device of the pinned configuration over partitions (the infeasible error's)."""
    tiny = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, memory=1.0))
    with pytest.raises(InfeasiblePlanError) as info:
        solve(graph, tiny, GLOBAL_BATCH, fixed={**pins, "schedule": schedule, "virtual_stages": v})
    return float(re.search(r"leanest plan needs ([0-9.e+-]+) GB", str(info.value)).group(1)) * 1e9


CLUSTER = Cluster.from_spec("1x8xA100-80GB")
GLOBAL_BATCH = 20   # 10 micro-batches a replica, not a multiple of pp: no interleaving (Megatron's order needs it)


def test_the_search_picks_zero_bubble_when_faster_and_not_when_memory_says(gpt_graph):
    """A pipeline forced by the pins (pp=4, no ZeRO, no recomputation): the search's pick is the fastest of
    the pinned schedules, each priced with its own stage partition, and that is a zero-bubble one;
    with memory for 1F1B but not for ZB-H1 (which holds p passes on every device, the head's logits on the
    last), it is not ZB-H1."""
    pins = dict(pp=4, dp=2, tp=1, micro_batch_size=1, zero=0, recompute="none")
    plan, _ = solve(gpt_graph, CLUSTER, GLOBAL_BATCH, fixed=pins, tie_tolerance=0)
    priced = {s: price(gpt_graph, CLUSTER, ParallelConfig(**pins, schedule=s, virtual_stages=v), GLOBAL_BATCH)
              for s, v in (("1f1b", 1), ("zbh1", 1), ("zbv", 2))}
    fastest = min(priced, key=lambda s: priced[s].step_time)
    assert fastest in ("zbh1", "zbv")
    assert plan.config.schedule == fastest and plan.step_time == pytest.approx(priced[fastest].step_time)
    lean = {s: _leanest(gpt_graph, pins, s, v) for s, v in (("1f1b", 1), ("zbh1", 1))}
    assert lean["1f1b"] < lean["zbh1"]
    memory = (lean["1f1b"] + lean["zbh1"]) / 2
    tight = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, memory=memory))
    plan, _ = solve(gpt_graph, tight, GLOBAL_BATCH, fixed=pins, tie_tolerance=0)
    assert plan.config.schedule != "zbh1" and plan.fits and plan.peak_memory <= memory


def test_zbv_bubble_at_2p_micro_batches_is_affine_in_p():
    """What cost_model/schedule.split_bubble's closed form rests on: at m = 2p ZB-V's simulated bubble is
    b(2) + (p - 2)(b(3) - b(2)) for every share of forward and weight gradient (simulated here in full).
    DualPipeV's is not (priced by its simulation at its p): shares F, I, W = 0.2, 0.25, 0.55 grow its bubble
    by 0.100 a device up to 5 devices and 0.125 from 6 on."""
    kind, start, r = "zbv", AFFINE_FROM["zbv"], 0.0
    rng = random.Random(7)
    for _ in range(25):
        f = round(rng.uniform(0.05, 0.6), 3)
        w = round(rng.uniform(0.0, 0.9 - f), 3)
        share = {"F": f / 2, "W": (w + r) / 2, "I": (1 - f - w) / 2, "B": (1 - f) / 2}

        def simulated(p: int) -> float:
            return simulate(build(kind, p, 2 * p, 2), 2, lambda a: share[a.kind]).makespan - 2 * p
        low, high = simulated(start), simulated(start + 1)
        for p in (start + 2, 6, 9):
            assert simulated(p) == pytest.approx(low + (p - start) * (high - low), rel=1e-9, abs=1e-12)
            assert split_bubble(kind, p, 2 * p, f, w, r) == pytest.approx(simulated(p), rel=1e-9, abs=1e-12)
    dual = [split_bubble("dualpipev", p, 2 * p, 0.2, 0.55) for p in range(2, 10)]
    slopes = [round(b - a, 3) for a, b in zip(dual, dual[1:])]
    assert slopes[:3] == [0.1] * 3 and slopes[-2:] == [0.125] * 2


def test_a_split_backward_reruns_the_recomputed_forward_in_both_passes(gpt_graph):
    """The input- and the weight-gradient pass each unpack a recomputed layer's checkpoint, so each reruns
    its forward (torch.utils.checkpoint; the runtime's count in tests/unit/codegen/test_pipeline.py): a
    zero-bubble plan pays recomputation twice, once in each pass; per-op recomputation, whose
    selective checkpoint allows one backward, is refused."""
    base = dict(dp=2, pp=4, micro_batch_size=1, recompute="full")
    one = estimate_plan(gpt_graph, CLUSTER, ParallelConfig(**base), 32)
    split = estimate_plan(gpt_graph, CLUSTER, ParallelConfig(**base, schedule="zbh1"), 32)
    assert [s.recompute_time for s in split.stages] == pytest.approx([2 * s.recompute_time for s in one.stages])
    assert split.breakdown.recompute == pytest.approx(2 * one.breakdown.recompute)
    assert split.hardware_flops - split.model_flops == pytest.approx(2 * (one.hardware_flops - one.model_flops))
    with pytest.raises(ConfigError, match="per-op recomputation"):
        ParallelConfig(**{**base, "recompute": "op"}, schedule="zbv", virtual_stages=2)


def test_the_search_picks_dualpipev_when_faster_and_not_when_memory_says(gpt_graph):
    """Under full recomputation ZB-H1 and ZB-V rerun each forward twice a micro-batch, DualPipeV only in the
    passes its warm-up and drain split: its plan is the fastest of the pinned schedules' best plans and the
    search picks it; with memory between ZB-V's leanest plan and DualPipeV's (which holds one chunk pass
    more), it does not."""
    pins = dict(pp=4, dp=2, tp=1, micro_batch_size=1, zero=0, recompute="full")
    best = {s: solve(gpt_graph, CLUSTER, GLOBAL_BATCH, fixed={**pins, "schedule": s, "virtual_stages": v},
                     tie_tolerance=0)[0] for s, v in (("1f1b", 1), ("zbh1", 1), ("zbv", 2), ("dualpipev", 2))}
    plan, _ = solve(gpt_graph, CLUSTER, GLOBAL_BATCH, fixed=pins, tie_tolerance=0)
    assert plan.config.schedule == "dualpipev"
    assert plan.step_time == pytest.approx(best["dualpipev"].step_time)
    assert all(best["dualpipev"].step_time < p.step_time for s, p in best.items() if s != "dualpipev")
    lean = {s: _leanest(gpt_graph, pins, s, 2) for s in ("zbv", "dualpipev")}
    assert lean["zbv"] < lean["dualpipev"]
    memory = (lean["zbv"] + lean["dualpipev"]) / 2
    tight = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, memory=memory))
    plan, _ = solve(gpt_graph, tight, GLOBAL_BATCH, fixed=pins, tie_tolerance=0)
    assert plan.config.schedule != "dualpipev" and plan.fits and plan.peak_memory <= memory
