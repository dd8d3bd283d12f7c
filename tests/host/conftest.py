"""The model-host tests' fixtures: a short socket path, and a host serving a `Tagged`
proxy with a `RemoteProxy` in front of it, in this process."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest
from _host_models import Tagged

from batchproxy.host import ModelHost, RemoteProxy


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


@pytest.fixture
async def served(socket_path: str) -> AsyncIterator[tuple[Tagged, ModelHost, RemoteProxy]]:
    proxy = Tagged()
    async with ModelHost(proxy, socket_path) as host, RemoteProxy(socket_path) as remote:
        yield proxy, host, remote
    assert not exists(socket_path)  # removed when the host closed


def exists(path: str) -> bool:
    return os.path.exists(path)
