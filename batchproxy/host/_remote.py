"""`RemoteProxy`: a proxy's call methods in a process that does not hold the model,
answered by a `ModelHost` over its Unix domain socket.

One connection per event loop (a web worker's, and the `BackgroundLoop` that plain
threads call through), opened on its first call there and again on the first call
after it was lost. Each call has an id, and a queue of its own for the host's answers
with that id (a unary call's one answer; a stream's chunks, then its end or error).
The connection's reader is the only code that delivers those answers; when the
connection ends it delivers `HostUnavailable` to every call still waiting, and a call
whose caller is cancelled (or whose stream is closed early) leaves with a
`("cancel", id)` to the host. Plain threads (`submit`, `inference_sync`) call through
the process-wide `BackgroundLoop`, on a connection of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import time
import weakref
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from typing_extensions import Unpack

from .. import _validate
from .._errors import DeadlineExceeded, HostUnavailable
from .._loops.background_loop import BackgroundLoop
from .._option_values import CallOptions, check_call
from ._wire import message_bytes, open_sealed, read_message, seal, unpack_error

__all__ = ["RemoteProxy"]

_Answer = tuple[str, list[Any]] | HostUnavailable
"""What a call's queue gets: an answer `(kind, sealed)` from the host, or the
`HostUnavailable` of a lost connection."""

_HAND_OVER = 1.0
"""Seconds `aclose()` waits for another loop to close its connection."""

_SYNC_MARGIN = 0.5
"""Seconds a thread waits beyond its call's timeout (which the host enforces) before it
gives up on a host too busy to answer at all."""


class RemoteProxy:
    """Calls to the proxy a `ModelHost` serves on `path`, from this process.

    The proxy's call methods, with its call options (`timeout`, `priority`,
    `tenant`, `key`), checked here before anything is sent: `inference`,
    `inference_many`, `stream` (the host's stream, chunk by chunk; a proxy that
    does not stream sends its one result), and from plain threads `submit` and
    `inference_sync`. The host applies the options, so its batches mix the calls
    of every connected process. A timeout travels as a deadline. The host's errors
    arrive as the same exceptions (`QueueFull`, `DeadlineExceeded`, `InvalidItem`,
    the model's own), and a host that cannot be reached or is lost with the call in
    flight raises `HostUnavailable` (never a hang). Cancelling a call (or closing
    its stream early) cancels it in the host. `connect_timeout`: seconds to wait for
    the socket.
    """

    def __init__(self, path: str | os.PathLike[str], *, connect_timeout: float = 5.0) -> None:
        self.path = os.fspath(path)
        self.connect_timeout = connect_timeout
        # by loop; each changed on its own loop only (aclose() of another hands over)
        self._connections: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Connection] = (
            weakref.WeakKeyDictionary()
        )
        self._connecting: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Task[_Connection]
        ] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"RemoteProxy({self.path!r})"

    async def __aenter__(self) -> RemoteProxy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def inference(self, item: Any, **call: Unpack[CallOptions]) -> Any:
        """`item`'s result from the host's proxy (see the class)."""
        options = _options("inference()", call)
        connection = await self._connect()
        return await connection.call(item, options)

    async def inference_many(
        self, items: Iterable[Any], *, return_exceptions: bool = False, **call: Unpack[CallOptions]
    ) -> list[Any]:
        """Each item as its own call, all at once; results in order. With
        `return_exceptions`, a failed item's exception takes its place instead of
        the first failure raising (the other calls are then cancelled)."""
        _options("inference_many()", call)  # a bad option raises here, not per item
        calls = [asyncio.ensure_future(self.inference(item, **call)) for item in items]
        try:
            return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))
        finally:
            for task in calls:
                task.cancel()

    async def stream(self, item: Any, **call: Unpack[CallOptions]) -> AsyncGenerator[Any, None]:
        """`item`'s chunks from the host proxy's `stream` as they come (its `timeout`
        bounds the whole stream). Leaving the loop early, closing the iterator or
        being cancelled cancels the call in the host."""
        options = _options("stream()", call)
        connection = await self._connect()
        async with contextlib.aclosing(connection.stream(item, options)) as chunks:
            async for chunk in chunks:
                yield chunk

    def submit(self, item: Any, **call: Unpack[CallOptions]) -> concurrent.futures.Future[Any]:
        """From a plain thread: `inference` on the process-wide `BackgroundLoop`; a
        `concurrent.futures.Future` of its result (cancel it to cancel the call)."""
        _options("submit()", call)
        return BackgroundLoop.default().submit(self.inference(item, **call))

    def inference_sync(self, item: Any, **call: Unpack[CallOptions]) -> Any:
        """From a plain thread: block for `inference`'s result (on the process-wide
        `BackgroundLoop`). An interrupted wait (`KeyboardInterrupt`) cancels the call.
        Refused in a thread that runs an event loop, which it would block (`await
        remote.inference(...)` there)."""
        options = _options("inference_sync()", call)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop in this thread: the usual case
        else:
            raise RuntimeError(
                f"{self!r}.inference_sync() was called in a thread running an event loop, "
                f"which it would block: await remote.inference(...) there"
            )
        future = BackgroundLoop.default().submit(self.inference(item, **call))
        seconds = options.get("timeout")
        try:
            done, _ = concurrent.futures.wait(
                [future], None if seconds is None else seconds + _SYNC_MARGIN
            )
        except BaseException:  # interrupted: the call is withdrawn, not left queued
            future.cancel()
            raise
        if not done and future.cancel():  # (cancel() fails only if it just finished)
            assert seconds is not None  # only a bounded wait ends without the result
            raise DeadlineExceeded(self.path, seconds)
        return future.result()

    async def aclose(self) -> None:
        """Close this process's connections (calls still waiting fail with
        `HostUnavailable`); the next call opens a new one. Another running loop's
        connection is closed on that loop."""
        here = asyncio.get_running_loop()
        connections = list(self._connections.items())
        self._connections.clear()
        why = "the RemoteProxy was closed"
        for loop, connection in connections:
            if loop is here:
                await connection.close(why)
            elif loop.is_running():
                # bounded: a loop that stops before it runs this never answers
                with contextlib.suppress(RuntimeError, asyncio.TimeoutError):
                    closing = asyncio.run_coroutine_threadsafe(connection.close(why), loop)
                    await asyncio.wait_for(asyncio.wrap_future(closing), _HAND_OVER)
            # else: a loop that no longer runs; its transports go with it

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = self._connections.get(loop)
        if connection is not None and connection.open:
            return connection
        connecting = self._connecting.get(loop)
        if connecting is None or connecting.done():
            connecting = self._connecting[loop] = loop.create_task(self._open(loop))
        return await asyncio.shield(connecting)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path), self.connect_timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise HostUnavailable(self.path, f"cannot connect ({exc!r})") from exc
        connection = self._connections[loop] = _Connection(self.path, loop, reader, writer)
        return connection


def _options(where: str, call: CallOptions) -> dict[str, Any]:
    """The call's options as they travel, checked as the proxy checks them: a timeout
    (None or infinite: none) goes with its deadline on the machine's monotonic clock."""
    check_call(where, call)
    options: dict[str, Any] = {"priority": _validate.priority(call.get("priority", 0))}
    for name in ("tenant", "key"):
        value = call.get(name)
        if value is not None:
            options[name] = _validate.hashable(name, value)
    timeout = _validate.timeout("timeout", call.get("timeout"))
    if timeout is not None:
        options["timeout"] = timeout
        options["deadline"] = time.monotonic() + timeout
    return options


