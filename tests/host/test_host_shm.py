"""Large buffers between `RemoteProxy` and `ModelHost` through shared memory (`_shm`):
a large array arrives equal, writable and as a view of a segment, a small one in the
message, and no segment is left in /dev/shm whatever becomes of the call: cancelled,
unreadable, unsendable, its connection or host gone."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _host_models import Echo, Unreadable, in_shared_memory
from _host_process import HostProcess
from _support import wait_until

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy, _shm, _wire

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="needs /dev/shm (Linux)"),
    pytest.mark.usefixtures("no_leftovers"),  # no task or thread left behind
]

FLOATS = 1 << 19  # a 2 MiB float32 array: over the 1 MiB threshold


def big(tag: int, floats: int = FLOATS) -> Any:
    return np.arange(floats, dtype=np.float32) + tag


def segments(pid: int | None = None) -> list[str]:
    """The segments in /dev/shm that process `pid` (this one) made."""
    prefix = f"bp-{os.getpid() if pid is None else pid}-"
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def mapped() -> list[str]:
    """This process's mappings of segments (gone once their arrays are collected)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [line for line in maps if "/dev/shm/bp-" in line]


@pytest.fixture(autouse=True)
def no_segments() -> Iterator[None]:
    """After the test and its host: no segment of this process left, none mapped."""
    yield
    gc.collect()  # the arrays made from a mapping are gone, and with them the mapping
    assert segments() == []
    assert mapped() == []


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the segments this process makes, in order."""
    sizes: list[int] = []
    put = _shm.put

    def counting(view: memoryview) -> _shm.Segment | None:
        segment = put(view)
        if segment is not None:
            sizes.append(segment.size)
        return segment

    monkeypatch.setattr(_shm, "put", counting)
    return sizes


@pytest.fixture
async def echoed(socket_path: str) -> AsyncIterator[tuple[Echo, ModelHost, RemoteProxy]]:
    proxy = Echo()
    async with ModelHost(proxy, socket_path) as host, RemoteProxy(socket_path) as remote:
        yield proxy, host, remote
        proxy.gate.set()  # (a test that failed with its gate shut: the host can close)


# -- what travels how -------------------------------------------------------------------


async def test_a_large_array_travels_both_ways_in_shared_memory(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    proxy, _, remote = echoed
    item = np.random.default_rng(0).random(FLOATS, dtype=np.float32)
    result = await remote.inference(item)
    assert result.dtype == item.dtype
    assert np.array_equal(result, item)
    assert made == [item.nbytes, item.nbytes]  # the item's segment, the answer's
    assert proxy.shared == [True]  # the host's item was a view of its segment
    assert in_shared_memory(result)  # and so is the caller's answer
    assert segments() == []  # each unlinked as it was read
    result[0] = -1.0  # writable, as the socket's arrays are
    assert result[0] == -1.0


async def test_a_segment_is_unmapped_once_its_array_is_dropped_connection_open(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    """No frame of either side keeps a message read while it awaits the next one: the
    host's item and the caller's answer unmap as soon as their arrays go, while the
    connection stays open (the first version kept the last message of each side
    mapped until the next message, or the connection's end)."""
    _, _, remote = echoed
    result = await remote.inference(big(0))
    assert in_shared_memory(result)
    del result
    gc.collect()
    assert mapped() == []
    assert made == [4 * FLOATS, 4 * FLOATS]


async def test_a_large_cpu_tensor_travels_both_ways_in_shared_memory(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    torch = pytest.importorskip("torch")
    proxy, _, remote = echoed
    item = torch.arange(FLOATS, dtype=torch.float32)
    result = await remote.inference(item)
    assert isinstance(result, torch.Tensor)
    assert torch.equal(result, item)
    assert made == [4 * FLOATS, 4 * FLOATS]
    assert proxy.shared == [True]
    assert in_shared_memory(result)
    result[0] = -1.0
    assert result[0] == -1.0


async def test_below_the_threshold_buffers_travel_in_the_message(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    proxy, _, remote = echoed
    below = np.ones(_shm.THRESHOLD // 4 - 1, dtype=np.float32)
    result = await remote.inference(below)
    assert np.array_equal(result, below)
    assert made == []
    assert proxy.shared == [False]
    assert not in_shared_memory(result)
    assert result.flags.writeable
    at = np.ones(_shm.THRESHOLD // 4, dtype=np.float32)
    assert np.array_equal(await remote.inference(at), at)
    assert made == [_shm.THRESHOLD, _shm.THRESHOLD]


async def test_without_shared_memory_large_buffers_travel_in_the_message(
    echoed: tuple[Echo, ModelHost, RemoteProxy],
    made: list[int],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(_shm, "DIRECTORY", str(tmp_path / "no-such-directory"))
    proxy, _, remote = echoed
    result = await remote.inference(big(1))
    assert np.array_equal(result, big(1))
    assert made == []
    assert proxy.shared == [False]
    assert result.flags.writeable


async def test_many_concurrent_large_calls_each_get_their_own(
    echoed: tuple[Echo, ModelHost, RemoteProxy],
    made: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4 tasks of 8 calls at once, each item two arrays (two segments a message)."""
    monkeypatch.setattr(_shm, "THRESHOLD", 64 * 1024)
    _, _, remote = echoed

    def item(task: int, index: int) -> dict[str, Any]:
        tag = 100 * task + index
        return {"tag": tag, "a": big(tag, 20_000), "b": np.full(30_000, tag, np.int64)}

    async def caller(task: int) -> None:
        items = [item(task, index) for index in range(8)]
        answers = await remote.inference_many(items)
        for sent, answer in zip(items, answers, strict=True):
            assert answer["tag"] == sent["tag"]
            assert np.array_equal(answer["a"], sent["a"])
            assert np.array_equal(answer["b"], sent["b"])
            assert in_shared_memory(answer["a"])

    await asyncio.gather(*(caller(task) for task in range(4)))
    assert len(made) == 4 * 8 * 2 * 2  # items and answers, two arrays each
    assert segments() == []


# -- nothing left behind ----------------------------------------------------------------


async def test_no_segment_left_when_a_queued_call_is_cancelled(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    proxy, host, remote = echoed
    proxy.gate.clear()
    running = asyncio.ensure_future(remote.inference(big(0)))
    await wait_until(lambda: proxy.stats.in_flight >= 1)
    queued = asyncio.ensure_future(remote.inference(big(1)))
    await wait_until(lambda: proxy.stats.requests == 2 and proxy.stats.queue_depth == 1)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await wait_until(lambda: proxy.stats.cancelled == 1)
    assert segments() == []
    proxy.gate.set()
    assert np.array_equal(await running, big(0))
    assert len(made) == 3  # two items, one answer
    assert not any(connection.calls for connection in host._connections)


async def test_no_segment_left_when_an_item_or_answer_cannot_be_read(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    _, host, remote = echoed
    with pytest.raises(TypeError, match="could not read the call's item"):
        await remote.inference((big(0), Unreadable()))
    with pytest.raises(TypeError, match="answer cannot be read here"):
        await remote.inference(("unreadable", big(1)))
    assert len(made) == 3  # two items, one answer
    assert segments() == []
    assert host.connections == 1  # the same connection all along


async def test_no_segment_left_when_an_item_or_answer_cannot_be_sent(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    _, _, remote = echoed
    with pytest.raises(TypeError, match="could not send the call's result"):
        await remote.inference(("unsendable", big(0)))
    assert len(made) == 1  # the answer failed to pickle before its segment was made
    # the item is sealed in its segment, then its options fail to pickle
    with pytest.raises(TypeError, match="cannot be sent to the model host"):
        await remote.inference(big(1), tenant=lambda: None)
    assert len(made) == 2
    assert segments() == []
    assert np.array_equal(await remote.inference(big(2)), big(2))


async def test_no_segment_left_when_the_host_closes_with_calls_in_flight(
    socket_path: str, made: list[int]
) -> None:
    proxy = Echo(delay=0.5)
    host = ModelHost(proxy, socket_path, drain_timeout=0.05)
    await host.start()
    async with RemoteProxy(socket_path) as remote:
        calls = [asyncio.ensure_future(remote.inference(big(i))) for i in range(4)]
        await wait_until(lambda: proxy.stats.requests >= 4)
        await host.aclose()  # the drain ends before the calls do: cut off
        for call in calls:
            with pytest.raises(batchproxy.DrainDeadline):
                await call
    assert len(made) == 4
    assert segments() == []


async def test_a_closing_host_lets_its_callers_read_the_answers_it_wrote(
    socket_path: str, made: list[int]
) -> None:
    """The host drains on SIGTERM while this process reads nothing: the answers it
    wrote wait in their segments until this process has read them, then it exits."""
    host = HostProcess(socket_path, delay=0.3, factory="echo")
    try:
        async with RemoteProxy(socket_path) as remote:
            calls = [asyncio.ensure_future(remote.inference(big(i))) for i in range(4)]
            await wait_until(lambda: len(made) == 4)
            await wait_until(lambda: segments() == [])  # the host has read the calls
            host.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # noqa: ASYNC251 (this loop stalls: the host answers and waits)
            answers = await asyncio.gather(*calls)
            assert all(np.array_equal(answer, big(i)) for i, answer in enumerate(answers))
        assert host.process.wait(timeout=30) == 0  # it exits once this process has read
    finally:
        host.stop()
    assert segments(host.process.pid) == []


async def test_no_segment_left_when_a_client_leaves_with_its_answer_unread(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int], socket_path: str
) -> None:
    _, host, _ = echoed
    connected = host.connections  # (the fixture's RemoteProxy, started)
    _, writer = await asyncio.open_unix_connection(socket_path)
    data, _names = _wire.sealed_message("call", 0, big(0), {"priority": 0})
    writer.write(_wire.WIRE + data)  # a client that sends a call and never reads the answer
    await writer.drain()
    await wait_until(lambda: len(made) == 2)  # the answer is written, in its segment
    assert len(segments()) == 1  # the item's segment went as the host read it
    writer.close()
    await writer.wait_closed()
    await wait_until(lambda: host.connections == connected)
    assert segments() == []


async def test_no_segment_left_when_a_client_closes_with_its_call_in_the_host(
    echoed: tuple[Echo, ModelHost, RemoteProxy], made: list[int]
) -> None:
    proxy, host, remote = echoed
    proxy.gate.clear()
    call = asyncio.ensure_future(remote.inference(big(0)))
    await wait_until(lambda: proxy.stats.in_flight >= 1)
    await remote.aclose(timeout=0)  # (no drain: its call is cut off)
    with pytest.raises(batchproxy.DrainDeadline):
        await call
    await wait_until(lambda: host.connections == 0)
    proxy.gate.set()
    assert made == [4 * FLOATS]
    assert segments() == []


async def test_no_segment_left_when_a_client_closes_before_its_items_are_read(
    socket_path: str, made: list[int]
) -> None:
    """A peer that never reads: the client unlinks its items as it closes."""
    accepted: list[asyncio.StreamWriter] = []

    async def never_read(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_unix_server(never_read, path=socket_path)
    try:
        remote = RemoteProxy(socket_path)
        call = asyncio.ensure_future(remote.inference(big(0)))
        await wait_until(lambda: bool(made and accepted))
        assert len(segments()) == 1
        await remote.aclose(timeout=0)  # (no drain: its call is cut off)
        with pytest.raises(batchproxy.DrainDeadline):
            await call
        assert segments() == []
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_no_segment_left_when_the_host_dies_with_items_unread(
    socket_path: str, made: list[int]
) -> None:
    host = HostProcess(socket_path, factory="echo")
    try:
        async with RemoteProxy(socket_path) as remote:  # (started: the host answered)
            os.kill(host.process.pid, signal.SIGSTOP)  # it reads nothing from here on
            calls = [asyncio.ensure_future(remote.inference(big(i))) for i in range(3)]
            await wait_until(lambda: len(made) == 3)
            assert len(segments()) == 3
            host.kill()
            for call in calls:
                with pytest.raises(batchproxy.HostUnavailable):
                    await call
            assert segments() == []
    finally:
        host.kill()
    assert segments(host.process.pid) == []


async def test_arrays_through_a_host_process_leave_no_segment(
    socket_path: str, made: list[int]
) -> None:
    host = HostProcess(socket_path, factory="echo")
    try:
        async with RemoteProxy(socket_path) as remote:
            answers = await remote.inference_many([big(i) for i in range(6)])
            assert all(np.array_equal(answer, big(i)) for i, answer in enumerate(answers))
            assert all(in_shared_memory(answer) for answer in answers)
            del answers
    finally:
        assert host.stop() == 0
    assert len(made) == 6
    assert segments(host.process.pid) == []


def test_a_ledger_forgets_what_was_read_and_unlinks_the_rest() -> None:
    ledger = _shm.Ledger()
    views = [memoryview(bytes([i]) * 16) for i in range(100)]
    made = [_shm.put(view) for view in views]
    names = [segment.name for segment in made if segment is not None]
    assert len(names) == 100
    ledger.add(names[:50])
    _shm.unlink(names[:40])  # read: the reader unlinked them
    ledger.add(names[50:])  # past 64: a sweep forgets those 40
    assert len(ledger) == 60
    ledger.unlink_all()
    assert len(ledger) == 0
    assert segments() == []


def test_a_reader_opens_and_unlinks_only_batchproxys_segments(tmp_path: Path) -> None:
    outside = tmp_path / "keep"
    outside.write_bytes(b"x")
    for name in ("../" + str(outside), "bp-1-zz", "other"):
        assert isinstance(_shm.attach(name, 1), _shm.SegmentLost)
    assert outside.exists()
    assert isinstance(_shm.attach(f"bp-{os.getpid()}-{'0' * 16}", 1), _shm.SegmentLost)
    segment = _shm.put(memoryview(b"abc"))
    assert segment is not None
    assert isinstance(_shm.attach(segment.name, 4), _shm.SegmentLost)  # not its size
    assert segments() == []  # unlinked all the same
