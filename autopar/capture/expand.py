"""The program of a whole model from an export of its first blocks: the last traced period, copied.

capture/repeat.py exports a model whose block containers hold only their first blocks (a lead of
blocks unlike the rest, then three periods of the repeating pattern). :func:`expand` turns that
program into the one exporting every block gives, node for node: the same ops in the same order,
with the same names, arguments, shapes and module paths, and the same graph signature, once
capture/periods.py has checked that copying the last traced period gives it (else
:class:`~autopar.capture.periods.Mismatch`, and capture exports every block).

Copies reuse the traced ops' fake-tensor values (shapes and dtypes only are read downstream).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch.fx as fx
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputSpec, TensorArgument

from .periods import (Blocks, Layout, Mismatch, join_name, layouts, lifted_number, moved_stack, placeholder_name,
                      split_name)


@dataclass
class Expanded:
    """What capture reads of an ExportedProgram (graph_of, check_dtypes): the expanded graph and
    signature, and the traced program's graph module (its meta holds the loss; higher-order ops'
    bodies)."""

    graph_module: fx.GraphModule
    graph: fx.Graph
    graph_signature: ExportGraphSignature


def expand(program: Any, containers: Sequence[Blocks], counters: Sequence[Sequence[Mapping[str, int]] | None]
           ) -> Expanded:
    """The program of the whole model (module docstring). ``counters[i][b]``: torch.fx's name
    counters when block ``b`` of ``containers[i]`` was entered (None: its blocks did not run)."""
    body, specs, found = layouts(program, containers, counters)
    return _Emit(program, body, specs, found).result


class _Emit:
    """Writes the expanded graph and signature (one pass over the traced graph, copies inserted)."""

    def __init__(self, program: Any, body: Sequence[fx.Node], specs: Sequence[InputSpec],
                 layouts: Sequence[Layout]) -> None:
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
        # created bare, then given its arguments: create_node walks them with pytree for a warning about
        # raw symbolic sizes (a static export has none), which took half of the expansion's time
        new = self.g.create_node(old.op, old.target if old.op != "placeholder" else name, name=name,
                                 type_expr=old.type)
        if new.name != name:
            raise Mismatch(f"the name {name} is taken twice")
        new.args, new.kwargs = fx.node.map_arg((old.args, old.kwargs), load)
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
