"""autopar.plan end to end: model families x clusters, fixed fields, determinism, time limit,
alternatives, the infeasible error, bad arguments."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar import Cluster, ConfigError, InfeasiblePlanError, Precision
from autopar.capture import capture
from autopar.models import GPTConfig, build_gpt, registry
from autopar.solver import solve
from autopar.solver.choice import moving_parts
from autopar.solver.sharding_solver import ShardingSolver
from suite import ALL_CASES

pytest.importorskip("transformers", reason="the Hugging Face models are the optional dev extra")
from autopar.models.hf import build_hf_bert, build_hf_gpt2, build_hf_llama  # noqa: E402

CLUSTERS = ["1x2xcpu", "1x8xA100-80GB", "4x8xA100-80GB", "64x8xH100-SXM"]


def _small_cnn():
    return registry.build("small-cnn", batch_size=2, device="meta")


MODELS = {
    "small-cnn": _small_cnn,
    "hf-gpt2": lambda: build_hf_gpt2(device="meta"),
    "hf-llama": lambda: build_hf_llama(device="meta"),
    "hf-bert": lambda: build_hf_bert(device="meta"),
}


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name, builder in MODELS.items():
        model, inputs = builder()
        out[name] = capture(model, inputs)
    return out


_SOLVERS: dict[tuple[str, str], ShardingSolver] = {}


def _solve(graphs, name: str, spec: str, gbs: int, **kwargs):
    """solve(), with one ShardingSolver per model and cluster shared by this module's tests (the plans
    are those of a solver of their own; each sharding ILP is solved once)."""
    if (name, spec) not in _SOLVERS:
        cluster = Cluster.from_spec(spec)
        _SOLVERS[name, spec] = ShardingSolver(graphs[name], cluster, Precision.for_device(cluster.device.name))
    return solve(graphs[name], Cluster.from_spec(spec), gbs, sharding=_SOLVERS[name, spec], **kwargs)


# make bench (AUTOPAR_ALL_CASES=1) plans every family on every cluster; the suite plans every family on
# 2 CPUs, the decoders on 8 A100s, and the large clusters on one family each (an HF model on 4 nodes
# costs 10-26 s).
PAIRS = [(n, c) for n in MODELS for c in CLUSTERS
         if ALL_CASES or c == CLUSTERS[0] or (n, c) in {("hf-llama", "1x8xA100-80GB"), ("hf-gpt2", "1x8xA100-80GB"),
                                                       ("hf-llama", "4x8xA100-80GB"), ("small-cnn", "64x8xH100-SXM")}]


@pytest.mark.parametrize("name,spec", PAIRS)
def test_plans_for_every_family_and_cluster(graphs, name, spec):
    graph = graphs[name]
    cluster = Cluster.from_spec(spec)
    gbs = 4 * cluster.devices
    plan, stats = _solve(graphs, name, spec, gbs)
    assert plan.fits and plan.peak_memory <= cluster.device.memory
    assert plan.config.devices == cluster.devices
    assert plan.global_batch_size == gbs and plan.step_time > 0
    # optimal unless a sharding ILP hit its wall-clock limit (it can on a loaded machine: then the
    # plan must say so rather than claim optimality)
    assert plan.optimal is (stats.ilp_stopped_early == 0) and plan.gap is None
    # every layer lands on exactly one stage, in order
    layers = [name for s in plan.stages for name in s.layers]
    assert sorted(layers) == sorted(layer.name for layer in graph.layers)
    assert stats.evaluated >= 1 and stats.evaluated + stats.pruned_bound + stats.pruned_memory \
        + stats.dominated == stats.candidates
    fastest = min([plan.step_time] + [a.step_time for a in plan.alternatives if a.fits])
    assert plan.step_time <= fastest * 1.01 * (1 + 1e-9)   # the default tie tolerance
    for alt in plan.alternatives:   # faster ones are ties the plan won on fewer moving parts
        assert (alt.fits is False or alt.step_time >= plan.step_time
                or (alt.reason.startswith("faster by") and moving_parts(alt.config) > moving_parts(plan.config)))
    # the plan survives JSON and reloads equal
    again = autopar.Plan.from_dict(json.loads(plan.to_json()))
    assert again.to_json() == plan.to_json()


@pytest.mark.parametrize("name,batch,gbs", [("gpt2-small", 1, 64)] + [("resnet50", 2, 256)] * ALL_CASES)
def test_small_model_gets_data_parallel(name, batch, gbs):
    """GPT-2 small (124M) and ResNet-50 (26M) on 8 A100s: a replica fits on every GPU, so neither
    tensor nor pipeline parallelism pays. (The tiny test CNN would not do: its ops are so small
    that kernel launches dominate and duplicated compute is free.)"""
    model, inputs = registry.build(name, batch_size=batch, device="meta")
    plan, _ = solve(capture(model, inputs), Cluster.from_spec("1x8xA100-80GB"), gbs)
    assert (plan.config.tp, plan.config.pp, plan.config.dp) == (1, 1, 8)


def test_deterministic_json_however_slow_the_machine(monkeypatch):
    """autopar.plan with its default arguments gives the same plan, byte for byte, when every clock
    read says 1000 s have passed since the last: a machine as slow (or as loaded) as can be. A load
    changes nothing a plan reads but the clock, so a clock limit anywhere (the search's, a sharding
    ILP's) is what would change the plan; each ILP is bounded by branch-and-bound nodes instead, and
    no solver is handed a clock limit of its own (HiGHS and CBC read their own clocks). The second plan
    solves every ILP again (nothing from the first's memory: ilp_solvers._SOLVED)."""
    import itertools
    import time
    from autopar.solver import ilp_solvers
    from autopar.solver.sharding import lp_solvers
    model, inputs = build_hf_llama(device="meta")
    cluster = Cluster.from_spec("1x4xA100-80GB")   # tensor, pipeline and data parallelism all in play
    idle = autopar.plan(model, cluster, inputs, global_batch_size=64, verbose=False)
    ticks, real = itertools.count(), time.perf_counter
    slow = lambda: real() + 1000.0 * next(ticks)   # noqa: E731
    monkeypatch.setattr(time, "perf_counter", slow)
    monkeypatch.setattr(time, "monotonic", slow)
    monkeypatch.setattr(ilp_solvers, "_SOLVED", type(ilp_solvers._SOLVED)())   # every ILP solved again
    loaded = autopar.plan(model, cluster, inputs, global_batch_size=64, verbose=False)
    assert next(ticks) > 10   # the planner did read the clock
    monkeypatch.undo()
    assert idle.optimal and idle.to_json() == loaded.to_json()
    solvers = lp_solvers()
    assert solvers and all(solver.timeLimit is None for _, solver in solvers)


def test_fixed_pins_fields(graphs):
    plan, _ = _solve(graphs, "hf-gpt2", "1x8xA100-80GB", 32, fixed={"tp": 2, "pp": 2, "recompute": "full"})
    assert (plan.config.tp, plan.config.pp, plan.config.dp) == (2, 2, 2)
    assert plan.config.recompute == "full" and not plan.config.stage_recompute


def test_fixed_rejects_unknown_and_bad_values(graphs):
    cluster = Cluster.from_spec("1x8xA100-80GB")
    with pytest.raises(ConfigError, match="unknown field"):
        solve(graphs["hf-gpt2"], cluster, 32, fixed={"tensor_parallel": 2})
    with pytest.raises(ConfigError, match="zero"):
        solve(graphs["hf-gpt2"], cluster, 32, fixed={"zero": 5})
    with pytest.raises(ConfigError, match="time_limit"):
        solve(graphs["hf-gpt2"], cluster, 32, time_limit=-1)
    with pytest.raises(ConfigError, match="global_batch_size"):
        solve(graphs["hf-gpt2"], cluster, 0)


def test_fixed_that_matches_nothing_says_why(graphs):
    with pytest.raises(InfeasiblePlanError, match="no configuration of 8 devices"):
        _solve(graphs, "hf-gpt2", "1x8xA100-80GB", 32, fixed={"tp": 3})


def test_time_limit_returns_best_so_far(graphs):
    cluster = Cluster.from_spec("4x8xA100-80GB")
    full, stats_full = _solve(graphs, "hf-llama", "4x8xA100-80GB", 128)
    assert stats_full.evaluated > 1  # else a limit cannot cut anything short
    quick, stats = solve(graphs["hf-llama"], cluster, 128, time_limit=1e-9)
    assert stats.timed_out and stats.evaluated == 1
    assert quick.optimal is False and any("time_limit" in n for n in quick.notes)
    assert quick.step_time >= full.step_time


def test_infeasible_error_says_what_to_change():
    """GPT-3's layer shape (h=12288, 96 heads, V=51200, s=2048) with 4 layers: 7.9B parameters,
    whose weights, gradients and AdamW states (16 bytes each) alone exceed one 80 GB device."""
    model, inputs = build_gpt(GPTConfig(vocab_size=51200, hidden=12288, heads=96, layers=4, seq_len=2048),
                              batch_size=1, device="meta")
    graph = capture(model, inputs)
    with pytest.raises(InfeasiblePlanError) as err:
        solve(graph, Cluster.from_spec("1x1xA100-80GB"), 8, fixed={"offload": "none"})
    msg = str(err.value)
    assert "leanest plan needs" in msg and "per device" in msg and "80 GB" in msg
    assert "host memory (offload='none' is pinned" in msg   # offloaded, it fits (tests/unit/cost_model/test_offload.py)
    assert "more devices" in msg and "a device with more than" in msg
    need = float(msg.split("leanest plan needs ")[1].split(" GB")[0])
    # 7.9e9 parameters x 16 bytes on one device is 126 GB: no plan is below
    assert need > graph.param_numel * 16 / 1e9


def test_alternatives_explain_why_they_lost(graphs):
    plan, _ = _solve(graphs, "hf-gpt2", "1x8xA100-80GB", 32)
    assert plan.alternatives
    for alt in plan.alternatives:
        assert alt.reason.split(" by ")[0] in ("slower", "faster") or alt.reason.startswith("does not fit")
    assert "runners-up (plan.explain() says why each lost):" in plan.summary()


def test_public_plan_entry_point():
    model, inputs = build_hf_gpt2(device="meta")
    plan = autopar.plan(model, Cluster.from_spec("1x2xcpu"), inputs, global_batch_size=8)
    assert plan.fits and plan.config.devices == 2 and plan.extra["search"]["evaluated"] >= 1
