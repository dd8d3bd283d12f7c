"""The package's layers, pinned: each folder imports only what its `__init__.py`
docstring allows ("May import: ..."), and the folders and the modules left at the
top import each other with no cycle, so that no folder imports a module that
imports back into it. Every import counts, a lazy one inside a function too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "batchproxy"
FOLDERS = ["_executors", "_loops", "_runs", "_scheduling", "tensors"]
LONGEST = 500  # lines in one module


def _node(path: Path) -> str:
    """The unit of layering a module belongs to: its folder, or itself at the top."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imports(path: Path) -> set[str]:
    """The units `path` imports from inside the package (relative imports)."""
    tree = ast.parse(path.read_text(), str(path))
    package = list(path.relative_to(PACKAGE).parent.parts)
    found: set[str] = set()
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.ImportFrom) or not statement.level:
            continue
        base = package[: len(package) - (statement.level - 1)]
        target = base + (statement.module.split(".") if statement.module else [])
        if target:
            found.add(target[0])
        else:  # `from . import name` at the top: each name is a unit
            found.update(alias.name for alias in statement.names)
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        node = _node(path)
        if node == "__init__":
            continue  # the surface re-exports everything
        edges = graph.setdefault(node, set())
        edges.update(target for target in _imports(path) if target != node)
    return graph


def _allowed(folder: str) -> set[str]:
    docstring = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
    assert docstring, f"{folder}/__init__.py has no docstring"
    match = re.search(r"May import:(.*?)\.(?:\n|$)", docstring, re.DOTALL)
    assert match, f"{folder}/__init__.py's docstring says nothing of what it may import"
    return set(re.findall(r"`([\w.]+)`", match.group(1)))


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_imports_only_what_its_docstring_allows(folder: str) -> None:
    imported = _graph()[folder]
    assert imported <= _allowed(folder), (
        f"{folder}/ imports {sorted(imported - _allowed(folder))}, which its "
        f"__init__.py docstring does not allow"
    )


def test_the_folders_and_top_modules_form_layers_with_no_cycle() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = [*path[path.index(node) :], node]
            pytest.fail("an import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_the_executors_know_nothing_of_requests() -> None:
    """Below the scheduling, the runs and the loops: an executor gets items."""
    assert not _graph()["_executors"] & {"_scheduling", "_runs", "_loops", "_settle", "_intake"}


def test_no_module_is_over_the_limit() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > LONGEST
    }
    assert not long, f"modules over {LONGEST} lines: {long}"
