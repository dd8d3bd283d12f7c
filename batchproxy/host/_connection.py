"""One `RemoteProxy` connection: the socket to the host on one event loop.

Each call has an id, and a waiter of its own for the host's answers with that id (a
future for a unary call's one answer or a list's results; a queue for a stream's
chunks, then its end or error). The reader task is the only code that delivers those
answers, all those that arrived together in one go; when the connection
ends it delivers `HostUnavailable` to every call still waiting (and tells its owner,
`on_lost`). A call with a deadline (`_deadline`) waits for nothing past it: not for
room to write its message, nor for an answer (its queue gets the deadline when it
passes). A call whose caller is done before its last answer (cancelled, past its
deadline, a stream closed early) leaves with a `("cancel", id)` to the host. The
items' shared-memory segments the host has not read when the connection ends are
unlinked then (`_shm`). Each new connection asks the host's health at once, for its
owner (`on_health`), without waiting for the answer.

The messages queued in one iteration of the loop (calls, cancels, health questions)
are written together when the loop next runs its callbacks, in order (`_queue`).
The transport may know the connection lost before the reader task does (a write
failed: the host is gone); from then on nothing is written to it. A call whose
message could not be written at all (the connection found lost when it was queued,
or when the queue was written) raises `NotSent` if the connection had carried calls
(it was lost while idle), and its `RemoteProxy` sends it on a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from .._errors import HostUnavailable
from .._stats import Health
from . import _shm
from ._deadline import Deadline
from ._wire import (
    MessageReader,
    message_bytes,
    open_sealed,
    owned,
    seal,
    sealed_message,
    segment_names,
    unpack_error,
)

__all__ = ["Connection", "NotSent"]

_Answer = tuple[str, Any] | BaseException | Deadline
"""What a call's waiter gets: an answer `(kind, sealed)` from the host, the error that
ends it here (the `HostUnavailable` of a lost connection, a drain's `DrainDeadline`:
`cut`), or the call's `Deadline` once it passed."""

_Waiter = asyncio.Future[list[_Answer]] | asyncio.Queue[_Answer]
"""A call's: a future for its one final answer, a queue for a stream's. The future's
result is a list the answer is taken out of: the loop's callback that wakes the call
holds the future until the call's task next yields, and an answer left in it would
keep its arrays' shared memory mapped until then."""


