"""The benchmarks' layout (benchmarks/README.md is its map): folders by concern, each named
in the map; no file over MAX_LINES lines; no import cycle among the benchmarks' modules;
every `make bench-*` target (and the GPU machine's script) runs a module that exists; the
path is set up in one place (the package's bootstrap), not in every file."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
MAX_LINES = 500
# where `sys.path` may change, and why: the bootstrap (examples/ on the path); the host
# benchmark's model, from the host tests (tests/_host_models.py); `host_cpu --base`'s
# package, put first in its server processes
SYS_PATH = {
    "benchmarks/__init__.py",
    "benchmarks/host/host.py",
    "benchmarks/host/_cpu_roles.py",
}
NOT_OURS = {"results", "__pycache__", ".venvs", ".logs"}


def sources() -> Iterator[Path]:
    for path in sorted(BENCHMARKS.rglob("*")):
        parts = set(path.relative_to(BENCHMARKS).parts)
        if path.suffix in (".py", ".sh") and not parts & NOT_OURS:
            yield path


def folders() -> list[Path]:
    return sorted(
        path for path in BENCHMARKS.iterdir() if path.is_dir() and path.name not in NOT_OURS
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sources() if path.suffix == ".py"}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The benchmarks' modules `path` imports, at any depth of its code (`from a import b`
    counts `a.b` where that is a module, else `a`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
    return {name for name in found if name in known}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph`, as the modules in its order, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def bench_targets() -> dict[str, str]:
    """Every `bench*` target of the Makefile, with its recipe."""
    text = (ROOT / "Makefile").read_text()
    return {
        match.group(1): match.group(2)
        for match in re.finditer(r"^(bench[\w-]*):[^\n]*\n((?:\t[^\n]*\n)+)", text, re.MULTILINE)
    }


def test_no_file_is_longer_than_the_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): count
        for path in sources()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: split them by concern: {long}"


def test_the_line_limit_is_checked_on_every_benchmark_file() -> None:
    names = {str(path.relative_to(BENCHMARKS)) for path in sources()}
    assert {"__init__.py", "_harness/report.py", "gpu/gpu_device.sh", "servers/run.py"} <= names


def test_no_import_cycle_among_the_benchmarks() -> None:
    known = modules()
    graph = {name: imports_of(path, known) - {name} for name, path in known.items()}
    assert "benchmarks._harness.clients" in graph["benchmarks.servers.run"]  # (read at all)
    assert "benchmarks.servers._gpu_sim" in graph["benchmarks.models._tune_models"]  # (nested)
    assert cycle(graph) is None, f"an import cycle: {' -> '.join(cycle(graph) or [])}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_every_folder_is_a_package_and_on_the_map() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    assert (BENCHMARKS / "__init__.py").is_file()
    for folder in folders():
        assert (folder / "__init__.py").is_file(), f"{folder.name}/ is not a package"
        assert f"`{folder.name}/`" in readme, f"benchmarks/README.md does not name {folder.name}/"
    assert "`results/`" in readme


def test_every_bench_target_runs_a_benchmark_module_that_exists() -> None:
    targets = bench_targets()
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert phony is not None
    assert {name for name in phony.group(1).split() if name.startswith("bench")} == set(targets)
    readme = (BENCHMARKS / "README.md").read_text()
    for target, recipe in targets.items():
        found = re.findall(r"python -m (benchmarks(?:\.\w+)+)", recipe)
        assert found, f"make {target}: no `python -m benchmarks...` in {recipe!r}"
        for name in found:
            assert name in modules(), f"make {target}: no module {name}"
            assert 'if __name__ == "__main__":' in modules()[name].read_text()
        assert f"`make {target}" in readme, f"benchmarks/README.md does not name make {target}"


def test_the_gpu_machine_script_runs_a_module_that_exists() -> None:
    script = (BENCHMARKS / "gpu" / "gpu_device.sh").read_text()
    assert set(re.findall(r"python3 -m (benchmarks(?:\.\w+)+)", script)) == {"benchmarks.gpu.gpu"}
    assert 'cd "$(dirname "$0")/../.."' in script  # (the repository's root)


def test_the_path_is_set_up_in_one_place() -> None:
    changed = {
        str(path.relative_to(ROOT))
        for path in sources()
        if path.suffix == ".py"
        and re.search(r"sys\.path(\.insert|\.append|\[[^]]*\]\s*=)", path.read_text())
    }
    assert changed == SYS_PATH
