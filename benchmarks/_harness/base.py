"""The package as it was at a git ref, for a benchmark that measures it beside this
checkout's (`--base REF`): `git archive` of `batchproxy/` into a folder of its own."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

from benchmarks import ROOT


@contextlib.contextmanager
def archived_package(ref: str) -> Iterator[str]:
    """A new folder holding the `batchproxy` package as it was at git `ref` (first on a
    child's path, it is the one imported), removed afterwards."""
    folder = tempfile.mkdtemp(prefix="bp-base-", dir="/tmp")
    try:
        archive = subprocess.run(
            ["git", "archive", ref, "batchproxy"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