class _Connection:
    """The socket to the host on one event loop: each call's answer queue by id, and the
    reader task that fills them."""

    def __init__(
        self,
        path: str,
        loop: asyncio.AbstractEventLoop,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.path = path
        self.loop = loop
        self.writer = writer
        self.open = True
        self.waiting: dict[int, asyncio.Queue[_Answer]] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._reader = loop.create_task(self._read(reader))

    async def call(self, item: Any, options: dict[str, Any]) -> Any:
        ident, answers = await self._send("call", item, options)
        try:
            kind, sealed = _received(await answers.get())
        finally:
            self._leave(ident)
        return _opened(kind, sealed)

    async def stream(self, item: Any, options: dict[str, Any]) -> AsyncGenerator[Any, None]:
        ident, answers = await self._send("stream", item, options)
        try:
            while True:
                kind, sealed = _received(await answers.get())
                if kind == "end":
                    return
                chunk = _opened(kind, sealed)  # an "error" raises here
                yield chunk
        finally:
            self._leave(ident)

    async def _send(
        self, kind: str, item: Any, options: dict[str, Any]
    ) -> tuple[int, asyncio.Queue[_Answer]]:
        """Send the call; its id and its answer queue (registered before the message is
        written, so no answer can arrive unseen)."""
        ident = next(self._ids)
        try:
            data = message_bytes((kind, ident, seal(item), options))
        except Exception as exc:  # an item that cannot travel fails here, alone
            raise TypeError(
                f"the call cannot be sent to the model host at {self.path}: {exc!r}"
            ) from exc
        answers: asyncio.Queue[_Answer] = asyncio.Queue()
        self.waiting[ident] = answers
        try:
            async with self._lock:
                if not self.open:
                    raise HostUnavailable(self.path, "the connection to the host was lost")
                self.writer.write(data)
                await self.writer.drain()
        except ConnectionError as exc:
            self._leave(ident)
            raise HostUnavailable(self.path, f"the connection broke ({exc!r})") from exc
        except BaseException:
            self._leave(ident)
            raise
        return ident, answers

    def _leave(self, ident: int) -> None:
        """The caller is done with call `ident`: if the host may still be working on it
        (it is still listed: no final answer came), tell the host to drop it."""
        if self.waiting.pop(ident, None) is not None and self.open:
            with contextlib.suppress(Exception):
                self.writer.write(message_bytes(("cancel", ident)))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the host closed the connection"
        try:
            while True:
                kind, ident, sealed = await read_message(reader)
                answers = self.waiting.get(ident)
                if answers is None:
                    continue  # a call withdrawn meanwhile
                if kind != "chunk":  # the call's last answer: the host is done with it
                    del self.waiting[ident]
                answers.put_nowait((kind, sealed))  # opened by the call itself
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                why = f"the connection to the host broke ({exc!r})"
        except asyncio.CancelledError:
            why = "the RemoteProxy was closed"
            raise
        finally:
            self._fail_waiting(why)

    def _fail_waiting(self, why: str) -> None:
        self.open = False
        waiting, self.waiting = self.waiting, {}
        for answers in waiting.values():
            answers.put_nowait(HostUnavailable(self.path, why))
        self.writer.close()

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


def _opened(kind: str, sealed: list[Any]) -> Any:
    """An answer's value: a result or chunk, or its error raised."""
    try:
        value = open_sealed(sealed)
    except Exception as exc:  # fails this call alone
        raise TypeError(f"the model host's answer cannot be read here: {exc!r}") from exc
    if kind == "error":
        raise unpack_error(value)
    return value
