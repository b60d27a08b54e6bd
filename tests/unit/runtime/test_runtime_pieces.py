"""The runtime's pieces that need no process group: graph split, specs, inputs, emitted script."""

from __future__ import annotations

import pytest
import torch

import autopar
import autopar.codegen
from autopar import Cluster, ConfigError, ParallelConfig, PlanMismatchError
from autopar.capture import capture, graph_of, param_aliases
from autopar.capture.export import run_export
from autopar.models import GPTConfig, build_gpt
from autopar.codegen.split import flatten_batch, split_graph
from autopar.runtime.batches import replica_micro_batches, slice_batch
from autopar.codegen.inputs import check_batch, describe_inputs, example_at
from autopar.codegen.specs import node_specs, sequence_parallel
from autopar.plan.placement import Replicate, Shard

CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=8, dropout=0.0)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model, inputs = build_gpt(CFG, batch_size=2)
    program = run_export(model, inputs, None)
    return model, inputs, program, graph_of(model, program)


def test_split_sends_every_value_a_later_chunk_reads(gpt):
    model, inputs, program, graph = gpt
    names = [layer.name for layer in graph.layers]
    chunks = [names[:3], names[3:5], names[5:]]
    split = split_graph(program, graph, chunks, param_aliases(model))
    assert [c.index for c in split.chunks] == [0, 1, 2]
    assert split.chunks[-1].send == (split.loss,)
    for c in split.chunks:
        for v in c.recv:
            assert split.producer[v] < c.index and c.index in split.consumers[v]
            assert v in split.chunks[split.producer[v]].send
    # the labels (a graph input) are read where the loss is computed, never sent
    assert all(v not in split.user_inputs for c in split.chunks for v in c.send)
    held = [p for c in split.chunks for p in c.params]
    assert set(held) == set(graph.params)


def test_split_refuses_layers_the_model_lacks(gpt):
    model, _, program, graph = gpt
    with pytest.raises(PlanMismatchError, match="layers"):
        split_graph(program, graph, [["nope"]], param_aliases(model))


def test_batch_flattening_follows_the_exported_order(gpt):
    _, inputs, program, _ = gpt
    leaves = flatten_batch(dict(reversed(list(inputs.items()))), program.call_spec.in_spec)
    assert [t.data_ptr() for t in leaves] == [inputs[k].data_ptr() for k in inputs]
    with pytest.raises(PlanMismatchError, match="keyword"):
        flatten_batch({"input_ids": inputs["input_ids"]}, program.call_spec.in_spec)


def test_inputs_record_round_trip():
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "mask": torch.ones(4, 8)}
    record = describe_inputs(batch)
    again = example_at(record, 2)
    assert again["input_ids"].shape == (2, 8) and again["input_ids"].dtype == torch.long
    assert slice_batch(batch, 1, 3, 4)["mask"].shape == (2, 8)
    check_batch(batch, record, 4)
    with pytest.raises(ConfigError, match="global batch size is 8"):
        check_batch(batch, record, 8)
    with pytest.raises(ConfigError, match="keys"):
        check_batch({"input_ids": batch["input_ids"]}, record, 4)


def test_a_replica_takes_its_rows_in_consecutive_micro_batches():
    """Both drivers cut a step's global batch with replica_micro_batches: replica r of R takes rows
    r*B/R.. in runs of the micro-batch size; a tensor not batched along dim 0 passes whole."""
    batch = {"x": torch.arange(8).reshape(8, 1), "scale": torch.tensor([2.0])}
    parts = replica_micro_batches(batch, 1, 2, 2, 2, 8)
    assert [p["x"].flatten().tolist() for p in parts] == [[4, 5], [6, 7]]
    assert all(p["scale"] is batch["scale"] for p in parts)
    assert [p.flatten().tolist() for p in replica_micro_batches(batch["x"], 0, 4, 1, 2, 8)] == [[0], [1]]
    assert replica_micro_batches(batch, 0, 1, 8, 1, 8) == [batch]   # one micro-batch: the batch itself


