"""Faults through a model host (issue 38, item 3): the host killed or stalled mid-call,
the connection dropped between a call and its answer (a client killed mid-call:
tests/host/test_host.py and the soak, tests/host/test_host_soak.py).

The walk draws a program of calls (`inference`, `inference_many`, `stream`; items that
succeed or fail; deadlines; cancellations) and a fault at a drawn time, and checks
that every call ends once, as its story allows, and that nothing is left
(tests/_host_faults.py). Each example starts a host process (and a second one after
a kill): 6 examples in CI, 10 to 40 s on two cores (idle to loaded); `BATCHPROXY_COMBINATIONS=N`
runs N / 250 times as many.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _host_faults
import pytest
from _combinations import EXAMPLES
from _host_faults import Call, Fault, HostProcess, Program, drop, problems, programs, run
from _host_models import Tagged
from _support import wait_until
from hypothesis import HealthCheck, Phase, given, settings

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy
from batchproxy.host._wire import (
    WIRE,
    message_bytes,
    open_sealed,
    read_message,
    sealed_message,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets")

WALK = 6
"""The walk's examples in CI."""


@pytest.mark.timeout(300)
@settings(
    max_examples=max(1, EXAMPLES // 250) if EXAMPLES else WALK,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # (no shrinking: a second an
    # example; a failure shows its program, a dozen calls at most, as drawn)
)
@given(program=programs())
def test_every_call_ends_once_whatever_the_host_does(program: Program) -> None:
    found = problems(run(program))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("kind", ["kill", "stall", "drop"])
def test_each_fault_mid_call(kind: str) -> None:
    """Each fault once, with calls surely in flight (the model takes 0.2 s a batch)."""
    calls = [Call(i, 0.0, "inference", (i,), None, None) for i in range(4)]
    calls.append(Call(4, 0.0, "many", (1, "bad", 2), 5.0, None))
    calls.append(Call(5, 0.0, "stream", (3,), None, None))
    found = problems(run(Program(calls, Fault(kind, 0.1, 0.3), delay=0.2)))
    assert not found, "\n".join(found)


def test_a_socket_another_thread_holds_is_not_counted_as_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in CI: after the Ray tests, Ray's GCS client (C++ threads that
    `ray.shutdown()` leaves, invisible to `threading`) opens a TCP socket every 20-40 s
    for a few seconds, trying to reach its stopped cluster. One open across a run was
    counted as this run's socket left open. What a run can leave is a Unix socket
    (its connections to the host, its loop's own pair); a TCP socket is not its."""
    inventory, opened, done = threading.Event(), threading.Event(), threading.Event()
    taking = _host_faults.open_sockets

    def taken() -> set[str]:
        found = taking()
        inventory.set()
        return found

    def foreign() -> None:
        inventory.wait(60)  # (after the run took its inventory)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM):
            opened.set()
            done.wait(60)

    monkeypatch.setattr(_host_faults, "open_sockets", taken)
    thread = threading.Thread(target=foreign)
    thread.start()
    try:
        calls = [Call(0, 0.1, "inference", (1,), None, None)]
        result = run(Program(calls, Fault("stall", 0.1, 0.05), delay=0.0))
        assert opened.is_set()  # (the foreign socket was open across the run's end)
    finally:
        inventory.set()
        done.set()
        thread.join()
    found = problems(result)
    assert not found, "\n".join(found)


async def test_callers_cancelled_as_the_connection_drops_write_nothing_to_it(
    socket_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the soak: the callers cancelled after the connection broke, before its
    reader had seen it, each wrote their cancel to the dead transport, which asyncio
    logs past five ("socket.send() raised exception."). The transport knows first:
    a connection whose transport is closing writes nothing more."""
    proxy = Tagged()
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path), RemoteProxy(socket_path) as remote:
        calls = [asyncio.ensure_future(remote.inference(i)) for i in range(20)]
        await wait_until(lambda: proxy.stats.requests == 20)
        connection = next(iter(remote._connections.values()))
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            connection.writer.transport.abort()  # dropped: the reader has not seen it yet
            for call in calls:
                call.cancel()
            await asyncio.wait(calls)
            later = asyncio.ensure_future(remote.inference(99))  # a new connection
            proxy.gate.set()
            assert (await later)[0] == 99
        assert all(call.cancelled() for call in calls)
        await wait_until(lambda: proxy.stats.queue_depth == proxy.stats.in_flight == 0)
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def test_a_call_cancelled_before_its_task_ran_leaves_nothing_in_the_host(
    socket_path: str,
) -> None:
    """Found by the soak (the host's RSS grew by about 90 bytes a call): a call whose
    cancel the host read with the call itself was cancelled before its task's first
    step, so the coroutine's `finally` that unlisted it never ran, and the host kept
    the task and its item for as long as the connection lived."""
    proxy = Tagged()
    async with ModelHost(proxy, socket_path) as host:
        reader, writer = await asyncio.open_unix_connection(socket_path)
        try:
            call, _ = sealed_message("call", 0, "doomed", {"priority": 0})
            then, _ = sealed_message("call", 1, "served", {"priority": 0})
            writer.write(WIRE + call + message_bytes(("cancel", 0)) + then)  # read in one go
            assert await reader.readexactly(len(WIRE)) == WIRE
            kind, ident, sealed = await asyncio.wait_for(read_message(reader), 30)
            assert (kind, ident, open_sealed(sealed)[0]) == ("result", 1, "served")
            (connection,) = host._connections
            await wait_until(lambda: not connection.calls)
            assert [item for batch in proxy.seen for item in batch] == ["served"]
        finally:
            writer.close()
            await writer.wait_closed()


@pytest.mark.parametrize("form", ["inference", "stream", "health"])
async def test_a_call_made_as_the_connection_drops_is_sent_on_a_new_one(
    served: tuple[Tagged, ModelHost, RemoteProxy], form: str
) -> None:
    """Found by the fault walk: a call made after the connection was lost, before its
    reader task had seen it, was written to the dead socket and failed with
    `HostUnavailable`, though the host was there. Nothing of it was written (the
    socket refused its first byte), so it is sent on a new connection."""
    _, host, remote = served
    assert (await remote.inference(1))[0] == 1  # connected
    connection = next(iter(remote._connections.values()))
    drop(connection.writer)
    if form == "inference":
        assert (await remote.inference(2))[0] == 2
    elif form == "stream":
        chunks = [chunk async for chunk in remote.stream(2)]
        assert [chunk[0] for chunk in chunks] == [2]
    else:  # the question a service's watch asks every second
        assert (await remote._ask()).healthy
    assert remote._connections[asyncio.get_running_loop()] is not connection
    await wait_until(lambda: host.connections == 1)


@pytest.mark.parametrize("form", ["inference", "stream", "health"])
async def test_a_call_queued_as_the_connection_ends_is_sent_on_a_new_one(
    served: tuple[Tagged, ModelHost, RemoteProxy], form: str
) -> None:
    """Found by the fault walk once a connection wrote the messages of one iteration
    of the loop together: a call queued, not written yet, when the reader saw the end
    of the stream failed with `HostUnavailable`, though nothing of it had left. It is
    `NotSent`, and sent on a new connection, as a call that found the socket dead."""
    _, host, remote = served
    assert (await remote.inference(1))[0] == 1  # connected (it carried a call)
    connection = next(iter(remote._connections.values()))

    async def call() -> Any:
        if form == "inference":
            return (await remote.inference(2))[0]
        if form == "stream":
            return [chunk[0] async for chunk in remote.stream(2)]
        return (await remote._ask()).healthy

    made = asyncio.ensure_future(call())
    await asyncio.sleep(0)  # queued, not written: that waits for the loop's next callbacks
    assert connection._pending_calls
    connection._fail_waiting("the host closed the connection")  # (as its reader does)
    assert await asyncio.wait_for(made, 30) == {"inference": 2, "stream": [2]}.get(form, True)
    assert remote._connections[asyncio.get_running_loop()] is not connection
    await wait_until(lambda: host.connections == 1)


async def test_a_failed_connect_whose_callers_all_left_is_not_logged(
    socket_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the fault walk: the task connecting to a host that is down, shared by
    the calls waiting for it, failed after they had all been cancelled; nobody
    retrieved its `HostUnavailable`, and asyncio logged "Task exception was never
    retrieved" when it was collected."""
    remote = RemoteProxy(socket_path)  # no host there
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        call = asyncio.ensure_future(remote.inference(1))
        await asyncio.sleep(0)  # waiting for the connection, which is not tried yet
        call.cancel()
        await asyncio.wait([call])
        await wait_until(lambda: all(t.done() for t in remote._connecting.values()))
        assert call.cancelled()
        del call  # (its CancelledError's traceback holds the connecting task)
        await remote.aclose()  # (lets go of it too)
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def test_aclose_during_a_connect_leaves_no_connection(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    _, host, _ = served
    remote = RemoteProxy(host.path)
    call = asyncio.ensure_future(remote.inference(1))
    await asyncio.sleep(0)  # connecting: the connect task is scheduled, not run
    await remote.aclose()
    await asyncio.wait([call])  # (its outcome: its result, or ProxyClosed)
    await asyncio.sleep(0.05)
    left = dict(remote._connections)
    for connection in left.values():  # (closed here, for the fixture's checks)
        await connection.close("the test is over")
    assert left == {}


async def test_a_call_to_a_stalled_host_ends_by_its_deadline() -> None:
    folder = Path(tempfile.mkdtemp(prefix="bp-stall-", dir="/tmp"))
    path = str(folder / "m.sock")
    host = await asyncio.to_thread(HostProcess, path, folder / "host.log", 0.0)
    try:
        async with RemoteProxy(path) as remote:
            assert (await remote.inference(1))[0] == 1  # connected
            host.process.send_signal(signal.SIGSTOP)
            resume = asyncio.get_running_loop().call_later(
                3.0, host.process.send_signal, signal.SIGCONT
            )
            started = time.monotonic()
            try:
                with pytest.raises(batchproxy.DeadlineExceeded):
                    await remote.inference(2, timeout=0.3)
                assert time.monotonic() - started < 1.5  # not the 3 s of the stall
            finally:
                resume.cancel()
                host.process.send_signal(signal.SIGCONT)
    finally:
        await asyncio.to_thread(host.stop)
        shutil.rmtree(folder, ignore_errors=True)


async def test_a_client_of_another_version_is_parted_with_before_any_call(
    served: tuple[Tagged, ModelHost, RemoteProxy], socket_path: str
) -> None:
    """The wire changes between versions: a web worker left on the old version must not
    have its messages read as this version's (a garbled call, a hung read)."""
    proxy, _, remote = served
    reader, writer = await asyncio.open_unix_connection(socket_path)
    try:
        call, _ = sealed_message("call", 0, "old", {"priority": 0})
        writer.write(b"batchproxy-wire 2\n" + call)
        assert await reader.readexactly(len(WIRE)) == WIRE  # the host says its own
        assert await asyncio.wait_for(reader.read(), 30) == b""  # then parts with it
    finally:
        writer.close()
    assert proxy.seen == []  # its call was never read
    assert (await remote.inference("new"))[0] == "new"  # the others are served on


async def test_a_host_of_another_version_is_unavailable_and_says_why(socket_path: str) -> None:
    async def old_host(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"batchproxy-wire 2\n")
        await reader.read()  # (it reads on, as an old host would)
        writer.close()

    server = await asyncio.start_unix_server(old_host, socket_path)
    try:
        remote = RemoteProxy(socket_path)
        try:
            with pytest.raises(batchproxy.HostUnavailable, match="same batchproxy version"):
                await remote.inference("x", timeout=30)
        finally:
            await remote.aclose()
    finally:
        server.close()
        await server.wait_closed()
