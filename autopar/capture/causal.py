"""Explicit causal masks run as ``is_causal``: what a model's own eager step runs, under export too.

A model that builds its attention mask from positions alone (Hugging Face's ``create_causal_mask``,
GPT-style ``tril`` buffers computed in forward) hands ``scaled_dot_product_attention`` an explicit
mask when it is traced: transformers skips the mask and passes ``is_causal=True`` only when it is
not tracing. Exported, every such model would run attention with a mask tensor, which the fused
kernels read whole (FlashAttention cannot take one: on a GPU the call falls back to a slower
kernel; the cost model prices it dense, ``Gemm.density`` 1) and which costs ops of its own on
every step (the mask construction: host time at small sizes).

The pass: for each attention call with a mask and ``is_causal`` False, when the mask is computed
from no input, parameter or buffer (only factories and arithmetic on them: it depends on shapes
alone, which export fixes), evaluate it once on the CPU and, when every (batch, head) slice of it
is exactly the lower triangle of a square (a boolean mask; or an additive float one of 0 below
and on the diagonal and -inf or the dtype's lowest value above, which softmax turns into the same
zeros), replace it by ``is_causal=True``. The mask's construction, then unread, is removed. A mask
that reads an input (padding, packed sequences), or that is anything but the causal triangle,
stays as it is. Runs inside :func:`~autopar.capture.export.run_export`, so a plan and the program
that runs it see the same graph, at every batch size (the runtime re-exports at its micro-batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

_ATTENTION = (torch.ops.aten.scaled_dot_product_attention.default,)
_NAMES = tuple(a.name for a in torch.ops.aten.scaled_dot_product_attention.default._schema.arguments)
# The decision must not depend on the batch (a plan made at batch 1 and the program exported at its
# micro-batch must agree): it is bounded by one (query x key) plane, up to 8192 x 8192. The
# evaluation costs the whole mask (every sample's), once per export, with integer temporaries of
# its size: past 1 Gi elements the mask stays explicit, which runs correctly, only without the
# fused kernel.
_MAX_PLANE = 1 << 26
_MAX_ELEMENTS = 1 << 30


def causal_masks(program: torch.export.ExportedProgram) -> int:
    """Rewrite ``program``'s attention calls whose mask is the causal triangle; return how many."""
    graph = program.graph
    masks: dict[fx.Node, bool] = {}
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ATTENTION:
            continue
        call = _bind(node)
        mask = call.get("attn_mask")
        if not isinstance(mask, fx.Node) or call.get("is_causal"):
            continue
        if mask not in masks:
            masks[mask] = _is_causal(mask)
        if masks[mask]:
            call.pop("attn_mask")
            call["is_causal"] = True
            node.args = tuple(call.pop(name) for name in _NAMES[:3])
            node.kwargs = call
            rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return rewritten


def _bind(node: fx.Node) -> dict[str, Any]:
    call = dict(zip(_NAMES, node.args))
    call.update(node.kwargs)
    return call


def _is_causal(mask: fx.Node) -> bool:
    """Whether ``mask`` depends on shapes alone and is the causal triangle (evaluated on the CPU)."""
    shape = getattr(mask.meta.get("val"), "shape", None)
    if shape is None or len(shape) < 2 or shape[-1] != shape[-2] or shape[-1] * shape[-2] > _MAX_PLANE \
            or shape.numel() > _MAX_ELEMENTS:
        return False
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if n.op != "call_function" or isinstance(n.target, torch._ops.HigherOrderOperator):
            return False   # an input, parameter, buffer or constant, or a region: not shapes alone
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return False   # a random mask (dropout's) is no triangle
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        order.append(n)
        return True

    if not visit(mask):
        return False
    try:
        value = _evaluate(order, mask)
    except Exception:   # noqa: BLE001 - an op that does not run on the CPU: leave the mask as it is
        return False
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        return False
    size = shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == lower).all())
    if value.is_floating_point():
        low = torch.finfo(value.dtype).min
        above = value.masked_select(~lower.expand(value.shape))
        return bool((value.masked_select(lower.expand(value.shape)) == 0).all()) and \
            bool(((above == low) | (above == float("-inf"))).all())
    return False


def _evaluate(order: list[fx.Node], mask: fx.Node) -> Any:
    """Run the nodes in ``order`` (factories and arithmetic) on the CPU; the value of ``mask``."""
    cpu = torch.device("cpu")
    env: dict[fx.Node, Any] = {}

    def load(a: Any) -> Any:   # (map_aggregate maps nodes and constants alike)
        if isinstance(a, fx.Node):
            return env[a]
        return cpu if isinstance(a, torch.device) else a

    for n in order:
        args, kwargs = fx.node.map_aggregate((n.args, n.kwargs), load)
        env[n] = n.target(*args, **kwargs)
    return env[mask]
