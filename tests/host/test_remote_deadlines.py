"""A `RemoteProxy` call's deadline holds in the caller's process, whatever the host does.

A host that does not run (a process stopped with SIGSTOP: the kernel still accepts
its connections and takes writes until the socket's buffer is full; or a host whose
loop is blocked, as by a factory's blocking code) leaves each caller at its deadline
plus `_deadline.MARGIN` (`inference`, `inference_many`, `stream`, `inference_sync`),
and the call is withdrawn in the host when it reads it, counted once (as expired
on its way, or timed out by the proxy). The client's other waits are bounded too: a
health question (`start()`, the watcher), `aclose()` with a call stuck writing to a
stopped host. The bounds below are checked with `SLACK` for a loaded machine: what
they catch is a wait with no end at all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _host_models import Tagged
from _host_process import HostProcess
from _support import (
    LoopThread,
    batchproxy_cycles,
    fails_with,
    in_a_task_of_its_own,
    wait_for,
    wait_until,
)

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy
from batchproxy.host._deadline import MARGIN

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="Unix sockets and signals"),
    pytest.mark.usefixtures("no_leftovers"),
]

SLACK = 3.0
"""Seconds a loaded machine may add to a bound."""

TIMEOUT = 0.3


@contextlib.contextmanager
def stopped(host: HostProcess) -> Iterator[None]:
    """The host process stopped (SIGSTOP) for the block, continued after, whatever
    happens."""
    os.kill(host.process.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _state(host.process.pid) == "T")  # (stopped, before the block)
        yield
    finally:
        os.kill(host.process.pid, signal.SIGCONT)


def _state(pid: int) -> str:
    """Process `pid`'s state letter (Linux's /proc)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1][0]


@pytest.fixture
def host_process(socket_path: str) -> Iterator[HostProcess]:
    host = HostProcess(socket_path)
    try:
        yield host
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(host.process.pid, signal.SIGCONT)
        host.stop()


@pytest.fixture
def background_loop(no_leftovers: None) -> Iterator[None]:
    """The process-wide `BackgroundLoop` that threads call through, closed after (and
    before `no_leftovers` looks for threads)."""
    yield
    batchproxy.BackgroundLoop.default().close()


async def _ends_by_its_deadline(call: Callable[[], Awaitable[Any]]) -> Any:
    """What `call()` (with `timeout=TIMEOUT`) ends with, checked to come between its
    deadline and its deadline plus the margin (plus `SLACK`)."""
    started = time.monotonic()
    try:
        return await asyncio.wait_for(call(), TIMEOUT + MARGIN + SLACK)
    finally:
        elapsed = time.monotonic() - started
        assert TIMEOUT <= elapsed < TIMEOUT + MARGIN + SLACK, elapsed


async def _chunks(remote: RemoteProxy, item: object, **call: Any) -> list[object]:
    async with contextlib.aclosing(remote.stream(item, **call)) as stream:
        return [chunk async for chunk in stream]


