"""Values computed from the batch and buffers alone (capture/replicated.py): each pipeline chunk that
reads one computes it again instead of receiving it, and the cost model sends what the split sends."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from autopar import Cluster, Precision
from autopar.capture import graph_of, param_aliases
from autopar.capture.export import run_export
from autopar.codegen.split import split_graph
from autopar.cost_model.layer_cost import LayerCostModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]).float() * 3.0             # shapes alone
        scaled = x * self.scale                                          # the batch and a buffer
        noise = F.dropout(torch.ones_like(scaled), 0.5, training=True)  # random: drawn again it would differ
        hidden = self.proj(scaled)                                       # a parameter
        return (hidden * noise).sum() + positions.sum()


def _targets(program, names) -> set[str]:
    """The aten op names (``cos``, ``mul``) of the nodes ``names``."""
    by_name = {n.name: n for n in program.graph.nodes}
    return {str(by_name[n].target).split(".")[1] for n in names if str(by_name[n].target).startswith("aten.")}


def test_replicated_are_what_reads_the_batch_and_buffers_alone() -> None:
    program = run_export(_Mixed(), (torch.randn(2, 4),), lambda out, _: out)
    graph = graph_of(_Mixed(), program)
    ops = {n.name: str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    replicated = {ops[n] for n in graph.replicated}
    assert {"aten.arange.default", "aten.mul.Tensor", "aten.ones_like.default"} <= replicated
    # the dropout mask (random), the projection (a parameter) and what reads either are not
    assert {name for name, op in ops.items() if op in ("aten.dropout.default", "aten.linear.default")} \
        .isdisjoint(graph.replicated)
    assert "add" in ops and "add" not in graph.replicated    # the loss


class _Written(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]).float() + 1.0
        positions.view(-1).mul_(self.proj.weight.sum())    # written in place through a view
        steps = torch.arange(x.shape[1]) * 2                 # never written
        return (self.proj(x) * positions).sum() + steps.sum()


def test_a_value_written_in_place_is_not_replicated() -> None:
    """The exported graph keeps in-place writes: a value some op writes (here through a view, with a
    parameter) is not computed again elsewhere, nor is what reads it; an untouched one still is."""
    program = run_export(_Written(), (torch.randn(2, 4),), lambda out, _: out)
    graph = graph_of(_Written(), program)
    ops = {n.name: str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any(op.endswith("mul_.Tensor") for op in ops.values())          # the write survived export
    added = next(name for name, op in ops.items() if op == "aten.add.Tensor")
    assert added not in graph.replicated
    assert any(ops[n] == "aten.mul.Tensor" for n in graph.replicated)     # steps


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    return LlamaForCausalLM(config)


def test_a_later_chunk_computes_the_rotary_embedding_again() -> None:
    """HF Llama computes the rotary cos and sin once, from a buffer and positions, for every layer: a
    pipeline cut after the first decoder layer sends the hidden state alone, the second chunk
    computing cos and sin again; the cost model's crossing elements at that cut are the same."""
    model = _llama()
    ids = torch.randint(0, 64, (2, 8))
    program = run_export(model, {"input_ids": ids, "labels": ids}, None)
    graph = graph_of(model, program)
    names = [layer.name for layer in graph.layers]
    cut = next(i for i, layer in enumerate(graph.layers) if layer.is_block) + 1
    split = split_graph(program, graph, [names[:cut], names[cut:]], param_aliases(model))
    (hidden,) = split.chunks[1].recv
    assert tuple(split.meta(hidden).shape) == (2, 8, 32)
    assert split.chunks[0].send == (hidden,)
    first, second = (set(n for layer in c.layers for n in layer.nodes) for c in split.chunks)
    again = first & second
    assert again and again <= graph.replicated and {"cos", "sin"} <= _targets(program, again)
    cluster = Cluster.from_spec("1x2xcpu")
    costs = LayerCostModel(graph, cluster, Precision.for_device(cluster.device.name))
    batch_dependent, constant = costs.crossing_numels
    assert (batch_dependent[cut - 1], constant[cut - 1]) == (2 * 8 * 32, 0)
