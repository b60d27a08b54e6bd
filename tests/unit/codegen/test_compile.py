"""codegen/compile.py: the one compiler entry, without ranks. A tp=2 x pp=2 plan compiled for each rank
says what that rank runs (its chunks, each layer's collectives, its receives and sends, its actions);
and no other module of autopar runs the lowering sequence (tests/distributed runs what it compiles)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import autopar
from autopar import Cluster
from autopar.capture.export import run_export
from autopar.codegen.compile import compile_program, compile_rank, describe
from autopar.codegen.redistribute import convert
from autopar.models import GPTConfig, build_gpt
from autopar.plan.placement import normal

CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=8, dropout=0.0)


@pytest.fixture(scope="module")
def planned():
    """GPT planned at tp=2, pp=2 with sequence parallelism (batch-1 example on meta), exported at its micro-batch."""
    torch.manual_seed(0)
    model, example = build_gpt(CFG, batch_size=1, device="meta")
    cluster = Cluster.from_spec("1x4xcpu", intra_node_bandwidth=1e12, intra_node_latency=1e-9)
    plan = autopar.plan(model, cluster, example, global_batch_size=8,
                        fixed=dict(dp=1, tp=2, pp=2, micro_batch_size=2, sequence_parallel=True,
                                   schedule="1f1b", virtual_stages=1))
    _, inputs = build_gpt(CFG, batch_size=2, device="meta")
    return plan, run_export(model, inputs, None), model


def test_each_rank_gets_its_stage(planned):
    plan, exported, model = planned
    compiled = compile_program(plan, exported, model)
    assert [c.stage for c in compiled.chunks] == [0, 1]
    for rank in range(4):
        mine = compiled.rank(rank)
        assert mine.coords.pp == rank // 2 and mine.coords.tp == rank % 2
        assert [c.index for c in mine.chunks] == [mine.coords.pp]
        assert mine.actions == compiled.schedule[mine.coords.pp]
    # a value stage 0 sends is what stage 1 receives, and crosses split along the sequence: the receiver
    # allocates its block (half the tokens)
    (sent,) = [s for s in compiled.chunks[0].sends]
    assert compiled.chunks[1].receives == (sent.value,)
    assert sent.crossing == compiled.crossing(sent.value)
    shape = compiled.split.meta(sent.value).shape
    assert compiled.values[sent.value].shape[1] == shape[1] // 2
    assert not compiled.values[sent.value].scatter   # a shard already: sent as it is


def test_a_whole_value_crosses_scattered_over_the_tensor_parallel_ranks(planned):
    """Without sequence parallelism the residual stream crosses whole (R) on every tensor-parallel rank: each
    sends 1/t of it and the receivers all-gather it (Value.scatter), which is what the cost model prices."""
    _, exported, model = planned
    m, example = build_gpt(CFG, batch_size=1, device="meta")
    cluster = Cluster.from_spec("1x4xcpu", intra_node_bandwidth=1e12, intra_node_latency=1e-9)
    plan = autopar.plan(m, cluster, example, global_batch_size=8,
                        fixed=dict(dp=1, tp=2, pp=2, micro_batch_size=2, sequence_parallel=False,
                                   schedule="1f1b", virtual_stages=1))
    compiled = compile_program(plan, exported, model)
    (sent,) = compiled.chunks[0].sends
    value = compiled.values[sent.value]
    assert value.shape == tuple(compiled.split.meta(sent.value).shape) and value.scatter
    text = describe(compiled.rank(0))   # the rank's program says so
    assert "this rank's 1/t of it" in text and "1/t from each rank, all-gathered" in describe(compiled.rank(2))


def test_rank_program_reads_as_what_the_rank_runs(planned):
    plan, exported, model = planned
    text = str(compile_rank(plan, exported, 3, model))
    lines = text.splitlines()
    assert lines[0].startswith("rank 3 of 4: pp=1 dp=0 cp=0 tp=1")
    assert any(line.startswith("chunk 1 (stage 1): layers") for line in lines)
    assert any(line.strip().startswith("recv ") and "from chunk 0" in line for line in lines)
    assert any(line.strip().startswith("send ") and "the loss" in line for line in lines)
    # sequence parallelism's all-gathers and the row-parallel outputs' reduce-scatters, named per op
    assert any("gather_partial" in line for line in lines) and any("reduce_scatter" in line for line in lines)
    assert lines[-1] == "actions: " + " ".join(map(str, compile_rank(plan, exported, 3, model).actions))
    assert re.search(r"layer \S+: \d+ ops, recompute none", text)
    first = str(compile_rank(plan, exported, 0, model))
    assert "chunk 0 (stage 0)" in first and "chunk 1" not in first


def test_sends_carry_their_collectives(planned):
    """Each send's steps take the value from the placement it is held in to the one it crosses in."""
    plan, exported, model = planned
    compiled = compile_program(plan, exported, model)
    sends = [s for chunk in compiled.chunks for s in chunk.sends]
    assert sends
    for send in sends:
        d = compiled.split.meta(send.value).dim()
        assert send.steps == convert(normal(send.held, d), normal(send.crossing, d), False)


SEQUENCE = ("check_structure(", "split_graph(", "plan_specs(", "lower(", "analyse(")


def test_one_lowering_sequence():
    """Only codegen/compile.py calls the lowering's steps (their own modules define them)."""
    root = pathlib.Path(autopar.__file__).parent
    callers = {}
    for path in root.rglob("*.py"):
        text = path.read_text()
        for call in SEQUENCE:
            for line in text.splitlines():
                code = line.split("#")[0]
                if re.search(rf"(?<![\w.]){re.escape(call)}", code) and not code.lstrip().startswith("def "):
                    callers.setdefault(call, set()).add(path.relative_to(root).as_posix())
    allowed = {"codegen/compile.py", "codegen/split.py", "codegen/specs.py", "codegen/lower.py", "codegen/context.py"}
    strays = {call: sorted(where - allowed) for call, where in callers.items() if where - allowed}
    assert not strays, f"the lowering sequence runs outside codegen/compile.py: {strays}"
    assert all("codegen/compile.py" in callers[c] for c in SEQUENCE)
