"""Rows picked by a mask, one per sample: the last picked row of each sample, with static shapes.

Sequence classifiers of encoder-decoders (Hugging Face's Bart, MBart, PLBart, MVP, BigBird-Pegasus,
T5, MT5, UMT5 ``...ForSequenceClassification``) pool the hidden state at each sequence's last
end-of-sequence token::

    eos_mask = input_ids.eq(eos_token_id)
    check(unique_consecutive(eos_mask.sum(1)).numel() == 1)      # as many per sample
    pooled = hidden[eos_mask, :].view(batch, -1, hidden_size)[:, -1, :]

``hidden[eos_mask]`` has as many rows as the batch has end-of-sequence tokens: a size that depends
on the input's values, which a static plan cannot shard, price or cut into stages (capture refuses
it). The pooled result is static, ``(batch, hidden_size)``: each sample's row at the last position
its mask picks. The pass rewrites the three ops, ``index`` by a boolean mask of the first two dims
of a 3-D tensor, ``view(batch, -1, hidden_size)`` and ``select(1, -1)``, into that gather::

    last = S - 1 - argmax(flip(mask, [1]), 1)           # (batch,), the last picked position
    pooled = gather(hidden, 1, last[:, None, None].expand(batch, 1, hidden_size))[:, 0]

equal to the original for every mask it accepts (each sample picks the same number of rows, at least
one; the model's own checks). Those checks are assertions on sizes that depend on values (the count
of unique per-sample counts, the number of picked rows): with the selection gone they test nothing
the program computes, and are removed with the tensors they measure. A mask selection used any other
way is left as it is (and capture refuses it, naming the op). Runs inside
:func:`~autopar.capture.export.run_export`, before the graph is read.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_ASSERTS = (aten._assert_scalar.default, aten.sym_constrain_range_for_size.default)
_SIZE_OPS = (aten.sym_size.int, aten.sym_numel.default)


def last_selected(program: torch.export.ExportedProgram) -> int:
    """Rewrite ``program``'s mask-selected last rows (module docstring); return how many."""
    graph = program.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.index.Tensor and _rewrite(graph, node):
            rewritten += 1
    if rewritten:
        _drop_value_checks(graph)
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return rewritten


def _rewrite(graph: fx.Graph, index: fx.Node) -> bool:
    x, indices = index.args[0], index.args[1]
    if not (isinstance(x, fx.Node) and isinstance(indices, (list, tuple)) and len(indices) == 1
            and isinstance(indices[0], fx.Node)):
        return False
    mask = indices[0]
    xv, mv = x.meta.get("val"), mask.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(mv, torch.Tensor) and mv.dtype == torch.bool
            and xv.dim() == 3 and _static(xv) and _static(mv) and tuple(mv.shape) == tuple(xv.shape[:2])):
        return False
    batch, seq, width = (int(d) for d in xv.shape)
    tensor_users = [u for u in index.users if u.target not in _SIZE_OPS]
    if len(tensor_users) != 1 or tensor_users[0].target is not aten.view.default:
        return False
    view = tensor_users[0]
    shape = view.args[1]
    if not (isinstance(shape, (list, tuple)) and len(shape) == 3 and shape[0] == batch and shape[2] == width):
        return False
    if len(view.users) != 1:
        return False
    (select,) = view.users
    if select.target is not aten.select.int or tuple(select.args[1:]) != (1, -1):
        return False
    with graph.inserting_before(select):
        made = []

        def call(target, *args, **kwargs):
            out = graph.call_function(target, args, kwargs)
            made.append(out)
            return out
        flipped = call(aten.flip.default, call(aten._to_copy.default, mask, dtype=torch.int64), [1])
        first = call(aten.argmax.default, flipped, 1)
        last = call(aten.rsub.Scalar, first, seq - 1)
        where = call(aten.expand.default, call(aten.view.default, last, [batch, 1, 1]), [batch, 1, width])
        pooled = call(aten.view.default, call(aten.gather.default, x, 1, where), [batch, width])
    _fill_meta(made, index)
    select.replace_all_uses_with(pooled)
    for dead in (select, view):
        graph.erase_node(dead)
    return True


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in value.shape)


def _fill_meta(made: list[fx.Node], like: fx.Node) -> None:
    """Each new node's ``val`` (run on the program's fake tensors) and the source location of ``like``."""
    fake = like.args[0].meta["val"].fake_mode
    with fake:
        for node in made:
            args = fx.node.map_arg(node.args, lambda a: a.meta["val"])
            node.meta["val"] = node.target(*args, **node.kwargs)
    for node in made:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
            if key in like.meta:
                node.meta[key] = like.meta[key]


def _drop_value_checks(graph: fx.Graph) -> None:
    """Remove the assertions on sizes of tensors that nothing but size reads and assertions use: a
    check of values (the model's own, on its selection) that the program no longer computes."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ASSERTS:
            continue
        sized = _sized_tensors(node)
        if sized and all(_only_measured(tensor) for tensor in sized):
            graph.erase_node(node)


def _sized_tensors(check: fx.Node) -> list[fx.Node]:
    """The tensors whose sizes the expression an assertion tests is computed from."""
    found, stack, seen = [], [a for a in check.all_input_nodes], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target in _SIZE_OPS:
            found.append(node.args[0])
        elif node.op == "call_function" and not isinstance(node.meta.get("val"), torch.Tensor):
            stack.extend(node.all_input_nodes)   # symbolic arithmetic on sizes
        else:
            return []   # it reads a tensor's values or a graph input: a real check, kept
    return found


def _only_measured(tensor: fx.Node) -> bool:
    """Whether ``tensor`` (or the tuple element holding it) is read only by size ops and assertions."""
    users = list(tensor.users)
    return all(u.target in _SIZE_OPS or u.target in _ASSERTS for u in users)
