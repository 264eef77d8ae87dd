"""The results readers import one way: results → selection → summary, plots → report, with no import hidden in
a function to dodge a cycle."""

import ast
from pathlib import Path

import dpsgd_cli

READERS = {"dpsgd_cli.engine.results": "engine/results.py", "dpsgd_cli.engine.selection": "engine/selection.py",
           "dpsgd_cli.engine.summary": "engine/summary.py", "dpsgd_cli.plots": "plots/__init__.py",
           "dpsgd_cli.report": "report.py"}


def _imports(path: Path) -> set[str]:
    """The readers a module imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in READERS}
    return found


def test_the_results_readers_import_each_other_without_a_cycle():
    root = Path(dpsgd_cli.__file__).parent
    graph = {module: _imports(root / path) - {module} for module, path in READERS.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import cycle: {' → '.join([*path[path.index(module):], module])}"
        if module not in done:
            for target in graph[module]:
                visit(target, [*path, module])
            done.add(module)

    for module in graph:
        visit(module, [])
    assert "dpsgd_cli.engine.selection" in graph["dpsgd_cli.engine.summary"]  # the direction data flows
    assert not graph["dpsgd_cli.engine.results"]


def _modules() -> dict[str, ast.Module]:
    """Every module of the package, by dotted name (a package by its own name, not `.__init__`)."""
    root = Path(dpsgd_cli.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(encoding="utf-8"))
    return found


def test_no_module_imports_a_private_name_of_another_package():
    """`from dpsgd_cli.x import _y` only inside the package that owns `_y`: a name used elsewhere is public."""
    packages = {name for name in _modules() if (Path(dpsgd_cli.__file__).parent.parent / name.replace(".", "/")
                                                / "__init__.py").exists()}
    found = []
    for name, tree in _modules().items():
        package = name if name in packages else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpsgd_cli"):
                owner = node.module if node.module in packages else node.module.rpartition(".")[0]
                found += [f"{name}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__") and owner != package]
    assert not found


def test_imports_are_at_the_top_of_their_module_but_for_a_few():
    """An import inside a function is for a module that is optional or heavy and cannot go through
    `dpsgd_cli.lazy`, or that would close a cycle at the top: at most 30 (each counted once for every function it
    sits in)."""
    count = sum(isinstance(node, (ast.Import, ast.ImportFrom))
                for tree in _modules().values() for function in ast.walk(tree)
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(function))
    assert count <= 30
