"""parallelize's steps (driver/assembly.py), each called alone on a one-rank gloo group in this process:
export, compile_rank, apply_mesh, apply_tensor_parallel, build_chunks, apply_data_parallel, tied_groups,
build_optimizer. Together they give the program tests/distributed runs against one process."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import Cluster
from autopar.codegen.compile import compile_rank
from autopar.codegen.split import flatten_batch
from autopar.driver.assembly import (RankSetup, apply_data_parallel, apply_mesh, apply_tensor_parallel, build_chunks,
                                     build_optimizer, export_model, tied_groups)
from autopar.models import GPTConfig, build_gpt
from autopar.runtime.mesh import Mesh
from autopar.runtime.sharded_init import Materializer

CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=8, dropout=0.0)


@pytest.fixture(scope="module")
def world(one_rank_world):
    return None


def _planned(device: str = "cpu"):
    torch.manual_seed(0)
    model, example = build_gpt(CFG, batch_size=1, device=device)
    plan = autopar.plan(model, Cluster.from_spec("1x1xcpu"), example, global_batch_size=4,
                        fixed=dict(dp=1, tp=1, pp=1, micro_batch_size=2, recompute="none"))
    setup = RankSetup(plan, 0, Mesh.of(plan.config).coords(0), torch.device("cpu"), 60.0,
                      Materializer(model, 0, None) if device == "meta" else None)
    return model, plan, setup


def test_each_step_alone_builds_a_rank_that_computes_the_models_loss(world):
    model, plan, setup = _planned()
    exported = export_model(setup, model, None, plan.extra["inputs"])
    compiled = compile_rank(plan, exported, 0, model)
    groups = apply_mesh(setup, compiled)
    assert groups.tp is None and groups.tied == {}
    params = apply_tensor_parallel(setup, compiled, groups, model)
    assert set(params) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():   # the model's values, in storage of the program's own
        assert torch.equal(params[name], p) and params[name].data_ptr() != p.data_ptr()
    runner, chunks = build_chunks(setup, compiled, groups, params, None)
    assert list(chunks) == [0] and runner.group is None
    _, batch = build_gpt(CFG, batch_size=2)
    split = compiled.program.split
    env = dict(zip(split.user_inputs, flatten_batch(batch, split.in_spec)))
    (loss,) = chunks[0](*(env[v] for v in compiled.chunks[0].spec.graph_inputs))
    torch.testing.assert_close(loss, model(**batch))
    assert apply_data_parallel(setup, compiled, groups, chunks, False) == []   # one replica: nothing to reduce
    assert tied_groups(compiled, groups, params) == []   # the tied embedding and head are on one stage
    optimizer, stepped, shards = build_optimizer(setup, compiled, groups, params,
                                                 lambda ps: torch.optim.SGD(ps, lr=0.1), None)
    assert shards == [] and stepped == params   # no tensor parallelism: the parameters are stepped themselves
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len({id(p) for p in params.values()})


def test_a_meta_model_is_materialised_by_apply_tensor_parallel(world):
    model, plan, setup = _planned("meta")
    compiled = compile_rank(plan, export_model(setup, model, None, plan.extra["inputs"]), 0, model)
    params = apply_tensor_parallel(setup, compiled, apply_mesh(setup, compiled), model)
    reference = build_gpt(CFG, batch_size=1, device="meta")[0]
    autopar.init_weights(reference, 0)
    for name, p in reference.named_parameters():
        assert not params[name].is_meta
        torch.testing.assert_close(params[name], p)
