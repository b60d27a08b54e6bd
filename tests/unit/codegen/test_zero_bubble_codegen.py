"""The zero-bubble schedules (zbh1, zbv) through the compiler and both emitted programs, without ranks: each
chunk on the device the schedule runs it on (ZB-V's V), the split backward's I and W actions in each rank's
program, and what cannot run refused by name (per-op recompute; torch.compile'd chunks, in parallelize and in a
standalone folder's train.py). tests/distributed (test_parallelize.py, test_standalone.py) trains them."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch

import autopar
from autopar import Cluster
from autopar.capture.export import run_export
from autopar.codegen.compile import compile_program, compile_rank
from autopar.codegen.split import plan_chunks
from autopar.models import GPTConfig, build_gpt

CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=8, dropout=0.0)
FACTORY = """from autopar.models import GPTConfig, build_gpt


def gpt(device="cpu"):
    return build_gpt(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=8, dropout=0.0), batch_size=1,
                     device=device)[0]
"""


@pytest.fixture(scope="module")
def zero_bubble():
    """GPT (tied head) planned at pp=2 under ZB-V and ZB-H1, exported at its micro-batch."""
    torch.manual_seed(0)
    model, example = build_gpt(CFG, batch_size=1, device="meta")
    cluster = Cluster.from_spec("1x2xcpu", intra_node_bandwidth=1e12, intra_node_latency=1e-9)
    plans = {kind: autopar.plan(model, cluster, example, global_batch_size=4, verbose=False,
                                fixed=dict(dp=1, tp=1, pp=2, micro_batch_size=1, schedule=kind, virtual_stages=v))
             for kind, v in (("zbv", 2), ("zbh1", 1))}
    return plans, run_export(model, example, None), model


def test_zero_bubble_chunks_sit_where_the_schedule_runs_them(zero_bubble):
    """ZB-V's V: device 0 holds chunks 0 and 3 (the loss), device 1 chunks 1 and 2; each rank's program
    lists the split backward's I and W actions."""
    plans, exported, model = zero_bubble
    plan = plans["zbv"]
    assert plan_chunks(plan) == [plan.stages[0].chunks[0], plan.stages[1].chunks[0], plan.stages[1].chunks[1],
                                 plan.stages[0].chunks[1]]
    compiled = compile_program(plan, exported, model)
    assert [c.stage for c in compiled.chunks] == [0, 1, 1, 0]
    assert compiled.holders["embed.tok.weight"] == (0,)   # the tied embedding and head: one stage holds both
    for rank, chunks in ((0, [0, 3]), (1, [1, 2])):
        text = str(compiled.rank(rank))
        assert [c.index for c in compiled.rank(rank).chunks] == chunks
        assert re.search(rf"^chunk {chunks[1]} \(stage {rank}\)", text, re.M)
        actions = text.splitlines()[-1].split()[1:]
        assert {a[0] for a in actions} == set("FIW")
        assert f"I{chunks[1]}.0" in actions and f"W{chunks[0]}.3" in actions
    assert "send cross_entropy_loss the loss" in str(compiled.rank(0))
    h1 = compile_rank(plans["zbh1"], exported, 1, model)
    # the last device defers each W past the next I (ZB-H1)
    assert str(h1).splitlines()[-1] == "actions: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 F1.3 I1.3 W1.2 W1.3"


def test_zero_bubble_refuses_per_op_recompute(zero_bubble):
    """recompute="op" (selective activation checkpointing) lets autograd through a layer once; a split
    backward goes through it twice: the configuration itself is refused, so no plan has it to compile."""
    plans, _, _ = zero_bubble
    with pytest.raises(autopar.ConfigError, match=r"schedule='zbh1'.*per-op recomputation.*use recompute='full'"):
        dataclasses.replace(plans["zbh1"].config, recompute="op")


def test_compiled_chunks_are_refused_by_parallelize(zero_bubble):
    """A torch.compile'd chunk's backward is one node: nothing to split (before any process group is needed)."""
    plans, _, model = zero_bubble
    with pytest.raises(autopar.ConfigError, match=r"schedule='zbv'.*one compiled node.*pass compile=False"):
        autopar.parallelize(model, plans["zbv"], compile="aot_eager")


def test_both_emitted_programs_spell_out_the_placement(zero_bubble, tmp_path, monkeypatch):
    """The torchrun script and the standalone folder name each chunk's pipeline rank (CHUNK_DEVICES); the
    folder's train.py refuses --compile under a split backward before it starts anything."""
    plans, _, _ = zero_bubble
    (tmp_path / "zb_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    script = autopar.codegen.emit(plans["zbv"], tmp_path / "run", "zb_factory:gpt")
    text = open(script).read()
    assert "CHUNK_DEVICES = [0, 1, 1, 0]" in text and "I (input gradients) and W (weight gradients)" in text
    train = autopar.codegen.emit(plans["zbv"], tmp_path / "folder", "zb_factory:gpt", standalone=True)
    program = (tmp_path / "folder" / "program.py").read_text()
    assert "CHUNK_DEVICES = [0, 1, 1, 0]" in program and "SPLIT_BACKWARD = True" in program
    assert "STAGE_PARAMS = {0: ['blocks.0." in program   # rank 0: chunks 0 and 3
    run = subprocess.run([sys.executable, train, "--compile"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "zero-bubble schedule splits each chunk's backward" in run.stderr, run.stderr
