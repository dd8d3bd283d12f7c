"""The public surface, pinned (as httpx's `test_exported_members.py` does): a name
added to or dropped from `batchproxy` is a decision, made here too."""

from __future__ import annotations

import re
import types
from pathlib import Path

from _imports import PACKAGE, find_cycle, relative_imports
from _support import modules_after

import batchproxy

PUBLIC = [
    "END",
    "Autoscaling",
    "BackgroundLoop",
    "BatchProxyError",
    "BatchSizeMismatch",
    "BatchSizeUnreachable",
    "BatchSizes",
    "BatchTimeout",
    "Batched",
    "BatchedArgs",
    "CallOptions",
    "CostEstimate",
    "DeadlineExceeded",
    "Dedup",
    "DrainDeadline",
    "Executor",
    "GenerationProxy",
    "Health",
    "HostUnavailable",
    "InferenceError",
    "InvalidItem",
    "Last",
    "Listener",
    "ModelFactory",
    "Options",
    "Percentiles",
    "PoolUnavailable",
    "ProcessWorkers",
    "Proxy",
    "ProxyClosed",
    "ProxyStats",
    "QueueFull",
    "Slot",
    "StagedModel",
    "Step",
    "StreamBufferFull",
    "StreamEnd",
    "TensorProxy",
    "Watchdog",
    "WorkerDied",
    "WorkerThread",
    "WorkersStats",
    "__version__",
    "batch",
    "batch_args",
    "batch_key",
    "caller_contexts",
]
"""Everything `from batchproxy import ...` offers; the modules `tensors`, `simulation`, `tune`
and `integrations.*` are public too, imported by name."""


def test_the_public_names_are_exactly_these() -> None:
    assert batchproxy.__all__ == PUBLIC


def test_every_public_name_is_exported_and_nothing_else_is_public() -> None:
    for name in PUBLIC:
        assert getattr(batchproxy, name) is not None
    public_modules = {"tensors", "simulation", "integrations", "host", "tune"}
    exposed = {
        name
        for name, value in vars(batchproxy).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exposed <= set(PUBLIC), exposed - set(PUBLIC)
    modules = {
        name
        for name, value in vars(batchproxy).items()
        if not name.startswith("_") and isinstance(value, types.ModuleType)
    }
    assert modules <= public_modules, modules - public_modules


def test_importing_batchproxy_loads_no_numpy() -> None:
    """NumPy (about half of the import time, and its BLAS threads) loads with the
    tensor features only."""
    assert "numpy" not in modules_after("import batchproxy")
    assert "numpy" in modules_after("import batchproxy; batchproxy.TensorProxy")


def modules() -> dict[str, Path]:
    """Every module of the library, by dotted name (without `batchproxy.`)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(p for p in parts if p != "__init__") or "__init__"] = path
    return found


def test_no_module_is_over_500_lines() -> None:
    """One concept a module: a module that grows past this has taken on a second one."""
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}


def test_the_modules_import_each_other_without_a_cycle() -> None:
    """Not even a type-only one, nor one through an import inside a function: a module's
    dependencies come before it."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target in relative_imports(path):
            candidate = ".".join(target)
            if candidate in known and name not in (candidate, "__init__"):
                graph[name].add(candidate)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_version_is_written_in_one_place() -> None:
    """`batchproxy.__version__`; pyproject.toml reads it from there (hatchling's dynamic
    version), and the wheel's metadata carries it (`.ci/smoke.py` compares the two)."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", batchproxy.__version__)
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r"^version\s*=", pyproject, re.MULTILINE) is None
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.MULTILINE)
    assert '[tool.hatch.version]\npath = "batchproxy/__init__.py"' in pyproject
    written = [
        path.name for path in PACKAGE.rglob("*.py") if batchproxy.__version__ in path.read_text()
    ]
    assert written == ["__init__.py"]
