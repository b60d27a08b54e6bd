"""autopar's modules import each other without a cycle (issue 49), counting every import: at module
level, under TYPE_CHECKING and inside functions, and the package ``__init__`` an import runs first.

The one exception is documented (docs/architecture.md): the reading methods of Plan and Sweep are
one-line facades that import report/, viz/ or exports/ inside the method, which read the plan, and
``Plan.from_dict`` one on plan/io.py; ``Cluster.local`` is one on the profiler (which measures this
machine by running generated code). Imports under ``if TYPE_CHECKING:`` never run and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import autopar

ROOT = Path(autopar.__file__).parent
FACADES = {
    ("autopar.plan.record", "Plan"): {"summary", "explain", "compare", "plot_timeline", "plot_memory",
                                      "plot_partition", "export", "_repr_html_", "from_dict"},
    ("autopar.plan.sweep", "Sweep"): {"table", "plot"},
    ("autopar.cluster", "Cluster"): {"local"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _facade_lines(module: str, tree: ast.Module) -> set[int]:
    """The lines of the documented facade methods in ``module``, and of its ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            lines.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.ClassDef) and (module, node.name) in FACADES:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in FACADES[module, node.name]:
                    lines.update(range(item.lineno, item.end_lineno + 1))
    return lines


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _facade_lines(module, tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{a.name}" for a in node.names)   # a submodule imported by name
    out = set()
    for target in targets:
        if target not in known:
            continue
        parts = target.split(".")
        for i in range(2, len(parts) + 1):   # the packages the import runs first, then the module
            name = ".".join(parts[:i])
            if name in known and not module.startswith(name + ".") and name != module:
                out.add(name)
    return out


def test_no_import_cycle_but_the_documented_facades() -> None:
    modules = _modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for target in _imports(module, path, set(modules)):
            graph.add_edge(module, target)
    cycles = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(_path(nx.find_cycle(graph.subgraph(c))) for c in cycles)


def _path(edges: list[tuple[str, str]]) -> str:
    return " -> ".join([a for a, _ in edges] + [edges[0][0]])


def test_the_graph_sees_a_cycle_when_there_is_one(tmp_path, monkeypatch) -> None:
    """The check above is not vacuous: the facades it exempts are real imports of report/, viz/ and exports/."""
    modules = _modules()
    record = modules["autopar.plan.record"]
    monkeypatch.setitem(FACADES, ("autopar.plan.record", "Plan"), set())
    assert {"autopar.report", "autopar.viz", "autopar.exports"} <= _imports("autopar.plan.record", record,
                                                                            set(modules))
