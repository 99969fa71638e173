"""The package's layers hold: the import contract in pyproject.toml (import-linter), no import cycle
between any two modules, and ``import pyprune.ops`` loads the op library alone."""
import json
import os
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def test_the_layer_contract_holds():
    """``lint-imports`` (import-linter) checks the ``layers`` contract of pyproject.toml: a module
    that imports from a layer above its own fails here."""
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")  # import-linter's command
    result = subprocess.run([lint_imports, str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout, result.stdout


def _cycles(graph, modules):
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.find_modules_directly_imported_by(node):
            if nxt not in modules:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others():
    """No import cycle among pyprune's modules, imports inside functions included. A package's
    ``__init__`` re-exporting its own submodules is not a cycle of the code, so packages are left
    out and only module files are compared."""
    graph = grimp.build_graph("pyprune", include_external_packages=False)
    packages = {m for m in graph.modules if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    assert _cycles(graph, graph.modules - packages) == []


def test_the_cycle_check_finds_a_cycle():
    """The check above is not blind: a two-module cycle in a graph is found."""
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph, {"a.x", "a.y", "a.z"}) == [["a.x", "a.y"]]


def test_import_pyprune_ops_loads_neither_methods_nor_cli():
    code = ("import json, sys; import pyprune.ops; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('pyprune'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env=dict(os.environ, TRITON_INTERPRET="1"))
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "pyprune.ops" in loaded
    above_ops = [m for m in loaded if m != "pyprune" and not m.startswith(("pyprune.ops", "pyprune._C"))]
    assert above_ops == [], above_ops


def _kernel_imports(source):
    """The modules a kernels/ file imports, relative imports resolved against ``pyprune.ops.kernels``."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ["pyprune", "ops", "kernels"][:3 - node.level + 1] if node.level else []
            names.add(".".join(base + ([node.module] if node.module else [])))
    return names


def test_kernels_import_only_ops_internals_and_triton():
    """``kernels/`` installs as ``pyprune.ops.kernels`` (setup.py ``package_dir``), outside the tree
    import-linter walks, so its layer is checked here: a Triton kernel module imports torch, triton,
    the standard library, its siblings and ``pyprune.ops.conventions``, and nothing above."""
    allowed_pyprune = ("pyprune.ops.kernels", "pyprune.ops.conventions")
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for name in _kernel_imports(path.read_text(encoding="utf-8")):
            top = name.split(".")[0]
            if top == "pyprune":
                assert name.startswith(allowed_pyprune), f"{path.name} imports {name}"
            else:
                assert top in {"torch", "triton"} | sys.stdlib_module_names, f"{path.name} imports {name}"


def test_kernel_import_check_sees_an_upward_import():
    assert _kernel_imports("from ...nn import sparse\nfrom ..conventions import ScoreKind\nfrom .scores import x") == {
        "pyprune.nn", "pyprune.ops.conventions", "pyprune.ops.kernels.scores"}
