"""`RemoteProxy`'s other call forms, across the socket: `stream` (chunks as the host's
proxy makes them, its errors, an early close or a cancel withdrawing the call in the
host, a deadline over the whole stream), and `submit` and `inference_sync` from plain
threads (results, errors, deadlines, a lost host, the event loop's thread refused)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import pytest
from _host_models import Counting, Tagged, Units
from _support import batchproxy_cycles, fails_with, in_a_task_of_its_own, wait_until

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy

T = TypeVar("T")

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets"),
    pytest.mark.usefixtures("no_leftovers"),
]


@pytest.fixture
async def streaming(socket_path: str) -> AsyncIterator[tuple[Counting, ModelHost, RemoteProxy]]:
    proxy = Counting()
    async with ModelHost(proxy, socket_path) as host, RemoteProxy(socket_path) as remote:
        try:
            yield proxy, host, remote
        finally:
            proxy.gate.set()  # a test that failed holding it must not hang the drain


@pytest.fixture
def background_loop(no_leftovers: None) -> Iterator[None]:
    """The process-wide `BackgroundLoop` that threads call through, closed after (and
    before `no_leftovers` looks for threads)."""
    yield
    batchproxy.BackgroundLoop.default().close()


async def in_a_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a plain thread of its own (joined before returning)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        return await asyncio.wrap_future(future)
    finally:
        thread.join()


async def _chunks(remote: RemoteProxy, item: object, **call: object) -> list[object]:
    async with contextlib.aclosing(remote.stream(item, **call)) as stream:  # type: ignore[arg-type]
        return [chunk async for chunk in stream]


async def _hold_the_model(proxy: Counting, remote: RemoteProxy) -> asyncio.Future[list[object]]:
    """A one-step stream, held in the model at its gate."""
    proxy.gate.clear()
    blocker = asyncio.ensure_future(_chunks(remote, 1))
    await wait_until(lambda: proxy.seen == [[1]])
    return blocker


# -- stream -------------------------------------------------------------------------------


async def test_each_stream_gets_its_own_chunks_in_order_and_they_share_steps(
    streaming: tuple[Counting, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = streaming
    blocker = await _hold_the_model(proxy, remote)  # the calls made now queue
    streams = [asyncio.ensure_future(_chunks(remote, item)) for item in ("a", 2, "b", 4)]
    await wait_until(lambda: proxy.stats.queue_depth == 4)
    proxy.gate.set()
    assert await blocker == [(1, 0)]
    got = await asyncio.gather(*streams)
    assert got == [
        [("a", 0), ("a", 1), ("a", 2)],
        [(2, 0), (2, 1)],
        [("b", 0), ("b", 1), ("b", 2)],
        [(4, 0), (4, 1), (4, 2), (4, 3)],
    ]
    assert proxy.seen == [[1], ["a", 2, "b", 4]]  # one batch: each step shared
    assert proxy.steps_run == 1 + 4


async def test_an_error_in_its_slot_ends_that_stream_alone(
    streaming: tuple[Counting, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = streaming
    blocker = await _hold_the_model(proxy, remote)  # the calls made now queue
    boom = asyncio.ensure_future(_chunks(remote, "boom"))
    fine = asyncio.ensure_future(_chunks(remote, "a"))
    await wait_until(lambda: proxy.stats.queue_depth == 2)
    proxy.gate.set()
    await blocker
    with pytest.raises(ValueError, match="refused 'boom' at step 1"):
        await boom
    assert await fine == [("a", 0), ("a", 1), ("a", 2)]
    assert proxy.seen[1] == ["boom", "a"]


async def test_a_stream_closed_early_is_withdrawn_in_the_host(
    streaming: tuple[Counting, ModelHost, RemoteProxy],
) -> None:
    proxy, host, remote = streaming
    async with contextlib.aclosing(remote.stream(1000)) as stream:
        assert await anext(stream) == (1000, 0)
    await wait_until(lambda: not any(c.calls for c in host._connections))
    steps = proxy.steps_run
    await asyncio.sleep(0.05)
    assert proxy.steps_run <= steps + 1  # it stopped, not 1,000 steps
    assert proxy.stats.cancelled == 1
    assert await _chunks(remote, 2) == [(2, 0), (2, 1)]  # the connection still serves


async def test_a_cancelled_stream_reader_is_withdrawn_in_the_host(
    streaming: tuple[Counting, ModelHost, RemoteProxy],
) -> None:
    proxy, host, remote = streaming
    blocker = await _hold_the_model(proxy, remote)  # the calls made now queue
    reader = asyncio.ensure_future(_chunks(remote, 1000))
    await wait_until(lambda: proxy.stats.queue_depth == 1)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    await wait_until(lambda: proxy.stats.cancelled == 1)
    proxy.gate.set()
    await blocker
    assert proxy.seen == [[1]]  # withdrawn while queued: never reached the model
    await wait_until(lambda: not any(c.calls for c in host._connections))


async def test_a_streams_timeout_bounds_the_whole_stream(
    streaming: tuple[Counting, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = streaming
    chunks: list[object] = []

    async def read() -> None:
        async for chunk in remote.stream(10**9, timeout=0.05):
            chunks.append(chunk)

    with pytest.raises(batchproxy.DeadlineExceeded):
        await read()
    assert chunks[:2] == [(10**9, 0), (10**9, 1)]  # chunks came, then the deadline
    await wait_until(lambda: proxy.stats.timed_out == 1)


async def test_a_unary_proxy_streams_its_one_result(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    _, _, remote = served
    [only] = await _chunks(remote, "x")
    assert only[0] == "x"  # type: ignore[index]


async def test_a_stream_whose_host_closes_ends_with_its_drain_deadline(
    socket_path: str,
) -> None:
    proxy = Counting()
    host = ModelHost(proxy, socket_path, drain_timeout=0.0)
    await host.start()
    async with RemoteProxy(socket_path) as remote:
        proxy.gate.clear()
        reader = asyncio.ensure_future(_chunks(remote, 3))
        await wait_until(lambda: proxy.seen == [[3]])  # in the model, held at step 0
        await host.aclose()
        with pytest.raises(batchproxy.DrainDeadline):
            await reader
    proxy.gate.set()  # the abandoned step ends; nothing of it is left running
    await wait_until(lambda: proxy.stats.in_flight == 0)


# -- threads --------------------------------------------------------------------------------


@pytest.mark.usefixtures("background_loop")
async def test_threads_call_with_submit_and_inference_sync(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = served
    proxy.gate.clear()  # the model held until the 8 submitted calls reached the host

    def from_a_thread() -> list[object]:
        futures = [remote.submit(("s", i), priority=1) for i in range(8)]
        answers = [remote.inference_sync(("i", i), timeout=60) for i in range(3)]
        return [future.result(60) for future in futures] + answers

    thread = asyncio.ensure_future(in_a_thread(from_a_thread))
    await wait_until(lambda: sum(map(len, proxy.seen)) + proxy.stats.queue_depth >= 8, seconds=30)
    proxy.gate.set()
    answers = await thread
    assert [tuple(answer[0]) for answer in answers] == [  # type: ignore[index]
        *[("s", i) for i in range(8)],
        *[("i", i) for i in range(3)],
    ]
    assert max(answer[2] for answer in answers[:8]) > 1  # type: ignore[index]  # batched


@pytest.mark.usefixtures("background_loop")
async def test_a_threads_errors_are_the_hosts(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = served
    with pytest.raises(batchproxy.InvalidItem):
        await in_a_thread(remote.inference_sync, "bad")
    with pytest.raises(ValueError, match="refused 'boom'"):
        await asyncio.wrap_future(await in_a_thread(remote.submit, "boom"))
    proxy.gate.clear()
    try:
        with pytest.raises(batchproxy.DeadlineExceeded):
            await in_a_thread(remote.inference_sync, "late", timeout=0.05)
    finally:
        proxy.gate.set()


async def test_inference_sync_is_refused_in_a_thread_running_a_loop(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    _, _, remote = served
    with pytest.raises(RuntimeError, match="would block"):
        remote.inference_sync("x")


@pytest.mark.usefixtures("background_loop")
async def test_a_thread_waiting_on_a_closing_host_gets_its_answer(socket_path: str) -> None:
    proxy = Tagged()
    proxy.gate.clear()
    host = ModelHost(proxy, socket_path, drain_timeout=0.0)
    await host.start()
    remote = RemoteProxy(socket_path)
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            remote.inference_sync("x")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    await wait_until(lambda: proxy.seen == [["x"]])
    await host.aclose()
    await in_a_thread(thread.join, 5)
    assert not thread.is_alive()
    assert [type(exc) for exc in outcome] == [batchproxy.DrainDeadline]  # (drain_timeout=0)
    with pytest.raises(batchproxy.HostUnavailable):  # and no host now: at once
        await in_a_thread(remote.inference_sync, "x")


async def test_calls_through_a_host_leave_no_reference_cycle(
    served: tuple[Tagged, ModelHost, RemoteProxy], socket_path: str
) -> None:
    """Both ends of a host connection free each call by reference counting, whatever its
    outcome (see `tests/calls/test_hot_path.py`: what a cycle costs under load)."""
    _, _, remote = served
    path = socket_path + ".streams"
    async with ModelHost(Counting(), path), RemoteProxy(path) as streams:
        await remote.inference("warm")
        assert [chunk async for chunk in streams.stream(2)] == [(2, 0), (2, 1)]

        async def calls() -> None:
            tagged = await asyncio.gather(*(remote.inference(i) for i in range(8)))
            assert [answer[0] for answer in tagged] == list(range(8))
            assert [answer[0] for answer in await remote.inference_many(["a", "b"])] == ["a", "b"]
            await fails_with(remote.inference("bad"), batchproxy.InvalidItem)
            await fails_with(remote.inference("boom"), ValueError)
            await fails_with(remote.inference_many(["a", "bad"]), batchproxy.InvalidItem)
            mixed = ["a", "bad", "boom", "unsendable", lambda: None]
            answers = await remote.inference_many(mixed, return_exceptions=True)
            assert [type(answer) for answer in answers[1:]] == [
                batchproxy.InvalidItem,
                ValueError,
                TypeError,
                TypeError,
            ]
            del answers  # (a list of errors: freed here, not by the collector)
            await fails_with(remote.inference_many(["a", "unsendable"]), TypeError)
            await fails_with(remote.inference_many(["a", lambda: None]), TypeError)
            late = await remote.inference_many(["x"], timeout=1e-6, return_exceptions=True)
            assert [type(answer) for answer in late] == [batchproxy.DeadlineExceeded]
            del late
            await fails_with(remote.inference("late", timeout=1e-6), batchproxy.DeadlineExceeded)
            assert [chunk async for chunk in streams.stream(2)] == [(2, 0), (2, 1)]
            async with contextlib.aclosing(streams.stream(3)) as chunks:
                async for _ in chunks:
                    break  # (withdrawn in the host)

        with batchproxy_cycles() as cycles:
            await in_a_task_of_its_own(calls())
            for _ in range(5):
                await asyncio.sleep(0.01)  # (the host's side ends each call)
        assert cycles == []


# -- per-batch arguments --------------------------------------------------------------------


@pytest.mark.usefixtures("background_loop")
async def test_with_args_reach_the_host_proxys_with_args(socket_path: str) -> None:
    """`remote.with_args(...)` is the proxy's `with_args`: the arguments travel with
    each call, the host's proxy batches the call with calls of equal arguments only,
    and its `_inference` gets them; every call method takes them."""
    proxy = Units()
    async with ModelHost(proxy, socket_path), RemoteProxy(socket_path) as remote:
        cm = remote.with_args(unit="cm")
        assert repr(cm) == f"<{remote!r} with_args(unit='cm')>"
        answers = await asyncio.gather(
            cm.inference(1),
            cm.inference(2),
            remote.inference(3),
            remote.with_args(unit="m").inference(4),
        )
        assert answers == ["1cm", "2cm", "3x", "4m"]
        assert sorted(proxy.batches) == [([1, 2], "cm"), ([3], "x"), ([4], "m")]
        assert await cm.inference_many([5, 6], priority=1) == ["5cm", "6cm"]

        def from_a_thread() -> list[Any]:
            return [cm.submit(7).result(10), cm.inference_sync(8, timeout=10)]

        assert await in_a_thread(from_a_thread) == ["7cm", "8cm"]
        with pytest.raises(TypeError, match="nope"):  # checked by the host's proxy
            await remote.with_args(nope=1).inference(1)
        with pytest.raises(TypeError, match="'unit' must be hashable"):
            remote.with_args(unit=["c", "m"])
        with pytest.raises(TypeError, match="takes no key="):
            await cm.inference(1, key="k")  # type: ignore[call-arg]
        assert await cm.inference("still") == "stillcm"


async def test_with_args_to_a_proxy_that_takes_none_is_a_type_error(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    _, _, remote = served
    with pytest.raises(TypeError, match="takes no per-batch arguments"):
        await remote.with_args(unit="cm").inference("x")
    assert (await remote.inference("x"))[0] == "x"
