"""Cancel a request's work when its HTTP client disconnects: the ASGI side (FastAPI,
Starlette, any ASGI app); the aiohttp side is in `aiohttp`.

An ASGI server tells an app its client is gone by answering `receive()` with
``{"type": "http.disconnect"}``, but only once the app has read its body, and only
to an app that calls `receive()` again, which a FastAPI route does not.
`CancelOnDisconnect` does, once per request, in one waiter task: it starts
`WATCH_AFTER` seconds after the request came, if the response is not complete by
then, and waits on `receive()`, which costs nothing until the server wakes it. A
request answered sooner never makes the task (a timer, armed and cancelled, is all
it pays): so the watch costs nothing measurable where requests are fast, and where
they wait in a queue, which is where a client that leaves costs a model its time,
it is there.

A body the app has not read by then (a route without a body parameter, or one that
reads it after a call) stands before the disconnect: the waiter reads it ahead and
keeps it for the app, which gets every message when it reads, however late. It
reads at most `READ_AHEAD` bytes beyond what the app has taken, as the server
itself buffers no more; a longer body the app leaves unread hides the disconnect
until the app reads on.

When the client disconnects before the response is complete, the waiter marks the
request's `Client` gone and cancels the task that handles the request: every
batchproxy call it waits on is cancelled like any cancelled call (a queued one
leaves the queue and never reaches the model, a running one has its result
dropped) and counted as `disconnected`. The middleware then completes the
response, with status 499 (client closed request) if it had not started, which
the server drops: whatever wraps the app (Starlette's ``@app.middleware("http")``
awaits a response, and takes none for an error) sees an ordinary answer, as
aiohttp's middlewares do. A response already complete is left alone (its
background tasks too). No polling: the waiter sleeps in the server's `receive()`.

The app still sees ``http.disconnect`` if it calls `receive()` itself (Starlette's
`StreamingResponse` and `request.is_disconnected()` do): the waiter hands it on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .._client import Client, current_client

__all__ = ["CancelOnDisconnect"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

_DISCONNECT: Message = {"type": "http.disconnect"}

WATCH_AFTER = 0.05
"""Seconds a request runs before its disconnect waiter starts."""

READ_AHEAD = 2**16
"""Bytes of body the waiter reads beyond what the app has taken (uvicorn's own
high-water mark), to reach the disconnect behind a body the app has not read."""

CLIENT_CLOSED = 499
"""The status of the response completed for a client that left (nginx's)."""


class CancelOnDisconnect:
    """ASGI middleware: cancel the handling of an HTTP request whose client disconnects
    before its response is complete (see the module)."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        watch = _Watch(receive, send, task)
        token = current_client.set(watch.client)
        try:
            await self.app(scope, watch.receive, watch.send)
        except asyncio.CancelledError:
            if not watch.cancelled or _uncancel(task):  # (someone else cancelled it too)
                raise
            # the client is gone: nobody reads the answer, but whatever wraps the app
            # awaits one
            await watch.complete()
        finally:
            current_client.reset(token)
            watch.stop()


def _uncancel(task: asyncio.Task[Any]) -> int:
    """Withdraw the waiter's cancel request; how many others remain (Python 3.11+; on
    3.10 a task does not count them: none)."""
    uncancel = getattr(task, "uncancel", None)
    return 0 if uncancel is None else int(uncancel())


def _size(message: Message) -> int:
    return len(message.get("body", b""))


class _Watch:
    """One request's disconnect waiter, and the `receive` and `send` its app gets.

    Until the waiter starts, the app reads from the server itself; from then on the
    waiter alone does (two readers would race for each message), and the app takes
    what it read, in order."""

    __slots__ = (
        "_body_read",
        "_buffered",
        "_complete",
        "_due",
        "_error",
        "_pending",
        "_reading",
        "_receive",
        "_room",
        "_send",
        "_started",
        "_task",
        "_timer",
        "_waiter",
        "_waiting",
        "cancelled",
        "client",
    )

    def __init__(self, receive: Receive, send: Send, task: asyncio.Task[Any]) -> None:
        self.client = Client()
        self.cancelled = False  # the waiter cancelled the handling task
        self._receive = receive
        self._send = send
        self._task = task
        self._started = False  # the response has started
        self._complete = False  # the response was sent whole
        self._body_read = False  # the app has read the whole body itself
        self._reading = False  # the app awaits the server's receive() itself
        self._due = False  # the waiter starts when the app's read returns
        self._pending: deque[Message] = deque()  # what the waiter received for the app
        self._buffered = 0  # the bytes of body in `_pending`
        self._error: Exception | None = None  # what the waiter's receive() raised
        self._waiting: list[asyncio.Future[None]] = []  # the app's receive() calls waiting
        self._room: asyncio.Future[None] | None = None  # the waiter waits for the app to read
        self._waiter: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = loop.call_later(WATCH_AFTER, self._on_time)

    def _on_time(self) -> None:
        self._timer = None
        if self._reading:
            self._due = True
        else:
            self._start()

    def _start(self) -> None:
        if not self._complete and self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_task(self._wait())

    async def _wait(self) -> None:
        """The waiter: read on (the body's rest, kept for the app) until the client is
        gone, then sleep in the server's `receive()` until it is."""
        receive = self._receive
        try:
            while True:
                while self._buffered > READ_AHEAD:  # the app reads slower than it comes
                    self._room = asyncio.get_running_loop().create_future()
                    await self._room
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
                self._pending.append(message)
                self._buffered += _size(message)
                self._wake()
        except Exception as error:  # (a body limit outside): the app's to see when it reads
            self._error = error
            self._wake()
            return
        if not self._complete:
            self.client.gone = True
            self.cancelled = True
            self._task.cancel()
        self._wake()

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, []
        for future in waiting:
            if not future.done():
                future.set_result(None)

    async def receive(self) -> Message:
        if self._waiter is None:
            if not self._body_read or self._complete:  # the app reads from the server
                self._reading = True
                try:
                    message = await self._receive()
                finally:
                    self._reading = False
                    if self._due:  # the timer went off meanwhile
                        self._due = False
                        self._start()
                if message["type"] == "http.request" and not message.get("more_body", False):
                    self._body_read = True
                return message
            # the app waits for what follows its body, the disconnect: the waiter reads it
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._start()
        return await self._take()

    async def _take(self) -> Message:
        """The app takes the next message the waiter read."""
        waiter = self._waiter
        assert waiter is not None
        while not self._pending:
            if waiter.done():
                error, self._error = self._error, None
                if error is not None:
                    raise error
                return _DISCONNECT
            future = asyncio.get_running_loop().create_future()
            self._waiting.append(future)
            await future
        message = self._pending.popleft()
        self._buffered -= _size(message)
        room = self._room
        if room is not None and self._buffered <= READ_AHEAD:
            self._room = None
            if not room.done():
                room.set_result(None)
        return message

    def send(self, message: Message) -> Awaitable[None]:
        # (a plain function handing on the server's awaitable: no coroutine of its own)
        kind = message["type"]
        if kind == "http.response.start":
            self._started = True
        elif kind == "http.response.body":
            if not message.get("more_body", False):
                self._complete = True
        elif kind == "http.response.pathsend":  # (the file is the whole body)
            self._complete = True
        return self._send(message)

    async def complete(self) -> None:
        """The client is gone and the app cancelled: complete its response (499 if it
        had not started) for whatever wraps the app; the server drops it."""
        if self._complete:
            return
        try:
            if not self._started:
                start = {"type": "http.response.start", "status": CLIENT_CLOSED, "headers": []}
                await self.send(start)
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # (a server may say so of a closed connection: ASGI 2.4)
            pass

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._error = None  # (its traceback holds the waiter's frame, and so this watch)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            # the cancelled waiter keeps its CancelledError, whose traceback holds the
            # waiter's frame and so this watch: let go of the waiter, or the two form a
            # cycle that holds the request's objects until a full collection
            waiter.cancel()
