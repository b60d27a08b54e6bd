"""The plan's tensor-parallel sharding: per layer group, each op's placements, keyed by a structural op identity.

An op is named by :class:`OpId` ``(layer, module, op, occurrence)``: the layer holding it (its
name, as in ``Stage.layers``), its module path relative to the layer (``*.self_attn.q_proj``, or
an absolute path for a module outside it), the aten op it calls (``linear``) and how many
non-volatile ops of the same layer, module and aten op come before it. *Volatile* ops
(capture/structure.py ``is_volatile``) are the memory-layout copies and broadcasts (``contiguous``,
``clone``, ``expand``, ``alias``), ``detach``, ``lift_fresh_copy``, dropout, state updates (an
in-place op on a buffer, BatchNorm's batch count), and index and mask plumbing, the ops computing from
integer and boolean tensors alone (e.g. T5's decoder inputs shifted from its labels, which torch.export
traces as other ops at a batch of 1, and a mixture of experts' token counts, cast to float on a CPU and to
int elsewhere: capture/structure.py ``plumbing``); each is named instead by the op it reads: ``reads``
holds that op's identity and ``occurrence`` counts the volatile ops of the same aten op reading it
before this one (one reading no op reads OpId.source: the graph input it reads, or nothing).

Why any rank's export of the same model maps onto the plan's exactly. Two exports of one model
(meta or CPU, batch 1 or 8, train or eval mode, the parameters real or frozen stand-ins) run the
same Python code on tensors of other sizes, strides and modes. What they may differ in is decided
by those alone: a kernel's strides add or drop a ``contiguous`` (or a ``clone`` in its place), a
batch of 1 makes a broadcast to the batch a no-op that export drops (an ``expand``), a tensor that
needs no gradient makes its ``detach`` a no-op and a program holding constants whole needs no
``lift_fresh_copy`` of them (the standalone emit's export), eval mode turns dropout into the
identity and makes no state updates, and index plumbing traced at a batch of 1 takes other ops (on
another device, other dtypes).
These are exactly the volatile ops, none of which computes a new floating-point activation (each
returns its input's values, or zeroes some of them; a state update writes only a buffer; plumbing
computes from integers and masks alone, and every op a plan decides a split for computes from
floating-point data), so leaving them out of the numbering leaves the same sequence of value-computing
ops in each layer in both exports, and numbering per (layer, module, aten op) gives each the same
identity: an op present in one export only is volatile, so it shifts no other
op's occurrence. A volatile op present in both reads the same op in both, so its name by that op
is the same too; one present in the plan's export only is not there to shard, and one present
in the rank's export only has no record: the compiler gives it its input's placement, carried
through the op's dims. The non-volatile ops must match one to one; a model whose code branches on
the batch size or the device otherwise breaks the rule, and the mapping then fails by name
(PlanMismatchError), never approximately. One limit: of two volatile ops of one aten op reading the
same op (two broadcasts of one tensor), an export that drops the first gives the second the first's
name; its record only places the op's output, and the compiler checks that placement fits the op at
this rank's shapes (codegen/lower.py ``fits``) and carries its input's otherwise.

A group's first ``solved`` layers are recorded op by op; each later layer of the group repeats the
first one, so its ops take the placement of the op of the same identity in the group's first layer
(:meth:`OpId.in_layer`; a volatile op reading another layer's op has no counterpart there and is carried).

Placements are :mod:`autopar.plan.placement`'s; a batch-independent constant (the solver's ``C``,
computed whole by every rank) is recorded as ``Replicate()``. Plain data: no torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import PlanFormatError
from .placement import Placement, Replicate, placement_from_json, placement_to_json
from .structure import relative_name


@dataclass(frozen=True)
class OpId:
    """One op of a model, the same in every export of it (module docstring). ``reads`` is None for an op
    every export has; for a volatile op it is the identity of the op it reads (its first input)."""

    layer: str
    module: str
    op: str
    occurrence: int
    reads: "OpId | None" = None

    def __post_init__(self) -> None:
        if type(self.occurrence) is not int or self.occurrence < 0:
            raise TypeError(f"OpId occurrence must be an int >= 0, not {self.occurrence!r}")

    @classmethod
    def source(cls, graph_input: str | None) -> "OpId":
        """What a volatile op reads when it reads no op: the graph input ``graph_input`` (by its name, as
        the model's forward names it), or nothing (None: a creation op). Its layer is empty."""
        return cls("", "", "nothing" if graph_input is None else f"input {graph_input}", 0)

    @property
    def volatile(self) -> bool:
        """An op some exports of the model have and others not (module docstring)."""
        return self.reads is not None

    def in_layer(self, layer: str) -> "OpId | None":
        """The same op in another layer that repeats this one's layer; None for a volatile op reading an op
        of another layer (its counterpart there is not named by this layer's); one reading a graph input or
        nothing (:meth:`source`) reads the same there."""
        reads = None
        if self.reads is not None and not self.reads.layer:
            reads = self.reads
        elif self.reads is not None:
            if self.reads.layer != self.layer:
                return None
            reads = self.reads.in_layer(layer)
            if reads is None:
                return None
        return OpId(layer, self.module, self.op, self.occurrence, reads)

    def __str__(self) -> str:
        if not self.layer:
            return self.op
        where = f"in {self.module}" if self.module else "in the model's top level"
        after = "" if self.reads is None else f" reading ({self.reads})"
        return f"{self.layer}: {self.op}#{self.occurrence} {where}{after}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "module": self.module, "op": self.op,
                               "occurrence": self.occurrence}
        if self.reads is not None:
            out["reads"] = self.reads.to_dict()
        return out


