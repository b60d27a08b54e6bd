"""The generated code calls torch's own Python bindings for the common aten ops: ``torch.add(x, y)``,
``x.view(...)``, ``torch._C._nn.linear(x, w)`` rather than ``torch.ops.aten.add.Tensor(x, y)``.

An exported graph's nodes call aten overloads (``OpOverload``): each call goes through a Python
``__call__`` and the boxed calling convention, 1.5-2 us more per op than the binding that an eager
model's ``F.linear`` or ``x + y`` reaches (measured on this CPU: ``torch.ops.aten.add.Tensor`` 6.5 us,
``torch.add`` 4.6 us, at tiny sizes). A decoder layer runs about a hundred ops forward, so at small
sizes, the host time a GPU step waits on, the overloads cost a few percent of a step; they are also
harder to read. The binding runs the same kernel: the Python argument parser picks the overload the
export recorded from the same arguments.

Only the overloads listed here are rewritten, each one whose binding takes the overload's arguments
positionally and by the same keyword names (tests/unit/codegen/test_bindings.py runs every entry on
sample arguments against its overload); every other op keeps its ``OpOverload``. A rewritten call
passes every argument the schema has, its defaults written out: a binding's own defaults may differ
(``torch._C._nn.cross_entropy_loss`` reduces nothing unless told; aten's overload takes the mean). A binding is a
function of ``torch`` itself (``torch.add``: fx writes it by that name), of ``torch._C._nn``, or a
``Tensor`` method written as a method call. dynamo traces all three, so compiled code is unchanged.
Imports only torch: generated source runs without autopar.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.fx as fx

FUNCTIONS = tuple("""
add.Tensor sub.Tensor mul.Tensor div.Tensor neg.default rsqrt.default sqrt.default pow.Tensor_Scalar
pow.Tensor_Tensor exp.default log.default cos.default sin.default tanh.default sigmoid.default relu.default
abs.default mean.dim sum.dim_IntList sum.default amax.default cat.default stack.default transpose.int
unsqueeze.default squeeze.dim reshape.default permute.default t.default select.int embedding.default
softmax.int log_softmax.int layer_norm.default matmul.default mm.default bmm.default addmm.default
baddbmm.default clone.default where.self dropout.default split_with_sizes.default arange.default arange.start
full.default zeros.default ones.default zeros_like.default ones_like.default eq.Scalar ne.Scalar lt.Scalar
gt.Scalar minimum.default maximum.default rsub.Scalar tril.default triu.default
""".split())
"""Overloads called as ``torch.<op>`` (a builtin of ``torch._C._VariableFunctions``)."""

NN = tuple("linear.default silu.default gelu.default scaled_dot_product_attention.default "
           "cross_entropy_loss.default".split())
"""Overloads called as ``torch._C._nn.<op>``."""

METHODS = tuple("view.default expand.default to.dtype masked_fill.Scalar contiguous.default add_.Tensor "
                "mul_.Tensor detach_.default".split())
"""Overloads called as a method of their first argument, ``x.<op>(...)``."""


def _overload(name: str) -> Any:
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload, None)


def _table() -> dict[Any, tuple[str, Any]]:
    """OpOverload -> ("function", callable) or ("method", name), for the entries this torch has."""
    out: dict[Any, tuple[str, Any]] = {}
    for name in FUNCTIONS:
        op, packet = _overload(name), name.split(".")[0]
        fn = getattr(torch._C._VariableFunctions, packet, None)
        if op is not None and fn is not None and getattr(torch, packet, None) is fn:
            out[op] = ("function", fn)
    for name in NN:
        op, fn = _overload(name), getattr(torch._C._nn, name.split(".")[0], None)
        if op is not None and fn is not None:
            out[op] = ("function", fn)
    for name in METHODS:
        op, method = _overload(name), name.split(".")[0]
        if op is not None and isinstance(getattr(torch.Tensor, method, None), types.MethodDescriptorType):
            out[op] = ("method", method)
    return out


TABLE = _table()


def use_bindings(graph: fx.Graph) -> None:
    """Rewrite ``graph``'s calls of the listed overloads into calls of their bindings, in place."""
    for node in graph.nodes:
        if node.op != "call_function" or not node.args:
            continue
        found = TABLE.get(node.target)
        if found is None:
            continue
        kind, target = found
        node.args, node.kwargs = _explicit(node.target._schema, node.args, node.kwargs)
        if kind == "method":
            node.op = "call_method"
        node.target = target


def _explicit(schema: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the schema's required arguments positional and every argument that has a
    default given by name, at its default where they leave it out (by name: a binding may take keyword-only
    what the schema takes positionally, as ``Tensor.to`` takes ``memory_format``, which an export may pass
    positionally: ``x.to(torch.float32, False, False, torch.contiguous_format)`` is refused by the binding)."""
    required = next((i for i, a in enumerate(schema.arguments[:len(args)]) if a.has_default_value()), len(args))
    kwargs = {**{a.name: v for a, v in zip(schema.arguments[required:], args[required:])}, **kwargs}
    args = args[:required]
    for arg in schema.arguments[len(args):]:
        if arg.name in kwargs or not arg.has_default_value():
            continue
        if arg.default_value is not None and arg.name in _ENUMS:
            continue   # the schema keeps an enum's default as its int (the binding's default: test_bindings.py)
        kwargs[arg.name] = arg.default_value
    return tuple(args), kwargs


_ENUMS = frozenset(("memory_format", "layout", "dtype", "device"))
