"""The program of a whole model from an export of its first blocks: the last traced period, copied.

capture/repeat.py exports a model whose block containers hold only their first blocks (a lead of
blocks unlike the rest, then three periods of the repeating pattern). :func:`expand` turns that
program into the one exporting every block gives, node for node: the same ops in the same order,
with the same names, arguments, shapes and module paths, and the same graph signature.

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

Copies reuse the traced ops' fake-tensor values (shapes and dtypes only are read downstream).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputSpec,
                                          TensorArgument)

from .build import _stack, module_paths

WRAPPER = "model"                     # capture's LossWrapper holds the user's model as ``model``
_NUMBERED = re.compile(r"^(.*)_(\d+)$")  # torch.fx's suffix rule (fx.graph._Namespace)
_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}  # torch.export's
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


@dataclass
class Expanded:
    """What capture reads of an ExportedProgram (graph_of): the expanded graph and signature, and
    the traced program's graph module (its meta holds the loss; higher-order ops' bodies)."""

    graph_module: fx.GraphModule
    graph: fx.Graph
    graph_signature: ExportGraphSignature


@dataclass(frozen=True)
class _Input:
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
    return _PREFIX[kind] + re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def _raw(path: str) -> str:
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


class _Layout:
    """One container's traced blocks in the program (the checks of the module docstring)."""

    def __init__(self, blocks: Blocks, body: Sequence[fx.Node], pos: Mapping[fx.Node, int],
                 owned: Sequence[_Input], counters: Sequence[Mapping[str, int]] | None) -> None:
        self.blocks, self.body, self.pos = blocks, body, pos
        self.raw = _raw(blocks.path)
        k, p, s = blocks.traced, blocks.period, blocks.lead
        self.own: dict[int, list[_Input]] = {b: [] for b in range(k)}
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


def expand(program: Any, containers: Sequence[Blocks], counters: Sequence[Sequence[Mapping[str, int]]]) -> Expanded:
    """The program of the whole model (module docstring). ``counters[i][b]``: torch.fx's name
    counters when block ``b`` of ``containers[i]`` was entered."""
    graph = program.graph
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    pos = {n: i for i, n in enumerate(body)}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    specs = list(program.graph_signature.input_specs)
    layouts = []
    for blocks, marks in zip(containers, counters):
        layouts.append(_Layout(blocks, body, pos, _owned(specs, blocks, placeholders), marks))
    order = {id(spec): i for i, spec in enumerate(specs)}
    for lay in layouts:
        for kind in _PREFIX:
            found = sorted((order[id(x.spec)], b) for b, owned in lay.own.items() for x in owned
                           if x.spec.kind is kind)
            if found and (found[-1][0] - found[0][0] + 1 != len(found)
                          or [b for _, b in found] != sorted(b for _, b in found)):
                raise Mismatch(f"{lay.blocks.path}: the blocks' {kind.name.lower()}s are not in block order")
    layouts.sort(key=lambda lay: -1 if lay.end is None else lay.end)
    run = [lay for lay in layouts if lay.end is not None]
    for a, b in zip(run, run[1:]):
        if a.end > b.ranges[0].start:
            raise Mismatch(f"the blocks of {a.blocks.path} and {b.blocks.path} interleave")
    return _Emit(program, body, specs, layouts).result


def _owned(specs: Sequence[InputSpec], blocks: Blocks, placeholders: Mapping[str, fx.Node]) -> list[_Input]:
    """Each parameter, buffer and constant tensor inside the container's blocks."""
    prefix = _raw(blocks.path) + "."
    out: list[_Input] = []
    ranks: Counter = Counter()
    for spec in specs:
        target = spec.target or ""
        if not target.startswith(prefix):
            continue
        head, _, rest = target[len(prefix):].partition(".")
        if not head.isdigit() or spec.kind not in _PREFIX:
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
        out.append(_Input(int(head), spec, placeholders[spec.arg.name], key, number))
    return out


