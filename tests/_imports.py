"""The library's own imports, read from its source: what `tests/surface/` checks its
layers and cycles with. Every relative import counts, one inside a function too."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

import batchproxy

PACKAGE = Path(batchproxy.__file__).resolve().parent


def relative_imports(path: Path) -> Iterator[tuple[str, ...]]:
    """Each relative import of the module at `path`, as the dotted parts of what it
    names inside the package: `from ..x import y` gives ("x",) and, in case `y` is a
    module, ("x", "y"); `from .. import y` gives ("y",)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(parts[:-1])  # a package's __init__ is in its own package, too
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - (node.level - 1)]
        if node.module:
            target = (*base, *node.module.split("."))
            yield target
            for alias in node.names:
                yield (*target, alias.name)
        else:
            for alias in node.names:
                yield (*base, alias.name)


def find_cycle(graph: Mapping[str, Set[str]]) -> list[str] | None:
    """An import cycle in `graph` (each node -> what it imports), as the path that
    closes it; None if there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            if (cycle := visit(target, [*path, node])) is not None:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        if (cycle := visit(node, [])) is not None:
            return cycle
    return None
