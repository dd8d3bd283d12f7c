"""Cancel a request's work when its HTTP client disconnects: the ASGI side (FastAPI,
Starlette, any ASGI app); the aiohttp side is in `aiohttp`.

An ASGI server tells an app its client is gone by answering `receive()` with
``{"type": "http.disconnect"}``, but only to an app that calls `receive()` after
reading its body, and a FastAPI route does not. `CancelOnDisconnect` does, once
per request, in one waiter task: it starts `WATCH_AFTER` seconds after the app
has read the whole body (after the request came, for a request without one), if
the response is not complete by then, and waits on `receive()`, which costs
nothing until the server wakes it. A request answered sooner never makes the task
(a timer, armed and cancelled, is all it pays): so the watch costs nothing
measurable where requests are fast, and where they wait in a queue, which is where
a client that leaves costs a model its time, it is there. When the client disconnects before the
response is complete, the waiter marks the request's `Client` gone and cancels
the task that handles the request: every batchproxy call it waits on is
cancelled like any cancelled call (a queued one leaves the queue and never
reaches the model, a running one has its result dropped) and counted as
`disconnected`. A response already complete is left alone (its background tasks
too). No polling: the waiter sleeps in the server's `receive()`.

The app still sees ``http.disconnect`` if it calls `receive()` itself (Starlette's
`StreamingResponse` and `request.is_disconnected()` do): the waiter hands it on.
"""

from __future__ import annotations

import asyncio
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
"""Seconds a request runs, its body read, before its disconnect waiter starts."""


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
        watch = _Watch(receive, send, task, bodiless=_bodiless(scope))
        token = current_client.set(watch.client)
        try:
            await self.app(scope, watch.receive, watch.send)
        except asyncio.CancelledError:
            if not watch.cancelled or _uncancel(task):  # (someone else cancelled it too)
                raise
            # the client is gone: there is nobody to answer
        finally:
            current_client.reset(token)
            watch.stop()


def _uncancel(task: asyncio.Task[Any]) -> int:
    """Withdraw the waiter's cancel request; how many others remain (Python 3.11+; on
    3.10 a task does not count them: none)."""
    uncancel = getattr(task, "uncancel", None)
    return 0 if uncancel is None else int(uncancel())


def _bodiless(scope: MutableMapping[str, Any]) -> bool:
    """Whether the request has no body (so the waiter can start at once)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return bool(value.strip() == b"0")
        if name == b"transfer-encoding":
            return False
    return True


class _Watch:
    """One request's disconnect waiter, and the `receive` and `send` its app gets."""

    __slots__ = (
        "_complete",
        "_pending",
        "_receive",
        "_send",
        "_task",
        "_timer",
        "_waiter",
        "_waiting",
        "cancelled",
        "client",
    )

    def __init__(self, receive: Receive, send: Send, task: asyncio.Task[Any], *, bodiless: bool):
        self.client = Client()
        self.cancelled = False  # the waiter cancelled the handling task
        self._receive = receive
        self._send = send
        self._task = task
        self._complete = False  # the response was sent whole
        self._pending: list[Message] = []  # what the waiter received for the app
        self._waiting: list[asyncio.Future[None]] = []  # the app's receive() calls waiting
        self._waiter: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        if bodiless:
            self._arm()

    def _arm(self) -> None:
        """The body is read: start the waiter in `WATCH_AFTER` s unless answered."""
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER, self._start)

    def _start(self) -> None:
        self._timer = None
        if not self._complete:
            self._waiter = asyncio.get_running_loop().create_task(self._wait())

    async def _wait(self) -> None:
        """The waiter: sleep in the server's `receive()` until the client is gone."""
        receive = self._receive
        while (message := await receive())["type"] != "http.disconnect":
            self._pending.append(message)  # (the empty body of a bodiless request)
            self._wake()
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
        waiter = self._waiter
        if waiter is None:  # the app reads its body (or reads on before the waiter starts)
            if self._timer is not None:  # the body is read: the waiter reads from now on
                self._timer.cancel()
                self._start()  # (no waiter if the response is complete: read on below)
                if self._waiter is not None:
                    return await self.receive()
            message = await self._receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                self._arm()  # the body is read: soon, wait for the disconnect
            return message
        while not self._pending:
            if waiter.done():
                return _DISCONNECT
            future = asyncio.get_running_loop().create_future()
            self._waiting.append(future)
            await future
        return self._pending.pop(0)

    def send(self, message: Message) -> Awaitable[None]:
        # (a plain function handing on the server's awaitable: no coroutine of its own)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._complete = True
        return self._send(message)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            # the cancelled waiter keeps its CancelledError, whose traceback holds the
            # waiter's frame and so this watch: let go of the waiter, or the two form a
            # cycle that holds the request's objects until a full collection
            waiter.cancel()
