"""`RemoteProxy`'s own life: `aclose()` lets the calls in flight on every loop finish
(a plain thread's, through the `BackgroundLoop`, as well as this loop's), and
`health` follows the host across a reconnection even without `start()`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from _host_models import Tagged
from _support import wait_until

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets"),
    pytest.mark.usefixtures("no_leftovers"),
]


@pytest.fixture
def background_loop(no_leftovers: None) -> Iterator[None]:
    """The process-wide `BackgroundLoop` that threads call through, closed after (and
    before `no_leftovers` looks for threads)."""
    yield
    batchproxy.BackgroundLoop.default().close()


class Caller:
    """`remote.inference_sync(item)` in a plain thread of its own; `outcome()` is its
    result or error, once the thread ended (joined)."""

    def __init__(self, remote: RemoteProxy, item: Any, **call: Any) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(remote, item, call))
        self.thread.start()

    def _run(self, remote: RemoteProxy, item: Any, call: dict[str, Any]) -> None:
        try:
            self.future.set_result(remote.inference_sync(item, **call))
        except BaseException as exc:
            self.future.set_exception(exc)

    async def outcome(self) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.future), 30)
        finally:
            self.thread.join()


@pytest.mark.usefixtures("background_loop")
async def test_aclose_lets_a_threads_call_in_flight_finish(socket_path: str) -> None:
    proxy = Tagged()
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path):
        remote = RemoteProxy(socket_path)
        caller = Caller(remote, "from a thread")
        submitted = remote.submit("submitted")
        await wait_until(lambda: proxy.stats.requests == 2)
        closing = asyncio.ensure_future(remote.aclose(timeout=30))
        await asyncio.sleep(0.1)
        assert not closing.done()  # it waits for them
        assert not caller.future.done()
        proxy.gate.set()
        assert (await caller.outcome())[0] == "from a thread"
        assert (await asyncio.wrap_future(submitted))[0] == "submitted"
        await asyncio.wait_for(closing, 30)
        with pytest.raises(batchproxy.ProxyClosed):
            await Caller(remote, "after").outcome()


@pytest.mark.usefixtures("background_loop")
async def test_aclose_timeout_fails_a_threads_call_still_in_flight(socket_path: str) -> None:
    proxy = Tagged()
    proxy.gate.clear()
    try:
        async with ModelHost(proxy, socket_path, drain_timeout=0):
            remote = RemoteProxy(socket_path)
            caller = Caller(remote, "held")
            await wait_until(lambda: proxy.stats.requests == 1)
            await asyncio.wait_for(remote.aclose(timeout=0.1), 30)
            with pytest.raises(batchproxy.DrainDeadline, match="drain deadline"):
                await caller.outcome()
    finally:
        proxy.gate.set()
        await wait_until(lambda: proxy.stats.in_flight == 0)


async def test_health_follows_a_reconnection_without_start(socket_path: str) -> None:
    remote = RemoteProxy(socket_path)
    assert not remote.health.healthy  # no word from a host yet
    async with ModelHost(Tagged(), socket_path):
        assert (await remote.inference("x"))[0] == "x"
        await wait_until(lambda: remote.health.healthy)  # the new connection asked
    with pytest.raises(batchproxy.HostUnavailable):
        await remote.inference("y")
    assert not remote.health.healthy
    assert "model host" in (remote.health.reason or "")
    async with ModelHost(Tagged(), socket_path):
        assert (await remote.inference("z"))[0] == "z"  # connects again
        await wait_until(lambda: remote.health.healthy)
    await remote.aclose()
    assert not remote.health.healthy
