"""codegen/bindings.py: every overload the generated code calls through a torch binding computes what the
overload computes, on the arguments an exported graph passes (positional as the schema orders them,
keyword-only ones by name), and a rewritten graph prints as plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autopar.codegen.bindings import FUNCTIONS, METHODS, NN, TABLE, use_bindings

g = torch.Generator().manual_seed(0)
X = torch.randn(2, 3, 4, generator=g)
Y = torch.randn(2, 3, 4, generator=g)
M = torch.randn(4, 5, generator=g)
B = torch.randn(2, 4, 5, generator=g)
IDS = torch.tensor([[0, 2, 1], [3, 3, 0]])
Q = torch.randn(1, 2, 3, 4, generator=g)

SAMPLES = {
    "add.Tensor": ((X, Y), {"alpha": 2}), "sub.Tensor": ((X, 1.5), {}), "mul.Tensor": ((X, Y), {}),
    "div.Tensor": ((X, 2), {}), "neg.default": ((X,), {}), "rsqrt.default": ((X.abs() + 1,), {}),
    "sqrt.default": ((X.abs(),), {}), "pow.Tensor_Scalar": ((X, 2),), "pow.Tensor_Tensor": ((X.abs(), Y),),
    "exp.default": ((X,),), "log.default": ((X.abs() + 1,),), "cos.default": ((X,),), "sin.default": ((X,),),
    "tanh.default": ((X,),), "sigmoid.default": ((X,),), "relu.default": ((X,),), "abs.default": ((X,),),
    "mean.dim": ((X, [-1], True),), "sum.dim_IntList": ((X, [0, 2]), {"dtype": torch.float64}),
    "sum.default": ((X,),), "amax.default": ((X, [1], True),), "cat.default": (([X, Y], -2),),
    "stack.default": (([X, Y], 1),), "transpose.int": ((X, 1, 2),), "unsqueeze.default": ((X, 2),),
    "squeeze.dim": ((X[:, :1], 1),), "reshape.default": ((X, [6, -1]),), "permute.default": ((X, [2, 0, 1]),),
    "t.default": ((M,),), "select.int": ((X, 1, 2),), "embedding.default": ((M, IDS, 1),),
    "softmax.int": ((X, -1),), "log_softmax.int": ((X, 1, torch.float64),),
    "layer_norm.default": ((X, [4], torch.ones(4), torch.zeros(4), 1e-5),), "matmul.default": ((X, M),),
    "mm.default": ((X[0], M),), "bmm.default": ((X, B),), "addmm.default": ((torch.ones(5), X[0], M), {"beta": 2}),
    "baddbmm.default": ((torch.ones(2, 3, 5), X, B), {"alpha": 0.5}), "clone.default": ((X,),),
    "where.self": ((X > 0, X, Y),), "dropout.default": ((X, 0.5, False),),
    "split_with_sizes.default": ((X, [1, 3], -1),), "arange.default": ((6,), {"dtype": torch.float32}),
    "arange.start": ((2, 7),), "full.default": (([2, 3], 1.5), {"dtype": torch.float64}),
    "zeros.default": (([2, 3],),), "ones.default": (([3],), {"dtype": torch.int64}),
    "zeros_like.default": ((X,),), "ones_like.default": ((X,), {"dtype": torch.float64}),
    "eq.Scalar": ((IDS, 3),), "ne.Scalar": ((IDS, -100),), "lt.Scalar": ((X, 0.1),), "gt.Scalar": ((X, 0),),
    "minimum.default": ((X, Y),), "maximum.default": ((X, Y),), "rsub.Scalar": ((X, 1.0),),
    "tril.default": ((M, 1),), "triu.default": ((M,),),
    "linear.default": ((X, M.t(), torch.ones(5)),), "silu.default": ((X,),),
    "gelu.default": ((X,), {"approximate": "tanh"}),
    "scaled_dot_product_attention.default": ((Q, Q, Q), {"is_causal": True, "scale": 0.3}),
    "cross_entropy_loss.default": ((X[0], torch.tensor([1, 3, 0])),),
    "view.default": ((X, [3, 8]),), "expand.default": ((X[:, :1], [2, 5, 4]),), "to.dtype": ((X, torch.float64),),
    "masked_fill.Scalar": ((X, X > 0, -1.0),), "contiguous.default": ((X.transpose(0, 2),),),
    "add_.Tensor": ((X.clone(), Y), {"alpha": 3}), "mul_.Tensor": ((X.clone(), 2),), "detach_.default": ((X.clone(),),),
}


def _rewritten(op, args, kwargs):
    """A graph calling ``op`` on ``args`` (its tensors as inputs), through use_bindings."""
    graph, inputs = fx.Graph(), []

    def arg(a):
        if isinstance(a, torch.Tensor):
            inputs.append(a)
            return graph.placeholder(f"x{len(inputs)}")
        return [arg(b) for b in a] if isinstance(a, list) else a
    node = graph.call_function(op, tuple(arg(a) for a in args), {k: arg(v) for k, v in kwargs.items()})
    graph.output(node)
    use_bindings(graph)
    return fx.GraphModule({}, graph), inputs


@pytest.mark.parametrize("name", FUNCTIONS + NN + METHODS)
def test_binding_computes_the_overload(name):
    """Through the rewrite, on the sample's arguments (only the required ones for most: the defaults
    the rewrite writes out must be the overload's)."""
    packet, overload = name.split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    assert op in TABLE, f"{name}: no binding found in this torch"
    args, kwargs = (SAMPLES[name] + ({},))[:2]
    fresh = lambda a: [x.clone() if isinstance(x, torch.Tensor) else x for x in a]  # noqa: E731 (in-place ops)
    module, inputs = _rewritten(op, args, kwargs)
    want = op(*fresh(args), **kwargs)
    got = module(*fresh(inputs))
    want, got = (w if isinstance(w, (tuple, list)) else (w,) for w in (want, got))
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_every_entry_has_a_sample():
    assert set(SAMPLES) == set(FUNCTIONS + NN + METHODS)