@dataclass(frozen=True)
class OpSharding:
    """The plan's sharding of one op: its strategy, output placement, the placement it reads each activation
    input in (input order) and the split dim of each parameter it reads (read order; None: whole)."""

    id: OpId
    strategy: str
    output: Placement
    inputs: tuple[Placement, ...]
    params: tuple[tuple[str, int | None], ...] = ()   # (parameter name in the plan's model, split dim)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id.to_dict(), "strategy": self.strategy, "output": placement_to_json(self.output),
                "inputs": [placement_to_json(p) for p in self.inputs], "params": dict(self.params)}


@dataclass(frozen=True)
class ShardingGroup:
    """Layers solved together: the first ``solved`` op by op in ``ops``, the rest repeat the first."""

    layers: tuple[str, ...]
    solved: int
    ops: tuple[OpSharding, ...]
    boundary: Placement | None = None   # the placement of tensors crossing between groups the solution assumed

    def __post_init__(self) -> None:
        if not 0 < self.solved <= len(self.layers):
            raise ValueError(f"a sharding group of {len(self.layers)} layers cannot have solved={self.solved}")
        ids = [op.id for op in self.ops]
        if len(set(ids)) != len(ids):
            raise ValueError(f"op {next(i for i in ids if ids.count(i) > 1)} is listed twice")
        outside = next((i for i in ids if i.layer not in self.layers[:self.solved]), None)
        if outside is not None:
            raise ValueError(f"op {outside} is not in the group's solved layers {list(self.layers[:self.solved])}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.layers), "solved": self.solved}
        if self.boundary is not None:
            out["boundary"] = placement_to_json(self.boundary)
        out["ops"] = [op.to_dict() for op in self.ops]
        return out


# --- reading ---------------------------------------------------------------------------------------
_FIX = "the file is truncated or was edited; re-create it with plan.save()"


def group_from_dict(data: Any, where: str) -> ShardingGroup:
    """A ``sharding[]`` object of the current format; PlanFormatError naming the field when it is not one."""
    g = _object(data, where)
    layers = _field(g, "layers", where)
    if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise _bad(f"{where}.layers", layers, "a list of strings")
    solved = _int(g, "solved", where)
    boundary = g.get("boundary")
    ops = _field(g, "ops", where)
    if not isinstance(ops, list):
        raise _bad(f"{where}.ops", ops, "a list")
    typed = tuple(_op(op, f"{where}.ops[{k}]") for k, op in enumerate(ops))
    crossing = None if boundary is None else placement_from_json(boundary, f"plan field {where}.boundary")
    try:
        return ShardingGroup(tuple(layers), solved, typed, crossing)
    except ValueError as exc:
        raise PlanFormatError(f"plan field {where}: {exc}: {_FIX}") from None


def _op(data: Any, where: str) -> OpSharding:
    o = _object(data, where)
    op_id = _op_id(_field(o, "id", where), f"{where}.id")
    strategy = _field(o, "strategy", where)
    if not isinstance(strategy, str):
        raise _bad(f"{where}.strategy", strategy, "a string")
    inputs = _field(o, "inputs", where)
    if not isinstance(inputs, list):
        raise _bad(f"{where}.inputs", inputs, "a list")
    params = _object(o.get("params", {}), f"{where}.params")
    for name, d in params.items():
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise _bad(f"{where}.params.{name}", d, "an integer >= 0 or null")
    return OpSharding(op_id, strategy, placement_from_json(_field(o, "output", where), f"plan field {where}.output"),
                      tuple(placement_from_json(p, f"plan field {where}.inputs[{k}]") for k, p in enumerate(inputs)),
                      tuple(params.items()))


def group_from_v2(data: Any, where: str) -> ShardingGroup:
    """A ``sharding[]`` object as schema 2 wrote it (each op named by its ``node`` in the planning export), for
    reading only: each op's identity is rebuilt from what the file holds (the module under which the op's
    layer is the longest prefix, else the layer of the op before it; the op its node name calls, ``linear_3``
    calls ``linear``; occurrences counted in file order, volatile ops included). That is what summary, explain
    and the exports read; it is not the identity a rank's export gives (schema 2 numbered the planning
    export's nodes, volatile ops among them, and recorded neither its batch nor its device), so parallelize
    refuses to run such a plan with tp > 1 (codegen/specs.py plan_specs) rather than pair ops approximately."""
    g = _object(data, where)
    layers = _field(g, "layers", where)
    if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers) or not layers:
        raise _bad(f"{where}.layers", layers, "a non-empty list of strings")
    solved = g.get("solved", len(layers))
    if isinstance(solved, bool) or not isinstance(solved, int) or not 0 < solved <= len(layers):
        raise _bad(f"{where}.solved", solved, f"an integer from 1 to {len(layers)}")
    ops = _field(g, "ops", where)
    if not isinstance(ops, list):
        raise _bad(f"{where}.ops", ops, "a list")
    current, seen, out = layers[0], {}, []
    for k, data_op in enumerate(ops):
        w = f"{where}.ops[{k}]"
        o = _object(data_op, w)
        node, module = _field(o, "node", w), o.get("module", "")
        if not isinstance(node, str) or not isinstance(module, str):
            raise _bad(f"{w}.node", node, "a string (and module a string)")
        owners = [name for name in layers[:solved] if module == name or module.startswith(name + ".")]
        current = max(owners, key=len) if owners else current
        key = (current, relative_name(module, current), _V2_NUMBER.sub("", node).rstrip("_") or node)
        seen[key] = seen.get(key, -1) + 1
        inputs = o.get("inputs") or []
        params = _object(o.get("params", {}), f"{w}.params")
        out.append(OpSharding(OpId(*key, seen[key]), str(o.get("strategy", "")),
                              _v2_placement(o.get("output", "R"), f"{w}.output"),
                              tuple(_v2_placement(p, f"{w}.inputs[{j}]") for j, p in enumerate(inputs)),
                              tuple(params.items())))
    boundary = g.get("boundary")
    return ShardingGroup(tuple(layers), solved, tuple(out),
                         None if boundary is None else _v2_placement(boundary, f"{where}.boundary"))


