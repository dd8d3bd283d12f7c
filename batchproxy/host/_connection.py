"""One `RemoteProxy` connection: the socket to the host on one event loop.

Each call has an id, and a queue of its own for the host's answers with that id (a
unary call's one answer; a stream's chunks, then its end or error). The reader task
is the only code that delivers those answers; when the connection ends it delivers
`HostUnavailable` to every call still waiting (and tells its owner, `on_lost`). A
call whose caller is done before its last answer (cancelled, a stream closed early)
leaves with a `("cancel", id)` to the host. The items' shared-memory segments the
host has not read when the connection ends are unlinked then (`_shm`).

The transport may know the connection lost before the reader task does (a write
failed: the host is gone); from then on nothing is written to it. A call that finds
it so before any of its message was written raises `NotSent` if the connection had
carried calls (it was lost while idle), and its `RemoteProxy` sends it on a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, Callable
from typing import Any

from .._errors import HostUnavailable
from .._stats import Health
from . import _shm
from ._wire import message_bytes, open_sealed, read_message, sealed_message, unpack_error

__all__ = ["Connection", "NotSent"]

_Answer = tuple[str, list[Any]] | HostUnavailable
"""What a call's queue gets: an answer `(kind, sealed)` from the host, or the
`HostUnavailable` of a lost connection."""


class NotSent(HostUnavailable):
    """The connection was lost before any of a call's message was written: nothing of it
    reached the host, so it may be sent again on a new connection."""


class Connection:
    """The socket to the host on one event loop: each call's answer queue by id, and the
    reader task that fills them."""

    def __init__(
        self,
        path: str,
        loop: asyncio.AbstractEventLoop,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_lost: Callable[[str], None],
    ) -> None:
        self.path = path
        self.loop = loop
        self.writer = writer
        self.open = True
        self.waiting: dict[int, asyncio.Queue[_Answer]] = {}
        self.segments = _shm.Ledger()  # of the items written, until the host reads them
        self._on_lost = on_lost
        self._idle = asyncio.Event()  # set while no call waits (`waiting` is empty)
        self._idle.set()
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._carried = False  # a message was written whole (see `_unsent`)
        self._reader = loop.create_task(self._read(reader))

    async def call(self, item: Any, options: dict[str, Any]) -> Any:
        return await self._one_answer(lambda ident: self._sealed("call", ident, item, options))

    async def stream(self, item: Any, options: dict[str, Any]) -> AsyncGenerator[Any, None]:
        ident, answers = await self._send(
            lambda ident: self._sealed("stream", ident, item, options)
        )
        try:
            while True:
                kind, sealed = _received(await answers.get())
                if kind == "end":
                    return
                chunk = _opened(self.path, kind, sealed)  # an "error" raises here
                yield chunk
        finally:
            self._leave(ident)

    async def health(self) -> Health:
        """The host's `Health`, asked now."""
        health = await self._one_answer(lambda ident: (message_bytes(("health", ident)), []))
        assert isinstance(health, Health), health
        return health

    async def _one_answer(self, message: Callable[[int], tuple[bytes, list[str]]]) -> Any:
        """Send `message(id)`; the host's one answer to it (its error raised)."""
        ident, answers = await self._send(message)
        try:
            kind, sealed = _received(await answers.get())
        finally:
            self._leave(ident)
        return _opened(self.path, kind, sealed)

    async def drained(self) -> None:
        """Once no call on this connection waits for the host (the others may still
        make calls meanwhile: the owner stops them first)."""
        await self._idle.wait()

    async def _send(
        self, message: Callable[[int], tuple[bytes, list[str]]]
    ) -> tuple[int, asyncio.Queue[_Answer]]:
        """Send `message(id)` (its bytes, and the shared-memory segments they carry);
        the id and its answer queue (registered before the message is written, so no
        answer can arrive unseen)."""
        ident = next(self._ids)
        data, names = message(ident)
        answers: asyncio.Queue[_Answer] = asyncio.Queue()
        self.waiting[ident] = answers
        self._idle.clear()
        try:
            async with self._lock:
                if not self.writable():
                    raise self._unsent()
                fresh = self.writer.transport.get_write_buffer_size() == 0
                self.writer.write(data)
                if fresh and self.writer.is_closing():  # its first byte already refused
                    raise self._unsent()
                self.segments.add(names)  # the host unlinks them as it reads the call
                names = []
                await self.writer.drain()
                self._carried = True
        except NotSent:
            self._leave(ident)
            raise
        except ConnectionError as exc:
            self._leave(ident)
            raise HostUnavailable(self.path, f"the connection broke ({exc!r})") from exc
        except BaseException:
            self._leave(ident)
            raise
        finally:
            _shm.unlink(names)  # never written (cancelled, or lost): nobody else knows them
        return ident, answers

    def _unsent(self) -> HostUnavailable:
        """The error of a call found the connection lost before any of it was written:
        `NotSent` (to be sent on a new connection) if this connection carried calls
        before, so was lost while it stood idle; else `HostUnavailable` (the host
        ended it as it opened: it refuses this process, or died then)."""
        kind = NotSent if self._carried else HostUnavailable
        return kind(self.path, "the connection to the host was lost")

    def _sealed(
        self, kind: str, ident: int, item: Any, options: dict[str, Any]
    ) -> tuple[bytes, list[str]]:
        """A call's message; one whose item or options cannot travel fails here, alone."""
        try:
            return sealed_message(kind, ident, item, options)
        except Exception as exc:
            raise TypeError(
                f"the call cannot be sent to the model host at {self.path}: {exc!r}"
            ) from exc

    def _leave(self, ident: int) -> None:
        """The caller is done with call `ident`: if the host may still be working on it
        (it is still listed: no final answer came), tell the host to drop it."""
        if self._forget(ident) and self.writable():
            with contextlib.suppress(Exception):
                self.writer.write(message_bytes(("cancel", ident)))

    def writable(self) -> bool:
        """Whether a message may be written: the connection is not known lost, neither
        here nor by its transport, which may know first (a write failed: its peer is
        gone, and the reader task has not seen the end yet) and drops every later
        write (logging each, past a few)."""
        return self.open and not self.writer.is_closing()

    def _forget(self, ident: int) -> bool:
        """Unlist call `ident`; whether it was listed."""
        listed = self.waiting.pop(ident, None) is not None
        if not self.waiting:
            self._idle.set()
        return listed

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the host closed the connection"
        try:
            while True:
                # (handed on, not kept in this frame while the next one is awaited: its
                # buffers may map shared memory, freed only with the last reference)
                self._deliver(*await read_message(reader))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                why = f"the connection to the host broke ({exc!r})"
        except asyncio.CancelledError:
            why = "the RemoteProxy was closed"
            raise
        finally:
            self._fail_waiting(why)

    def _deliver(self, kind: str, ident: int, sealed: list[Any]) -> None:
        """An answer to the call it is for (opened by the call itself)."""
        answers = self.waiting.get(ident)
        if answers is None:
            return  # a call withdrawn meanwhile
        if kind != "chunk":  # the call's last answer: the host is done with it
            self._forget(ident)
        answers.put_nowait((kind, sealed))

    def _fail_waiting(self, why: str) -> None:
        if self.open:
            self.open = False
            self._on_lost(why)
        waiting, self.waiting = self.waiting, {}
        self._idle.set()
        for answers in waiting.values():
            answers.put_nowait(HostUnavailable(self.path, why))
        self.writer.close()
        self.segments.unlink_all()  # the items the host did not read: nobody will now

    async def close(self, why: str) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._fail_waiting(why)
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def _received(answer: _Answer) -> tuple[str, list[Any]]:
    if isinstance(answer, HostUnavailable):
        raise answer
    return answer


def _opened(path: str, kind: str, sealed: list[Any]) -> Any:
    """An answer's value: a result or chunk, or its error raised."""
    try:
        value = open_sealed(sealed)
    except _shm.SegmentLost as exc:  # the host closed before this call read it
        raise HostUnavailable(path, f"the answer was lost ({exc})") from exc
    except Exception as exc:  # fails this call alone
        raise TypeError(f"the model host's answer cannot be read here: {exc!r}") from exc
    if kind == "error":
        raise unpack_error(value)
    return value
