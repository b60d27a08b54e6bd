"""The traced blocks of a cut program, checked before they are copied (capture/expand.py).

capture/repeat.py exports a model whose block containers hold only their first blocks (a lead of
blocks unlike the rest, then three periods of the repeating pattern). :func:`layouts` finds each
container's blocks in that program and checks that copying the last traced period gives the
program exporting every block would. What it checks (any miss raises :class:`Mismatch`, and capture
exports every block):

What it checks first (any miss raises :class:`Mismatch`, and capture exports every block):

- every traced block's ops are one contiguous run of the graph, in block order; a block's range
  runs from its first op to the next block's first op (the loop's own ops after a block are part
  of it; the last block's range is as long as its counterpart's one period before);
- the third period repeats the second exactly: op for op the same target, non-tensor arguments,
  output shapes, dtypes and strides, module path (the block index moved), and each tensor argument
  read from the same place: an op of its own block (the same offset), of the block before it (the
  same offset: the value carried from block to block), one of its own block's parameters (the same
  name in the other block), or a value both read, computed before the second period (rotary
  tables, masks, position ids);
- what follows the blocks (final norm, head, loss) reads no block's value but what the last block
  hands the next one (a layer-indexed read such as ``hidden_states[-2]`` would change with the
  depth);
- names: torch.fx numbers each op's name by the ops of its kind created before it, dead ones
  included; repeat.py notes the counters at each block's entry, so each block's share is known
  exactly and every name of a copy and of what follows is the traced one shifted by the blocks
  added. The traced names are checked to lie within their block's share;
- parameters and buffers: each block's own (no weight or module shared with another block or
  outside), named and ordered as torch.export names and orders them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, InputSpec

from .build import _stack, module_paths

WRAPPER = "model"                     # capture's LossWrapper holds the user's model as ``model``
_NUMBERED = re.compile(r"^(.*)_(\d+)$")  # torch.fx's suffix rule (fx.graph._Namespace)
PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}  # torch.export's
_LIFTED = re.compile(r"^(.*lifted_tensor_)(\d+)$")   # a tensor made in forward, numbered as lifted (lift_constants_pass)


class Mismatch(Exception):
    """The traced program does not fit copying (the message says why): every block is exported."""


@dataclass(frozen=True)
class Blocks:
    """One container's blocks as traced: ``size`` in the model, the first ``lead + 3 * period`` traced."""

    path: str          # the container in the user's model, e.g. "model.layers" ("" for the model itself)
    size: int          # N
    lead: int          # s: blocks before the repeating pattern
    period: int        # P

    @property
    def traced(self) -> int:
        return self.lead + 3 * self.period

    def template(self, block: int) -> int:
        """The traced block of the last period a block copies."""
        return self.lead + 2 * self.period + (block - self.lead) % self.period

    def phase(self, block: int) -> int:
        return (block - self.lead) % self.period


@dataclass(frozen=True)
class Input:
    """A parameter, buffer or constant tensor of one block (a placeholder of the program)."""

    block: int
    spec: InputSpec
    node: fx.Node
    key: tuple           # what names it within its block: its relative name, or (lifted, its rank)
    number: int | None   # a constant made in forward: its number among the program's lifted tensors

    def target(self, raw: str, block: int, number: int | None) -> str:
        """Its target in block ``block`` (a lifted constant numbered ``number``)."""
        rest = self.key[1] if self.number is None else f"{self.key[1]}{number}"
        return f"{raw}.{block}.{rest}"


def lifted_number(target: str | None) -> int | None:
    m = _LIFTED.match(target or "")
    return int(m.group(2)) if m else None


def split_name(name: str) -> tuple[str, int]:
    m = _NUMBERED.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def join_name(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


def placeholder_name(kind: InputKind, fqn: str) -> str:
    """The name torch.export gives the placeholder of a parameter or buffer (``placeholder_naming_pass``)."""
    return PREFIX[kind] + re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def raw_path(path: str) -> str:
    return f"{WRAPPER}.{path}" if path else WRAPPER


def moved_stack(stack: Mapping[str, tuple[str, Any]], raw: str, old: int, new: int) -> dict:
    """An ``nn_module_stack`` with block ``old`` of container ``raw`` renamed block ``new``."""
    o, n = f"{raw}.{old}", f"{raw}.{new}"
    out = {}
    for key, (path, typ) in stack.items():
        if path == o or path.startswith(o + "."):
            renamed = n + path[len(o):]
            if path not in key:
                raise Mismatch(f"module stack key {key!r} does not hold its path {path!r}")
            key, path = key.replace(path, renamed, 1), renamed
        out[key] = (path, typ)
    return out


def _val_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.dtype, tuple(value.stride()), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_val_key(v) for v in value)
    if isinstance(value, torch.SymInt):
        raise Mismatch("a symbolic size")
    return value


