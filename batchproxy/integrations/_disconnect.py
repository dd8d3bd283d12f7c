"""Cancel a request's work when its HTTP client disconnects: the ASGI side (FastAPI,
Starlette, any ASGI app); the aiohttp side is in `aiohttp`.

An ASGI server tells an app its client is gone by answering `receive()` with
``{"type": "http.disconnect"}``, but only once the app has read its body, and only
to an app that calls `receive()` again, which a FastAPI route does not.
`CancelOnDisconnect` does, once per request, in one waiter task: it starts
`WATCH_AFTER` seconds after the request came, if the response is not complete by
then, and waits on `receive()`, which costs nothing until the server wakes it. A
request answered sooner never makes the task. What it pays: three small objects
(its watch, its `Client`, a copy of its context), `current_client` set and reset,
an ASGI layer whose `receive` and `send` check a flag or two before the server's
own, and a place in its loop's schedule of watches (one timer serves them all,
armed for the oldest still short of its time; none per request). About 2.5 µs in
process, on asyncio's loop and uvloop alike (docs/benchmarks.md): so the watch
costs nothing measurable where requests are fast, and where they wait in a queue,
which is where a client that leaves costs a model its time, it is there.

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
from contextvars import Context, copy_context
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
        self._schedule: _Schedule | None = None  # the running loop's

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        schedule = self._schedule
        if schedule is None or schedule.loop is not loop:
            # (an app served by another loop now: the last loop's schedule ends on its own)
            schedule = self._schedule = _Schedule(loop)
        watch = _Watch(receive, send, task, loop.time() + WATCH_AFTER)
        schedule.add(watch)
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
            schedule.prune()


def _uncancel(task: asyncio.Task[Any]) -> int:
    """Withdraw the waiter's cancel request; how many others remain (Python 3.11+; on
    3.10 a task does not count them: none)."""
    uncancel = getattr(task, "uncancel", None)
    return 0 if uncancel is None else int(uncancel())


def _size(message: Message) -> int:
    return len(message.get("body", b""))


class _Schedule:
    """When one loop's disconnect waiters are due: the watches of the requests still
    running, in the order they came, which is the order they are due in (each
    `WATCH_AFTER` after it came), and one timer, armed for the first, in place of a
    timer per request. The watches of complete responses are let go of from the
    front, as each request ends (a lone client's at once) and when the timer goes
    off: none is held past the time of the oldest one still waiting. The timer runs
    in an empty context of its own (armed in a request's, it would hold that
    request's context for as long as it is armed anew), each waiter in its
    request's."""

    __slots__ = ("_armed", "_context", "_watches", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._watches: deque[_Watch] = deque()
        self._armed = False  # the timer is armed, for the first watch's time or sooner
        self._context = Context()

    def add(self, watch: _Watch) -> None:
        self._watches.append(watch)
        if not self._armed:
            self._armed = True
            self.loop.call_at(watch.due, self._on_time, watch.due, context=self._context)

    def prune(self) -> None:
        """Let go of the first watches, as long as their responses are complete."""
        watches = self._watches
        while watches and watches[0].done:
            watches.popleft()

    def _on_time(self, now: float) -> None:
        """The timer, armed for `now`: start the waiters due by then, arm it for the next."""
        watches = self._watches
        while watches:
            watch = watches[0]
            if not watch.done and watch.due > now:
                self.loop.call_at(watch.due, self._on_time, watch.due, context=self._context)
                return
            watches.popleft()
            if not watch.done:
                watch.context.run(watch.on_time)
        self._armed = False


class _Watch:
    """One request's disconnect waiter, and the `receive` and `send` its app gets.

    Until the waiter starts, the app reads from the server itself; from then on the
    waiter alone does (two readers would race for each message), and the app takes
    what it read, in order. What only the waiter uses is made when it starts."""

    __slots__ = (
        "_body_read",
        "_buffered",
        "_due",
        "_error",
        "_pending",
        "_reading",
        "_receive",
        "_room",
        "_send",
        "_started",
        "_task",
        "_waiter",
        "_waiting",
        "cancelled",
        "client",
        "context",
        "done",
        "due",
    )

    def __init__(self, receive: Receive, send: Send, task: asyncio.Task[Any], due: float) -> None:
        self.client = Client()
        self.cancelled = False  # the waiter cancelled the handling task
        self.due = due  # the loop's time the waiter starts at, if the response is not complete
        self.context = copy_context()  # the request's, for the waiter its time starts
        self.done = False  # the response was sent whole, or the request is over
        self._receive = receive
        self._send = send
        self._task = task
        self._started = False  # the response has started
        self._body_read = False  # the app has read the whole body itself
        self._reading = False  # the app awaits the server's receive() itself
        self._due = False  # the waiter starts when the app's read returns
        self._waiter: asyncio.Task[None] | None = None
        # made with the waiter (`_start`):
        self._pending: deque[Message]  # what the waiter received for the app
        self._buffered: int  # the bytes of body in `_pending`
        self._error: Exception | None  # what the waiter's receive() raised
        self._waiting: list[asyncio.Future[None]]  # the app's receive() calls waiting
        self._room: asyncio.Future[None] | None  # the waiter waits for the app to read

    def on_time(self) -> None:
        """`WATCH_AFTER` has passed (`_Schedule`), the response is not complete."""
        if self._reading:
            self._due = True
        else:
            self._start()

    def _start(self) -> None:
        if not self.done and self._waiter is None:
            self._pending = deque()
            self._buffered = 0
            self._error = None
            self._waiting = []
            self._room = None
            self._waiter = self._task.get_loop().create_task(self._wait())

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
        if not self.done:
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
            if not self._body_read or self.done:  # the app reads from the server
                self._reading = True
                try:
                    message = await self._receive()
                finally:
                    self._reading = False
                    if self._due:  # the waiter came due meanwhile
                        self._due = False
                        self._start()
                if message["type"] == "http.request" and not message.get("more_body", False):
                    self._body_read = True
                return message
            # the app waits for what follows its body, the disconnect: the waiter reads it
            # (its time, when it comes, finds it started)
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
                self.done = True
        elif kind == "http.response.pathsend":  # (the file is the whole body)
            self.done = True
        return self._send(message)

    async def complete(self) -> None:
        """The client is gone and the app cancelled: complete its response (499 if it
        had not started) for whatever wraps the app; the server drops it."""
        if self.done:
            return
        try:
            if not self._started:
                start = {"type": "http.response.start", "status": CLIENT_CLOSED, "headers": []}
                await self.send(start)
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # (a server may say so of a closed connection: ASGI 2.4)
            pass

    def stop(self) -> None:
        """The request is over: no waiter starts now; the one started, if any, ends."""
        self.done = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._error = None  # (its traceback holds the waiter's frame, and so this watch)
            if not waiter.done():
                # the cancelled waiter keeps its CancelledError, whose traceback holds the
                # waiter's frame and so this watch: let go of the waiter, or the two form
                # a cycle that holds the request's objects until a full collection
                waiter.cancel()