def test_specs_cover_every_op_and_sequence_parallel_splits_the_residual(gpt):
    model, inputs, _, graph = gpt
    cluster = Cluster.from_spec("1x2xcpu", intra_node_bandwidth=1e12, intra_node_latency=1e-9)
    plan = autopar.plan(model, cluster, inputs, global_batch_size=2,
                        fixed=dict(dp=1, tp=2, pp=1, micro_batch_size=2, sequence_parallel=True))
    specs, params = node_specs(plan.sharding, graph)
    assert set(specs) == {n.name for n, i in zip(graph.nodes, graph.op_ids) if i is not None}   # volatile: none
    assert set(params) <= set(graph.params) and any(d is not None for d in params.values())
    sp = sequence_parallel(specs, graph, 2)
    for node in graph.nodes:
        out = node.outputs[0]
        if node.name not in specs:
            continue
        residual = (specs[node.name].output == Replicate() and node.batch_dependent and out.is_float
                    and len(out.shape) == 3 and out.shape[1] % 2 == 0)
        assert sp[node.name].output == (Shard(1) if residual else specs[node.name].output), node.name


def test_op_identities_map_across_the_batch_one_specialisation():
    from autopar.runtime.batches import replica_micro_batches, slice_batch as cut
    import autopar.models.hf as hf
    model, inputs = hf.build_hf_llama(layers=2, hidden=32, heads=4, vocab=64, seq_len=8, batch_size=2)
    one, two = capture(model, cut(inputs, 0, 1, 2)), capture(model, inputs)
    assert len(two.nodes) > len(one.nodes)   # export drops no-ops at batch 1
    assert {i for i in one.node_of if not i.volatile} == {i for i in two.node_of if not i.volatile}
    assert all(one.node(a).target == two.node(two.node_of[i]).target for i, a in one.node_of.items()
               if i in two.node_of)


def test_emitted_script_spells_out_the_plan(gpt, tmp_path):
    model, inputs, _, _ = gpt
    plan = autopar.estimate(model, Cluster.from_spec("1x2xcpu"), inputs,
                            ParallelConfig(pp=2, micro_batch_size=1), global_batch_size=2)
    path = autopar.codegen.emit(plan, tmp_path, "mypkg.models:build", lr=3e-4)
    text = open(path).read()
    compile(text, path, "exec")
    assert "from mypkg.models import build as model_factory" in text
    assert "DP, CP, TP, PP, EP = 1, 1, 1, 2, 1" in text and "'F0.0 F0.1 B0.0 B0.1'" in text and "lr\", type=float, default=0.0003" in text
    assert autopar.load_plan(tmp_path / "plan.json").config == plan.config
    with pytest.raises(ConfigError, match="package.module:function"):
        autopar.codegen.emit(plan, tmp_path, "no_colon")


def test_parallelize_needs_a_process_group(gpt):
    model, inputs, _, _ = gpt
    plan = autopar.estimate(model, Cluster.from_spec("1x2xcpu"), inputs, ParallelConfig(dp=2),
                            global_batch_size=2)
    with pytest.raises(ConfigError, match="init_process_group"):
        autopar.parallelize(model, plan)


def test_parallelize_needs_a_module(gpt):
    model, inputs, _, _ = gpt
    plan = autopar.estimate(model, Cluster.from_spec("1x2xcpu"), inputs, ParallelConfig(dp=2), global_batch_size=2)
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        autopar.parallelize("not a model", plan)


def test_a_meta_models_buffers_and_empty_constants_get_values() -> None:
    """A Hugging Face model built on meta from its own config (use_cache on: its attention lifts empty
    cache placeholders into the exported program as constants): the buffers are named for a rank to
    give values, the empty constants get empty values, and nothing the program reads stays on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.capture.export import run_export
    from autopar.runtime.sharded_init import Materializer
    from autopar.codegen.split import meta_buffers
    from autopar.driver.materialize import materialize_buffers
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.zeros(1, 8, dtype=torch.long)
    program = run_export(model, {"input_ids": ids, "labels": ids}, None, train_mode=False)
    unset = meta_buffers(program, "LlamaForCausalLM")
    named = {fqn for _, fqn in unset.values() if fqn is not None}
    assert "model.rotary_emb.inv_freq" in named
    empties = [key for key, fqn in unset.values() if fqn is None]
    assert empties and all(program.constants[k].numel() == 0 for k in empties)
    materialize_buffers(program, Materializer(model, seed=0))
    assert not any(t.is_meta for t in program.constants.values())
    assert not meta_buffers(program, "LlamaForCausalLM")   # no buffer left on meta either
    assert torch.equal(program.constants["model.model.rotary_emb.inv_freq"] if "model.model.rotary_emb.inv_freq"
                       in program.constants else program.state_dict["model.model.rotary_emb.inv_freq"],
                       LlamaForCausalLM(config).model.rotary_emb.inv_freq)   # the value a CPU build computes
