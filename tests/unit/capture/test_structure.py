"""ModelStructure: what a plan relies on of a model, the same across devices, example batches and modes,
and the first difference named when two models differ."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autopar
from autopar import PlanFormatError
from autopar.capture import capture
from autopar.plan.structure import first_difference
from autopar.capture.structure import is_volatile
from autopar.plan.structure import ModelStructure
from autopar.models import hf


def _llama(device: str, batch: int, hidden: int = 32, layers: int = 2, train: bool = True):
    model, inputs = hf.build_hf_llama(layers=layers, hidden=hidden, heads=4, kv_heads=2, ffn_hidden=64, vocab=64,
                                      seq_len=8, batch_size=batch, device=device)
    return capture(model if train else model.eval(), inputs)


@pytest.fixture(scope="module")
def planned():
    """As the README plans: on the meta device, from batch-1 inputs."""
    return _llama("meta", 1)


def test_same_model_same_fingerprint_on_any_device_batch_and_mode(planned):
    # a batch of 1 drops ops (Hugging Face's packed-sequence check, expands), the meta SDPA kernel's
    # strides add a contiguous: other graphs, the same model
    running = _llama("cpu", 8, train=False)
    assert [n.target for n in running.nodes] != [n.target for n in planned.nodes]
    assert running.fingerprint == planned.fingerprint
    assert running.structure == planned.structure
    assert first_difference(planned.structure, running.structure) is None
    assert running.content_hash != planned.content_hash   # what profiler caches key on: exactly this graph


def test_the_first_difference_is_named(planned):
    wider = _llama("meta", 1, hidden=48)
    assert wider.fingerprint != planned.fingerprint
    assert first_difference(planned.structure, wider.structure) == (
        "parameter model.embed_tokens.weight is [64, 48] here but [64, 32] in the plan (another model size?)")
    deeper = _llama("meta", 1, layers=3)
    assert first_difference(planned.structure, deeper.structure) == \
        "layer 3 is model.layers.2 here but model.norm in the plan"
    assert first_difference(deeper.structure, planned.structure) == \
        "layer 3 is model.norm here but model.layers.2 in the plan"


def test_an_op_that_differs_is_named():
    class Net(nn.Module):
        def __init__(self, attend: bool) -> None:
            super().__init__()
            self.attend = attend
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return torch.softmax(y @ y.transpose(-1, -2), -1) @ y if self.attend else y

    x = (torch.randn(2, 4, 8),)
    attending, plain = capture(Net(True), x), capture(Net(False), x)
    assert first_difference(attending.structure, plain.structure) == \
        "layer lin: the plan's op matmul in the model's top level is missing here"
    assert first_difference(plain.structure, attending.structure) == \
        "layer lin: op matmul in the model's top level here is not in the plan"


def test_anchors_are_stored_once_per_layer_body(planned):
    s = planned.structure
    assert len(s.layers) == len(planned.layers) and len(s.bodies) < len(s.layers)   # the blocks share one body
    block = s.anchors([name for name, _ in s.layers].index("model.layers.1"))
    assert ("*.self_attn.q_proj.weight", (32, 32)) in [p for a in block for p in a.params]


def test_json_round_trip_and_strict_loading(planned):
    s = planned.structure
    data = json.loads(json.dumps(s.to_dict()))
    assert ModelStructure.from_dict(data) == s
    assert ModelStructure.from_dict(data).fingerprint == s.fingerprint
    broken = {**data, "layers": [[data["layers"][0][0], 99]] + data["layers"][1:]}
    with pytest.raises(ValueError, match=r"structure\.layers\[0\]"):
        ModelStructure.from_dict(broken)
    bad_anchor = {**data, "bodies": [[["matmul", "mm", "", [["w", [-1]]]]]] + data["bodies"][1:]}
    with pytest.raises(ValueError, match=r"structure\.bodies\[0\]\[0\]"):
        ModelStructure.from_dict(bad_anchor)


def test_plan_files_carry_the_structure(planned, tmp_path):
    model, inputs = hf.build_hf_llama(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, seq_len=8,
                                      batch_size=1, device="meta")
    plan = autopar.estimate(model, autopar.Cluster.from_spec("1x2xcpu"), inputs, autopar.ParallelConfig(dp=2),
                            global_batch_size=4)
    assert plan.structure == planned.structure and plan.fingerprint == planned.fingerprint
    plan.save(tmp_path / "p.json")
    assert autopar.load_plan(tmp_path / "p.json") == plan
    data = plan.to_dict()
    del data["structure"]
    with pytest.raises(PlanFormatError, match="missing field 'structure'"):
        autopar.Plan.from_dict(data)
    with pytest.raises(PlanFormatError, match=r"plan field structure\.layers\[0\]"):
        autopar.Plan.from_dict({**plan.to_dict(), "structure": {"layers": [["x", 5]], "bodies": []}})


def test_every_op_identity_maps_one_to_one_across_exports(planned):
    # the meta SDPA kernel's contiguous, the expands a batch of 1 drops: volatile, without identity
    running = _llama("cpu", 8, train=False)
    assert [n.target for n in running.nodes] != [n.target for n in planned.nodes]
    assert {i for i in planned.node_of if not i.volatile} == {i for i in running.node_of if not i.volatile}
    for op_id, name in planned.node_of.items():
        if op_id in running.node_of:    # a volatile op both exports have: the same op
            assert planned.node(name).target == running.node(running.node_of[op_id]).target
    assert {running.node_of[i] for i, n in zip(planned.op_ids, planned.nodes) if n.params} == {
        n.name for n in running.nodes if n.params}   # every op reading parameters has its counterpart
    assert all(i is None or i.volatile for i, n in zip(running.op_ids, running.nodes) if is_volatile(n))


def test_op_identity_is_structural():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = torch.relu(b(x)) + torch.relu(x)
            return x

    graph = capture(Net(), (torch.randn(2, 8),))
    ids = {str(i) for i in graph.op_ids if i is not None}
    # the layer's own module is "*"; the relus run in Net.forward, the top level
    assert {"blocks.1: linear#0 in *", "blocks.1: relu#0 in the model's top level",
            "blocks.1: relu#1 in the model's top level"} <= ids, ids


def test_index_plumbing_cast_to_float_on_one_device_is_plumbing_on_every_device():
    """Hugging Face's mixture of experts counts the tokens per expert with ``histc`` over the sorted expert ids,
    cast to float on a CPU and to int elsewhere: the meta export the plan is made from makes integers where a
    rank's CPU export makes floats. Computed from integers alone, both are plumbing (volatile, named by what they
    read), so the two exports' ops map one to one; typed by the dtype they make, the CPU's cast and histogram had
    no counterpart in the plan (PlanMismatchError at tp > 1)."""
    from autopar.capture.structure import plumbing

    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            ids, _ = torch.sort(self.gate(x).argmax(-1).reshape(-1))
            counts = torch.histc(ids.float() if x.device.type == "cpu" else ids.int(), bins=4, min=0, max=3)
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            return self.proj(x) * (offsets[-1] / ids.numel()).to(x.dtype)

    torch.manual_seed(0)
    meta = capture(Routed().to("meta"), (torch.randn(1, 3, 8, device="meta"),))
    cpu = capture(Routed(), (torch.randn(2, 3, 8),))
    histc = [n for n in cpu.nodes if "histc" in n.target]
    assert histc and histc[0].outputs[0].is_float   # float on the CPU: not integral, plumbing all the same
    assert histc[0].name in plumbing(cpu.nodes, cpu.inputs)
    assert {i for i in meta.node_of if not i.volatile} == {i for i in cpu.node_of if not i.volatile}
    assert not any(n.params and n.name in plumbing(cpu.nodes, cpu.inputs) for n in cpu.nodes)   # anchors are data


def test_a_block_called_twice_names_its_ops_as_once():
    """A block the forward calls twice makes layers ``blocks.0`` and ``blocks.0#2`` of one module: both name their
    ops and parameters relative to it (``*``), so the second call shares the first's body and a sharding group that
    records the first layer's ops maps onto the second's (OpId.in_layer). Named by the module path with ``#2``, the
    second call's ops had absolute modules and no counterpart: at tp=2 a rank's program refused the plan."""
    from autopar.capture.export import run_export
    from autopar.codegen.compile import compile_program

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2))

        def forward(self, x):
            for _ in range(2):
                for block in self.blocks:
                    x = x + block(x)
            return x

    torch.manual_seed(0)
    model, example = Twice(), (torch.randn(2, 4, 8),)
    graph = capture(model, example)
    assert [layer.name for layer in graph.layers] == ["blocks.0", "blocks.1", "blocks.0#2", "blocks.1#2"]
    assert len(graph.structure.bodies) == 1
    first = [i for i in graph.op_ids if i is not None and i.layer == "blocks.0" and not i.volatile]
    assert {str(i.in_layer("blocks.0#2")) for i in first} == {
        str(i) for i in graph.op_ids if i is not None and i.layer == "blocks.0#2" and not i.volatile}
    loss = lambda out, inputs: out.pow(2).mean()   # noqa: E731
    plan = autopar.estimate(model, autopar.Cluster.from_spec("1x2xcpu"), example,
                            autopar.ParallelConfig(tp=2, micro_batch_size=2), global_batch_size=2, loss_fn=loss,
                            precision=autopar.Precision(compute="fp32"))
    assert any(len(group.layers) > group.solved for group in plan.sharding)   # the repeats copy the first layer's
    compile_program(plan, run_export(model, example, loss, train_mode=False), model)
