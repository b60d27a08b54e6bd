"""Per-op recomputation (recompute "op", torchtitan's policy): what the cost model keeps and reruns is what
the runtime's checkpoint policy (runtime/recompute.py) keeps and reruns."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autopar import Cluster, Precision
from autopar.capture import capture
from autopar.capture.opgraph import OpKind
from autopar.runtime.recompute import PRODUCTS, op_context
from autopar.cost_model.comm import GroupPlacement
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.cost_model.memory import op_kept
from autopar.models import LlamaConfig, build_llama

CFG = LlamaConfig(vocab_size=512, hidden=256, heads=8, kv_heads=2, layers=2, ffn_hidden=768, seq_len=256)


@pytest.fixture(scope="module")
def llama():
    model, inputs = build_llama(CFG, batch_size=1, device="meta", dtype=torch.bfloat16)
    return capture(model, inputs)


def _block(graph):
    return next(layer for layer in graph.layers if layer.is_block)


class _Products(TorchDispatchMode):
    """Counts the matrix products (runtime/recompute.py's PRODUCTS) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in PRODUCTS
        return func(*args, **(kwargs or {}))


def test_op_keeps_every_other_product_and_the_attention(llama):
    """A Llama block's seven projections in forward order q, k, v, o, gate, up, down: q, v, gate and down
    kept, and the fused attention."""
    block = _block(llama)
    nodes = list(llama.layer_nodes(block))
    products = [n.name for n in nodes if n.kind is OpKind.MATMUL]
    attention = [n.name for n in nodes if n.kind is OpKind.ATTENTION]
    assert len(products) == 7 and len(attention) == 1
    assert op_kept(llama, block) == frozenset(products[0::2] + attention)


def test_op_prices_between_none_and_full(llama):
    """Kept bytes: the layer's inputs and the kept outputs, between full's and none's; recomputed: the
    forward of every op not kept (FLOPs exactly those ops')."""
    cluster = Cluster.from_spec("1x8xH100-SXM")
    model = LayerCostModel(llama, cluster, Precision())
    group = GroupPlacement(size=1, ranks_per_node=1, groups_per_node=1)
    block = _block(llama)
    cost = {m: model.cost(block, 1, False, 1, m, group) for m in ("none", "op", "full")}
    assert cost["full"].activations < cost["op"].activations < cost["none"].activations
    assert 0 < cost["op"].recompute < cost["full"].recompute
    kept = op_kept(llama, block)
    assert cost["op"].recompute_flops == pytest.approx(
        sum(n.flops_fwd for n in llama.layer_nodes(block) if n.name not in kept), rel=1e-12)
    per = 2   # bf16
    outputs = sum(llama.node(n).outputs[0].numel for n in kept) * per
    assert cost["op"].activations - cost["full"].activations == pytest.approx(outputs, rel=1e-9)


def test_runtime_policy_reruns_the_even_products():
    """Under the policy a block's backward reruns 3 of its 7 products (every second one, as op_kept leaves
    out of the 7 the captured block has: the test above) and computes what an unchecked backward does."""
    torch.manual_seed(0)
    model, inputs = build_llama(LlamaConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, layers=1, ffn_hidden=64,
                                            seq_len=8), batch_size=2)
    block = model.layers[0]
    x = torch.randn(2, 8, 32, requires_grad=True)

    def grads(run):
        out = run()
        with _Products() as mode:
            got = torch.autograd.grad(out.float().pow(2).sum(), [x, *block.parameters()])
        return got, mode.count

    with _Products() as forward:
        block(x)
    plain, plain_count = grads(lambda: block(x))
    kept, kept_count = grads(lambda: checkpoint(block, x, use_reentrant=False, context_fn=op_context))
    assert forward.count == 7
    assert kept_count - plain_count == 3
    for a, b in zip(plain, kept, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

