"""One placement vocabulary (autopar/plan/placement.py) from the sharding ILP's strategies through the
plan's typed record and its text to the specs the lowering reads; a batch-independent constant is a
``const`` strategy reading and making ``Replicate()`` (a version-2 plan's ``"C"`` reads as ``Replicate()``)."""

from __future__ import annotations

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.capture import capture
from autopar.codegen.specs import node_specs
from autopar.errors import PlanFormatError
from autopar.models import registry
from autopar.plan.placement import (Partial, Replicate, Shard, normal, placement_from_json,
                                    placement_to_json)
from autopar.solver.strategies import OpContext, node_strategies

PLACEMENTS = (Replicate, Shard, Partial)


def test_strategies_speak_placements_and_constants_are_replicate():
    model, inputs = registry.build("gpt-tiny", batch_size=2)
    graph = capture(model, inputs)
    ctx = OpContext(graph)
    consts = []
    for node in graph.nodes:
        for s in node_strategies(ctx, node, 2):
            assert isinstance(s.output, PLACEMENTS) and all(isinstance(x, PLACEMENTS) for x in s.inputs), s
            if s.const:
                consts.append(s)
    assert consts and all(s.output == Replicate() and set(s.inputs) <= {Replicate()} for s in consts)


def test_placement_text_round_trips_and_names_a_bad_value():
    for p in (Replicate(), Shard(0), Shard(2), Partial()):
        assert placement_from_json(placement_to_json(p)) == p
    assert placement_from_json("C") == Replicate()
    with pytest.raises(PlanFormatError, match="op_7's output"):
        placement_from_json("S(x)", "op_7's output")
    assert normal(Shard(-1), 3) == Shard(2) and normal(Shard(1), 3) == Shard(1) and normal(Partial(), 3) == Partial()


def test_the_specs_a_rank_lowers_are_placements():
    model, inputs = registry.build("gpt-tiny", batch_size=2)
    cluster = Cluster.from_spec("1x2xcpu", intra_node_bandwidth=1e12, intra_node_latency=1e-9)
    plan = autopar.estimate(model, cluster, inputs, ParallelConfig(dp=1, tp=2, micro_batch_size=2),
                            global_batch_size=2)
    planned = {x for group in plan.sharding for op in group.ops for x in (op.output, *op.inputs)}
    assert all(isinstance(x, PLACEMENTS) for x in planned) and any(isinstance(x, Shard) for x in planned)
    texts = {x for group in plan.to_dict()["sharding"] for op in group["ops"] for x in (op["output"], *op["inputs"])}
    assert texts <= {"R", "P"} | {f"S({d})" for d in range(4)} and "C" not in texts
    graph = capture(model, inputs)
    specs, _ = node_specs(plan.sharding, graph)
    held = [s.output for s in specs.values()] + [x for s in specs.values() for x in s.inputs.values()]
    assert all(isinstance(x, PLACEMENTS) for x in held) and Shard(2) in held
    data = plan.to_dict()
    data["sharding"][0]["ops"][0]["output"] = "S(-)"
    with pytest.raises(PlanFormatError, match=r"sharding\[0\]\.ops\[0\]"):
        autopar.Plan.from_dict(data)
