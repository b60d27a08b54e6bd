"""Property-based checks (hypothesis) of the cost model, the solver and the plan file format.

Cost model (``estimate_plan``, with the sharding ILP's layouts), on three small graphs captured once per module: a GPT with
eager attention (selective recomputation has an attention core to drop), a Mixtral-style MoE
with fused attention (context and expert parallelism apply) and a plain MLP (no attention, every
layer recomputable). Configurations are drawn valid by construction (``configs`` below): any
split of the devices into dp x cp x tp x pp that the graph accepts, ep dividing dp, any schedule,
virtual stages, ZeRO stage, recompute mode, per-stage recompute, sequence parallelism and micro-
batching. Clusters: 1-4 nodes of 1-8 devices (3 and 6 per node too, where mesh groups land
unevenly on the nodes) of the A100, H100, V100 and CPU presets. Properties: more bandwidth is
never slower; twice the devices as twice the data-parallel replicas never use more memory per
device; a higher ZeRO stage never uses more memory per device (ZeRO 2 -> 3 as the model states it).

Solver (``solve``): the plan it returns fits, whatever the device memory; otherwise it raises
InfeasiblePlanError.

Plan JSON: random valid plans (every field, optional ones included, unicode, extreme finite
floats, free-form ``extra`` and ``sharding``) survive ``to_dict`` -> JSON -> ``from_dict`` and
``save`` -> ``load_plan`` unchanged, and write the same bytes again.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar import Cluster, InfeasiblePlanError, ParallelConfig, Plan
from autopar.capture import OpKind, capture
from autopar.plan.structure import Anchor, ModelStructure
from autopar.hardware import COLLECTIVE_NAMES, CollectiveFit, Device, Link
from autopar.presets import DEVICE_PRESETS
from autopar.config import RECOMPUTE_MODES, Precision
from autopar.cost_model import Estimator, context_parallel, estimate_plan, expert_parallel
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.plan import MemoryBreakdown, OpId, OpSharding, Partial, Replicate, Shard, ShardingGroup
from autopar.models import GPTConfig, MixtralConfig, build_gpt, build_mixtral, build_mlp
from suite import ALL_CASES
from autopar.plan import Alternative, Stage, TimeBreakdown
from autopar.solver import ShardingSolver, solve

GPT = GPTConfig(vocab_size=256, hidden=128, heads=4, layers=4, seq_len=64, dropout=0.0)   # eager attention
MOE = MixtralConfig(vocab_size=256, hidden=64, heads=4, kv_heads=2, layers=2, ffn_hidden=128, seq_len=32,
                    num_experts=4, top_k=2)
DEVICES = ("A100-80GB", "H100-SXM", "V100-32GB", "cpu")

# An example of the cost-model properties costs a few ms to 0.1 s (the solver's: 0.1-2 s). The suite
# draws a third of the examples make bench draws (AUTOPAR_ALL_CASES=1); both derandomized, so each run
# draws the same ones. No deadline: the first examples warm caches.
COST_SETTINGS = settings(max_examples=150 if ALL_CASES else 50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _mlp_loss(out, inputs):
    return out.float().pow(2).mean()


@pytest.fixture(scope="module")
def graphs():
    """name -> OpGraph, each model captured once (torch.export costs about a second)."""
    gpt_model, gpt_inputs = build_gpt(GPT, batch_size=1, device="meta")
    moe_model, moe_inputs = build_mixtral(MOE, batch_size=1, device="meta")
    mlp_model, mlp_inputs = build_mlp(batch_size=4, device="meta")
    out = {"gpt": capture(gpt_model, gpt_inputs), "moe": capture(moe_model, moe_inputs),
           "mlp": capture(mlp_model, mlp_inputs, _mlp_loss)}
    # what the generators below rely on: selective recompute has an attention core to drop in the
    # GPT, the MoE accepts cp and ep, the MLP has no attention
    assert any(n.attention_core for n in out["gpt"].nodes)
    assert context_parallel.unsupported(out["moe"], 2) is None and expert_parallel.unsupported(out["moe"], 2) is None
    assert context_parallel.unsupported(out["mlp"], 2) is not None
    return out


# --- strategies: clusters and configurations ---------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


cluster_shapes = st.tuples(st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from(DEVICES))


def _spec(nodes: int, per_node: int, device: str) -> str:
    return f"{nodes}x{per_node}x{device}"


@st.composite
def configs(draw, graph, devices: int, micro_batch_multiple: int = 1, zero: int | None = None):
    """(ParallelConfig, global batch) valid for ``graph`` on ``devices`` devices.

    The micro-batches per pipeline are a multiple of ``micro_batch_multiple`` (and of pp under
    the interleaved schedule, as Megatron's order needs)."""
    layers = len(graph.layers)
    blocks = sum(1 for layer in graph.layers if layer.is_block)
    tp = draw(st.sampled_from(_divisors(devices)))
    pp = draw(st.sampled_from([d for d in _divisors(devices // tp) if d <= layers]))
    cp = draw(st.sampled_from([d for d in _divisors(devices // (tp * pp))
                               if context_parallel.unsupported(graph, d) is None]))
    dp = devices // (tp * pp * cp)
    ep = draw(st.sampled_from([d for d in _divisors(dp) if expert_parallel.unsupported(graph, d) is None]))
    virtual = [v for v in (1, 2, 4) if pp > 1 and blocks % (pp * v) == 0 and pp * v <= layers]
    schedule = draw(st.sampled_from(["gpipe", "1f1b"] + (["interleaved"] if virtual else [])))
    v = draw(st.sampled_from(virtual)) if schedule == "interleaved" else 1
    m = draw(st.integers(1, 6)) * micro_batch_multiple * (pp if schedule == "interleaved" else 1)
    mbs = draw(st.sampled_from([1, 2, 4]))
    stage_recompute = ()
    if pp > 1 and schedule != "interleaved" and draw(st.booleans()):
        stage_recompute = tuple(draw(st.lists(st.sampled_from(RECOMPUTE_MODES), min_size=pp, max_size=pp)))
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch_size=mbs, schedule=schedule,
                         virtual_stages=v, zero=draw(st.integers(0, 3)) if zero is None else zero,
                         recompute=draw(st.sampled_from(RECOMPUTE_MODES)),
                         sequence_parallel=tp > 1 and draw(st.booleans()), stage_recompute=stage_recompute)
    return cfg, dp * mbs * m


_SOLVERS: dict = {}


def _estimate(graph, cluster: Cluster, cfg: ParallelConfig, gbs: int, chunks=None, layouts_from: Cluster | None = None):
    """``estimate_plan`` with the sharding ILP's layout (its ``fast-whole-batch`` variant, which runs any
    micro-batch) solved on ``layouts_from`` (default ``cluster``): comparisons between two clusters
    price the same layout, so that they test the cost model, not the ILP's choice."""
    source = layouts_from or cluster
    key = (id(graph), source)
    if key not in _SOLVERS:
        _SOLVERS[key] = ShardingSolver(graph, source, Precision.for_device(source.device.name))
    precision = Precision.for_device(cluster.device.name)
    layers = LayerCostModel(graph, cluster, precision, layout_fn=_SOLVERS[key].layout_fn("fast-whole-batch"))
    return estimate_plan(graph, cluster, cfg, gbs, precision, Estimator(graph, cluster, precision, layers),
                         chunks=chunks)


def _chunks(plan: Plan, graph) -> list[list[int]]:
    """The plan's layer partition as ``estimate_plan(chunks=...)`` takes it: model chunk ``c`` is
    chunk ``c // pp`` of pipeline device ``c % pp``."""
    index = {layer.name: layer.index for layer in graph.layers}
    pp = plan.config.pp
    return [[index[name] for name in plan.stages[c % pp].chunks[c // pp]]
            for c in range(pp * plan.config.virtual_stages)]


# --- 1a: bandwidth -------------------------------------------------------------------------------
@COST_SETTINGS
@given(data=st.data(), shape=cluster_shapes, model=st.sampled_from(["gpt", "moe", "mlp"]),
       intra=st.floats(1e9, 1e12), inter=st.floats(1e8, 1e11), more_intra=st.floats(1.0, 100.0),
       more_inter=st.floats(1.0, 100.0), overlap=st.sampled_from([1.0, 0.5, 0.0]))
def test_more_bandwidth_is_never_slower(graphs, data, shape, model, intra, inter, more_intra, more_inter, overlap):
    """For any valid configuration, raising the intra-node and/or inter-node link bandwidth
    (factors >= 1, each possibly exactly 1) never raises the predicted step time:
    ``step(B_intra * f, B_inter * g) <= step(B_intra, B_inter) * (1 + 1e-9)`` for ``f, g >= 1``.

    Both clusters come from ``Cluster.from_spec`` with bandwidth overrides (so both links have
    efficiency 1 and the same latencies), and share the links' overlap fraction (1 as NCCL,
    0.5 and 0 as a measured gloo might). The layer partition is the estimator's own choice in both
    (Megatron's even split, or the time-balanced one when the blocks do not divide evenly).
    Tolerance 1e-9 relative: the step time is a sum of float terms, and a faster link can move
    the slowest stage or the step's tail to another device, which sums the same terms in
    another order."""
    nodes, per_node, device = shape
    graph = graphs[model]
    cfg, gbs = data.draw(configs(graph, nodes * per_node), label="config")

    def cluster(b_intra: float, b_inter: float) -> Cluster:
        cl = Cluster.from_spec(_spec(nodes, per_node, device), intra_node_bandwidth=b_intra,
                               inter_node_bandwidth=b_inter)
        return dataclasses.replace(cl, intra_node=dataclasses.replace(cl.intra_node, overlap=overlap),
                                   inter_node=dataclasses.replace(cl.inter_node, overlap=overlap))

    slow = _estimate(graph, cluster(intra, inter), cfg, gbs)
    fast = _estimate(graph, cluster(intra * more_intra, inter * more_inter), cfg, gbs,
                     layouts_from=cluster(intra, inter))
    assert fast.step_time <= slow.step_time * (1 + 1e-9), (cfg.short(), slow.breakdown, fast.breakdown)


def test_uneven_mesh_is_priced(graphs):
    """Regression (found by the bandwidth property on 2 nodes of 6): dp=3 x tp=4 puts two of each
    data-parallel group's three ranks on one node and one on the other. place_axes prices such a
    group conservatively as 3 nodes of 1 rank, which collective_time used to refuse ("does not
    fit ... nodes <= 2; build placements with place_axes()"), so ``autopar.estimate`` failed on a
    valid configuration. It is now priced, and no cheaper than the same configuration inside one
    node of 12 (every hop over NVLink)."""
    cfg = ParallelConfig(dp=3, tp=4)
    two_nodes = _estimate(graphs["gpt"], Cluster.from_spec("2x6xA100-80GB"), cfg, 3)
    one_node = _estimate(graphs["gpt"], Cluster.from_spec("1x12xA100-80GB"), cfg, 3,
                         layouts_from=Cluster.from_spec("2x6xA100-80GB"))
    assert two_nodes.breakdown.dp_comm > one_node.breakdown.dp_comm > 0
    assert two_nodes.step_time > one_node.step_time


# --- 1b: more devices ----------------------------------------------------------------------------
@COST_SETTINGS
@given(data=st.data(), shape=cluster_shapes, model=st.sampled_from(["gpt", "moe", "mlp"]),
       grow_nodes=st.booleans(), scale_batch=st.booleans())
def test_more_devices_never_more_memory_per_device(graphs, data, shape, model, grow_nodes, scale_batch):
    """Twice the devices of the same kind used as twice the data-parallel replicas never raise
    any device's memory.

    Configuration A runs (dp, cp, tp, pp, ep, micro-batch size, schedule, ZeRO, recompute, ...) on
    a cluster of D devices; B is the same configuration with dp doubled on a cluster of 2D (twice
    the nodes, or twice the devices per node), with the same layer partition as A (``chunks=``).
    With the global batch doubled, each replica sees the same micro-batches (same size, same
    number m); with the global batch kept, each replica gets m/2 micro-batches. For every pipeline
    stage s:

        memory_B(s) <= memory_A(s), part by part (weights, gradients, optimizer, activations, buffers)

    because model states are the same per device, divided by the ZeRO group (dp * cp, experts
    dp * cp / ep) that only grows, activations are one micro-batch's bytes (the same) times the
    micro-batches in flight (min(m, ...), which does not grow with fewer micro-batches), and
    buffers depend on neither, but for one: under ZeRO-0/1 the gradient bucket the reducer flattens,
    which exists from two replicas on and grows with the group (runtime/buckets.py, as Megatron-Core's):
    the buffers less that bucket never grow. Without ZeRO and with the batch doubled nothing else
    changes, so there the memory is equal but for the bucket. Exact comparisons: each part is the same
    float expression of the same inputs, with a larger divisor or a smaller count (float division,
    multiplication and addition are monotone)."""
    nodes, per_node, device = shape
    graph = graphs[model]
    cfg, gbs = data.draw(configs(graph, nodes * per_node, micro_batch_multiple=1 if scale_batch else 2),
                         label="config")
    small = Cluster.from_spec(_spec(nodes, per_node, device))
    big = Cluster.from_spec(_spec(2 * nodes, per_node, device) if grow_nodes else _spec(nodes, 2 * per_node, device))
    a = _estimate(graph, small, cfg, gbs)
    b = _estimate(graph, big, dataclasses.replace(cfg, dp=2 * cfg.dp), 2 * gbs if scale_batch else gbs,
                  chunks=_chunks(a, graph), layouts_from=small)
    assert b.micro_batches == (a.micro_batches if scale_batch else a.micro_batches // 2)
    assert [s.layers for s in b.stages] == [s.layers for s in a.stages]
    grown = 0.0
    for sa, sb in zip(a.stages, b.stages):
        for part in ("params", "grads", "optimizer", "activations"):
            assert getattr(sb.memory, part) <= getattr(sa.memory, part), (part, sa.index, cfg.short())
        bucket_a, bucket_b = _bucket(a, sa), _bucket(b, sb)
        assert sb.memory.buffers - bucket_b <= sa.memory.buffers - bucket_a, (sa.index, cfg.short())
        assert sb.memory.total - bucket_b <= sa.memory.total - bucket_a
        grown = max(grown, bucket_b - bucket_a)
        if cfg.zero == 0 and scale_batch:
            assert dataclasses.replace(sb.memory, buffers=sb.memory.buffers - bucket_b) == \
                dataclasses.replace(sa.memory, buffers=sa.memory.buffers - bucket_a)
    assert b.peak_memory <= a.peak_memory + grown


def _bucket(plan, stage) -> float:
    """The data-parallel gradient bucket a stage's buffers count (Estimator.buffer_bytes): ZeRO-0/1 over 2+
    replicas, at most the stage's gradients."""
    from autopar.runtime.buckets import dp_bucket_bytes
    cfg = plan.config
    if cfg.zero > 1 or cfg.grad_replicas < 2:
        return 0.0
    return min(float(dp_bucket_bytes(cfg.grad_replicas, plan.precision.grad_bytes)), float(stage.memory.grads))


# --- 1c: ZeRO stages -----------------------------------------------------------------------------
def _largest_unit_params(graph, chunks) -> int:
    """Elements of the largest ZeRO-3 unit among a stage's ``chunks`` (ModelStructure.shard_units: a
    repeated block alone, a run of the other layers together, the small runs in one), whole (before tensor or expert
    parallelism split it), tied parameters included: an upper bound on what ZeRO-3 gathers at once."""
    index = {layer.name: i for i, layer in enumerate(graph.layers)}

    def numel(i: int) -> int:
        layer = graph.layers[i]
        return sum(graph.params[p].numel for p in layer.params + layer.shared_params if p in graph.params)

    return max(sum(numel(i) for i in unit) for chunk in chunks
               for unit in graph.structure.shard_units([index[n] for n in chunk], lambda i: numel(i) > 0).units)


@COST_SETTINGS
@given(data=st.data(), shape=cluster_shapes, model=st.sampled_from(["gpt", "moe", "mlp"]))
def test_higher_zero_stage_never_more_memory(graphs, data, shape, model):
    """Raising the ZeRO stage (everything else the same, dp * cp >= 1) never raises any stage's
    model-state memory (weights + gradients + optimizer state) and leaves its activations alone.
    Its total memory never grows from ZeRO 0 to 1.

    From ZeRO 1 to 2 it may grow, by what FSDP2 (the runtime's ZeRO-2) holds beside the model states: the
    weights' shards beside the gathered weights (``w P / N``) and two units of gradients being
    reduce-scattered (``2 g P_max``), which bench/step_memory.py measures in the programs (at dp * cp = 2,
    ZeRO-2 holds about what ZeRO-1 does); so ``total_2 - total_1 <= w P / N + 2 g P_max``.

    From ZeRO 2 to 3 the total may grow, for a legitimate reason: ZeRO-3 shards the weights
    (saving ``w * P * (1 - 1/N)`` bytes for ``P`` parameters held and ``N = dp * cp`` ranks) but
    gathers whole units to compute (a repeated block, or a run of the other layers such as the final
    norm and head), and the model holds two gathered units at a time (the one computing and the one
    prefetched: ``2 w P_max`` bytes for the largest unit ``P_max``). With
    dp * cp = 1 nothing is saved, and a stage of one or a few layers (dp=2, pp=8 on the 8-layer
    GPT: every stage) gathers more than sharding saves, as with FSDP, where a layer's unsharded
    weights exist while it computes. So the property for 2 -> 3 is the one the model states:

        total_3 - total_2 <= 2 w P_max        (it grows by at most the two gathered units)
        total_3 <= total_2  whenever  w P (1 - 1/N_e) >= 2 w P_max

    with ``N_e = dp * cp / ep`` (experts shard over fewer ranks, so this bounds the saving from
    below) and ``P_max`` the largest unit whole (an upper bound for its tensor-parallel part).
    Tolerance 1e-9 relative on these two: they compare sums formed in different orders."""
    nodes, per_node, device = shape
    graph = graphs[model]
    cfg, gbs = data.draw(configs(graph, nodes * per_node, zero=0), label="config")
    cluster = Cluster.from_spec(_spec(nodes, per_node, device))
    plans = [_estimate(graph, cluster, dataclasses.replace(cfg, zero=k), gbs) for k in range(4)]
    w = plans[0].precision.weight_bytes
    for k in range(3):
        for lo, hi in zip(plans[k].stages, plans[k + 1].stages):
            assert hi.layers == lo.layers
            states_lo = lo.memory.params + lo.memory.grads + lo.memory.optimizer
            states_hi = hi.memory.params + hi.memory.grads + hi.memory.optimizer
            assert states_hi <= states_lo, (k, lo.index, cfg.short())
            assert hi.memory.activations == lo.memory.activations
            if k == 0:
                assert hi.memory.total <= lo.memory.total, (k, lo.index, cfg.short())
                continue
            largest = w * _largest_unit_params(graph, lo.chunks)
            if k == 1:
                shards = w * cfg.zero_shard(lo.param_count, lo.expert_param_count)
                grads = plans[0].precision.grad_bytes / w * largest
                assert hi.memory.total - lo.memory.total <= (shards + 2 * grads) * (1 + 1e-9), (lo.index, cfg.short())
                continue
            assert hi.memory.total - lo.memory.total <= 2 * largest * (1 + 1e-9)
            if w * lo.param_count * (1 - 1 / cfg.expert_replicas) >= 2 * largest:
                assert hi.memory.total <= lo.memory.total * (1 + 1e-9), (lo.index, cfg.short())


# --- 2: the solver's plan fits -------------------------------------------------------------------
def _with_memory(cluster: Cluster, memory: float) -> Cluster:
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory=memory))


_SOLVERS: dict[tuple[str, str], ShardingSolver] = {}


def _solver(graph, spec: str) -> ShardingSolver:
    """One ShardingSolver per cluster spec: it serves every device memory of its cluster
    (ShardingSolver.serves), so the examples of one spec solve each sharding ILP once."""
    key = (graph.content_hash, spec)
    if key not in _SOLVERS:
        cluster = Cluster.from_spec(spec)
        _SOLVERS[key] = ShardingSolver(graph, cluster, Precision.for_device(cluster.device.name))
    return _SOLVERS[key]


@settings(max_examples=15 if ALL_CASES else 5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(["1x1xA100-80GB", "1x2xA100-80GB", "1x4xH100-SXM", "2x2xA100-80GB", "2x4xH100-SXM",
                             "4x2xV100-32GB", "1x4xcpu"]),
       gbs=st.sampled_from([1, 2, 4, 6, 8, 16]), log2_memory=st.floats(-7.0, 1.0),
       fixed=st.sampled_from([None, {"zero": 0}, {"recompute": "none"}, {"micro_batch_size": 1}, {"pp": 2}]))
def test_solver_plan_always_fits(graphs, plan_dir, spec, gbs, log2_memory, fixed):
    """``solve`` either returns a plan that fits or raises InfeasiblePlanError; never a plan
    that does not fit. A returned plan has ``fits`` true, ``peak_memory <= device memory``, every
    stage's memory total within the device memory, ``peak_memory`` the largest of them, the
    cluster's device count and the asked global batch.

    Device memory runs from roomy to nothing fits: ``2**u`` times the memory the whole model needs
    on one device (dp = tp = pp = 1, the whole batch as one micro-batch), u in [-7, 1]; a few
    pins (``fixed``) remove the leanest choices. When it raises, the message's "leanest plan
    needs X GB" exceeds the device memory (X has 3 significant digits: 0.5% slack). A returned plan
    also survives JSON (``_check_round_trip``, property 3)."""
    graph = graphs["gpt"]
    cluster = Cluster.from_spec(spec)
    whole = estimate_plan(graph, Cluster.from_spec(f"1x1x{cluster.device.name}"), ParallelConfig(micro_batch_size=gbs),
                          gbs).peak_memory
    memory = whole * 2.0 ** log2_memory
    cluster = _with_memory(cluster, memory)
    try:
        plan, _ = solve(graph, cluster, gbs, fixed=fixed, sharding=_solver(graph, spec))
    except InfeasiblePlanError as exc:
        need = re.search(r"leanest plan needs ([0-9.e+-]+) GB", str(exc))
        if need is not None:
            assert float(need.group(1)) * 1e9 > memory * (1 - 5e-3), str(exc)
        else:   # no configuration at all matches the pins (e.g. pp=2 on one device)
            assert fixed is not None and "no configuration" in str(exc), str(exc)
        return
    assert plan.fits and plan.peak_memory <= memory
    assert all(s.memory.total <= memory for s in plan.stages)
    assert plan.peak_memory == max(s.memory.total for s in plan.stages)
    assert plan.config.devices == cluster.devices and plan.global_batch_size == gbs
    assert all(plan.config.to_dict()[k] == v for k, v in (fixed or {}).items())
    _check_round_trip(plan, plan_dir)   # a searched plan: sharding groups, alternatives, the search's extra


# --- 3: plan JSON round trip ---------------------------------------------------------------------
# Numbers a plan holds are finite and non-negative (docs/plan-format.md); up to 1e300 so that the
# sums a consistent plan forms (step time, memory totals) stay finite. Subnormals included.
non_negative = st.floats(min_value=0.0, max_value=1e300)
positive = st.floats(min_value=0.0, max_value=1e300, exclude_min=True)
fraction = st.floats(min_value=0.0, max_value=1.0, exclude_min=True)
texts = st.text(max_size=16)                     # any unicode but lone surrogates (not UTF-8)
names = st.text(min_size=1, max_size=12)
counts = st.integers(0, 10 ** 15)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=10)


@st.composite
def links(draw) -> Link:
    fits = draw(st.dictionaries(st.sampled_from(COLLECTIVE_NAMES),
                                st.builds(CollectiveFit, latency=non_negative, bandwidth=positive), max_size=3))
    return Link(bandwidth=draw(positive), latency=draw(non_negative), efficiency=draw(fraction), name=draw(texts),
                overlap=draw(st.floats(0.0, 1.0)), context_latency=draw(non_negative),
                context_latency_p2p=draw(non_negative), collectives=fits)


@st.composite
def devices(draw) -> Device:
    if draw(st.booleans()):
        return DEVICE_PRESETS[draw(st.sampled_from(sorted(DEVICE_PRESETS)))]
    dtypes = ["fp32", "bf16", "fp16"] + (["tf32"] if draw(st.booleans()) else [])
    return Device(name=draw(names), peak_flops={d: draw(positive) for d in dtypes}, memory=draw(positive),
                  memory_bandwidth=draw(positive), source=draw(texts), matmul_efficiency=draw(fraction),
                  matmul_half_dim=draw(non_negative), memory_efficiency=draw(fraction),
                  kernel_overhead=draw(non_negative), dispatch_overhead=draw(non_negative),
                  dispatch_overhead_backward=draw(non_negative), threads=draw(st.integers(0, 512)))


@st.composite
def parallel_configs(draw, devices: int) -> tuple[ParallelConfig, int]:
    """(any valid ParallelConfig of ``devices`` devices, micro-batches per pipeline)."""
    tp = draw(st.sampled_from(_divisors(devices)))
    pp = draw(st.sampled_from(_divisors(devices // tp)))
    cp = draw(st.sampled_from(_divisors(devices // (tp * pp))))
    dp = devices // (tp * pp * cp)
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"] if pp > 1 else ["gpipe", "1f1b"]))
    stage_recompute = ()
    if pp > 1 and schedule != "interleaved" and draw(st.booleans()):
        stage_recompute = tuple(draw(st.lists(st.sampled_from(RECOMPUTE_MODES), min_size=pp, max_size=pp)))
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=draw(st.sampled_from(_divisors(dp))),
                         micro_batch_size=draw(st.integers(1, 64)), schedule=schedule,
                         virtual_stages=draw(st.integers(1, 4)) if schedule == "interleaved" else 1,
                         zero=draw(st.integers(0, 3)), recompute=draw(st.sampled_from(RECOMPUTE_MODES)),
                         sequence_parallel=tp > 1 and draw(st.booleans()), stage_recompute=stage_recompute)
    return cfg, draw(st.integers(1, 64))


breakdowns = st.builds(TimeBreakdown, compute=non_negative, recompute=non_negative, tp_comm=non_negative,
                       p2p=non_negative, bubble=non_negative, dp_comm=non_negative, optimizer=non_negative,
                       cp_comm=non_negative, ep_comm=non_negative)
memories = st.builds(MemoryBreakdown, params=non_negative, grads=non_negative, optimizer=non_negative,
                     activations=non_negative, buffers=non_negative)
placements = st.sampled_from([Replicate(), Shard(0), Shard(2), Partial()])


@st.composite
def sharding_groups(draw):
    layers = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    solved = draw(st.integers(1, len(layers)))
    ids = draw(st.lists(st.builds(OpId, layer=st.sampled_from(layers[:solved]), module=texts, op=names,
                                  occurrence=st.integers(0, 3)), max_size=3, unique=True))
    ops = tuple(OpSharding(i, draw(st.sampled_from(["replicate", "column", "row", "split(0)", "view"])),
                           draw(placements), tuple(draw(st.lists(placements, max_size=2))),
                           tuple(draw(st.dictionaries(names, st.none() | st.integers(0, 3), max_size=2)).items()))
                for i in ids)
    return ShardingGroup(tuple(layers), solved, ops, draw(st.none() | st.sampled_from([Replicate(), Shard(0)])))


anchors = st.builds(Anchor, kind=st.sampled_from([k.value for k in OpKind]), op=texts, module=texts,
                    params=st.lists(st.tuples(names, st.lists(st.integers(0, 10 ** 6), max_size=3).map(tuple)),
                                    max_size=2).map(tuple))


@st.composite
def structures(draw) -> ModelStructure:
    bodies = tuple(tuple(draw(st.lists(anchors, max_size=3))) for _ in range(draw(st.integers(1, 3))))
    layers = tuple((draw(names), draw(st.integers(0, len(bodies) - 1))) for _ in range(draw(st.integers(1, 4))))
    return ModelStructure(layers, bodies)


@st.composite
def stages(draw, index: int, virtual_stages: int, micro_batches: int) -> Stage:
    chunks = tuple(tuple(draw(st.lists(names, min_size=1, max_size=3))) for _ in range(virtual_stages))
    params = draw(counts)
    return Stage(index=index, layers=tuple(n for c in chunks for n in c), chunks=chunks, param_count=params,
                 fwd_time=draw(non_negative), bwd_time=draw(non_negative), recompute_time=draw(non_negative),
                 tp_comm_time=draw(non_negative), p2p_time=draw(non_negative),
                 in_flight=draw(st.integers(1, micro_batches * virtual_stages)),
                 activation_per_microbatch=draw(non_negative), memory=draw(memories),
                 cp_comm_time=draw(non_negative), ep_comm_time=draw(non_negative),
                 expert_param_count=draw(st.integers(0, params)))


@st.composite
def alternatives(draw, devices: int) -> Alternative:
    fits = draw(st.booleans())
    return Alternative(config=draw(parallel_configs(devices))[0], step_time=draw(non_negative),
                       peak_memory=draw(non_negative), fits=fits, reason=draw(texts),
                       breakdown=draw(st.none() | breakdowns) if fits else None)


PLAN_FIELDS = {f.name for f in dataclasses.fields(Plan)}


@st.composite
def plans(draw) -> Plan:
    """A random valid Plan: its parts agree as load_plan requires (dp * cp * tp * pp = the
    cluster's devices, global batch = dp * micro-batch size * micro-batches, pp stages indexed
    0.. with virtual_stages chunks each, peak memory the largest stage total, fits = it fits,
    step time the breakdown's sum); every value is otherwise free within its type and range."""
    n_devices = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 64]))
    nodes = draw(st.sampled_from(_divisors(n_devices)))
    cluster = Cluster(nodes=nodes, devices_per_node=n_devices // nodes, device=draw(devices()),
                      intra_node=draw(links()), inter_node=draw(links()))
    cfg, m = draw(parallel_configs(n_devices))
    stage_list = tuple(draw(stages(i, cfg.virtual_stages, m)) for i in range(cfg.pp))
    breakdown = draw(breakdowns)
    peak = max(s.memory.total for s in stage_list)
    model_flops = draw(non_negative)
    optimal = draw(st.none() | st.booleans())
    # ``gap`` (being added): a fraction when the search stopped early (optimal false), else null
    optional = {"gap": draw(st.none() | st.floats(0.0, 1.0)) if optimal is False else None} \
        if "gap" in PLAN_FIELDS else {}
    structure = draw(structures())
    return Plan(model_name=draw(names), fingerprint=structure.fingerprint, structure=structure,
                cluster=cluster, config=cfg,
                precision=draw(st.builds(Precision, compute=st.sampled_from(["fp32", "bf16", "fp16"]),
                                         grads=st.sampled_from(["fp32", "bf16", "fp16"]), master_weights=st.booleans(),
                                         optimizer=st.sampled_from(["adam", "sgd"]))),
                global_batch_size=cfg.dp * cfg.micro_batch_size * m, micro_batches=m, step_time=breakdown.total,
                peak_memory=peak, throughput=draw(non_negative), model_flops=model_flops,
                hardware_flops=model_flops + draw(non_negative), breakdown=breakdown, stages=stage_list,
                fits=peak <= cluster.device.memory, notes=tuple(draw(st.lists(texts, max_size=3))),
                optimal=optimal,
                alternatives=tuple(draw(st.lists(alternatives(n_devices), max_size=3))),
                sharding=tuple(draw(st.lists(sharding_groups(), max_size=2))),
                extra=draw(st.dictionaries(texts, json_values, max_size=4)), **optional)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plans")


def _check_round_trip(plan: Plan, folder: Path) -> None:
    data = plan.to_dict()
    assert json.loads(plan.to_json()) == data                       # to_dict is already JSON-native
    assert Plan.from_dict(json.loads(json.dumps(data))) == plan
    path = folder / "plan.json"
    plan.save(path)
    loaded = autopar.load_plan(path)
    assert loaded == plan
    assert loaded.to_json() == plan.to_json()    # same bytes: no -0.0 -> 0.0, 1 -> 1.0, tuple -> list drift


@settings(max_examples=100 if ALL_CASES else 30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan=plans())
def test_plan_json_round_trip(plan_dir, plan):
    """Every valid plan survives JSON: ``Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) ==
    plan``, and ``load_plan`` of what ``plan.save`` wrote equals the plan and writes the same JSON
    text again (so values keep their JSON type and sign: an int stays an int, -0.0 stays -0.0).
    ``to_dict`` is JSON-native (``json.loads(plan.to_json()) == plan.to_dict()``).

    Plans are random and valid: preset or arbitrary devices, links with measured collective fits,
    any valid configuration, stages, alternatives with or without a breakdown, sharding groups,
    notes, ``optimal`` None / True / False, unicode text anywhere text goes, floats from 0 and
    subnormals to 1e300, and ``extra`` holding any JSON value (nested lists and objects, big
    integers, negative zero)."""
    _check_round_trip(plan, plan_dir)


@COST_SETTINGS
@given(data=st.data(), shape=cluster_shapes, model=st.sampled_from(["gpt", "moe", "mlp"]))
def test_estimated_plan_json_round_trip(graphs, plan_dir, data, shape, model):
    """The plans the cost model makes (numbers as it computes them, notes, the context-parallel
    ``extra``) survive JSON as random ones do: equal after ``from_dict`` and after ``save`` /
    ``load_plan``, and written back as the same text."""
    nodes, per_node, device = shape
    cfg, gbs = data.draw(configs(graphs[model], nodes * per_node), label="config")
    plan = _estimate(graphs[model], Cluster.from_spec(_spec(nodes, per_node, device)), cfg, gbs)
    _check_round_trip(plan, plan_dir)