_V2_NUMBER = re.compile(r"_\d+$")


def _v2_placement(text: Any, where: str) -> Placement:
    """Schema 2's specs: "C" (a constant every rank computes whole) is Replicate()."""
    return Replicate() if text == "C" else placement_from_json(text, f"plan field {where}")


def _op_id(data: Any, where: str) -> OpId:
    i = _object(data, where)
    for key in ("layer", "module", "op"):
        if not isinstance(_field(i, key, where), str):
            raise _bad(f"{where}.{key}", i[key], "a string")
    reads = i.get("reads")
    return OpId(i["layer"], i["module"], i["op"], _int(i, "occurrence", where),
                None if reads is None else _op_id(reads, f"{where}.reads"))


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, Mapping):
        raise _bad(where, value, "a JSON object")
    return dict(value)


def _field(data: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise PlanFormatError(f"plan file is missing field {where}.{key!r}: {_FIX}")
    return data[key]


def _int(data: Mapping[str, Any], key: str, where: str) -> int:
    value = _field(data, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"{where}.{key}", value, "an integer >= 0")
    return value


def _bad(where: str, value: Any, expected: str) -> PlanFormatError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return PlanFormatError(f"plan field {where} = {shown} must be {expected}: {_FIX}")


def replicated(graph: Any) -> tuple[ShardingGroup, ...]:
    """Every op of ``graph`` (an OpGraph: ``nodes``, ``op_ids``, ``layers``) whole on every rank: the sharding
    of a plan at tp = 1, one group of all layers."""
    ops = tuple(OpSharding(i, "replicate", Replicate(), tuple(Replicate() for _ in n.inputs),
                           tuple((p, None) for p in n.params))
                for n, i in zip(graph.nodes, graph.op_ids) if i is not None)
    return (ShardingGroup(tuple(layer.name for layer in graph.layers), len(graph.layers), ops),)
