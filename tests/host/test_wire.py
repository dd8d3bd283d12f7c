"""The host's wire (`batchproxy.host._wire`) on its own: arrays as they pickle, the
messages one iteration of the loop sends in one write (`Outbox`), and the reader that
takes every message that arrived in one go (`MessageReader`)."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from batchproxy._executors import ipc
from batchproxy.host.__main__ import loop_factory, run
from batchproxy.host._wire import (
    MessageReader,
    Outbox,
    answer_message,
    message_bytes,
    open_sealed,
    seal,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets")


# -- arrays -----------------------------------------------------------------------------

PLAIN = [
    np.arange(12, dtype=np.int64),
    np.ones((3, 4), dtype=np.float16),
    np.zeros((0, 3)),
    np.array(5.0),
    np.array([1 + 2j, 3j]),
    np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian: its byte order travels
    np.array([True, False]),
    np.arange(256, dtype=np.uint8),
]
OTHERS = [
    np.arange(10)[::2],  # not contiguous
    np.asfortranarray(np.arange(6).reshape(2, 3)),
    np.array([("a", 1)], dtype=[("name", "U1"), ("n", "i4")]),  # fields
    np.array([{"a": 1}, None], dtype=object),
    np.array(["ab", "c"]),
    np.array([1, 2], dtype=np.dtype("i4", metadata={"unit": "m"})),
    np.arange(3).astype("datetime64[s]"),
]


@pytest.mark.parametrize("array", PLAIN + OTHERS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_an_array_comes_back_equal_and_writable(array: Any) -> None:
    for back in (ipc.decode(ipc.encode(array)), open_sealed(_travelled(seal(array)))):
        assert type(back) is np.ndarray
        assert back.dtype == array.dtype
        assert back.shape == array.shape
        # (numpy 2.2 unpickles a datetime64 dtype with {} for None: alike)
        assert (back.dtype.metadata or None) == (array.dtype.metadata or None)
        assert back.tolist() == array.tolist()
        assert back.flags.writeable


@pytest.mark.parametrize("array", PLAIN, ids=lambda a: f"{a.dtype}{a.shape}")
def test_a_plain_array_travels_as_its_dtype_string_shape_and_buffer(array: Any) -> None:
    frames = ipc.encode(array)
    assert b"_array" in bytes(frames[1])  # ipc's own reduction, not NumPy's
    assert b"numpy" not in bytes(frames[1])  # (NumPy's pickles the dtype object)
    assert [view.nbytes for view in frames[2:]] == [array.nbytes]  # out of band


@pytest.mark.parametrize("array", OTHERS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_another_array_pickles_as_numpy_pickles_it(array: Any) -> None:
    assert b"_array" not in bytes(ipc.encode(array)[1])


def _travelled(parts: list[Any]) -> list[Any]:
    """Sealed parts as the other end gets them: in a message read."""

    async def read() -> list[Any]:
        reader = asyncio.StreamReader()
        reader.feed_data(message_bytes(("result", 0, parts)))
        reader.feed_eof()
        [(_, _, received)] = await MessageReader(reader).next()
        return received  # type: ignore[no-any-return]

    return asyncio.run(read())


# -- the outbox and the reader ----------------------------------------------------------


@pytest.fixture
async def pair() -> AsyncIterator[tuple[asyncio.StreamWriter, asyncio.StreamReader, list[int]]]:
    """A writer, the reader at the other end, and the size of each write made."""
    ours, theirs = socket.socketpair()
    _, writer = await asyncio.open_connection(sock=ours)
    reader, other = await asyncio.open_connection(sock=theirs)
    writes: list[int] = []
    write = writer.write

    def counted(data: Any) -> None:
        writes.append(len(data))
        write(data)

    writer.write = counted  # type: ignore[method-assign]
    try:
        yield writer, reader, writes
    finally:
        writer.close()
        other.close()


async def test_the_messages_of_one_iteration_go_in_one_write_in_order(
    pair: tuple[asyncio.StreamWriter, asyncio.StreamReader, list[int]],
) -> None:
    writer, reader, writes = pair
    outbox = Outbox(asyncio.get_running_loop(), writer)
    for ident in range(20):
        outbox.put(answer_message("result", ident, np.full(3, ident))[0])
    assert writes == []  # (written when the loop next runs its callbacks)
    assert outbox.size() > 0
    await asyncio.sleep(0)
    assert len(writes) == 1
    assert outbox.size() == 0
    got = await MessageReader(reader).next()
    assert [(kind, ident) for kind, ident, _ in got] == [("result", i) for i in range(20)]
    for ident, (_, _, parts) in enumerate(got):
        array = open_sealed(parts)
        assert array.tolist() == [ident] * 3
        array[0] = -1  # writable, as arrays read from the socket are


async def test_the_outbox_counts_what_it_holds_so_that_a_sender_waits_for_room(
    pair: tuple[asyncio.StreamWriter, asyncio.StreamReader, list[int]],
) -> None:
    """`Peer.send` flushes and drains past the transport's limit: the outbox's size
    counts the answers queued, a list's too (below the shared-memory threshold)."""
    writer, _, _ = pair
    outbox = Outbox(asyncio.get_running_loop(), writer)
    array = np.zeros(50_000)  # 400 kB: in the message, not in shared memory
    outbox.put(answer_message("result", 1, array)[0])
    assert outbox.size() >= array.nbytes
    entries = [answer_message("result", 0, array)[0][2:] for _ in range(2)]
    outbox.put(("results", 2, [("result", parts) for (parts,) in entries]))
    assert outbox.size() >= 3 * array.nbytes
    outbox.flush()