def test_rewritten_graph_prints_plain_torch():
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    a = graph.create_node("call_function", torch.ops.aten.add.Tensor, (x, x), name="add")
    b = graph.create_node("call_function", torch.ops.aten.linear.default, (a, w), name="linear")
    c = graph.create_node("call_function", torch.ops.aten.view.default, (b, [2, -1]), name="view")
    d = graph.call_function(torch.ops.aten.slice.Tensor, (c, 1, 0, 2))   # no binding: stays
    graph.output((d,))
    use_bindings(graph)
    module = fx.GraphModule({}, graph)
    assert "torch.add(x, x, alpha = 1)" in module.code and "torch._C._nn.linear(add, w, bias = None)" in module.code
    assert "linear.view([2, -1])" in module.code and "torch.ops.aten.slice.Tensor" in module.code
    got = module(torch.ones(2, 3, 4), torch.ones(5, 4))[0]
    assert torch.equal(got, (2 * torch.ones(2, 3, 4) @ torch.ones(4, 5)).view(2, -1)[:, :2])


def test_optional_arguments_given_positionally_are_passed_by_name():
    """An export may record a cast with every argument positional, ``aten.to.dtype(x, float32, False, False,
    contiguous_format)`` (Qwen3-Next's and OLMo-Hybrid's gated delta rules); ``Tensor.to`` takes
    ``memory_format`` by name only, so the rewrite passes every argument that has a default by name."""
    op = torch.ops.aten.to.dtype
    module, inputs = _rewritten(op, (X, torch.float64, False, False, torch.contiguous_format), {})
    assert torch.equal(module(*inputs), op(X, torch.float64, False, False, torch.contiguous_format))
    assert "memory_format = torch.contiguous_format" in module.code
    module, inputs = _rewritten(torch.ops.aten.tril.default, (M, 1), {})
    assert torch.equal(module(*inputs), torch.tril(M, 1)) and "diagonal = 1" in module.code
