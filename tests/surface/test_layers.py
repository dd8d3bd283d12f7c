"""The package's layers, pinned: each folder imports only what its `__init__.py`
docstring allows ("May import: ..."), and the folders and the modules left at the
top import each other with no cycle, so that no folder imports a module that
imports back into it. Every import counts, a lazy one inside a function too. (That
no module imports another in a cycle, and none is over 500 lines, is
test_exported_members'.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from _imports import PACKAGE, find_cycle, relative_imports

FOLDERS = ["_executors", "_loops", "_runs", "_scheduling", "host", "tensors", "tune"]


def _node(path: Path) -> str:
    """The unit of layering a module belongs to: its folder, or itself at the top."""
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        node = _node(path)
        if node == "__init__":
            continue  # the surface re-exports everything
        edges = graph.setdefault(node, set())
        edges.update(target[0] for target in relative_imports(path) if target[0] != node)
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
    cycle = find_cycle(_graph())
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])


def test_the_executors_know_nothing_of_requests() -> None:
    """Below the scheduling, the runs and the loops: an executor gets items."""
    assert not _graph()["_executors"] & {"_scheduling", "_runs", "_loops", "_settle", "_intake"}
