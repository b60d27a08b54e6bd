"""autopar/runtime is the runtime library: it imports nothing of autopar but config and errors, and what
a standalone folder carries (runtime.STANDALONE) imports only torch, the standard library and its
siblings (and torchao where an fp8 program builds its linear layers), so the copy (runtime.vendor) runs where autopar cannot be imported."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import autopar.runtime as runtime

HERE = Path(runtime.__file__).parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """(relative level, module) of every import of ``path``, in functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
        elif isinstance(node, ast.Import):
            out += [(0, alias.name) for alias in node.names]
    return out


def test_runtime_imports_only_config_and_errors_of_autopar():
    found = {}
    for path in HERE.glob("*.py"):
        tree = ast.parse(path.read_text())
        checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                    and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in checking and node.level >= 2:
                if (node.module or "").split(".")[0] not in ("config", "errors"):
                    found.setdefault(path.name, []).append(f"from {'.' * node.level}{node.module}")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0 \
                    and id(node) not in checking:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(n == "autopar" or n.startswith("autopar.") for n in names):
                    found.setdefault(path.name, []).append(ast.unparse(node))
    assert not found, f"the runtime library imports more of autopar than config and errors: {found}"


def test_standalone_modules_import_only_torch_and_siblings():
    """And torchao in fp8.py, inside the functions an fp8 program calls (a bf16 folder imports fp8.py without
    it: its import is at no module's top level)."""
    stdlib = set(sys.stdlib_module_names)
    for name in runtime.STANDALONE:
        path = HERE / f"{name}.py"
        for level, module in _imports(path):
            top = module.split(".")[0]
            if level == 1:
                assert top in (*runtime.STANDALONE, "errors", ""), f"{name}.py imports .{module}"
            else:
                assert level == 0 and (top in stdlib or top == "torch" or (name, top) == ("fp8", "torchao")), \
                    f"{name}.py imports {'.' * level}{module}"
        top_level = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not any("torchao" in ast.unparse(n) for n in top_level), f"{name}.py imports torchao at its top"


def test_the_vendored_copy_runs_without_autopar(tmp_path):
    folder = runtime.vendor(str(tmp_path))
    assert sorted(p.name for p in Path(folder).glob("*.py")) == sorted(
        [f"{m}.py" for m in runtime.STANDALONE] + ["errors.py", "__init__.py"])
    script = textwrap.dedent(f"""
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name == "autopar" or name.startswith("autopar."):
                    raise ImportError("autopar cannot be imported here")

        sys.meta_path.insert(0, Refuse())
        sys.path.insert(0, {str(tmp_path)!r})
        from autopar_runtime import {", ".join(runtime.STANDALONE)}
        from autopar_runtime.errors import ConfigError, RuntimeFailure
        try:
            mesh.Mesh(tp=0)
        except ConfigError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: mesh degree tp=0" in done.stdout
