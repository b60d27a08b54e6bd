"""Dimension maps (OpNode.dims / OpNode.reduced) of captured ops, and the view-run grouping."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.capture.dims import broadcast_map, reshape_map
from autopar.models import GPTConfig, LlamaConfig, build_gpt, build_llama

B, S, H, A = 2, 16, 64, 4


@pytest.fixture(scope="module")
def gpt():
    model, inputs = build_gpt(GPTConfig(vocab_size=128, hidden=H, heads=A, layers=1, seq_len=S), batch_size=B,
                              device="meta")
    return capture(model, inputs)


def _first(graph, target: str, layer_name: str | None = None):
    for node in graph.nodes:
        if node.target == target and (layer_name is None or graph.layers[node.layer].name == layer_name):
            return node
    raise AssertionError(f"no {target} in the graph")


def test_reshape_runs():
    # (b, s, h) -> (b, s, heads, hd): heads is the outer dim of the split run, hd has no source
    assert reshape_map((2, 16, 64), (2, 16, 4, 16)) == (0, 1, 2, -1)
    # merge back: the merged dim comes from the outer input dim (heads)
    assert reshape_map((2, 16, 4, 16), (2, 16, 64)) == (0, 1, 2)
    # flatten the tokens: the outer dim (batch) carries over
    assert reshape_map((2, 16, 64), (32, 64)) == (0, 2)
    # unit dims never map (they cannot be split)
    assert reshape_map((2, 1, 64), (2, 64)) == (0, 2)
    assert reshape_map((2, 64), (2, 1, 64)) == (0, -1, 1)


def test_broadcast_right_aligned():
    assert broadcast_map((16, 64), (2, 16, 64)) == (-1, 0, 1)
    assert broadcast_map((2, 16, 1), (2, 16, 64)) == (0, 1, -1)


def test_gpt_attention_reshape_and_permute(gpt):
    view = _first(gpt, "aten.view.default")          # (b, s, 3h) -> (b, s, heads, 3, hd)
    assert view.outputs[0].shape == (B, S, A, 3, H // A)
    assert view.dims == ((0, 1, 2, -1, -1),)
    permute = _first(gpt, "aten.permute.default")    # -> (3, b, heads, s, hd)
    assert permute.dims == ((3, 0, 2, 1, 4),)
    select = _first(gpt, "aten.select.int")          # qkv[0]: drops dim 0
    assert select.dims == ((1, 2, 3, 4),)
    transpose = _first(gpt, "aten.transpose.int")    # k^T
    assert transpose.dims == ((0, 1, 3, 2),)
    reshape = next(n for n in gpt.nodes if n.target == "aten.reshape.default" and n.outputs[0].shape == (B, S, H))
    assert reshape.dims == ((0, 1, 2),)              # (b, s, heads, hd) -> (b, s, h): h comes from heads


def test_gpt_matmul_layer_norm_softmax_loss(gpt):
    qk = _first(gpt, "aten.matmul.default")          # (b, heads, s, hd) @ (b, heads, hd, s)
    assert qk.dims == ((0, 1, 2, -1), (0, 1, -1, 3))
    assert qk.reduced == ()
    linear = _first(gpt, "aten.linear.default")
    assert linear.dims == ((0, 1, -1),)              # the out-features dim comes from the weight
    ln = _first(gpt, "aten.layer_norm.default")
    assert ln.dims == ((0, 1, 2),) and ln.reduced == (2,)
    softmax = _first(gpt, "aten.softmax.int")
    assert softmax.dims == ((0, 1, 2, 3),) and softmax.reduced == (3,)
    loss = _first(gpt, "aten.cross_entropy_loss.default")
    assert loss.dims == ((), ()) and loss.reduced == (1,)
    emb = _first(gpt, "aten.embedding.default")
    assert emb.dims == ((0, 1, -1),)


def test_broadcasting_add_and_mask(gpt):
    add = _first(gpt, "aten.add.Tensor")             # token (b, s, h) + position (s, h) embeddings
    assert add.inputs[1] == "embedding_1"
    assert add.dims == ((0, 1, 2), (-1, 0, 1))
    fill = _first(gpt, "aten.masked_fill.Scalar")    # scores (b, heads, s, s) masked by a (s, s) constant
    assert fill.dims == ((0, 1, 2, 3), (-1, -1, 0, 1))


def test_llama_rms_norm_rotary_gqa():
    cfg = LlamaConfig(vocab_size=128, hidden=64, heads=4, kv_heads=2, layers=1, ffn_hidden=128, seq_len=16)
    model, inputs = build_llama(cfg, batch_size=2, device="meta")
    graph = capture(model, inputs)
    mean = _first(graph, "aten.mean.dim")            # RMSNorm's mean(x^2, -1, keepdim=True)
    assert mean.dims == ((0, 1, -1),) and mean.reduced == (2,)
    cat = next(n for n in graph.nodes if n.target == "aten.cat.default" and len(n.outputs[0].shape) == 4)
    assert cat.dims == ((0, 1, 2, -1), (0, 1, 2, -1))  # rotate_half: the concatenated dim has no single source
    sdpa = _first(graph, "aten.scaled_dot_product_attention.default")   # enable_gqa: k, v keep 2 heads of 4
    assert sdpa.inputs[1] != sdpa.inputs[0] and [graph.node(i).outputs[0].shape[1] for i in sdpa.inputs] == [4, 2, 2]
    assert sdpa.dims == ((0, 1, 2, -1), (0, 1, -1, -1), (0, 1, -1, 3))   # the heads split together, by group
    assert sdpa.gemm.density == (16 + 1) / (2 * 16)                        # is_causal: the kept (query, key) pairs


def test_repeated_key_heads():
    """Keys repeated to every head before attention (Hugging Face's repeat_kv on some paths)."""
    class Repeat(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, q, k):
            k = self.proj(k).repeat_interleave(2, dim=1)
            return torch.nn.functional.scaled_dot_product_attention(q, k, k)

    graph = capture(Repeat(), (torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)), lambda out, inputs: out.mean())
    assert _first(graph, "aten.repeat_interleave.self_int").dims == ((0, 1, 2, 3),)
    sdpa = _first(graph, "aten.scaled_dot_product_attention.default")
    assert sdpa.gemm.density == 1.0                                        # no causal mask: every pair