async def _in_a_thread(fn: Callable[[], Any]) -> Any:
    """`fn()` in a plain thread of its own, joined before returning."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        await wait_until(lambda: not thread.is_alive(), seconds=TIMEOUT + MARGIN + SLACK)
    finally:
        thread.join()
    [outcome] = box
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


# -- a host process stopped with SIGSTOP ------------------------------------------------


async def test_a_stopped_host_holds_no_caller_past_its_deadline(
    host_process: HostProcess, socket_path: str
) -> None:
    async with RemoteProxy(socket_path) as remote:
        assert (await remote.inference("warm"))[0] == "warm"
        with stopped(host_process):
            with pytest.raises(batchproxy.DeadlineExceeded) as caught:
                await _ends_by_its_deadline(lambda: remote.inference("x", timeout=TIMEOUT))
            assert caught.value.timeout == TIMEOUT
            assert caught.value.proxy == remote.name
            with pytest.raises(batchproxy.DeadlineExceeded):
                await _ends_by_its_deadline(
                    lambda: remote.inference_many(["a", "b"], timeout=TIMEOUT)
                )
            answers = await _ends_by_its_deadline(
                lambda: remote.inference_many(["a", "b"], timeout=TIMEOUT, return_exceptions=True)
            )
            assert [type(answer) for answer in answers] == [batchproxy.DeadlineExceeded] * 2
            with pytest.raises(batchproxy.DeadlineExceeded):
                await _ends_by_its_deadline(lambda: _chunks(remote, "x", timeout=TIMEOUT))
        # continued: it reads the calls (each withdrawn, past its deadline) and serves on
        assert (await remote.inference("after", timeout=30))[0] == "after"


@pytest.mark.usefixtures("background_loop")
async def test_a_stopped_host_holds_no_thread_past_its_deadline(
    host_process: HostProcess, socket_path: str
) -> None:
    remote = RemoteProxy(socket_path)
    try:
        assert (await _in_a_thread(lambda: remote.inference_sync("warm")))[0] == "warm"
        with stopped(host_process):
            with pytest.raises(batchproxy.DeadlineExceeded):
                await _ends_by_its_deadline(
                    lambda: _in_a_thread(lambda: remote.inference_sync("x", timeout=TIMEOUT))
                )
            future = remote.submit("y", timeout=TIMEOUT)
            with pytest.raises(batchproxy.DeadlineExceeded):
                await _ends_by_its_deadline(lambda: asyncio.wrap_future(future))
    finally:
        await remote.aclose()


async def test_a_stream_whose_host_stops_sending_ends_by_its_deadline(socket_path: str) -> None:
    host = HostProcess(socket_path, factory="counting")
    try:
        async with RemoteProxy(socket_path) as remote:
            started = time.monotonic()
            chunks = 0

            async def read() -> None:
                nonlocal chunks
                async with contextlib.aclosing(remote.stream(10**9, timeout=2.0)) as stream:
                    async for _ in stream:
                        chunks += 1
                        if chunks == 1:
                            os.kill(host.process.pid, signal.SIGSTOP)  # mid-stream
                            wait_for(lambda: _state(host.process.pid) == "T")

            with pytest.raises(batchproxy.DeadlineExceeded):
                await asyncio.wait_for(read(), 2.0 + MARGIN + SLACK)
            elapsed = time.monotonic() - started
            assert 2.0 <= elapsed < 2.0 + MARGIN + SLACK, elapsed
            assert chunks >= 1
    finally:
        os.kill(host.process.pid, signal.SIGCONT)
        host.stop()


async def test_a_stopped_host_holds_no_health_question(
    host_process: HostProcess, socket_path: str
) -> None:
    """`start()` gives up by its `start_timeout` (each question waits `connect_timeout`
    at most: the connection is accepted, the question never answered); a watching
    proxy finds the host unhealthy, and healthy again once it runs."""
    watching = RemoteProxy(socket_path, health_every=0.05, connect_timeout=0.2)
    await watching.start()
    try:
        assert watching.health.healthy
        with stopped(host_process):
            starting = RemoteProxy(socket_path, start_timeout=1.0, connect_timeout=0.2)
            started = time.monotonic()
            with pytest.raises(batchproxy.HostUnavailable, match="no model host answered"):
                await asyncio.wait_for(starting.start(), 1.0 + SLACK)
            assert time.monotonic() - started < 1.0 + SLACK
            await starting.aclose()
            await wait_until(lambda: not watching.health.healthy)
            assert "no answer within 0.2 s" in (watching.health.reason or "")
        await wait_until(lambda: watching.health.healthy)
    finally:
        await watching.aclose()


async def test_closing_with_a_call_stuck_writing_to_a_stopped_host_is_bounded(
    host_process: HostProcess, socket_path: str
) -> None:
    """A call with no deadline whose item fills the socket (the host reads nothing)
    holds `aclose(timeout=...)` no longer than its timeout: the call then fails with
    the drain's `DrainDeadline`, and what was not written is dropped."""
    remote = RemoteProxy(socket_path)
    assert (await remote.inference("warm"))[0] == "warm"
    with stopped(host_process):
        stuck = asyncio.ensure_future(remote.inference(b"x" * (8 << 20)))  # (in the pickle)
        await asyncio.sleep(0.1)
        assert not stuck.done()
        started = time.monotonic()
        await asyncio.wait_for(remote.aclose(timeout=TIMEOUT), TIMEOUT + SLACK)
        assert time.monotonic() - started < TIMEOUT + SLACK
        with pytest.raises(batchproxy.DrainDeadline):
            await stuck


# -- a host whose loop is blocked (in this process, to read its counts) ----------------


class BlockedHost:
    """A `ModelHost` serving `proxy` on a loop of its own (a `LoopThread`); `blocked()`
    blocks that loop for the block (as a factory's blocking call would)."""

    def __init__(self, proxy: Tagged, path: str, thread: LoopThread) -> None:
        self.proxy = proxy
        self.host = ModelHost(proxy, path)
        self.thread = thread

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        entered, release = threading.Event(), threading.Event()

        def block() -> None:
            entered.set()
            release.wait()

        self.thread.loop.call_soon_threadsafe(block)
        try:
            assert entered.wait(30)  # (blocked, before the block)
            yield
        finally:
            release.set()

    async def read(self, what: Callable[[], Any]) -> Any:
        """`what()` on the host's loop."""

        async def there() -> Any:
            return what()

        return await self.thread.arun(there())

    async def until(self, condition: Callable[[], bool]) -> None:
        """Once `condition()`, read on the host's loop, holds."""
        deadline = time.monotonic() + 30
        while not await self.read(condition):
            assert time.monotonic() < deadline, "condition never became true"
            await asyncio.sleep(0.005)

    async def idle(self) -> None:
        """Once the host has no call left (each one answered or withdrawn): of those it
        has read (a call answered on the same connection after them says it has)."""

        async def there() -> None:
            await wait_until(lambda: not any(c.calls for c in self.host._connections))

        await self.thread.arun(there(), timeout=30)