class Layout:
    """One container's traced blocks in the program (the checks of the module docstring)."""

    def __init__(self, blocks: Blocks, body: Sequence[fx.Node], pos: Mapping[fx.Node, int],
                 owned: Sequence[Input], counters: Sequence[Mapping[str, int]] | None) -> None:
        self.blocks, self.body, self.pos = blocks, body, pos
        self.raw = raw_path(blocks.path)
        k, p, s = blocks.traced, blocks.period, blocks.lead
        self.own: dict[int, list[Input]] = {b: [] for b in range(k)}
        self.inputs = {x.node: x for x in owned}
        self.owner: dict[fx.Node, int] = {}
        for x in owned:
            if x.block >= k:
                raise Mismatch(f"{blocks.path}: a weight of block {x.block} in the traced program")
            self.own[x.block].append(x)
            self.owner[x.node] = x.block
        self.lifted, self.last_lifted, self.ranges, self.end = 0, None, [], None
        if counters is None:   # its blocks did not run: only their weights to copy
            if any(x.number is not None or x.node.users for x in owned):
                raise Mismatch(f"{blocks.path}: its blocks did not run, yet their weights are read")
            return
        pattern = re.compile(rf"^{re.escape(blocks.path + '.' if blocks.path else '')}(\d+)$")
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, node in enumerate(body):
            for path in module_paths(_stack(node)):
                m = pattern.match(path)
                if m:
                    b = int(m.group(1))
                    first.setdefault(b, i)
                    last[b] = i
                    break
        if counters is not None and not first:
            raise Mismatch(f"{blocks.path}: its blocks ran but made no op")
        if sorted(first) != list(range(k)):
            raise Mismatch(f"{blocks.path}: the traced blocks with ops are {sorted(first)}, not 0..{k - 1}")
        starts = [first[b] for b in range(k)]
        if starts != sorted(starts) or any(last[b] >= starts[b + 1] for b in range(k - 1)):
            raise Mismatch(f"{blocks.path}: the blocks' ops are not one run each, in order")
        ends = starts[1:] + [starts[k - 1] + starts[k - p] - starts[k - p - 1]]
        if last[k - 1] >= ends[-1] or ends[-1] > len(body):
            raise Mismatch(f"{blocks.path}: the last block is longer than the one a period before it")
        self.ranges = [range(a, b) for a, b in zip(starts, ends)]
        self.end = ends[-1]                       # body position after the last traced block
        self.owner.update({body[i]: b for b, r in enumerate(self.ranges) for i in r})
        lifted = [sum(x.number is not None for b in range(s + q * p, s + q * p + p) for x in self.own[b])
                  for q in (1, 2)]
        if lifted[0] != lifted[1]:
            raise Mismatch(f"{blocks.path}: the periods make {lifted} constants")
        self.lifted = lifted[0]    # constants one period makes (and lifts)
        numbers = [x.number for x in owned if x.number is not None]
        self.last_lifted = max(numbers) if numbers else None
        self._names(counters)
        self.carry: dict[int, list[int]] = {}    # phase -> offsets its block hands the next one
        for r in range(p):
            self._match(s + p + r, s + 2 * p + r)
        self.tail_reads = self._tail()

    # --- names -------------------------------------------------------------------------------------
    def _names(self, counters: Sequence[Mapping[str, int]]) -> None:
        """Each phase's share of every op name's number (``self.share``) and a period's (``self.delta``).

        A name whose numbers run without a gap through the graph (0, 1, 2, ... in graph order: the
        names a pass gives after tracing, ``_assert_tensor_metadata_default_N``, and traced ones no
        op of which died) is shared by count. Others are numbered as traced, dead ops included: their
        share is what the counters moved while the block ran, and each op's number is checked to
        lie within its block's."""
        s, p, k = self.blocks.lead, self.blocks.period, self.blocks.traced
        numbers: dict[str, list[int]] = {}
        for n in self.body:
            base, number = split_name(n.name)
            numbers.setdefault(base, []).append(number)
        counted = {x for x, found in numbers.items() if found == list(range(len(found)))}

        def used(block: int, base: str) -> int:
            return counters[block].get(base, -1)

        traced = set(numbers) - counted   # (a name no op of the graph has cannot matter)
        self.share: list[dict[str, int]] = []
        for r in range(p):
            a, b = s + p + r, s + p + r + 1
            share = {x: used(b, x) - used(a, x) for x in traced if used(b, x) != used(a, x)}
            share.update(Counter(split_name(self.body[i].name)[0] for i in self.ranges[a]) & Counter(
                dict.fromkeys(counted, len(self.body))))
            self.share.append(share)
            other = sorted(x for x in traced if used(b + p, x) - used(a + p, x) != share.get(x, 0)) if r < p - 1 else []
            if other:
                raise Mismatch(f"{self.blocks.path}: block {a + p} names other ops than block {a}: {other[:3]}")
        self.delta = Counter()
        for share in self.share:
            self.delta.update(share)
        fresh = sorted(x for x in self.delta if x in traced and used(s + p, x) < 0)
        if fresh:
            raise Mismatch(f"{self.blocks.path}: ops first named in the second period: {fresh[:3]}")
        for b in range(s + p, k):
            for i in self.ranges[b]:
                base, number = split_name(self.body[i].name)
                if base in counted:
                    continue
                upper = used(b + 1, base) if b + 1 < k else None
                if number <= used(b, base) or (upper is not None and number > upper):
                    raise Mismatch(f"{self.blocks.path}: op {self.body[i].name} was not named in block {b}")

    # --- the third period against the second ---------------------------------------------------
    def _match(self, b1: int, b2: int) -> None:
        r1, r2 = self.ranges[b1], self.ranges[b2]
        if len(r1) != len(r2):
            raise Mismatch(f"{self.blocks.path}: blocks {b1} and {b2} have {len(r1)} and {len(r2)} ops")
        own1 = {x.key: x for x in self.own[b1]}
        prev: set[int] = set()
        phase_prev = self.blocks.phase(b2 - 1)

        def same(a1: Any, a2: Any) -> bool:
            if isinstance(a2, fx.Node):
                if not isinstance(a1, fx.Node):
                    return False
                o = self.owner.get(a2)
                if o == b2 and a2.op != "placeholder":
                    return self.pos.get(a1) == r1[self.pos[a2] - r2.start]
                if o == b2 - 1 and a2.op != "placeholder":
                    offset = self.pos[a2] - self.ranges[b2 - 1].start
                    r0 = self.ranges[b1 - 1]
                    if offset >= len(r0) or self.pos.get(a1) != r0.start + offset:
                        return False
                    prev.add(offset)
                    return True
                if o == b2:   # a weight or constant of the block: the same one of the other block
                    x2 = self.inputs[a2]
                    x1 = own1.get(x2.key)
                    return x1 is not None and x1.node is a1 and (
                        x2.number is None or x2.number - x1.number == self.lifted)
                return a1 is a2 and (o is None or o < b1)
            if isinstance(a2, (list, tuple)):
                return type(a1) is type(a2) and len(a1) == len(a2) and all(map(same, a1, a2))
            if isinstance(a2, dict):
                return type(a1) is type(a2) and a1.keys() == a2.keys() and all(same(a1[x], a2[x]) for x in a2)
            return type(a1) is type(a2) and a1 == a2

        for i1, i2 in zip(r1, r2):
            n1, n2 = self.body[i1], self.body[i2]
            base1, num1 = split_name(n1.name)
            base2, num2 = split_name(n2.name)
            if n2.op != "call_function" or n1.op != n2.op or n1.target is not n2.target or base1 != base2:
                raise Mismatch(f"{self.blocks.path}: op {n2.name} of block {b2} is not {n1.name} of block {b1}"
                               + ("" if n2.op == "call_function" else f" ({n2.op} in a block)"))
            if num2 - num1 != self.delta.get(base1, 0):
                raise Mismatch(f"{self.blocks.path}: op {n2.name} is not {n1.name} a period later")
            if _val_key(n1.meta.get("val")) != _val_key(n2.meta.get("val")):
                raise Mismatch(f"{self.blocks.path}: {n2.name} of block {b2} differs in shape from {n1.name}")
            stack1, stack2 = n1.meta.get("nn_module_stack") or {}, n2.meta.get("nn_module_stack") or {}
            if moved_stack(stack1, self.raw, b1, b2) != stack2:
                raise Mismatch(f"{self.blocks.path}: {n2.name} of block {b2} is not in the modules of {n1.name}")
            if not (same(n1.args, n2.args) and same(n1.kwargs, n2.kwargs)):
                raise Mismatch(f"{self.blocks.path}: {n2.name} of block {b2} reads other values than {n1.name} "
                               f"of block {b1}")
        self.carry[phase_prev] = sorted(prev)

    # --- what follows the blocks ---------------------------------------------------------------
    def _tail(self) -> list[int]:
        """Offsets in the last traced block of the values what follows reads (checked: only what a
        next block would read)."""
        last, k = self.ranges[-1], self.blocks.traced
        reads: set[int] = set()
        for node in [*self.body[self.end:], *_outputs(self.body)]:
            for a in node.all_input_nodes:
                o = self.owner.get(a)
                if o is None:
                    continue
                offset = self.pos.get(a, -1) - last.start
                if o != k - 1 or a.op == "placeholder" or offset not in self.carry[self.blocks.period - 1]:
                    raise Mismatch(f"{self.blocks.path}: {node.name} after the blocks reads {a.name} of block {o}")
                reads.add(offset)
        end_phase = self.blocks.phase(self.blocks.size - 1)
        if reads and end_phase != self.blocks.period - 1 and not (
                len(self.carry[self.blocks.period - 1]) == 1 and len(self.carry[end_phase]) == 1):
            raise Mismatch(f"{self.blocks.path}: the last period is cut short and blocks hand on several values")
        return sorted(reads)