def _put(waiter: _Waiter, answer: _Answer) -> None:
    """Hand `answer` to a call's waiter (a future already done keeps its first)."""
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():
            waiter.set_result([answer])
    else:
        waiter.put_nowait(answer)


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
        on_health: Callable[[Health], None],
    ) -> None:
        self.path = path
        self.loop = loop
        self.writer = writer
        self.open = True
        self.waiting: dict[int, _Waiter] = {}
        self.segments = _shm.Ledger()  # of the items written, until the host reads them
        self._on_lost = on_lost
        self._on_health = on_health
        self._health_asks: set[int] = set()  # asked by `ask_health`, not answered yet
        self._idle = asyncio.Event()  # set while no call waits (`waiting` is empty)
        self._idle.set()
        self._ids = itertools.count()
        self._lock = asyncio.Lock()  # one drain at a time (Python 3.10's streams allow no more)
        self._room = writer.transport.get_write_buffer_limits()[1]  # (then, writes pause)
        self._carried = False  # a call's message was written (see `_unsent`)
        self._pending: list[bytes] = []  # queued, written together (`_queue`)
        self._pending_calls: list[int] = []  # the calls among them
        self._queued = 0  # their bytes
        self._reader = loop.create_task(self._read(reader))

    async def call(self, item: Any, options: dict[str, Any], deadline: Deadline | None) -> Any:
        message = self._sealed("call", item, options)
        return await self._one_answer(message, deadline)

    async def many(
        self,
        items: list[Any],
        options: dict[str, Any],
        return_exceptions: bool,
        deadline: Deadline | None,
    ) -> list[Any]:
        """`inference_many` in one message, admitted by the host all at once (each item
        sealed on its own: one that cannot travel fails alone, in its place with
        `return_exceptions`, else the whole call before anything is sent)."""
        parts: list[list[Any]] = []
        unsendable: dict[int, Exception] = {}
        try:
            for index, item in enumerate(items):
                try:
                    parts.append(owned(seal(item)))
                except Exception as exc:
                    if not return_exceptions:
                        raise _unsendable(self.path, exc) from exc
                    unsendable[index] = _unsendable(self.path, exc)
        except BaseException:
            _shm.unlink([name for sealed in parts for name in segment_names(sealed)])
            raise
        if not parts:  # (none could be sent)
            return [unsendable[index] for index in range(len(items))]
        extra = (return_exceptions,)
        message = self._sealed("many", parts, options, extra)
        kind, entries = _received(await self._final_answer(message, deadline))
        if kind == "error":
            raise unpack_error(_value(self.path, entries))
        sent = [_outcome(self.path, *entry) for entry in entries]
        failure = None if return_exceptions else _first_failure(sent)
        if failure is not None:
            # (no local may keep it: this frame is in its traceback, a cycle)
            del sent
            try:
                raise failure
            finally:
                del failure
        outcomes = iter(sent)
        return [unsendable.pop(i) if i in unsendable else next(outcomes) for i in range(len(items))]

    async def stream(
        self, item: Any, options: dict[str, Any], deadline: Deadline | None
    ) -> AsyncGenerator[Any, None]:
        answers: asyncio.Queue[_Answer] = asyncio.Queue()
        ident = await self._send(self._sealed("stream", item, options), deadline, answers)
        timer = None if deadline is None else deadline.arm(self.loop, _put, answers)
        try:
            while True:
                kind, sealed = _received(await answers.get())
                if kind == "end":
                    return
                chunk = _opened(self.path, kind, sealed)  # an "error" raises here
                yield chunk
        finally:
            if timer is not None:
                timer.cancel()
            self._leave(ident)

    async def health(self, deadline: Deadline) -> Health:
        """The host's `Health`, asked now (`deadline.exceeded()` if no answer by then)."""
        health = await self._one_answer(
            lambda ident: (message_bytes(("health", ident)), []), deadline
        )
        assert isinstance(health, Health), health
        return health

    def ask_health(self) -> None:
        """Ask the host's `Health` without waiting: its answer goes to `on_health`."""
        ident = next(self._ids)
        self._health_asks.add(ident)
        self._queue(message_bytes(("health", ident)))

    async def _one_answer(
        self, message: Callable[[int], tuple[bytes, list[str]]], deadline: Deadline | None
    ) -> Any:
        """Send `message(id)`; the host's one answer to it (its error raised)."""
        kind, sealed = _received(await self._final_answer(message, deadline))
        return _opened(self.path, kind, sealed)

    async def _final_answer(
        self, message: Callable[[int], tuple[bytes, list[str]]], deadline: Deadline | None
    ) -> _Answer:
        """Send `message(id)`; what its waiter gets first (by `deadline`, if any)."""
        answer: asyncio.Future[list[_Answer]] = self.loop.create_future()
        ident = await self._send(message, deadline, answer)
        timer = None if deadline is None else deadline.arm(self.loop, _put, answer)
        try:
            return (await answer).pop()
        finally:
            if timer is not None:
                timer.cancel()
            self._leave(ident)

    async def _send(
        self,
        message: Callable[[int], tuple[bytes, list[str]]],
        deadline: Deadline | None,
        answers: _Waiter,
    ) -> int:
        """Send `message(id)` (its bytes, and the shared-memory segments they carry),
        then, if the socket's buffer is full, wait for room, by `deadline` at most;
        the id (its `answers` registered before the message is written, so no answer
        can arrive unseen)."""
        ident = next(self._ids)
        data, names = message(ident)
        self.waiting[ident] = answers
        self._idle.clear()
        try:
            if not self.writable():
                raise self._unsent()
            self._queue(data, ident)  # (whole: the messages never interleave)
            self.segments.add(names)  # the host unlinks them as it reads the call
            names = []
            if self._queued + self.writer.transport.get_write_buffer_size() > self._room:
                # the host reads slower than this process writes, or not at all
                self._flush()
                room = self._drain()
                await (room if deadline is None else deadline.bound(room))
        except NotSent:
            self._leave(ident)
            raise
        except ConnectionError as exc:
            self._leave(ident)
            raise HostUnavailable(self.path, f"the connection broke ({exc!r})") from exc
        except BaseException:
            self._leave(ident)  # (past its deadline too: withdrawn, if it was written)
            raise
        finally:
            _shm.unlink(names)  # never written (cancelled, or lost): nobody else knows them
        return ident

    def _queue(self, data: bytes, ident: int | None = None) -> None:
        """Queue a message (of call `ident`, if a call's): the messages queued in one
        iteration of the loop are written together, in order, when it next runs its
        callbacks (`_flush`: one system call, and one wakeup of the host, for all the
        calls of the requests that arrived together)."""
        if not self._pending:
            self.loop.call_soon(self._flush)
        self._pending.append(data)
        self._queued += len(data)
        if ident is not None:
            self._pending_calls.append(ident)

    def _flush(self) -> None:
        """Write the messages queued. A call whose message could not be written at all
        (the connection was found lost: not writable, or its first byte refused) ends
        with `_unsent()`, as if it had found so itself."""
        pending, self._pending, self._queued = self._pending, [], 0
        calls, self._pending_calls = self._pending_calls, []
        if not pending:
            return
        if self.writable():
            fresh = self.writer.transport.get_write_buffer_size() == 0
            self.writer.write(pending[0] if len(pending) == 1 else b"".join(pending))
            if not (fresh and self.writer.is_closing()):  # (else its first byte refused)
                self._carried = self._carried or bool(calls)
                return
        unsent = self._unsent()
        for ident in calls:
            answers = self.waiting.get(ident)
            if answers is not None:
                self._forget(ident)  # (nothing of it reached the host: no cancel)
                _put(answers, unsent)

    async def _drain(self) -> None:
        """Until the socket has room again (for every call waiting for it)."""
        async with self._lock:
            await self.writer.drain()

    def _unsent(self) -> HostUnavailable:
        """The error of a call found the connection lost before any of it was written:
        `NotSent` (to be sent on a new connection) if this connection carried calls
        before, so was lost while it stood idle; else `HostUnavailable` (the host
        ended it as it opened: it refuses this process, or died then)."""
        kind = NotSent if self._carried else HostUnavailable
        return kind(self.path, "the connection to the host was lost")

    def _sealed(
        self, kind: str, value: Any, options: dict[str, Any], extra: tuple[Any, ...] = ()
    ) -> Callable[[int], tuple[bytes, list[str]]]:
        """A call's message, once it has its id: `(kind, id, sealed value, options,
        *extra)` and its segments (`value` is an item, or a list's items already
        sealed one by one); one whose item or options cannot travel fails here, alone."""

        def message(ident: int) -> tuple[bytes, list[str]]:
            if kind == "many":
                names = [name for sealed in value for name in segment_names(sealed)]
                try:
                    return message_bytes((kind, ident, value, options, *extra)), names
                except Exception as exc:
                    _shm.unlink(names)
                    raise _unsendable(self.path, exc) from exc
                except BaseException:
                    _shm.unlink(names)
                    raise
            try:
                data, names = sealed_message(kind, ident, value, options)
            except Exception as exc:
                raise _unsendable(self.path, exc) from exc
            return data, names

        return message

    def _leave(self, ident: int) -> None:
        """The caller is done with call `ident`: if the host may still be working on it
        (it is still listed: no final answer came), tell the host to drop it."""
        if self._forget(ident) and self.writable():
            self._queue(message_bytes(("cancel", ident)))  # (after its call, queued or not)

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
        inbox = MessageReader(reader)
        try:
            while True:
                # (each handed on, not kept in this frame while the next are awaited: its
                # buffers may map shared memory, freed only with the last reference)
                answers = await inbox.next()
                answers.reverse()
                while answers:
                    self._deliver(*answers.pop())
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                why = f"the connection to the host broke ({exc!r})"
        except asyncio.CancelledError:
            why = "the RemoteProxy was closed"
            raise
        finally:
            self._fail_waiting(why)

    def _deliver(self, kind: str, ident: int, sealed: Any) -> None:
        """An answer to the call it is for (opened by the call itself)."""
        answers = self.waiting.get(ident)
        if answers is None:
            if ident in self._health_asks:  # (not a call: nobody waits for it)
                self._health_asks.discard(ident)
                self._heard(kind, sealed)
            return  # else a call withdrawn meanwhile
        if kind != "chunk":  # the call's last answer: the host is done with it
            self._forget(ident)
        _put(answers, (kind, sealed))

    def cut(self, error: Callable[[], BaseException]) -> None:
        """End every call still waiting with `error()` now (a drain's deadline); the
        owner closes the connection next, which withdraws them in the host."""
        waiting, self.waiting = self.waiting, {}
        self._idle.set()
        for answers in waiting.values():
            _put(answers, error())

    def _heard(self, kind: str, sealed: Any) -> None:
        """The answer to `ask_health`, for the owner."""
        with contextlib.suppress(Exception):
            health = open_sealed(sealed)
            if kind == "result" and isinstance(health, Health):
                self._on_health(health)

    def _fail_waiting(self, why: str) -> None:
        if self.open:
            self.open = False
            self._on_lost(why)
        waiting, self.waiting = self.waiting, {}
        self._health_asks.clear()
        self._idle.set()
        # a call still queued here was never written: `NotSent`, as if it had found the
        # connection lost itself (sent on a new one, if this one had carried calls)
        unsent = set(self._pending_calls)
        self._pending, self._pending_calls, self._queued = [], [], 0
        for ident, answers in waiting.items():
            _put(answers, self._unsent() if ident in unsent else HostUnavailable(self.path, why))
        self.writer.close()
        self.segments.unlink_all()  # the items the host did not read: nobody will now

    async def shut(self, why: str, until: float | None, cut: Callable[[], BaseException]) -> None:
        """Let the calls waiting finish (until `until`, on `time.monotonic()`, if not
        None; the owner stops new ones first: those still waiting then end with
        `cut()`), then close (`close`)."""
        left = None if until is None else max(0.0, until - time.monotonic())
        try:
            await asyncio.wait_for(self._idle.wait(), left)
        except asyncio.TimeoutError:
            self.cut(cut)
        await self.close(why)

    async def close(self, why: str) -> None:
        """Fail the calls still waiting (`HostUnavailable`) and close at once: what is
        not written yet (to a host that stopped reading) is dropped, and the host
        withdraws this connection's calls as it sees it closed."""
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._fail_waiting(why)
        self.writer.transport.abort()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def _unsendable(path: str, exc: Exception) -> TypeError:
    return TypeError(f"the call cannot be sent to the model host at {path}: {exc!r}")


