"""The documentation, as printed: every ```python block of docs/*.md compiles, the
blocks marked `<!-- run -->` run in a subprocess, the README's service is the site's,
and every public name has an entry in the API reference (docs/reference/)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import batchproxy

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUN_MARK = "<!-- run -->"
FENCE = re.compile(
    r"^(?P<mark>[ ]*<!-- run -->\n)?(?P<indent>[ ]*)```python\n(?P<code>.*?)^(?P=indent)```$",
    re.DOTALL | re.MULTILINE,
)
RUN_SECONDS = 60
# Runs one block as `python block.py` would, top-level `await` allowed (a coroutine
# that the compiled block returns is run with asyncio.run).
RUNNER = """
import ast, asyncio, inspect, sys, types
path = sys.argv[1]
code = compile(open(path).read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
main = types.ModuleType("__main__")
main.__file__ = path
sys.modules["__main__"] = main
result = eval(code, main.__dict__)
if inspect.iscoroutine(result):
    asyncio.run(result)
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    run: bool

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    """Every ```python block of the guides and the reference pages."""
    found = []
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start("indent")) + 1
            code = textwrap.dedent(match.group("code"))
            page = path.relative_to(DOCS).as_posix()
            found.append(Block(page, line, code, run=match.group("mark") is not None))
    return found


BLOCKS = blocks()


def test_the_guides_have_code_and_some_of_it_runs() -> None:
    assert len(BLOCKS) >= 20
    assert sum(block.run for block in BLOCKS) >= 6
    # a mark that is not right before a python fence would silently test nothing
    marks = sum(
        line.strip() == RUN_MARK
        for path in DOCS.rglob("*.md")
        for line in path.read_text(encoding="utf-8").splitlines()
    )
    assert marks == sum(block.run for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_block_compiles(block: Block) -> None:
    compile(block.code, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("block", [block for block in BLOCKS if block.run], ids=str)
def test_the_self_contained_blocks_run(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
        check=False,
    )
    assert done.returncode == 0, f"{block} failed:\n{done.stdout}\n{done.stderr}"


def service_block(text: str, mark: str) -> str:
    match = re.search(re.escape(mark) + r"\n```python\n(.*?)\n```\n", text, re.DOTALL)
    assert match is not None, mark
    return match.group(1)


def test_the_readme_service_is_the_front_pages() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    front = (DOCS / "index.md").read_text(encoding="utf-8")
    assert service_block(readme, "<!-- service: app.py -->") == service_block(front, RUN_MARK)


def reference_entries() -> set[str]:
    """The objects the reference renders: the `::: identifier` lines of its pages."""
    entries: set[str] = set()
    for path in (DOCS / "reference").rglob("*.md"):
        text = path.read_text(encoding="utf-8")
        entries.update(re.findall(r"^::: ([\w.]+)$", text, re.MULTILINE))
    return entries


def test_every_public_name_is_in_the_api_reference() -> None:
    entries = reference_entries()
    missing = [name for name in batchproxy.__all__ if f"batchproxy.{name}" not in entries]
    assert not missing, f"no `::: batchproxy.<name>` entry in docs/reference/ for {missing}"
    modules = ["tensors", "simulation", "host"] + [
        f"integrations.{name}" for name in ("fastapi", "aiohttp", "prometheus", "otel", "ray")
    ]
    missing = [name for name in modules if f"batchproxy.{name}" not in entries]
    assert not missing, f"no reference page renders the modules {missing}"


def test_the_readmes_links_into_the_docs_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(((?:docs|benchmarks)/[^)#\s]+)", readme)
    assert any(target.startswith("docs/reference/") for target in targets)
    missing = [target for target in targets if not (ROOT / target).is_file()]
    assert not missing, missing