class _Emit:
    """Writes the expanded graph and signature (one pass over the traced graph, copies inserted)."""

    def __init__(self, program: Any, body: Sequence[fx.Node], specs: Sequence[InputSpec],
                 layouts: Sequence[_Layout]) -> None:
        self.g = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.shift: Counter = Counter()
        self.copy_params: dict[tuple[int, int, str], fx.Node] = {}   # (layout, block, template's name)
        self.body, self.layouts = body, layouts
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        new_specs = self._placeholders(specs, placeholders)
        after = {lay.end - 1: j for j, lay in enumerate(layouts) if lay.end is not None}
        for i, node in enumerate(body):
            self.env[node] = self._node(node, self._shifted(node.name), self.env.__getitem__, node.meta)
            if i in after:
                self._copies(after[i])
        (output,) = [n for n in program.graph.nodes if n.op == "output"]
        self._node(output, output.name, self.env.__getitem__, output.meta)
        renamed = {old.name: new.name for old, new in self.env.items()}
        out_specs = [OutputSpec(s.kind, TensorArgument(renamed.get(s.arg.name, s.arg.name)) if isinstance(
            s.arg, TensorArgument) else s.arg, s.target) for s in program.graph_signature.output_specs]
        self.result = Expanded(program.graph_module, self.g, ExportGraphSignature(new_specs, out_specs))

    def _shifted(self, name: str) -> str:
        base, number = split_name(name)
        return join_name(base, number + self.shift[base]) if self.shift[base] else name

    def _node(self, old: fx.Node, name: str, load, meta: Mapping) -> fx.Node:
        args, kwargs = fx.node.map_arg((old.args, old.kwargs), load)
        new = self.g.create_node(old.op, old.target if old.op != "placeholder" else name, args, kwargs,
                                 name=name, type_expr=old.type)
        if new.name != name:
            raise Mismatch(f"the name {name} is taken twice")
        new.meta = dict(meta)
        return new

    def _lifted_shift(self, number: int) -> int:
        """How far a lifted constant's number moves: by the constants of the blocks copied before it."""
        return sum(lay.lifted_copies for lay in self.layouts
                   if lay.last_lifted is not None and lay.last_lifted < number)

    def _placeholders(self, specs: Sequence[InputSpec], placeholders: Mapping[str, fx.Node]) -> list[InputSpec]:
        """Every placeholder in the full export's order: each copied block's parameters, buffers and
        constants after the last traced block's of the same kind; lifted constants after them
        renumbered."""
        out: list[InputSpec] = []
        last: dict[int, list[tuple[int, InputKind]]] = {}   # spec index -> (layout, kind) to copy after it
        for j, lay in enumerate(self.layouts):
            lay.lifted_copies = sum(x.number is not None for c in range(lay.blocks.traced, lay.blocks.size)
                                    for x in lay.own[lay.blocks.template(c)])
            ends: dict[InputKind, int] = {}
            for owned in lay.own.values():
                for x in owned:
                    ends[x.spec.kind] = max(ends.get(x.spec.kind, -1), specs.index(x.spec))
            for kind, i in ends.items():
                last.setdefault(i, []).append((j, kind))
        for i, spec in enumerate(specs):
            old = placeholders[spec.arg.name]
            number = lifted_number(spec.target) if spec.kind is InputKind.CONSTANT_TENSOR else None
            if number is not None and self._lifted_shift(number):
                target = spec.target[:len(spec.target) - len(str(number))] + str(number + self._lifted_shift(number))
                spec = InputSpec(spec.kind, TensorArgument(placeholder_name(spec.kind, target)), target,
                                 spec.persistent)
            self.env[old] = self._node(old, spec.arg.name, self.env.__getitem__, old.meta)
            out.append(spec)
            for j, kind in last.get(i, ()):
                out += self._copy_inputs(j, kind)
        return out

    def _copy_inputs(self, j: int, kind: InputKind) -> list[InputSpec]:
        lay = self.layouts[j]
        blocks, out = lay.blocks, []
        for c in range(blocks.traced, blocks.size):
            t = blocks.template(c)
            for x in lay.own[t]:
                if x.spec.kind is not kind:
                    continue
                number = None if x.number is None else (
                    x.number + self._lifted_shift(x.number) + (c - t) // blocks.period * lay.lifted)
                target = x.target(lay.raw, c, number)
                name = placeholder_name(kind, target)
                self.copy_params[(j, c, x.node.name)] = self._node(x.node, name, self.env.__getitem__, x.node.meta)
                out.append(InputSpec(kind, TensorArgument(name), target, x.spec.persistent))
        return out

    def _copies(self, j: int) -> None:
        """Blocks ``traced .. size-1`` of layout ``j``, after its last traced block; then what follows
        reads the last block."""
        lay = self.layouts[j]
        blocks, body, p = lay.blocks, self.body, lay.blocks.period
        made: dict[int, list[fx.Node]] = {}

        def node_at(block: int, offset: int) -> fx.Node:
            if block < blocks.traced:
                return self.env[body[lay.ranges[block][offset]]]
            return made[block][offset]

        stacks: dict[int, dict] = {}
        for c in range(blocks.traced, blocks.size):
            t = blocks.template(c)
            span, before = lay.ranges[t], lay.ranges[t - 1]
            periods = (c - t) // p
            made[c] = []

            def load(a: fx.Node, c=c, t=t, span=span, before=before) -> fx.Node:
                o = lay.owner.get(a)
                if o == t and a.op == "placeholder":
                    return self.copy_params[(j, c, a.name)]
                i = lay.pos.get(a)
                if o == t:
                    return made[c][i - span.start]
                if o == t - 1 and a.op != "placeholder":
                    return node_at(c - 1, i - before.start)
                return self.env[a]

            for i in span:
                old = body[i]
                base, number = split_name(old.name)
                name = join_name(base, number + self.shift[base] + periods * lay.delta.get(base, 0))
                meta = dict(old.meta)
                stack = old.meta.get("nn_module_stack")
                if stack is not None:
                    key = id(stack)
                    if key not in stacks or stacks[key][0] != c:
                        stacks[key] = (c, moved_stack(stack, lay.raw, t, c))
                    meta["nn_module_stack"] = stacks[key][1]
                made[c].append(self._node(old, name, load, meta))
        # what follows reads the last block
        end, last_phase = blocks.size - 1, p - 1
        for offset in lay.tail_reads:
            source = offset if blocks.phase(end) == last_phase else lay.carry[blocks.phase(end)][0]
            self.env[body[lay.ranges[-1][offset]]] = node_at(end, source)
        for c in range(blocks.traced, blocks.size):
            self.shift.update(lay.share[blocks.phase(c)])