async def test_flush_writes_now_and_a_lone_message_goes_as_itself(
    pair: tuple[asyncio.StreamWriter, asyncio.StreamReader, list[int]],
) -> None:
    writer, reader, writes = pair
    outbox = Outbox(asyncio.get_running_loop(), writer)
    outbox.put(answer_message("end", 7, None)[0])
    outbox.flush()
    assert len(writes) == 1
    await asyncio.sleep(0)  # (the callback the put asked for finds nothing left)
    assert len(writes) == 1
    kind, ident, parts = await asyncio.wait_for(_read_message(reader), 10)
    assert (kind, ident, open_sealed(parts)) == ("end", 7, None)


async def test_an_outbox_drops_what_a_closing_writer_cannot_take(
    pair: tuple[asyncio.StreamWriter, asyncio.StreamReader, list[int]],
) -> None:
    writer, _, writes = pair
    outbox = Outbox(asyncio.get_running_loop(), writer)
    outbox.put(answer_message("end", 1, None)[0])
    writer.close()
    outbox.flush()
    assert writes == []


async def _read_message(reader: asyncio.StreamReader) -> Any:
    from batchproxy.host._wire import read_message

    return await read_message(reader)


async def test_the_reader_returns_every_message_arrived_and_waits_for_a_split_one() -> None:
    data = b"".join(message_bytes(("cancel", ident)) for ident in range(5))
    big = seal(np.arange(100_000, dtype=np.float64))  # 800 kB: more than one read
    data += message_bytes(("result", 5, big))
    reader = asyncio.StreamReader()
    inbox = MessageReader(reader)
    reader.feed_data(data[:3])  # not even a count
    pending = asyncio.ensure_future(inbox.next())
    await asyncio.sleep(0.01)
    assert not pending.done()
    reader.feed_data(data[3 : len(data) // 2])
    got = await asyncio.wait_for(pending, 10)
    assert got == [("cancel", ident) for ident in range(5)]  # the whole ones, at once
    reader.feed_data(data[len(data) // 2 :])
    [(kind, ident, parts)] = await asyncio.wait_for(inbox.next(), 10)
    assert (kind, ident) == ("result", 5)
    assert np.array_equal(open_sealed(parts), np.arange(100_000, dtype=np.float64))


async def test_the_reader_raises_at_the_end_of_the_stream_even_mid_message() -> None:
    data = message_bytes(("cancel", 1))
    for cut in (0, 2, len(data) - 1):
        reader = asyncio.StreamReader()
        reader.feed_data(data[:cut])
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await MessageReader(reader).next()


# -- the host's loop --------------------------------------------------------------------


def test_the_host_loop_is_uvloop_where_installed_unless_asked_otherwise() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__.partition(".")[0])

    for choice in ("auto", "asyncio", "uvloop"):
        run(main(), choice)
    policys = asyncio.get_event_loop_policy().new_event_loop()  # (asyncio's, unless the
    policys.close()  # suite runs with --loop=uvloop, which sets uvloop's policy)
    assert seen == ["uvloop", type(policys).__module__.partition(".")[0], "uvloop"]