def _outputs(body: Sequence[fx.Node]) -> list[fx.Node]:
    if not body:
        return []
    return [n for n in body[-1].graph.nodes if n.op == "output"]


def layouts(program: Any, containers: Sequence[Blocks], counters: Sequence[Sequence[Mapping[str, int]] | None]
            ) -> tuple[list[fx.Node], list[InputSpec], list[Layout]]:
    """The program's body (its ops), input specs and each container's checked Layout, in graph order.
    ``counters[i][b]``: torch.fx's name counters when block ``b`` of ``containers[i]`` was entered."""
    graph = program.graph
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    pos = {n: i for i, n in enumerate(body)}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    specs = list(program.graph_signature.input_specs)
    found = [Layout(blocks, body, pos, owned_inputs(specs, blocks, placeholders), marks)
             for blocks, marks in zip(containers, counters)]
    order = {id(spec): i for i, spec in enumerate(specs)}
    for lay in found:
        for kind in PREFIX:
            places = sorted((order[id(x.spec)], b) for b, owned in lay.own.items() for x in owned
                            if x.spec.kind is kind)
            if places and (places[-1][0] - places[0][0] + 1 != len(places)
                           or [b for _, b in places] != sorted(b for _, b in places)):
                raise Mismatch(f"{lay.blocks.path}: the blocks' {kind.name.lower()}s are not in block order")
    found.sort(key=lambda lay: -1 if lay.end is None else lay.end)
    run = [lay for lay in found if lay.end is not None]
    for a, b in zip(run, run[1:]):
        if a.end > b.ranges[0].start:
            raise Mismatch(f"the blocks of {a.blocks.path} and {b.blocks.path} interleave")
    return body, specs, found


def owned_inputs(specs: Sequence[InputSpec], blocks: Blocks, placeholders: Mapping[str, fx.Node]) -> list[Input]:
    """Each parameter, buffer and constant tensor inside the container's blocks."""
    prefix = raw_path(blocks.path) + "."
    out: list[Input] = []
    ranks: Counter = Counter()
    for spec in specs:
        target = spec.target or ""
        if not target.startswith(prefix):
            continue
        head, _, rest = target[len(prefix):].partition(".")
        if not head.isdigit() or spec.kind not in PREFIX:
            raise Mismatch(f"{blocks.path}: input {spec.arg.name} ({spec.kind.name}) is not a block's weight")
        if spec.arg.name != placeholder_name(spec.kind, target):
            raise Mismatch(f"{blocks.path}: placeholder {spec.arg.name} is not named after {target}")
        number = lifted_number(rest) if spec.kind is InputKind.CONSTANT_TENSOR else None
        if number is None:
            key: tuple = ("name", rest)
        else:
            base = _LIFTED.match(rest).group(1)
            key = ("lifted", base, ranks[(head, base)])
            ranks[(head, base)] += 1
        out.append(Input(int(head), spec, placeholders[spec.arg.name], key, number))
    return out