def test_conv_batch_norm_pool_reduction():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x):
            y = torch.nn.functional.max_pool2d(self.bn(self.conv(x)), 2)
            return y.sum(dim=(2, 3))

    graph = capture(Net(), (torch.randn(4, 3, 8, 8),), lambda out, inputs: out.mean())
    conv = _first(graph, "aten.conv2d.default")
    assert conv.dims == ((0, -1, -1, -1),)
    bn = _first(graph, "aten.batch_norm.default")
    assert bn.dims == ((0, 1, 2, 3),) and bn.reduced == (0, 2, 3)
    pool = _first(graph, "aten.max_pool2d.default")
    assert pool.dims == ((0, 1, -1, -1),)
    total = _first(graph, "aten.sum.dim_IntList")
    assert total.dims == ((0, 1),) and total.reduced == (2, 3)


def test_unknown_op_has_no_map():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, idx):
            return torch.gather(self.lin(x), 1, idx)

    graph = capture(Net(), (torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long)), lambda out, inputs: out.mean())
    gather = _first(graph, "aten.gather.default")
    assert gather.dims == () and gather.reduced == ()


def test_fingerprint_ignores_dims(gpt):
    stripped = replace(gpt, nodes=tuple(replace(n, dims=(), reduced=()) for n in gpt.nodes))
    assert gpt.content_hash == stripped.content_hash and gpt.fingerprint == stripped.fingerprint
