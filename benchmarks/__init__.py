"""The benchmarks, run as modules from the repository's root: `python -m
benchmarks.overhead.overhead` (see benchmarks/README.md for the map).

The one bootstrap every benchmark shares: importing this package puts `examples/` on
`sys.path`, so a benchmark imports the examples' models and helpers (`minilm`,
`sample_text`, `demo`, ...) by name, as the examples import each other. The repository's
root is on the path already (`python -m` from it, or `PYTHONPATH`), so this checkout's
`batchproxy` is the one imported, and every child process a benchmark starts with
`python -m` (same directory, same environment) finds the same. Light on purpose: a
peer's virtual environment (benchmarks/servers) imports it without batchproxy's extras.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RESULTS = Path(__file__).resolve().parent / "results"

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


def pythonpath() -> str:
    """`$PYTHONPATH` with the repository's root first: the environment variable for a
    child that runs `python -m benchmarks...` (or imports a benchmark's module by name)
    whatever its working directory."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
