"""Tensor-parallel layouts as the cost model reads them, and Megatron's rules as a reference.

A :class:`TPLayout` says, for one tensor-parallel degree, which ops are split and which
collectives run. Every layout the cost model prices for ``tp > 1`` comes from the per-op sharding
ILP (solver/sharding.py): :func:`autopar.plan` and :func:`autopar.estimate` alike. ``tp = 1`` is
:func:`replicated_layout`.

:func:`megatron_layout` hard-codes Megatron-LM's rules (below). No estimate uses it: it is the
reference the sharding ILP is checked against (it must price Megatron's layout no cheaper than
its own optimum: tests/unit/solver/test_sharding.py, bench/sharding_ilp.py). Each activation gets
a state (:class:`Work`), propagated in graph order:

- ``R`` (``Work.WHOLE``) replicated: every tensor-parallel rank holds all of it (the residual stream);
- ``S`` (``Work.SPLIT``) split: each rank holds ``1/t`` (attention heads, MLP hidden, vocabulary);
- ``C`` (``Work.CONST``) constant: does not depend on the batch (masks, rotary tables).

Rules (Shoeybi et al. 2019, Megatron-LM section 3):

- a matmul with a weight reading an ``R`` input is *column parallel*: output ``S``;
  its input gradient needs one all-reduce in backward per distinct ``R`` input (Megatron's ``f``);
- a matmul with a weight reading an ``S`` input is *row parallel*: output ``R`` after an
  all-reduce in forward (Megatron's ``g``);
- an embedding of the batch's tokens is vocabulary parallel: output ``R`` after a forward
  all-reduce (a table looked up by batch-independent indices, as positions, stays whole);
- a loss on ``S`` logits is the vocabulary-parallel cross entropy (three all-reduces of
  one value per token: the max, the target logit, the exp-sum): its output is ``R``, but each
  rank computes it from its ``1/t`` of the logits (``TPLayout.split_work``);
- any other op with an ``S`` input is ``S`` (it works on its shard), unless it also reads
  an ``R`` activation or normalises/reduces its input, in which case the ``S`` input is
  all-gathered first (a cost, never silently wrong);
- the rest inherit ``R`` (or ``C`` when no input depends on the batch).

A weight whose split dimension does not divide by ``t`` stays replicated (column
rule not applied) and the graph keeps going in ``R``.

With sequence parallelism (Korthikanti et al.) the ``R`` regions are split along the
sequence too: their compute and activations divide by ``t`` and every all-reduce
becomes a reduce-scatter plus an all-gather of the same total volume. Only what the runtime
splits is divided (:func:`splits_along_sequence`: ``[batch, seq, hidden]`` float activations
whose sequence divides by ``t``, codegen/specs.py), and an ``R`` op that is not split but
reads a split one gathers that input first (:func:`sequence_gathers`: an all-gather forward,
a reduce-scatter backward); in a Megatron layer there is none, in a layout that leaves
attention replicated there is one per attention input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

from ..capture.opgraph import OpGraph, OpKind, OpNode
from ..errors import ConfigError
from ..ops import base_name

class Work(Enum):
    """What each rank of the group computes of a node's output under a layout (the module docstring's
    states). Not a placement: a partial output whose weight is whole counts as SPLIT (each rank does
    ``1/t`` of the work)."""

    WHOLE = "R"   # all of it, and it depends on the batch
    SPLIT = "S"   # 1/t of it
    CONST = "C"   # all of it, and it does not depend on the batch


@dataclass(frozen=True)
class TPComm:
    """One tensor-parallel collective: ``numel`` elements at the captured batch (rescaled by the caller).

    ``kind``: "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all" (``numel`` is the
    full tensor's elements). ``phase``: "fwd" / "bwd" run once per micro-batch on the critical
    path; "step" runs once per optimizer step on gradients (a weight the layout keeps whole
    while splitting its input's batch is data parallel inside the tensor-parallel group, so its
    gradient is all-reduced there, overlapped with backward like data-parallel buckets)."""

    node: str
    kind: str
    phase: str          # "fwd" | "bwd" | "step"
    numel: int
    batch_dependent: bool


@dataclass(frozen=True)
class TPLayout:
    """The result of propagation for one tensor-parallel degree."""

    tp: int
    state: Mapping[str, Work]         # node (and graph input) name -> what each rank computes of it
    split_params: frozenset[str]      # parameters divided by tp
    comms: Mapping[int, tuple[TPComm, ...]]  # layer index -> collectives per micro-batch
    replicated_weights: tuple[str, ...]      # matmul weights left whole because tp does not divide them
    gemm_split: Mapping[str, str] = field(default_factory=dict)  # node -> GEMM dim split: "n" | "k" | "batch"
    strategy: Mapping[str, str] = field(default_factory=dict)    # node -> strategy name (solver layouts)
    sequence_split: frozenset[str] = frozenset()  # R nodes sequence parallelism splits (splits_along_sequence)
    kept_whole: tuple[str, ...] = ()  # matmul / conv / embedding weights that could split but are kept whole
    # R nodes each rank computes from 1/t of their inputs, then all-reduces (the vocabulary-parallel
    # cross entropy, a reduction over a split dim): their work and what they keep inside divide by t
    split_work: frozenset[str] = frozenset()

    def shard(self, name: str, sequence_parallel: bool) -> int:
        """Divisor of a node's output and activations (``name``), or of a tensor a node keeps inside
        (``"node:part"``: the log-probabilities of a cross entropy)."""
        base, _, part = name.partition(":")
        st = self.state.get(base, Work.WHOLE)
        if (st == Work.SPLIT or (part and base in self.split_work)
                or (st == Work.WHOLE and sequence_parallel and base in self.sequence_split)):
            return self.tp
        return 1

    def work_shard(self, name: str, sequence_parallel: bool) -> int:
        """Divisor of a node's compute: its output's, or ``t`` for a node of ``split_work``."""
        return self.tp if name in self.split_work else self.shard(name, sequence_parallel)


def splits_along_sequence(node: OpNode, tp: int) -> bool:
    """Whether sequence parallelism splits this node's output when it is replicated: a batch-dependent
    float ``[batch, seq, hidden]`` activation whose sequence divides by ``tp`` (the runtime's rule)."""
    out = node.outputs[0] if node.outputs else None
    return (out is not None and node.batch_dependent and out.is_float and len(out.shape) == 3
            and out.shape[1] > 1 and out.shape[1] % tp == 0)


def sequence_split_nodes(graph: OpGraph, state: Mapping[str, Work], tp: int) -> frozenset[str]:
    """The nodes whose ``R`` output sequence parallelism splits."""
    return frozenset(n.name for n in graph.nodes
                     if state.get(n.name) == Work.WHOLE and splits_along_sequence(n, tp))


def sequence_gathers(graph: OpGraph, layout: TPLayout, nodes) -> list[TPComm]:
    """Under sequence parallelism: an all-gather of every sequence-split input an ``R`` node that
    is not split itself reads (the runtime redistributes it to replicated for that op)."""
    out = []
    for node in nodes:
        if layout.state.get(node.name) != Work.WHOLE or node.name in layout.sequence_split:
            continue
        for name in dict.fromkeys(node.inputs):
            if name in layout.sequence_split:
                out.append(TPComm(node.name, "all_gather", "fwd", graph.node(name).outputs[0].numel, True))
    return out


def _weight_split_dim(node: OpNode, graph: OpGraph, column: bool) -> int | None:
    if not node.params:
        return None
    weight = graph.params.get(node.params[0])
    if weight is None or len(weight.shape) < 2:
        return None
    # linear weight is (out, in); a plain matmul's weight is (in, out).
    if base_name(node.target) == "linear":
        return weight.shape[0] if column else weight.shape[1]
    return weight.shape[-1] if column else weight.shape[-2]


def replicated_layout(graph: OpGraph) -> TPLayout:
    """The layout of one tensor-parallel rank: every batch-dependent value (and whatever reads one) R,
    the rest C."""
    state: dict[str, Work] = {gi.name: Work.WHOLE for gi in graph.inputs}
    for node in graph.nodes:
        ins = [state.get(i, Work.CONST) for i in node.inputs]
        batch = (ins and any(s != Work.CONST for s in ins)) or node.batch_dependent
        state[node.name] = Work.WHOLE if batch else Work.CONST
    return TPLayout(1, state, frozenset(), {}, ())


def single_rank_layout(graph: OpGraph, tp: int) -> TPLayout:
    """A ``layout_fn`` that knows only ``tp == 1``: tensor-parallel layouts come from the sharding ILP
    (``autopar.solver.ShardingSolver.layout_fn``, as ``autopar.solver.price`` and ``solve`` use it)."""
    if tp != 1:
        raise ConfigError(f"tp={tp} needs the sharding ILP's layout: price the configuration with "
                          "autopar.solver.price (or autopar.estimate), or pass LayerCostModel(layout_fn=...)")
    return replicated_layout(graph)


def megatron_layout(graph: OpGraph, tp: int) -> TPLayout:
    """Megatron-LM's layout for ``tp`` by its rules (module docstring): the sharding ILP's reference."""
    if tp == 1:
        return replicated_layout(graph)
    state: dict[str, Work] = {gi.name: Work.WHOLE for gi in graph.inputs}
    split: set[str] = set()
    replicated: list[str] = []
    comms: dict[int, list[TPComm]] = {}
    f_inputs: set[str] = set()  # R tensors feeding column-parallel matmuls (one bwd all-reduce each)
    split_work: set[str] = set()

    def split_numel(node: OpNode) -> int:
        """Elements of the node's split (S) inputs: what gathering them moves."""
        return sum(graph.node(i).outputs[0].numel for i in node.inputs if state.get(i) == Work.SPLIT)

    def add(node: OpNode, kind: str, phase: str, numel: int) -> None:
        comms.setdefault(node.layer, []).append(TPComm(node.name, kind, phase, numel, node.batch_dependent))

    for node in graph.nodes:
        ins = [state.get(i, Work.CONST) for i in node.inputs]
        act_r = [i for i in node.inputs if state.get(i) == Work.WHOLE]
        has_s = Work.SPLIT in ins
        out_numel = node.outputs[0].numel
        if node.kind is OpKind.MATMUL and node.params:
            column = not has_s
            dim = _weight_split_dim(node, graph, column)
            if dim is None or dim % tp:
                replicated.append(node.params[0])
                if has_s:
                    add(node, "all_gather", "fwd", split_numel(node))
                state[node.name] = Work.WHOLE
                continue
            split.update(node.params)
            if column:
                state[node.name] = Work.SPLIT
                for i in act_r:
                    if i not in f_inputs:
                        f_inputs.add(i)
                        src = graph.node(i) if i in graph.node_index else None
                        numel = src.outputs[0].numel if src else out_numel
                        add(node, "all_reduce", "bwd", numel)
            else:
                state[node.name] = Work.WHOLE
                add(node, "all_reduce", "fwd", out_numel)
        elif node.kind is OpKind.EMBEDDING and node.params:
            vocab = graph.params[node.params[0]].shape[0] if node.params[0] in graph.params else 0
            if vocab % tp == 0 and node.batch_dependent:   # Megatron keeps position tables whole
                split.update(node.params)
                add(node, "all_reduce", "fwd", out_numel)
            else:
                replicated.append(node.params[0])
            state[node.name] = Work.WHOLE
        elif node.kind is OpKind.LOSS and has_s:
            logits = graph.node(node.inputs[0]).outputs[0]
            rows = out_numel if node.outputs[0].shape else max(1, logits.numel // max(1, logits.shape[-1]))
            for _ in range(3):
                add(node, "all_reduce", "fwd", rows)
            state[node.name] = Work.WHOLE
            split_work.add(node.name)
        elif has_s and (act_r or node.kind in (OpKind.NORM, OpKind.REDUCTION, OpKind.LOSS)):
            add(node, "all_gather", "fwd", split_numel(node))
            state[node.name] = Work.WHOLE
        elif has_s:
            state[node.name] = Work.SPLIT
        elif act_r or node.batch_dependent:
            state[node.name] = Work.WHOLE
        else:
            state[node.name] = Work.CONST
    return TPLayout(tp, state, frozenset(split), {k: tuple(v) for k, v in comms.items()},
                    tuple(dict.fromkeys(replicated)), sequence_split=sequence_split_nodes(graph, state, tp),
                    split_work=frozenset(split_work))
