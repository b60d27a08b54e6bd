"""autopar/ops.py, the one op table: its name function, that it is a leaf and the only place that strips
aten targets, and that what the solver offers for a class loss is what the lowering runs (both read
from the table, so a new entry cannot be offered without being run)."""

from __future__ import annotations

import operator
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autopar import ops
from autopar.capture import graph_of
from autopar.capture.export import run_export
from autopar.capture.opgraph import OpKind
from autopar.runtime import shard_ops
from autopar.codegen.lower import How, _Lowering
from autopar.solver.strategies import OpContext, node_strategies

AUTOPAR = Path(ops.__file__).parent


@pytest.mark.parametrize("target, name", [
    (torch.ops.aten.sum.dim_IntList, "sum"),
    (torch.ops.aten.sum, "sum"),
    ("aten.sum.dim_IntList", "sum"),
    ("aten::sum.dim_IntList", "sum"),
    ("aten.sum", "sum"),
    (torch.ops.aten.relu_.default, "relu"),
    ("aten.add_.Tensor", "add"),
    (torch.ops.aten._softmax.default, "_softmax"),
    (operator.getitem, "getitem"),
    (str(operator.getitem), "getitem"),
    ("transformers.grouped_mm_fallback.default", "grouped_mm_fallback"),
    (torch.ops.higher_order.wrap_with_set_grad_enabled, "wrap_with_set_grad_enabled"),
    (str(torch.ops.higher_order.wrap_with_set_grad_enabled), "wrap_with_set_grad_enabled"),
])
def test_base_name_of_every_form_a_target_takes(target, name):
    assert ops.base_name(target) == name


def test_the_table_is_a_leaf():
    code = ("import sys, autopar.ops; print(sorted(m for m in sys.modules if m.startswith('autopar') or "
            "m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['autopar', 'autopar.ops']", out


# an aten target written as text ("aten.linear.default", "aten::sum", the namespace "aten" to compare a part
# with), a target split into its parts, or a schema's name read: what base_name does
_STRIPPING = (re.compile(r"target\w*(\(\))?[\w.]*\.split\("), re.compile(r"_schema\.name"))
_ATEN_TEXT = re.compile(r"""^[rbuf]*("|')(aten|torch\.ops\.aten)([.:]|\1)""")


def _strippers(path: Path) -> list[str]:
    found = []
    with path.open() as fh:
        for tok in tokenize.generate_tokens(fh.readline):
            if tok.type == tokenize.STRING and _ATEN_TEXT.match(tok.string):
                found.append(f"{path.relative_to(AUTOPAR.parent)}:{tok.start[0]}: {tok.string}")
            elif tok.type not in (tokenize.COMMENT, tokenize.STRING) and any(p.search(tok.line) for p in _STRIPPING):
                found.append(f"{path.relative_to(AUTOPAR.parent)}:{tok.start[0]}: {tok.line.strip()}")
    return sorted(set(found))


def test_the_table_is_the_only_aten_name_stripper():
    found = [hit for path in sorted(AUTOPAR.rglob("*.py")) if path != Path(ops.__file__) for hit in _strippers(path)]
    assert not found, "aten names read outside autopar/ops.py (use ops.base_name and its sets):\n" + "\n".join(found)


class ClassLosses(nn.Module):
    """Every class loss of the table, called as its aten op: class scores [N, C, H, W] for the ``2d``
    ones, [N, C] for the others (log-probabilities for the nll ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x2: torch.Tensor, t1: torch.Tensor, x4: torch.Tensor, t3: torch.Tensor) -> torch.Tensor:
        total = x2.new_zeros(())
        for name in sorted(ops.CLASS_LOSSES):
            x, t = (x4 * self.scale[:, None, None], t3) if "2d" in name else (x2 * self.scale, t1)
            if not name.startswith("cross"):
                x = x.log_softmax(1)
            out = getattr(torch.ops.aten, name).default(x, t, None, 1, -100)
            total = total + (out[0] if isinstance(out, (tuple, list)) else out)
        return total


def test_the_solver_offers_the_vocab_loss_for_exactly_the_losses_the_lowering_runs():
    model = ClassLosses()
    inputs = (torch.randn(6, 8), torch.randint(0, 8, (6,)), torch.randn(2, 8, 3, 3), torch.randint(0, 8, (2, 3, 3)))
    program = run_export(model, inputs, None)
    graph = graph_of(model, program)
    nodes = {n.name: n for n in program.graph.nodes}
    lowering = _Lowering(nodes, graph, {}, {}, {}, 2)
    ctx = OpContext(graph)
    offered, run, seen = set(), set(), set()
    for node in graph.nodes:
        if node.kind is not OpKind.LOSS:
            continue
        name = ops.base_name(node.target)
        seen.add(name)
        if any(s.name == "vocab" for s in node_strategies(ctx, node, 2)):
            offered.add(name)
        if lowering.how(nodes[node.name], SimpleNamespace(strategy="vocab")) is How.VOCAB_LOSS:
            run.add(name)
    assert seen == set(ops.CLASS_LOSSES)
    assert offered == run == set(ops.VOCAB_LOSSES)


@pytest.mark.parametrize("name", sorted(ops.VOCAB_LOSSES))
def test_every_vocab_loss_form_is_implemented_with_arguments_its_op_has(name):
    fn, rest = shard_ops.VOCAB_LOSS_FORMS[ops.VOCAB_LOSSES[name].form]
    schema = getattr(torch.ops.aten, name).default._schema
    assert [a.name for a in schema.arguments][:2] == ["self", "target"] and len(schema.returns) == 1
    assert set(rest) <= {a.name for a in schema.arguments}, (name, rest)
