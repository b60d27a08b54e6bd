"""Context parallelism (cp): the exported graph run on this rank's share of every sequence.

This module decides, once per graph, the state of every value and how every node runs
(:func:`analyse`, giving a context_state.ContextPlan); layers.py emits each layer's code accordingly, calling
context_ops.py.

The ``cp`` ranks of a context-parallel group get the same micro-batch; each works on the tokens
:func:`.ring_attention.local_indices` gives it (chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``).
Every value of the graph is in one of three states:

- FULL: the whole sequence in its original order, the same on every rank of the group
  (constants, positions, rotary tables, masks, and whatever is computed from FULL values only:
  cheap, and kept whole so that masks reach attention whole);
- :class:`Local` ``(dim, seq, outer, inner)``: dim ``dim`` holds this rank's tokens: its full size
  is ``outer * seq * inner`` (a view merged the sequence with ``outer`` dims before it, e.g. the
  ``[batch * seq, h]`` tokens of an MoE layer, and ``inner`` after it), locally
  ``outer * seq / cp * inner``;
- PARTIAL: a value whose true value is the mean over the group of the ranks' values (a mean over
  the sequence, the loss).

Seeds: a graph input with a dim of a sequence length (the query or key length of an attention
op: ``seq``) at dim >= 1 starts Local (:func:`shard_sequence` of the micro-batch); the others FULL.

Rules, per op (``ContextOp.mode``), with the op's dimension maps (capture/dims.py: which input dim each
output dim comes from, and the dims the op reduces over):

- ``full``: no Local input: run as is (a PARTIAL input is first resolved by an all-reduce mean);
  also any op that mixes positions of a Local dim (a shift of the labels, a pooling, a sort, an
  op without a map): its Local inputs are gathered first (:func:`gather_sequence`, autograd-aware);
- ``local``: the op is token-wise along the Local dim: an output dim ``o`` comes from the Local
  dim of an input, and that dim is not one the op reduces over. Other inputs follow ``o``: a FULL
  one whose dim maps to ``o`` is sliced (:func:`shard_sequence`; one that maps nothing to ``o`` is
  used whole, e.g. a weight, or keys gathered for an unfused attention's scores); a Local one in
  another layout is gathered, then sliced. Shape arguments (``view``, ``reshape``, ``expand``) are
  rewritten to the local shape; views follow the sequence through merges and splits of dims
  (:func:`_view_layout`);
- ``ring``: ``scaled_dot_product_attention`` with Local q, k, v (dim -2, one sequence):
  :func:`ring_attention` with the FULL mask and the node's ``is_causal``, ``scale``, ``enable_gqa``;
  ``local_query`` when keys are another sequence (cross attention): the keys are gathered and the
  query rows of the mask (and of the causal triangle) taken;
- ``loss_mean`` / ``reduce``: a class loss of ``ops.VOCAB_LOSSES`` (``cross_entropy``, ``nll_loss``; or a
  ``sum`` / ``mean`` over the Local dim) on the local tokens. A mean loss is ``cp * sum_local / N`` with ``N`` the group's
  count of non-ignored targets (an all-reduce of counts), so that the group's mean of the ranks'
  values is the exact mean over the sequence even with ``ignore_index`` labels (a shifted label
  row ignores its last position, which one rank holds); a sum is ``cp * sum_local``. Their output
  is PARTIAL;
- ``partial``: an op linear in its PARTIAL inputs (add, scale, views, casts, sums, a linear layer)
  keeps them PARTIAL; any other op resolves them;
- an MoE region (experts.py) is one op, token-wise in its ``[T, h]`` tokens and ``[T, k]`` ids
  and weights: the experts see this rank's tokens.

Gradients. The program averages gradients over the ``dp * cp`` ranks holding a weight (the
data-parallel reduction), so each rank back-propagates its own value of the loss: for a PARTIAL
loss the group's mean is the true loss, for a FULL one every rank has it whole. Then the
gradient a rank holds for a FULL value averages (over the group) to the true one, and for a
Local value it is ``cp`` times the true gradient of its tokens; :func:`gather_sequence`'s
backward (a sum over ranks, sliced), :func:`shard_sequence`'s (zero padding), the ring
attention's (exact for its shards) and a PARTIAL value's resolution (an all-reduce mean, whose
backward is one too; context_ops.py) all keep to that.

Every rank of a group analyses the same graph and so runs the same collectives in the same
order. Anything not covered raises ConfigError naming the node (an in-place op on a value that
would have to be gathered; attention dropout; a weighted mean loss), never a wrong answer.
Dropout draws its own numbers on every rank, as under data parallelism.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Mapping, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from .. import ops
from ..capture.dims import bound_args, broadcast_map, op_dims, shape_of
from ..errors import ConfigError
from ..ops import SKIPPED_TARGETS, base_name
from ..runtime.context_state import (FULL, PARTIAL, ContextOp, ContextPlan, Conv, GatherTokens, Local, Mode, Resolve, State,
                            TakeTokens, holds_tensor)


# ------------------------------------------------------------------------------------ analysis

def analyse(program: ExportedProgram, cp: int, attention: frozenset[str],
            regions: Mapping[str, tuple[str, str, str]] = {}, skipped: frozenset[str] = frozenset()) -> ContextPlan:
    """States and steps of every node (the module docstring's rules).

    ``attention``: the fused attention nodes; ``regions``: MoE output node -> (tokens, ids, weights)
    inputs, run as one token-wise op; ``skipped``: nodes not run at all (the rest of each region)
    besides the metadata asserts, which no rank runs (ops.SKIPPED_TARGETS)."""
    nodes = list(program.graph.nodes)
    skipped = skipped | {n.name for n in nodes if str(n.target) in SKIPPED_TARGETS}
    seqs = _sequence_lengths(nodes, attention, cp)
    user = {s.arg.name for s in program.graph_signature.input_specs if s.kind is InputKind.USER_INPUT}
    states: dict[str, State] = {}
    inputs: dict[str, Local] = {}
    for n in nodes:
        if n.op == "placeholder":
            seed = _seed(n, seqs) if n.name in user else None
            states[n.name] = FULL if seed is None else seed
            if seed is not None:
                inputs[n.name] = seed
        elif n.op == "get_attr":
            states[n.name] = FULL
    steps: dict[str, ContextOp] = {}
    for n in nodes:
        if n.op != "call_function" or n.name in skipped:
            continue
        if n.name in regions:
            step = _region_step(n, regions[n.name], states, cp)
        else:
            step = _step(n, states, cp, attention)
        steps[n.name] = step
        states[n.name] = step.out
    output = next(n for n in nodes if n.op == "output")
    loss = output.args[0][0] if isinstance(output.args[0], (list, tuple)) else output.args[0]
    if isinstance(states.get(loss.name, FULL), Local):
        raise ConfigError(f"the loss {loss.name} is not a scalar split along the sequence: context parallelism "
                          "needs a scalar loss; re-plan with cp=1")
    return ContextPlan(cp, states, steps, inputs)


def _sequence_lengths(nodes: Sequence[torch.fx.Node], attention: frozenset[str], cp: int) -> frozenset[int]:
    seqs = set()
    for n in nodes:
        if n.name in attention and n.op == "call_function":
            args = bound_args(n)
            for key in ("query", "key"):
                shape = shape_of(_val(args.get(key)))
                if shape is not None and len(shape) >= 2:
                    seqs.add(shape[-2])
    if not seqs:
        raise ConfigError("context parallelism splits sequences for attention, but the model has no fused attention "
                          "op (F.scaled_dot_product_attention): build it with SDPA attention, or re-plan with cp=1")
    for s in sorted(seqs):
        if s % (2 * cp):
            raise ConfigError(f"sequence length {s} cannot be cut into 2*cp = {2 * cp} equal chunks for context "
                              f"parallelism cp={cp}: use a sequence length that is a multiple of {2 * cp} (pad it) "
                              "or re-plan with another cp")
    return frozenset(seqs)


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _seed(node: torch.fx.Node, seqs: frozenset[int]) -> Local | None:
    shape = shape_of(node.meta.get("val"))
    if not shape:
        return None
    for d in range(1, len(shape)):
        if shape[d] in seqs:
            return Local(d, shape[d])
    return None


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every tensor-valued fx.Node argument, args then kwargs, lists flattened (capture's order)."""
    found = []
    for arg in list(node.args) + list(node.kwargs.values()):
        for leaf in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(leaf, torch.fx.Node) and holds_tensor(leaf.meta.get("val")):
                found.append(leaf)
    return found


def _out_shapes(node: torch.fx.Node) -> list[tuple[int, ...]]:
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return shape_of(node.meta.get("val")) or ()


def _full_step(ins: Sequence[torch.fx.Node], states: Mapping[str, State],
               pre: Sequence[Conv] | None = None) -> ContextOp:
    """Run whole: gather Local inputs, resolve PARTIAL ones."""
    conv = []
    for i, a in enumerate(ins):
        s = states.get(a.name, FULL)
        if pre is not None and pre[i]:
            conv.append(pre[i])
        elif isinstance(s, Local):
            conv.append((GatherTokens(s),))
        elif s == PARTIAL:
            conv.append((Resolve(),))
        else:
            conv.append(())
    return ContextOp(Mode.FULL, tuple(a.name for a in ins), tuple(conv), FULL)


def _step(n: torch.fx.Node, states: dict[str, State], cp: int, attention: frozenset[str]) -> ContextOp:
    ins = tensor_args(n)
    names = tuple(a.name for a in ins)
    for a in ins:
        if a.name not in states:
            raise ConfigError(f"node {n.name} reads {a.name}, which context parallelism does not compute here "
                              "(an expert-parallel region's inner value?): re-plan with cp=1")
    st = [states[a.name] for a in ins]
    if n.target is operator.getitem:
        return ContextOp(Mode.FULL, (), (), st[0] if st else FULL)
    if all(s == FULL for s in st):
        return ContextOp(Mode.FULL, names, tuple(() for _ in ins), FULL)
    name = base_name(n.target)
    if n.name in attention:
        return _attention_step(n, ins, states, cp)
    if name in ops.VOCAB_LOSSES and str(n.target).endswith(".default"):
        return _loss_step(n, name, ins, states, cp)
    if any(s == PARTIAL for s in st):
        if not any(isinstance(s, Local) for s in st) and _linear_in_partial(n, name, st):
            return ContextOp(Mode.PARTIAL, names, tuple(() for _ in ins), PARTIAL)
        pre = [(Resolve(),) if s == PARTIAL else () for s in st]
        st = [FULL if s == PARTIAL else s for s in st]
        if all(s == FULL for s in st):
            return ContextOp(Mode.FULL, names, tuple(pre), FULL)
    else:
        pre = [() for _ in st]
    return _local_step(n, name, ins, st, pre, cp)


def _linear_in_partial(n: torch.fx.Node, name: str, st: Sequence[State]) -> bool:
    """Whether the op is linear (affine) in its PARTIAL inputs, so that it commutes with the group's mean."""
    value = n.meta.get("val")
    if name not in ops.LINEAR_OPS or not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return False   # (a cast to integers rounds: not linear)
    partial = [i for i, s in enumerate(st) if s == PARTIAL]
    if name in ops.PRODUCTS and len(partial) != 1:
        return False
    if name == "div" and partial != [0]:
        return False
    return True


def _local_step(n: torch.fx.Node, name: str, ins: Sequence[torch.fx.Node], st: Sequence[State],
                pre: Sequence[Conv], cp: int, maps: Sequence[Sequence[int]] | None = None,
                reduced: Sequence[int] = ()) -> ContextOp:
    """A node with a Local input: token-wise if its maps allow it, else run whole."""
    states = {a.name: s for a, s in zip(ins, st)}

    def gathered() -> ContextOp:
        return _checked(n, ins, _full_step(ins, states, pre))

    outs = _out_shapes(n)
    if not outs:
        return gathered()
    out_shape = outs[0]
    shapes = [_shape(a) for a in ins]
    if maps is None and name in ops.RESHAPES and len(ins) == 1:
        layout = _view_layout(shapes[0], st[0], out_shape)
        if layout is None:
            return gathered()
        return ContextOp(Mode.LOCAL, (ins[0].name,), (pre[0],), layout, _view_rewrite(n, name, layout, out_shape, cp))
    if maps is None:
        maps, reduced = _maps(name, n, ins, out_shape)
    if maps is None or any(m is None for m in maps):
        return gathered()
    choice = None
    for i, s in enumerate(st):
        if isinstance(s, Local):
            hits = [o for o, e in enumerate(maps[i]) if e == s.dim]
            if len(hits) == 1 and not (i == 0 and s.dim in reduced) and out_shape[hits[0]] == shapes[i][s.dim]:
                choice = s.at(hits[0])
                break
    if choice is None:
        if name in ("sum", "mean") and len(ins) == 1 and isinstance(st[0], Local) and st[0].dim in reduced:
            return ContextOp(Mode.REDUCE, (ins[0].name,), (pre[0],), PARTIAL, scale=float(cp) if name == "sum" else 1.0)
        return gathered()
    o = choice.dim
    if any(len(s) <= o or s[o] != out_shape[o] for s in outs):
        return gathered()
    conv = []
    for i, (a, s) in enumerate(zip(ins, st)):
        e = maps[i][o]
        if isinstance(s, Local) and e == s.dim and s.at(o) == choice:
            conv.append(pre[i])
            continue
        chain = tuple(pre[i]) + ((GatherTokens(s),) if isinstance(s, Local) else ())
        if e == -1:
            conv.append(chain)
        elif shapes[i][e] == out_shape[o]:
            conv.append(chain + (TakeTokens(choice.at(e)),))
        else:
            return gathered()
    rewrite = _expand_rewrite(n, name, choice, cp) if name == "expand" else ()
    step = ContextOp(Mode.LOCAL, tuple(a.name for a in ins), tuple(conv), choice, rewrite)
    if any(c for a, c in zip(ins, conv) if a in _mutated(n)):
        return gathered()   # a whole input written in place: run whole
    return step


def _checked(n: torch.fx.Node, ins: Sequence[torch.fx.Node], step: ContextOp) -> ContextOp:
    """``step``, unless it would convert (copy) an input the op writes in place: the write would be lost."""
    for a, c in zip(ins, step.convert):
        if c and a in _mutated(n):
            raise ConfigError(f"node {n.name} ({n.target}) writes in place into {a.name}, which context parallelism "
                              "would have to gather or slice first (the write would be lost): re-plan with cp=1")
    return step


def _mutated(n: torch.fx.Node) -> set[torch.fx.Node]:
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return set()
    out = set()
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            for leaf in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(leaf, torch.fx.Node):
                    out.add(leaf)
    return out


def _maps(name: str, n: torch.fx.Node, ins: Sequence[torch.fx.Node], out_shape: tuple[int, ...]):
    """Dimension maps of the op's tensor inputs (capture/dims.py, plus sorts and ``*_like``)."""
    shapes = [_shape(a) for a in ins]
    if name in ops.LIKE_CREATION and len(ins) == 1:
        return [broadcast_map(shapes[0], out_shape)], ()
    if name in ops.SORTS and len(ins) == 1:
        args = bound_args(n)
        nd = len(shapes[0])
        dim = int(args.get("dim", -1)) % nd if nd else 0
        return [tuple(d if d != dim else -1 for d in range(nd))], (dim,)
    maps, reduced = op_dims(name, n, [(i, a) for i, a in enumerate(ins)], out_shape)
    return (list(maps) if maps else None), tuple(reduced)


def _view_layout(in_shape: Sequence[int], s: State, out_shape: Sequence[int]) -> Local | None:
    """Where a view puts the sequence of a Local input: the output dim holding all of it, else None.

    With ``P`` the elements before the sequence and ``Q`` after it (in the flat order), output dim
    ``o`` holds it whole when the output's elements before ``o`` divide ``P`` and those after divide
    ``Q``; then it is ``(P / before, seq, Q / after)`` (at most one dim qualifies)."""
    if not isinstance(s, Local):
        return None
    p = math.prod(in_shape[:s.dim]) * s.outer
    q = math.prod(in_shape[s.dim + 1:]) * s.inner
    for o in range(len(out_shape)):
        before, after = math.prod(out_shape[:o]), math.prod(out_shape[o + 1:])
        if before and after and p % before == 0 and q % after == 0 \
                and (p // before) * s.seq * (q // after) == out_shape[o]:
            return Local(o, s.seq, p // before, q // after)
    return None


def _view_rewrite(n: torch.fx.Node, name: str, layout: Local, out_shape: Sequence[int], cp: int):
    local = list(out_shape)
    local[layout.dim] = layout.local_size(cp)
    if name in ops.SHAPED_VIEWS:
        return ((1, local),)
    if name == "unflatten":
        args = bound_args(n)
        dim = int(args["dim"]) % len(_shape(n.args[0]))
        return ((2, local[dim:dim + len(list(args["sizes"]))]),)
    return ()


def _expand_rewrite(n: torch.fx.Node, name: str, layout: Local, cp: int):
    sizes = list(n.args[1])
    if 0 <= layout.dim < len(sizes) and sizes[layout.dim] != -1:
        sizes[layout.dim] = layout.local_size(cp)
    return ((1, sizes),)


def _attention_step(n: torch.fx.Node, ins: Sequence[torch.fx.Node], states: Mapping[str, State], cp: int) -> ContextOp:
    if base_name(n.target) != "scaled_dot_product_attention":
        return _full_step(ins, states)
    args = bound_args(n)
    q, k, v, mask = args["query"], args["key"], args["value"], args.get("attn_mask")
    if float(args.get("dropout_p") or 0.0) != 0.0:
        raise ConfigError(f"attention node {n.name} has dropout_p={args.get('dropout_p')}: attention dropout is not "
                          "supported under context parallelism; set the model's attention dropout to 0 or re-plan "
                          "with cp=1")
    sq, sk = _shape(q), _shape(k)
    qs = states.get(q.name, FULL)
    d = len(sq) - 2
    if not (isinstance(qs, Local) and qs.dim == d and qs.outer == 1 and qs.inner == 1 and qs.seq == sq[d]):
        return _full_step(ins, states)
    ring = sk[-2] == sq[-2]
    conv = []
    for a in ins:
        s = states.get(a.name, FULL)
        if a is q:
            conv.append(())
        elif (a is k or a is v) and ring:   # this rank's key / value tokens, as the query's
            conv.append(_to(s, Local(len(_shape(a)) - 2, sk[-2])))
        else:   # keys and values of local-query attention, the mask: whole
            conv.append(_to(s, None))
    if mask is not None and not isinstance(mask, torch.fx.Node):
        raise ConfigError(f"attention node {n.name} has a non-tensor mask {mask!r}: re-plan with cp=1")
    return ContextOp(Mode.RING if ring else Mode.LOCAL_QUERY, tuple(a.name for a in ins), tuple(conv), qs)


def _to(state: State, want: Local | None) -> tuple:
    """The conversion of a value in ``state`` to this rank's tokens ``want`` (None: the whole value):
    summed if partial, gathered if split, then the wanted tokens taken; nothing if already there."""
    if state == want:
        return ()
    chain = (Resolve(),) if state == PARTIAL else ()
    chain += (GatherTokens(state),) if isinstance(state, Local) else ()
    return chain + ((TakeTokens(want),) if want is not None else ())


def _loss_step(n: torch.fx.Node, name: str, ins: Sequence[torch.fx.Node], states: Mapping[str, State],
               cp: int) -> ContextOp:
    args = bound_args(n)
    x, t = args["self"], args["target"]
    xs = states.get(x.name, FULL)
    xshape = _shape(x)
    if not isinstance(xs, Local) or len(xshape) < 2 or xs.dim == 1:
        return _full_step(ins, states)
    td = 0 if xs.dim == 0 else xs.dim - 1
    reduction = int(args.get("reduction", 1))
    if reduction == 1 and args.get("weight") is not None:
        raise ConfigError(f"loss node {n.name} is a class-weighted mean: context parallelism cannot split it; "
                          "re-plan with cp=1")
    conv = [() if a is x else _to(states.get(a.name, FULL), xs.at(td) if a is t else None) for a in ins]
    names = tuple(a.name for a in ins)
    if reduction == 0:
        return ContextOp(Mode.LOCAL, names, tuple(conv), xs.at(td))
    if reduction == 2:
        return ContextOp(Mode.REDUCE, names, tuple(conv), PARTIAL, scale=float(cp))
    return ContextOp(Mode.LOSS_MEAN, names, tuple(conv), PARTIAL)


def _region_step(n: torch.fx.Node, inputs: tuple[str, str, str], states: Mapping[str, State], cp: int) -> ContextOp:
    """An MoE experts call as one op on ``[T, h]`` tokens, ``[T, k]`` ids and weights: token-wise in T."""
    graph_nodes = {a.name: a for a in n.graph.nodes}
    ins = [graph_nodes[v] for v in inputs]
    st = [states[v] for v in inputs]
    pre = [(Resolve(),) if s == PARTIAL else () for s in st]
    st = [FULL if s == PARTIAL else s for s in st]
    if all(s == FULL for s in st):
        return ContextOp(Mode.FULL, tuple(inputs), tuple(pre), FULL)
    out_nd = len(_out_shapes(n)[0])
    maps = [tuple([0] + [-1] * (out_nd - 1)) for _ in ins]
    return _local_step(n, "moe", ins, st, pre, cp, maps=maps, reduced=())
