"""Every op identity of the plan's export maps one to one onto any rank's export of the same model.

The plan is made as the README makes it (the model on the meta device, batch-1 inputs, captured in
train mode); a rank exports the model on the meta device or the CPU, at batch 1, 3 or 8, in the
mode the model is in (capture.run_export(train_mode=False), as parallelize does). The rule and its
argument are in autopar/plan/sharding.py. By default a few models, each exported so that every
device, batch and mode occurs; AUTOPAR_ALL_CASES=1: more models, every combination.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

import autopar
from autopar.capture import capture, graph_of, run_export
from autopar.codegen.specs import node_specs, plan_specs
from autopar.errors import PlanMismatchError
from autopar.models import hf, registry
from suite import ALL_CASES


def _hf_llama(batch: int, device: str):
    return hf.build_hf_llama(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, seq_len=8,
                             batch_size=batch, device=device)


def _shrunk(name: str):
    def build(batch: int, device: str):
        from autopar.models import shrink
        arch = next(a for a in shrink.architectures() if a.name == name)
        model = shrink.build(arch, device=device, dropout=0.1)
        return model, shrink.example(arch, model, batch, device=device)
    return build


def _registry(name: str):
    return lambda batch, device: registry.build(name, batch_size=batch, device=device)


# Hugging Face's models are where exports differ (a contiguous from the meta SDPA kernel's strides,
# expands a batch of 1 drops; T5's decoder inputs shifted from its labels, index plumbing traced as other
# ops at a batch of 1); gpt-tiny has dropout, gone in eval mode.
MODELS = {"hf-llama": _hf_llama, "gpt-tiny": _registry("gpt-tiny"), "hf-t5": _shrunk("T5ForConditionalGeneration")}
if ALL_CASES:
    MODELS |= {"hf-gpt2": _shrunk("GPT2LMHeadModel"), **{n: _registry(n) for n in ("bert-tiny", "t5-tiny", "mixtral-tiny",
                                                                  "mlp-small", "small-cnn")}}
ALL = list(itertools.product(("meta", "cpu"), (1, 3, 8), (True, False)))
# every device, batch and mode at least once (with the plan's own meta / 1 / train among the full product)
SAMPLE = [("cpu", 1, True), ("meta", 3, False), ("cpu", 8, False), ("meta", 8, True)]
EXPORTS = ALL if ALL_CASES else SAMPLE


def _rank_graph(build, device: str, batch: int, train: bool):
    model, inputs = build(batch, device)
    model.train(train)
    return graph_of(model, run_export(model, inputs, None, train_mode=False))


@pytest.fixture(scope="module", params=sorted(MODELS))
def planned(request):
    build = MODELS[request.param]
    model, inputs = build(1, "meta")
    return request.param, build, capture(model, inputs)


@pytest.mark.parametrize("device,batch,train", EXPORTS)
def test_every_op_identity_maps_one_to_one(planned, device, batch, train):
    name, build, graph = planned
    running = _rank_graph(build, device, batch, train)
    stable = {i for i in graph.node_of if not i.volatile}
    assert stable == {i for i in running.node_of if not i.volatile}, name
    assert len(running.node_of) == len(set(running.node_of.values()))      # one node per identity
    for op_id, node in graph.node_of.items():
        if op_id in running.node_of:   # every non-volatile one, and the volatile ops both exports have
            assert graph.node(node).target.rstrip("_") == running.node(running.node_of[op_id]).target.rstrip("_")
    assert all(n.params == running.node(running.node_of[i]).params for i, n in
               zip(graph.op_ids, graph.nodes) if i is not None and i in running.node_of)


@pytest.fixture(scope="module")
def gpt_plan():
    model, inputs = registry.build("gpt-tiny", device="meta")
    return autopar.plan(model, autopar.Cluster.from_spec("1x2xcpu"), inputs, global_batch_size=8,
                        fixed=dict(tp=2, dp=1, pp=1, micro_batch_size=8))


def test_a_plan_maps_exactly_and_refuses_ops_it_does_not_name(gpt_plan):
    running = _rank_graph(_registry("gpt-tiny"), "cpu", 8, False)      # eval: the dropouts are gone
    specs, _ = node_specs(gpt_plan.sharding, running)
    assert set(specs) == {n for i, n in running.node_of.items()}
    blocks = gpt_plan.sharding[1]
    first = next(op for op in blocks.ops if not op.id.volatile)
    fewer = dataclasses.replace(blocks, ops=tuple(op for op in blocks.ops if op is not first))
    refused = re.escape(f"op {first.id} of the model exported here is not in the plan")
    with pytest.raises(PlanMismatchError, match=refused):
        node_specs((gpt_plan.sharding[0], fewer), running)
    extra = dataclasses.replace(first, id=dataclasses.replace(first.id, occurrence=7))
    more = dataclasses.replace(blocks, ops=blocks.ops + (extra,))
    with pytest.raises(PlanMismatchError, match=r"the plan shards op blocks\.0: .*#7"):
        node_specs((gpt_plan.sharding[0], more), running)


def test_a_version_2_plan_reads_but_does_not_run_with_tp(gpt_plan):
    """Schema 2 named ops by the planning export's node names: read for display, refused to run."""
    graph = capture(*registry.build("gpt-tiny", device="meta"))
    data = gpt_plan.to_dict()
    data["schema_version"] = 2
    for group, typed in zip(data["sharding"], gpt_plan.sharding):     # the groups as schema 2 wrote them
        group["ops"] = [{"node": graph.node_of[op.id], "module": _module(op.id),
                         **{k: v for k, v in written.items() if k != "id"}}
                        for op, written in zip(typed.ops, group["ops"])]
    old = autopar.Plan.from_dict(data)
    assert old.schema_version == 2 and [g.layers for g in old.sharding] == [g.layers for g in gpt_plan.sharding]
    assert "tensor-parallel sharding (tp=2)" in old.summary()
    assert autopar.Plan.from_dict(old.to_dict()) == old           # written back as read
    with pytest.raises(PlanMismatchError, match="schema 2.*make it again with autopar.plan"):
        plan_specs(old, graph)
    whole = dataclasses.replace(old, config=dataclasses.replace(old.config, tp=1, sequence_parallel=False))
    assert plan_specs(whole, graph) == ({}, {})          # a version-2 plan without tensor parallelism runs


def _module(op_id) -> str:
    return op_id.layer + op_id.module[1:] if op_id.module.startswith("*") else op_id.module
