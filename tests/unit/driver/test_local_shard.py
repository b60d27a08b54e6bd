"""A tensor-parallel parameter's local shard (driver/chunk.py local_shard) accumulates its own gradient
over micro-batches, on a one-rank gloo group in this process.

``DTensor.to_local``'s backward wraps the incoming gradient in a fresh DTensor, so autograd took it as
the parameter's gradient even when it was a view of another parameter's (a class token concatenated
before a position embedding is added: ViT) or the very tensor another parameter took (``x + a + b``);
the next micro-batch then added into the shared memory twice."""

from __future__ import annotations

import pytest
import torch

from autopar.driver.chunk import local_shard


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def _class_token(cls, pos, bias_a, bias_b, x):
    """ViT's embeddings (the token expanded over a batch of one, concatenated, a position embedding
    added) and two parameters of its shape added to it (``add``'s backward hands both one tensor)."""
    h = torch.cat([cls.expand(x.shape[0], 1, x.shape[2]), x], 1) + pos
    return h + bias_a + bias_b


def _grads(params, wrap, micro_batches=3):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1, 3, 4, generator=g)
    for _ in range(micro_batches):
        x = torch.randn(1, 2, 4, generator=g)
        (_class_token(*(wrap(p) for p in params), x) * weight).sum().backward()
    return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]


def test_parameters_that_share_a_gradient_accumulate_their_own(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor
    torch.manual_seed(0)
    values = [torch.randn(1, 1, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    sharded = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, [Replicate()])) for v in values]
    want = _grads(plain, lambda p: p)
    got = _grads(sharded, local_shard)
    for name, w, g in zip(("class token", "position embedding", "bias a", "bias b"), want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=f"{name}'s gradient")
    storages = {g.untyped_storage().data_ptr() for g in got}
    assert len(storages) == len(got), "two parameters' gradients share memory"


def test_a_gradient_nothing_else_holds_is_not_copied(mesh):
    """A matmul's weight gradient is the parameter's as it is (no copy per parameter per step)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from autopar.driver import chunk
    copies = []
    own = chunk._OwnGradient.backward

    def counted(ctx, grad):
        out = own(ctx, grad)
        copies.append(out is not grad)
        return out
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    chunk._OwnGradient.backward = staticmethod(counted)
    try:
        (torch.randn(2, 4) @ local_shard(w)).sum().backward()
    finally:
        chunk._OwnGradient.backward = staticmethod(own)
    assert copies == [False]


def test_compiled_the_shared_gradients_are_own_and_the_graph_whole(mesh):
    """Under torch.compile the layer's graph is not broken at each parameter (dynamo cannot trace the
    reference count: every tensor-parallel parameter split the compiled layer), and the gradients are
    still each parameter's own."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    torch.manual_seed(0)
    values = [torch.randn(1, 1, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    sharded = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, [Replicate()])) for v in values]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *ps_x: _class_token(*(local_shard(p) for p in ps_x[:4]), ps_x[4]),
                             backend="aot_eager", fullgraph=True)   # fullgraph: a graph break raises
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1, 3, 4, generator=g)
    for _ in range(3):
        x = torch.randn(1, 2, 4, generator=g)
        (compiled(*sharded, x) * weight).sum().backward()
    got = [p.grad.to_local() for p in sharded]
    want = _grads(plain, lambda p: p)
    for w, gr in zip(want, got):
        torch.testing.assert_close(gr, w, rtol=0, atol=1e-6)
    assert len({gr.untyped_storage().data_ptr() for gr in got}) == len(got)
