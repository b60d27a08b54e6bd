"""Context and expert parallelism in the cost model and the search: what they divide, what they cost,
what they refuse, and the plans they win (128k-token Llama-3-8B on 8 H100s, Mixtral-8x7B on 64)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar import Cluster, ConfigError, ParallelConfig
from autopar.capture import capture
from autopar.cost_model import estimate_plan
from autopar.cost_model.expert_parallel import expected_max_normal, imbalance
from autopar.models import GPTConfig, build_gpt
from autopar.models.llama import LlamaConfig, build_llama
from autopar.models.moe import MixtralConfig, build_mixtral
from autopar.plan import Plan

LONG = LlamaConfig(vocab_size=512, hidden=256, heads=4, kv_heads=2, layers=2, ffn_hidden=512, seq_len=8192)
MOE = MixtralConfig(vocab_size=512, hidden=256, heads=4, kv_heads=2, layers=2, ffn_hidden=512, seq_len=256,
                    num_experts=8, top_k=2, capacity_factor=None)


@pytest.fixture(scope="module")
def long_graph():
    model, inputs = build_llama(LONG, batch_size=1, device="meta")
    return capture(model, inputs)


@pytest.fixture(scope="module")
def moe_graph():
    model, inputs = build_mixtral(MOE, batch_size=1, device="meta")
    return capture(model, inputs)


def test_cp_divides_activations_and_attention_and_hides_its_ring(long_graph):
    cluster = Cluster.from_spec("1x8xH100-SXM")
    one = estimate_plan(long_graph, cluster, ParallelConfig(dp=8), 8)
    # one micro-batch of 4 sequences, a quarter of each on every device: the same tokens, the same launches
    cp = estimate_plan(long_graph, cluster, ParallelConfig(dp=2, cp=4, micro_batch_size=4), 8)
    quarter = estimate_plan(long_graph, cluster, ParallelConfig(dp=2, cp=4), 8)
    a1, a4 = one.stages[0].activation_per_microbatch, quarter.stages[0].activation_per_microbatch
    # every saved activation is per token but the batch-independent constants (rotary tables), which the
    # cost model counts whole (at this toy width they are a tenth of the total)
    assert a1 / 4 < a4 < 1.15 * a1 / 4
    # the same tokens per device: compute within what smaller attention blocks and merges cost
    assert one.breakdown.compute <= cp.breakdown.compute <= 1.15 * one.breakdown.compute
    # NVLink keeps up with an 8k-token block: the ring is hidden, and costs only the compute its kernels
    # slow down (Device.overlap_slowdown of its time; none on a device without that slowdown)
    free = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, overlap_slowdown=0.0))
    assert estimate_plan(long_graph, free, ParallelConfig(dp=2, cp=4, micro_batch_size=4), 8).breakdown.cp_comm == 0
    assert 0 < cp.breakdown.cp_comm < cluster.device.overlap_slowdown * cp.breakdown.compute
    slow = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node, bandwidth=1e8))
    exposed = estimate_plan(long_graph, slow, ParallelConfig(dp=2, cp=4, micro_batch_size=4), 8).breakdown.cp_comm
    assert exposed > 10 * cp.breakdown.cp_comm


def test_cp_and_ep_are_refused_where_they_cannot_run(long_graph, moe_graph):
    cluster = Cluster.from_spec("1x8xH100-SXM")
    with pytest.raises(ConfigError, match="multiple of"):        # 8192 tokens do not cut into 2*cp=... chunks
        estimate_plan(long_graph, Cluster.from_spec("1x6xH100-SXM"), ParallelConfig(cp=6), 6)
    model, inputs = build_gpt(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=16), device="meta")
    eager = capture(model, inputs)
    with pytest.raises(ConfigError, match="fused attention"):
        estimate_plan(eager, Cluster.from_spec("1x2xH100-SXM"), ParallelConfig(cp=2), 2)
    with pytest.raises(ConfigError, match="no"):                  # a dense model has no experts
        estimate_plan(long_graph, cluster, ParallelConfig(dp=8, ep=2), 8)
    with pytest.raises(ConfigError, match="divide"):              # 8 experts over 3... via dp=6
        estimate_plan(moe_graph, Cluster.from_spec("1x6xH100-SXM"), ParallelConfig(dp=6, ep=3), 6)
    with pytest.raises(ConfigError, match="ep=4 must divide dp=2"):
        ParallelConfig(dp=2, ep=4)


def test_ep_splits_expert_weights_and_their_states(moe_graph):
    cluster = Cluster.from_spec("1x8xH100-SXM")
    experts = sum(moe_graph.params[p].numel for r in moe_graph.moe for p in (r.gate_up, r.down))
    dense = sum(p.numel for p in moe_graph.params.values()) - experts
    for ep in (1, 2, 4, 8):
        plan = estimate_plan(moe_graph, cluster, ParallelConfig(dp=8, ep=ep, zero=1), 8)
        stage = plan.stages[0]
        assert stage.param_count == dense + experts // ep and stage.expert_param_count == experts // ep
        # ZeRO-1: dense optimizer state over 8 replicas, expert state over the 8/ep holding the same experts
        assert stage.memory.optimizer == pytest.approx(12 * (dense / 8 + experts / ep / (8 // ep)))
        assert (plan.breakdown.ep_comm > 0) == (ep > 1)


def test_imbalance_grows_with_finer_expert_splits_and_capacity_caps_it(moe_graph):
    assert [round(expected_max_normal(n), 3) for n in (1, 2, 4, 8)] == [0.0, 0.564, 1.029, 1.424]
    layer = moe_graph.moe[0].layer
    lam = [imbalance(moe_graph, layer, ep, 0.15) for ep in (1, 2, 4, 8)]
    assert lam[0] == 1.0 and lam == sorted(lam)
    assert lam[3] == pytest.approx(1 + 0.15 * 1.4236)              # one expert per rank
    capped = dataclasses.replace(moe_graph, moe=tuple(dataclasses.replace(r, capacity=r.tokens * r.top_k // 8)
                                                      for r in moe_graph.moe))
    assert imbalance(capped, layer, 8, 0.15) == 1.0                    # capacity factor 1: the overflow is dropped


def test_plan_round_trips_cp_and_ep(moe_graph):
    plan = estimate_plan(moe_graph, Cluster.from_spec("1x8xH100-SXM"), ParallelConfig(dp=4, ep=2, cp=2), 8)
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and again.config.cp == 2 and again.config.ep == 2
    old = plan.to_dict()
    for key in ("cp_comm", "ep_comm"):
        del old["breakdown"][key]
    for stage in old["stages"]:
        for key in ("cp_comm_time", "ep_comm_time", "expert_param_count"):
            del stage[key]
    loaded = Plan.from_dict(old)                                   # a plan written before cp/ep loads
    assert loaded.breakdown.cp_comm == 0.0 and loaded.stages[0].expert_param_count == 0


def test_the_search_proposes_cp_with_tp(long_graph):
    """Free, the space holds every tensor-parallel degree beside every context-parallel one (NVIDIA's
    Llama 3.1 recipes run tp x cp; the runtime runs it: tests/distributed/test_context_expert.py);
    bench/long_context.py shows the search picking tp=2 x cp=8 for a 128k Llama-3-70B on 32 H100s."""
    from autopar.solver.space import candidates
    meshes = {(c.tp, c.cp) for c in candidates(long_graph, Cluster.from_spec("1x8xH100-SXM"), 8, ("fast",), {})}
    assert {(2, 2), (2, 4), (4, 2)} <= meshes


@pytest.mark.parametrize("graph_name, configs", [
    ("long_graph", [ParallelConfig(dp=8), ParallelConfig(dp=4, cp=2, micro_batch_size=2),
                    ParallelConfig(dp=4, cp=2), ParallelConfig(dp=8, micro_batch_size=2)]),
    ("moe_graph", [ParallelConfig(dp=8), ParallelConfig(dp=8, ep=2), ParallelConfig(dp=8, ep=4),
                   ParallelConfig(dp=4, cp=2, ep=2, micro_batch_size=2)])])
def test_layer_costs_do_not_depend_on_what_was_priced_before(request, graph_name, configs):
    """The layer cost model caches op times across configurations (the search prices the same op at
    the same micro-batch under thousands of them): a layer priced after others costs what it costs
    priced alone, with context parallelism's ring blocks and expert parallelism's local experts
    (each a copy of an op at another size, under the op's name) among the ops priced before."""
    from autopar.config import Precision
    from autopar.cost_model import Estimator
    graph, cluster = request.getfixturevalue(graph_name), Cluster.from_spec("1x8xH100-SXM")
    precision = Precision.for_device(cluster.device.name)

    def costs(est, cfg):
        groups = est.placements(cfg)
        return [est.layer_costs(cfg, groups["tp"], mode, groups) for mode in ("none", "selective", "full")]
    warm = Estimator(graph, cluster, precision)
    for cfg in configs + configs[::-1]:
        assert costs(warm, cfg) == costs(Estimator(graph, cluster, precision), cfg), cfg.short()