@pytest.fixture
async def blocked_host(socket_path: str) -> Any:
    proxy = Tagged()
    with LoopThread("blocked-host") as thread:
        served = BlockedHost(proxy, socket_path, thread)
        await thread.arun(served.host.start())
        try:
            yield served
        finally:
            thread.loop.call_soon_threadsafe(proxy.gate.set)
            await thread.arun(served.host.aclose(), timeout=30)


async def test_a_call_read_after_its_deadline_is_withdrawn_and_counted_expired_once(
    blocked_host: BlockedHost, socket_path: str
) -> None:
    async with RemoteProxy(socket_path) as remote:
        assert (await remote.inference("warm"))[0] == "warm"
        with blocked_host.blocked():
            with pytest.raises(batchproxy.DeadlineExceeded):
                await _ends_by_its_deadline(lambda: remote.inference("late", timeout=TIMEOUT))
            with pytest.raises(batchproxy.DeadlineExceeded):
                await _ends_by_its_deadline(
                    lambda: remote.inference_many(["l1", "l2"], timeout=TIMEOUT)
                )
        assert (await remote.inference("after"))[0] == "after"  # (read after them)
        await blocked_host.idle()  # read, and withdrawn: nothing of them is left
        assert blocked_host.host.expired == 3  # once for each item
        stats = await blocked_host.read(lambda: blocked_host.proxy.stats)
        assert stats.requests == 2  # warm, after: they never reached the proxy


async def test_a_call_queued_when_the_host_blocks_is_counted_timed_out_once(
    blocked_host: BlockedHost, socket_path: str
) -> None:
    proxy = blocked_host.proxy
    async with RemoteProxy(socket_path) as remote:
        await blocked_host.read(proxy.gate.clear)
        running = asyncio.ensure_future(remote.inference("running"))
        await blocked_host.until(lambda: bool(proxy.seen))
        queued = asyncio.ensure_future(remote.inference("queued", timeout=TIMEOUT + 0.5))
        await blocked_host.until(lambda: proxy.stats.queue_depth == 1)
        with blocked_host.blocked(), pytest.raises(batchproxy.DeadlineExceeded):
            await asyncio.wait_for(queued, TIMEOUT + 0.5 + MARGIN + SLACK)
        await blocked_host.until(lambda: proxy.stats.timed_out == 1)
        blocked_host.thread.loop.call_soon_threadsafe(proxy.gate.set)
        assert (await running)[0] == "running"
        assert (await remote.inference("after"))[0] == "after"  # (read after the cancel)
        await blocked_host.idle()
        stats = await blocked_host.read(lambda: proxy.stats)
        assert (stats.timed_out, stats.cancelled, stats.requests) == (1, 0, 3)
        assert all("queued" not in batch for batch in proxy.seen)  # it never ran


async def test_calls_past_their_deadline_in_a_blocked_host_leave_no_reference_cycle(
    blocked_host: BlockedHost, socket_path: str
) -> None:
    """Both ends free a call that its caller left at its deadline by reference counting
    (see `test_remote_calls`'s cycle test)."""
    async with RemoteProxy(socket_path) as remote:
        assert (await remote.inference("warm"))[0] == "warm"

        async def calls() -> None:
            with blocked_host.blocked():
                late = batchproxy.DeadlineExceeded
                await fails_with(remote.inference("a", timeout=0.05), late)
                await fails_with(remote.inference_many(["b", "c"], timeout=0.05), late)
                answers = await remote.inference_many(["d"], timeout=0.05, return_exceptions=True)
                assert [type(answer) for answer in answers] == [late]
                del answers
                await fails_with(_chunks(remote, "e", timeout=0.05), late)
            assert (await remote.inference("after"))[0] == "after"  # (read after them)
            await blocked_host.idle()

        with batchproxy_cycles() as cycles:
            await in_a_task_of_its_own(calls())
            for _ in range(5):
                await asyncio.sleep(0.02)  # (the host's side ends each call)
        assert cycles == []


async def test_a_call_cancelled_before_the_host_read_it_leaves_nothing_there(
    blocked_host: BlockedHost, socket_path: str
) -> None:
    """The call and its cancel are read back to back: the call's task is cancelled
    before it starts (so it never runs its own cleanup), and nothing of it is left."""
    async with RemoteProxy(socket_path) as remote:
        assert (await remote.inference("warm"))[0] == "warm"
        with blocked_host.blocked():
            call = asyncio.ensure_future(remote.inference("withdrawn"))
            await asyncio.sleep(0.05)  # written, not read
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        assert (await remote.inference("after"))[0] == "after"  # (read after them)
        await blocked_host.idle()
        stats = await blocked_host.read(lambda: blocked_host.proxy.stats)
        assert stats.requests == 2  # warm, after: it never reached the proxy