def _received(answer: _Answer) -> tuple[str, Any]:
    if isinstance(answer, tuple):
        return answer
    if isinstance(answer, Deadline):
        raise answer.exceeded()
    raise answer


def _opened(path: str, kind: str, sealed: list[Any]) -> Any:
    """An answer's value: a result or chunk, or its error raised."""
    value = _value(path, sealed)
    if kind == "error":
        raise unpack_error(value)
    return value


def _outcome(path: str, kind: str, sealed: list[Any]) -> Any:
    """One item's answer in a list's: its result, or its error, returned and never
    raised (a traceback would keep this frame's callers, which hold the list it goes
    in: a cycle)."""
    try:
        value = open_sealed(sealed)
    except _shm.SegmentLost as exc:
        return HostUnavailable(path, f"the answer was lost ({exc})")
    except Exception as exc:
        return _unreadable(exc)
    return unpack_error(value) if kind == "error" else value


def _first_failure(outcomes: list[Any]) -> Exception | None:
    return next((outcome for outcome in outcomes if isinstance(outcome, Exception)), None)


def _value(path: str, sealed: list[Any]) -> Any:
    """A sealed value opened; one that cannot be is this call's error alone."""
    try:
        return open_sealed(sealed)
    except _shm.SegmentLost as exc:  # the host closed before this call read it
        raise HostUnavailable(path, f"the answer was lost ({exc})") from exc
    except Exception as exc:  # fails this call alone
        raise _unreadable(exc) from exc


def _unreadable(exc: Exception) -> TypeError:
    return TypeError(f"the model host's answer cannot be read here: {exc!r}")
