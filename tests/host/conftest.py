"""The model-host tests' fixture: a socket path."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def socket_path() -> Iterator[str]:
    """A short path (a Unix socket's path has ~100 bytes at most), removed after."""
    folder = tempfile.mkdtemp(prefix="bp-host-", dir="/tmp")
    try:
        yield os.path.join(folder, "model.sock")
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
