"""One model, many processes: `ModelHost` and `RemoteProxy` over a Unix domain socket.

In one process first (the host and its callers on one loop: the wire, the options,
errors, cancellation, deadlines, permissions), then with real processes: a host
started with `python -m batchproxy.host`, client processes that each send 1,000
calls at once, a host killed under load, a client killed under load."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
from _host_models import Tagged, Unreadable
from _host_process import TESTS, HostProcess, environment
from _support import wait_until

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy
from batchproxy.host import _host as host_module

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets"),
    pytest.mark.usefixtures("no_leftovers"),  # no task or thread left behind
]


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)


# -- in one process ---------------------------------------------------------------------


async def test_each_caller_gets_its_own_result_and_the_calls_share_batches(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    proxy, _, remote = served
    items = [("a", i) for i in range(200)]
    answers = await asyncio.gather(*(remote.inference(item) for item in items))
    assert [answer[0] for answer in answers] == items
    assert len(proxy.seen) < 200  # batched in the host
    assert sum(len(batch) for batch in proxy.seen) == 200
    many = await remote.inference_many(["x", "y"])
    assert [answer[0] for answer in many] == ["x", "y"]


async def test_the_socket_is_the_owners_only(
    served: tuple[Tagged, ModelHost, RemoteProxy], socket_path: str
) -> None:
    mode = os.stat(socket_path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


async def test_errors_come_back_as_the_same_exceptions(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    _, _, remote = served
    with pytest.raises(batchproxy.InvalidItem, match="cannot tag 'bad'"):
        await remote.inference("bad")
    with pytest.raises(ValueError, match="refused 'boom'"):
        await remote.inference("boom")
    with pytest.raises(TypeError, match="could not send the call's result"):
        await remote.inference("unsendable")
    answers = await remote.inference_many(["ok", "bad", "boom"], return_exceptions=True)
    assert answers[0][0] == "ok"
    assert isinstance(answers[1], batchproxy.InvalidItem)
    assert isinstance(answers[2], ValueError)


async def test_an_item_that_cannot_travel_fails_its_own_call_only(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    _, _, remote = served
    with pytest.raises(TypeError, match="cannot be sent to the model host"):
        await remote.inference(lambda: None)
    assert (await remote.inference("after"))[0] == "after"


async def test_what_cannot_be_unpickled_at_the_other_end_fails_its_own_call_only(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    """An item the host cannot unpickle, a result the caller cannot: each fails its
    own call, and the connection and the calls beside it carry on."""
    proxy, host, remote = served
    answers = await remote.inference_many(
        ["before", Unreadable(), "beside", "unreadable", "after"], return_exceptions=True
    )
    assert [answers[i][0] for i in (0, 2, 4)] == ["before", "beside", "after"]
    assert isinstance(answers[1], TypeError)
    assert "could not read the call's item" in str(answers[1])
    assert isinstance(answers[3], TypeError)
    assert "answer cannot be read here" in str(answers[3])
    assert host.connections == 1  # the same connection all along
    assert all(not isinstance(item, Unreadable) for batch in proxy.seen for item in batch)


async def test_a_full_queue_is_queue_full_in_the_caller(socket_path: str) -> None:
    proxy = Tagged(max_queue_size=2)
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path), RemoteProxy(socket_path) as remote:
        first = asyncio.ensure_future(remote.inference("running"))
        await wait_until(lambda: bool(proxy.seen))
        queued = [asyncio.ensure_future(remote.inference(i)) for i in range(2)]
        await wait_until(lambda: proxy.stats.queue_depth >= 2)
        with pytest.raises(batchproxy.QueueFull):
            await remote.inference("one too many")
        proxy.gate.set()
        assert (await first)[0] == "running"
        assert [answer[0] for answer in await asyncio.gather(*queued)] == [0, 1]


async def test_a_timeout_travels_as_a_deadline(socket_path: str) -> None:
    proxy = Tagged()
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path), RemoteProxy(socket_path) as remote:
        running = asyncio.ensure_future(remote.inference("running"))
        await wait_until(lambda: bool(proxy.seen))
        with pytest.raises(batchproxy.DeadlineExceeded) as caught:
            await remote.inference("late", timeout=0.05)
        assert isinstance(caught.value, TimeoutError)
        assert proxy.stats.timed_out == 1
        proxy.gate.set()
        await running
    assert all("late" not in batch for batch in proxy.seen)  # left the queue unrun


async def test_a_call_whose_deadline_passed_on_its_way_is_counted_by_the_host(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    proxy, host, remote = served
    with pytest.raises(batchproxy.DeadlineExceeded):
        await remote.inference("late", timeout=1e-9)  # gone before the host reads it
    assert host.expired == 1
    assert proxy.stats.requests == 0  # never reached the proxy


async def test_a_cancelled_caller_cancels_its_call_in_the_host(socket_path: str) -> None:
    proxy = Tagged()
    proxy.gate.clear()
    async with ModelHost(proxy, socket_path) as host, RemoteProxy(socket_path) as remote:
        running = asyncio.ensure_future(remote.inference("running"))
        await wait_until(lambda: bool(proxy.seen))
        queued = asyncio.ensure_future(remote.inference("cancelled"))
        await wait_until(lambda: proxy.stats.queue_depth >= 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await wait_until(lambda: proxy.stats.queue_depth == 0)
        assert proxy.stats.cancelled == 1
        proxy.gate.set()
        assert (await running)[0] == "running"
        assert (await remote.inference("after"))[0] == "after"
        assert not any(connection.calls for connection in host._connections)
    assert all("cancelled" not in batch for batch in proxy.seen)


BAD_OPTIONS: list[dict[str, Any]] = [
    {"timeout": 0},
    {"timeout": -1.0},
    {"timeout": float("nan")},
    {"timeout": True},
    {"timeout": "1"},
    {"priority": 1.5},
    {"priority": True},
    {"tenant": ["a"]},
    {"key": {}},
    {"deadline": 1.0},
]


async def test_the_call_options_are_checked_in_the_caller_as_the_proxy_checks_them(
    served: tuple[Tagged, ModelHost, RemoteProxy],
) -> None:
    """Each bad option raises the exception the proxy raises for it, before anything
    is sent; an infinite timeout is no deadline, as for the proxy."""
    proxy, _, remote = served
    for bad in BAD_OPTIONS:
        with pytest.raises((TypeError, ValueError)) as here:
            await proxy.inference("x", **bad)
        with pytest.raises(type(here.value)):
            await remote.inference("x", **bad)
        with pytest.raises(type(here.value)):
            await remote.inference_many(["x"], **bad)
        with pytest.raises(type(here.value)):
            remote.submit("x", **bad)
        with pytest.raises(type(here.value)):
            await anext(remote.stream("x", **bad))
    assert proxy.stats.requests == 0  # nothing reached the host
    assert (await remote.inference("x", timeout=float("inf"), priority=3))[0] == "x"


async def test_no_host_is_host_unavailable_and_a_host_that_comes_back_serves(
    socket_path: str,
) -> None:
    remote = RemoteProxy(socket_path, connect_timeout=1.0)
    with pytest.raises(batchproxy.HostUnavailable, match="cannot connect") as caught:
        await remote.inference("x")
    assert isinstance(caught.value, ConnectionError)
    async with ModelHost(Tagged(), socket_path):
        assert (await remote.inference("x"))[0] == "x"
    with pytest.raises(batchproxy.HostUnavailable):
        await remote.inference("y")  # the host went away: the connection is gone too
    async with ModelHost(Tagged(), socket_path):
        assert (await remote.inference("z"))[0] == "z"  # connects again
    await remote.aclose()


async def test_a_closing_host_drains_calls_in_flight(socket_path: str) -> None:
    proxy = Tagged(delay=0.1)
    host = ModelHost(proxy, socket_path)
    await host.start()
    async with RemoteProxy(socket_path) as remote:
        calls = [asyncio.ensure_future(remote.inference(i)) for i in range(20)]
        await wait_until(lambda: proxy.stats.requests >= 20)
        await host.aclose()
        assert [answer[0] for answer in await asyncio.gather(*calls)] == list(range(20))
        with pytest.raises(batchproxy.HostUnavailable):
            await remote.inference("after")
    assert proxy.closed
    assert not _exists(socket_path)


async def test_the_drain_timeout_bounds_the_whole_close_even_with_a_hung_model(
    socket_path: str,
) -> None:
    """A model that never returns holds neither the host's close (past its
    `drain_timeout`) nor its caller: the call fails, the socket is gone. The calls
    the deadline cuts off get `DrainDeadline`, as the proxy's own drain answers them:
    `running` for the one in the hung batch, not for the one still queued."""
    proxy = Tagged()
    proxy.gate.clear()  # the model hangs
    host = ModelHost(proxy, socket_path, drain_timeout=0.2)
    await host.start()
    try:
        async with RemoteProxy(socket_path) as remote:
            call = asyncio.ensure_future(remote.inference("stuck"))
            await wait_until(lambda: proxy.seen == [["stuck"]])
            queued = asyncio.ensure_future(remote.inference("queued"))
            await wait_until(lambda: proxy.stats.queue_depth == 1)
            await asyncio.wait_for(host.aclose(), 5)
            with pytest.raises(batchproxy.DrainDeadline) as running:
                await call
            with pytest.raises(batchproxy.DrainDeadline) as waiting:
                await queued
            assert (running.value.running, waiting.value.running) == (True, False)
            assert running.value.timeout == 0.2
            assert proxy.seen == [["stuck"]]  # the queued call never reached the model
        assert proxy.closed
        assert not _exists(socket_path)
    finally:
        proxy.gate.set()  # the abandoned batch ends
        await wait_until(lambda: proxy.stats.in_flight == 0)


async def test_a_peer_of_another_user_is_refused(
    socket_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = Tagged()
    async with ModelHost(proxy, socket_path) as host:
        monkeypatch.setattr(host_module.os, "getuid", lambda: os.geteuid() + 1)
        remote = RemoteProxy(socket_path, start_timeout=0.2)
        with pytest.raises(batchproxy.HostUnavailable):
            await remote.inference("x")
        assert host.refused == 1
        with pytest.raises(batchproxy.HostUnavailable, match="no model host answered"):
            await remote.start()  # (what `async with remote:` does first)
        assert host.refused > 1
        await remote.aclose()
    assert proxy.seen == []
    gc.collect()  # CPython 3.12.1 segfaulted here once views of pickle buffers outlived a send


async def test_a_stale_socket_is_replaced_and_a_live_one_refused(socket_path: str) -> None:
    import socket

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(socket_path)
    stale.close()  # the file stays, nobody listens: a host that died
    async with ModelHost(Tagged(), socket_path), RemoteProxy(socket_path) as remote:
        assert (await remote.inference("x"))[0] == "x"
        with pytest.raises(FileExistsError, match="already listening"):
            await ModelHost(Tagged(), socket_path).start()
        assert (await remote.inference("still"))[0] == "still"
    _write(socket_path, "not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        await ModelHost(Tagged(), socket_path).start()


async def test_a_host_serves_a_batch_function(socket_path: str) -> None:
    """As the docs say: a `@batch` function is served as a proxy is (entered, and
    closed with the host)."""

    @batchproxy.batch(batch_size=8, max_delay_ms=5.0)
    async def tag(items: list[int]) -> list[tuple[int, int]]:
        return [(item, len(items)) for item in items]

    async with ModelHost(tag, socket_path), RemoteProxy(socket_path) as remote:
        answers = await asyncio.gather(*(remote.inference(i) for i in range(8)))
        assert [answer[0] for answer in answers] == list(range(8))
        assert remote.healthy
        with pytest.raises(batchproxy.DeadlineExceeded):
            await remote.inference(0, timeout=1e-9)
    assert tag.closed
    assert tag.stats.requests == 8


def test_a_host_needs_a_proxy() -> None:
    with pytest.raises(TypeError, match="inference"):
        ModelHost(object(), "/tmp/x.sock")


# -- with processes -------------------------------------------------------------------


def _client(path: str, ident: str, count: int, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TESTS / "_host_client.py"), path, ident, str(count), *flags],
        env=environment(),
        stdin=subprocess.PIPE if "--on-go" in flags else None,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("clients", [2, 4])
def test_client_processes_share_one_host_and_its_batches(socket_path: str, clients: int) -> None:
    host = HostProcess(socket_path, delay=0.05)  # (1,000 calls: 16 batches, 0.8 s)
    try:
        processes = [_client(socket_path, f"c{i}", 1000, "--on-go") for i in range(clients)]
        for process in processes:  # each connected, then all send at once: on a loaded
            assert process.stdout is not None  # machine a client's start took longer
            assert process.stdout.readline() == "ready\n"  # than another's 1,000 calls
        for process in processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        summaries = []
        for process in processes:
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 0
            summaries.append(json.loads(out))
    finally:
        assert host.stop() == 0
    for summary in summaries:
        assert summary == {**summary, "right": 1000, "wrong": 0, "failed": {}}
    # a batch id seen by more than one process: their calls were batched together
    seen_by = [set(summary["batches"]) for summary in summaries]
    shared = set.union(*[a & b for i, a in enumerate(seen_by) for b in seen_by[i + 1 :]])
    assert shared
    assert not _exists(socket_path)


@pytest.mark.parametrize("flag", ["", "--freeze-gc", "--no-freeze-gc"], ids=repr)
async def test_by_default_the_host_freezes_what_the_factory_loaded_before_serving(
    socket_path: str, flag: str
) -> None:
    """As a `Serving` does by default; `--no-freeze-gc` leaves the collector alone."""
    freeze = flag != "--no-freeze-gc"
    host = HostProcess(socket_path, 0.0, "freeze_count", *([flag] if flag else []))
    try:
        async with RemoteProxy(socket_path) as remote:
            frozen = await remote.inference(0)
    finally:
        assert host.stop() == 0
    # what the interpreter itself reports before any import: 0, except CPython 3.12,
    # whose startup leaves objects in the permanent generation (375 on 3.12.1)
    bare = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", "import gc; print(gc.get_freeze_count())", stdout=PIPE
    )
    baseline = int((await bare.communicate())[0])
    if freeze:
        assert frozen > baseline  # the objects alive once loaded: the proxy, its modules
    else:
        assert frozen == baseline


def test_a_host_killed_under_load_fails_every_call_and_none_hangs(socket_path: str) -> None:
    host = HostProcess(socket_path, delay=0.05)
    try:
        process = _client(socket_path, "c", 500)
        time.sleep(0.3)  # the calls are queued or running in the host
        host.kill()
        out, _ = process.communicate(timeout=60)
    finally:
        host.stop()
    summary = json.loads(out)
    assert summary["wrong"] == 0
    assert summary["right"] + sum(summary["failed"].values()) == 500
    assert set(summary["failed"]) == {"HostUnavailable"}
    assert summary["failed"]["HostUnavailable"] > 0


async def test_a_client_killed_under_load_leaves_nothing_and_the_others_are_served(
    socket_path: str,
) -> None:
    proxy = Tagged(delay=0.02)
    async with ModelHost(proxy, socket_path) as host, RemoteProxy(socket_path) as remote:
        process = _client(socket_path, "doomed", 200, "--forever")
        try:
            await wait_until(lambda: proxy.stats.requests >= 400)
            mine = asyncio.ensure_future(remote.inference_many(range(50)))
            process.kill()
        finally:
            process.kill()
            process.wait()
        assert [answer[0] for answer in await mine] == list(range(50))
        # its connection is seen closed, its calls cancelled
        await wait_until(lambda: host.connections == 1 and proxy.stats.queue_depth == 0)
        assert not any(
            connection.calls for connection in host._connections
        )  # the doomed one's calls are gone with it
