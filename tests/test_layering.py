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
