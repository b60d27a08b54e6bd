"""codegen/lower.py: the spec-to-spec conversions and the lowering of a plan's specs, without ranks
(tests/distributed runs the lowered programs against one process)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import Cluster
from autopar.capture import graph_of, param_aliases
from autopar.capture.export import run_export
from autopar.codegen.lower import How, lower
from autopar.codegen.redistribute import (Copy, Gather, GatherPartial, Reduce, ReduceScatter, Split, ToPartial,
                                          convert)
from autopar.plan.placement import Partial, Replicate, Shard
from autopar.models import GPTConfig, build_gpt
from autopar.codegen.split import plan_chunks, split_graph
from autopar.codegen.specs import node_specs, sequence_parallel

CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=8, dropout=0.0)


R, P, S = Replicate(), Partial(), Shard


@pytest.mark.parametrize("src, dst, partial, steps", [
    (R, R, False, ()),
    (R, R, True, (Copy(),)),                               # Megatron's f
    (R, S(2), False, (Split(2),)),
    (S(1), R, False, (Gather(1),)),
    (S(1), R, True, (GatherPartial(1),)),                  # sequence parallelism's all-gather
    (P, R, False, (Reduce(),)),                            # Megatron's g
    (P, R, True, (Reduce(), Copy())),
    (P, S(1), False, (ReduceScatter(1),)),
    (P, P, False, ()),
    (R, P, False, (ToPartial(),)),                         # a row-parallel bias, added once
    (S(0), S(1), False, (Gather(0), Split(1))),
])
def test_conversions(src, dst, partial, steps):
    assert convert(src, dst, partial) == steps


def _lowered(example_batch: int, micro: int, sp: bool = False):
    """The GPT planned at tp=2 from inputs of ``example_batch`` rows, lowered on its export at ``micro``."""
    torch.manual_seed(0)
    model, inputs = build_gpt(CFG, batch_size=example_batch)
    cluster = Cluster.from_spec("1x2xcpu", intra_node_bandwidth=1e12, intra_node_latency=1e-9)
    plan = autopar.plan(model, cluster, inputs, global_batch_size=micro,
                        fixed=dict(dp=1, tp=2, pp=1, micro_batch_size=micro, sequence_parallel=sp))
    _, run_inputs = build_gpt(CFG, batch_size=micro)
    program = run_export(model, run_inputs, None)
    graph = graph_of(model, program)
    specs, params = node_specs(plan.sharding, graph)
    if sp:
        specs = sequence_parallel(specs, graph, 2)
    split = split_graph(program, graph, plan_chunks(plan), param_aliases(model))
    low = lower(split.node_map, graph, split.chunks, specs, split.param_of, params, 2)
    return low, specs, split


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_layout_lowers_to_local_ops_and_few_collectives(sp):
    low, specs, split = _lowered(2, 2, sp)
    strategies = {name: s.strategy for name, s in specs.items()}
    linears = [n for n, s in strategies.items() if s in ("column", "row")]
    assert linears, "tp=2 split no matmul"
    for name in linears:
        op = low.ops[name]
        assert op.how is How.LOCAL
        if strategies[name] == "row":
            assert op.output == P
        else:   # the input's gradient is partial: f (or SP's all-gather with its reduce-scatter backward)
            x = split.node_map[name].args[0].name
            assert op.reads[x] and isinstance(op.reads[x][-1], (Copy, GatherPartial)), (name, op.reads)
    for op in low.ops.values():   # every shard has its local size; shape arguments say so
        if op.how is How.LOCAL and op.local_shape is not None and isinstance(op.output, Shard):
            val = split.node_map[op.node].meta["val"]
            d = op.output.dim
            assert op.local_shape[d] * 2 == val.shape[d]
    assert low.ops[split.loss].how is How.VOCAB_LOSS
    # what runs is what the ILP priced: one conversion per edge whose producer's spec differs from the
    # spec its reader needs (the vocabulary-parallel loss: one all-reduce of its own)
    priced = 0
    for name, spec in specs.items():
        for src, need in spec.inputs.items():
            held = specs[src].output if src in specs else low.ops[src].output if src in low.ops else R  # volatile: carried
            priced += sum(1 for s in convert(held, need, False) if s.communicates)
    assert low.collectives() == priced + 1
