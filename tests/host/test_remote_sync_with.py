"""`with remote:` from plain code (issue 40, item 1): a `RemoteProxy` started on the
process's `with` loop, where its plain-thread calls go inside (not the default
`BackgroundLoop`), drained and its connections closed on exit, no thread left."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from _host_models import Counting, Tagged, Units
from _support import wait_until

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets"),
    pytest.mark.usefixtures("no_leftovers"),  # (no thread left: not the default loop's either)
]

T = TypeVar("T")


def thread_names() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.is_alive()}


async def in_a_thread(code: Callable[[], T]) -> T:
    """`code()` in a plain thread of its own (joined after), awaited from this loop."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(code())
        except BaseException as exc:
            future.set_exception(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), 60)
    finally:
        thread.join(10)


async def test_calls_from_threads_inside_go_through_the_with_loop(socket_path: str) -> None:
    async with ModelHost(Tagged(), socket_path):

        def plain_code() -> dict[str, Any]:
            seen: dict[str, Any] = {}
            with RemoteProxy(socket_path) as remote:
                assert remote.healthy
                seen["threads"] = thread_names()
                seen["sync"] = remote.inference_sync("a")
                seen["submit"] = [remote.submit(n).result(30) for n in range(3)]
                seen["many"] = remote.inference_many_sync(["x", "y"], priority=1)
                parallel: dict[int, Any] = {}
                callers = [
                    threading.Thread(
                        target=lambda n=n: parallel.__setitem__(n, remote.inference_sync(n))
                    )
                    for n in range(4)
                ]
                for thread in callers:
                    thread.start()
                for thread in callers:
                    thread.join(30)
                seen["parallel"] = parallel
            seen["closed"] = remote.closed
            return seen

        seen = await in_a_thread(plain_code)
    assert "batchproxy-with" in seen["threads"]
    assert "batchproxy-loop" not in seen["threads"]  # the default loop is not used
    assert seen["sync"][0] == "a"
    assert [r[0] for r in seen["submit"]] == [0, 1, 2]
    assert [r[0] for r in seen["many"]] == ["x", "y"]
    assert {n: r[0] for n, r in seen["parallel"].items()} == {n: n for n in range(4)}
    assert seen["closed"]
    assert "batchproxy-with" not in thread_names()


async def test_the_exit_lets_a_call_in_flight_finish_and_refuses_later_ones(
    socket_path: str,
) -> None:
    proxy = Tagged()
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path):
        remote = RemoteProxy(socket_path)
        entered = threading.Event()
        outcome: dict[str, Any] = {}

        def plain_code() -> None:
            with remote:
                outcome["future"] = remote.submit("held")
                entered.set()
            # (the exit waited for it)
            outcome["done"] = outcome["future"].done()

        body = asyncio.ensure_future(in_a_thread(plain_code))
        await wait_until(lambda: entered.is_set() and proxy.stats.requests == 1)
        await asyncio.sleep(0.05)
        assert not body.done()  # the exit drains: it waits for the held call
        proxy.gate.set()
        await asyncio.wait_for(body, 30)
        assert outcome["done"]
        assert outcome["future"].result()[0] == "held"
        with pytest.raises(batchproxy.ProxyClosed):
            await in_a_thread(lambda: remote.inference_sync("after"))
        with pytest.raises(batchproxy.ProxyClosed):
            await asyncio.wrap_future(remote.submit("after"))
    assert "batchproxy-loop" not in thread_names()  # refused without starting a loop


async def test_an_exception_in_the_body_closes_it_and_propagates(socket_path: str) -> None:
    async with ModelHost(Tagged(), socket_path):
        remote = RemoteProxy(socket_path)

        def plain_code() -> Any:
            with remote:
                future = remote.submit("mine")
                raise LookupError(future)

        with pytest.raises(LookupError) as raised:
            await in_a_thread(plain_code)
        assert remote.closed
        assert raised.value.args[0].result(0)[0] == "mine"


async def test_with_remote_is_refused_in_a_running_loop(socket_path: str) -> None:
    before = thread_names()
    remote = RemoteProxy(socket_path)
    with pytest.raises(RuntimeError, match="use `async with"), remote:
        raise AssertionError("entered")
    assert thread_names() == before
    assert not remote.closed


async def test_no_host_fails_the_entry_and_leaves_no_thread(socket_path: str) -> None:
    remote = RemoteProxy(socket_path, connect_timeout=0.1, start_timeout=0.2)

    def plain_code() -> None:
        with remote:
            raise AssertionError("entered")

    with pytest.raises(batchproxy.HostUnavailable):
        await in_a_thread(plain_code)
    assert "batchproxy-with" not in thread_names()


async def test_with_args_inference_many_sync_inside(socket_path: str) -> None:
    async with ModelHost(Units(), socket_path):

        def plain_code() -> list[Any]:
            with RemoteProxy(socket_path) as remote:
                results: list[Any] = remote.with_args(unit="kg").inference_many_sync(["1", "2"])
                return results

        assert await in_a_thread(plain_code) == ["1kg", "2kg"]


async def test_stream_sync_reads_a_hosts_stream_from_a_plain_thread(socket_path: str) -> None:
    proxy = Counting()
    async with ModelHost(proxy, socket_path):

        def plain_code() -> dict[str, Any]:
            seen: dict[str, Any] = {}
            with RemoteProxy(socket_path) as remote:
                seen["whole"] = list(remote.stream_sync(3))
                with contextlib.closing(remote.stream_sync(10**6)) as chunks:
                    seen["first"] = next(chunks)
                try:
                    remote.stream_sync(1, timeuot=1)  # type: ignore[call-arg]
                except TypeError as exc:
                    seen["checked"] = str(exc)
            return seen

        seen = await in_a_thread(plain_code)
        await wait_until(lambda: proxy.stats.cancelled == 1)  # closed early: withdrawn
    assert seen["whole"] == [(3, 0), (3, 1), (3, 2)]
    assert seen["first"] == (10**6, 0)
    assert "timeuot" in seen["checked"]
    remote = RemoteProxy(socket_path)
    with pytest.raises(RuntimeError, match=r"remote.stream\(...\) there"):  # runs a loop
        remote.stream_sync(1)
