"""The ASGI disconnect watch (`CancelOnDisconnect`) in process, its server faked: when
each request's waiter starts (one timer per loop serves them all), what a streaming
response gets when its client leaves, what the watch holds on to once a request is
over, and one middleware served by two loops at once. The servers are in
tests/integrations/test_disconnect.py."""

from __future__ import annotations

import asyncio
import weakref
from contextlib import suppress
from contextvars import ContextVar
from typing import Any

import pytest

from batchproxy._client import client_gone
from batchproxy.integrations._disconnect import WATCH_AFTER, CancelOnDisconnect

Message = dict[str, Any]
START = {"type": "http.response.start", "status": 200, "headers": []}
BODY = {"type": "http.response.body", "body": b"ok", "more_body": False}


class Exchange:
    """One request as the server hands it to the app: its body (one message), then the
    disconnect once the client `leave`s; when each `receive()` was called, by which
    task, and what the app sent."""

    def __init__(self) -> None:
        self.messages: list[Message] = [{"type": "http.request", "body": b"", "more_body": False}]
        self.gone = asyncio.Event()
        self.reads: list[tuple[float, asyncio.Task[Any] | None]] = []
        self.sent: list[Message] = []

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> Message:
        self.reads.append((asyncio.get_running_loop().time(), asyncio.current_task()))
        if self.messages:
            return self.messages.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def read_at(self) -> list[float]:
        return [at for at, _ in self.reads]


async def answer_after(seconds: float, send: Any) -> None:
    await asyncio.sleep(seconds)
    await send(START)
    await send(BODY)


@pytest.mark.looptime
async def test_each_waiter_starts_WATCH_AFTER_after_its_own_request() -> None:
    """Requests that come and end at times of their own, through one middleware: the
    waiter of each one still running `WATCH_AFTER` after it came starts then (its
    first read past what the app took), to the instant; one answered sooner, or whose
    app failed sooner, never has one, wherever it stands among the others."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    # (arrival, what the app does: answers after so long, or fails after so long)
    requests = [
        (0.0, "answer", 0.1),
        (0.01, "answer", 0.02),
        (0.02, "answer", 0.07),
        (0.03, "fail", 0.01),
        (0.035, "answer", 0.03),
        (0.06, "answer", 0.2),
        (0.07, "fail", 0.02),
        (0.3, "answer", 0.06),  # after a lull: the timer is armed afresh
        (0.31, "answer", 0.01),
    ]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        _, does, seconds = requests[scope["index"]]
        if does == "fail":
            await asyncio.sleep(seconds)
            raise ValueError("the app failed")
        await answer_after(seconds, send)

    middleware = CancelOnDisconnect(app)
    exchanges = [Exchange() for _ in requests]

    async def serve(index: int) -> None:
        await asyncio.sleep(requests[index][0])
        exchange = exchanges[index]
        with suppress(ValueError):  # (the failing apps')
            await middleware({"type": "http", "index": index}, exchange.receive, exchange.send)

    await asyncio.gather(*(serve(index) for index in range(len(requests))))
    await asyncio.sleep(3 * WATCH_AFTER)
    for (arrival, _, seconds), exchange in zip(requests, exchanges, strict=True):
        # (the waiter reads the body, kept for the app, then waits for the disconnect)
        expected = [pytest.approx(start + arrival + WATCH_AFTER, abs=1e-6)] * 2
        assert exchange.read_at() == (expected if seconds > WATCH_AFTER else [])


@pytest.mark.looptime
async def test_a_streaming_response_is_completed_when_its_client_leaves() -> None:
    """A response streamed past `WATCH_AFTER`: when its client leaves, the app is
    cancelled, sees its client gone (as the proxies count it: `disconnected`), and its
    response is completed (the last, empty body: no 499, it had started); a response
    sent whole after the waiter started is left alone when its client leaves then."""
    gone_seen: list[bool] = []
    finished: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/stream":
            await send(START)
            try:
                while True:
                    await send({"type": "http.response.body", "body": b"x", "more_body": True})
                    await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                gone_seen.append(client_gone())
                raise
        await answer_after(2 * WATCH_AFTER, send)
        await asyncio.sleep(2 * WATCH_AFTER)  # (a background task, after the response)
        finished.append(scope["path"])

    middleware = CancelOnDisconnect(app)
    stream, whole = Exchange(), Exchange()
    served = [
        asyncio.create_task(middleware({"type": "http", "path": path}, e.receive, e.send))
        for path, e in (("/stream", stream), ("/whole", whole))
    ]
    await asyncio.sleep(3 * WATCH_AFTER)  # both waiters started; /whole is answered
    stream.leave()
    whole.leave()
    await asyncio.gather(*served)  # the middleware ends the cancelled one quietly
    assert gone_seen == [True]
    assert finished == ["/whole"]
    assert stream.sent[0] == START
    assert stream.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert all(m["more_body"] for m in stream.sent[1:-1])
    assert whole.sent == [START, BODY]
    assert [len(e.reads) for e in (stream, whole)] == [2, 2]  # the body, then the disconnect


@pytest.mark.looptime
async def test_a_waiter_due_while_the_app_reads_its_body_starts_when_that_read_returns() -> None:
    """A body still coming at the request's time: the app is reading it from the
    server, so its waiter starts once that read returns, not before (two readers
    would race for the server's messages), and still sees its client leave."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    body_at = round(1.6 * WATCH_AFTER, 6)

    class Slow(Exchange):
        async def receive(self) -> Message:
            if not self.reads:
                await asyncio.sleep(body_at)
            return await super().receive()

    got: list[Message] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        got.append(await receive())
        await asyncio.sleep(60)  # (cancelled)

    exchange = Slow()
    served = asyncio.create_task(
        CancelOnDisconnect(app)({"type": "http"}, exchange.receive, exchange.send)
    )
    await asyncio.sleep(4 * WATCH_AFTER)
    exchange.leave()
    await served
    assert got == [{"type": "http.request", "body": b"", "more_body": False}]
    reads = [(round(at - start, 6), task is served) for at, task in exchange.reads]
    assert reads == [(body_at, True), (body_at, False)]  # the app's, then the waiter's
    assert [(m["type"], m.get("status")) for m in exchange.sent] == [
        ("http.response.start", 499),
        ("http.response.body", None),
    ]


class Sink:
    """A server's `send` that can be watched for being freed."""

    async def __call__(self, message: Message) -> None:
        pass


@pytest.mark.looptime
async def test_the_watch_of_an_answered_request_is_let_go_of() -> None:
    """Once a request is over the watch holds nothing of it (here, its server's `send`)
    past the point where no request before it is still waiting for its time: at once
    for the lone client's, and no later than the waiter's time of the request before."""
    middleware = CancelOnDisconnect(lambda scope, receive, send: answer_after(0.01, send))

    async def answered() -> weakref.ref[Sink]:
        sink = Sink()
        await middleware({"type": "http"}, Exchange().receive, sink)
        return weakref.ref(sink)

    assert (await answered())() is None  # the lone client's
    assert (await answered())() is None  # and the next


@pytest.mark.looptime
async def test_a_watch_behind_one_still_waiting_is_let_go_of_at_that_ones_time() -> None:
    """A request answered while one that came before it is still short of its time:
    its watch goes once that one's waiter starts."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await answer_after(scope["seconds"], send)

    middleware = CancelOnDisconnect(app)
    slow = Exchange()
    first = asyncio.create_task(
        middleware({"type": "http", "seconds": 0.2}, slow.receive, slow.send)
    )
    await asyncio.sleep(0.01)
    sink = Sink()
    await middleware({"type": "http", "seconds": 0.01}, Exchange().receive, sink)
    freed = weakref.ref(sink)
    del sink
    await asyncio.sleep(start + WATCH_AFTER - loop.time() + 1e-3)
    assert slow.read_at() == [pytest.approx(start + WATCH_AFTER, abs=1e-6)] * 2
    assert freed() is None
    await first


class Tag:
    """What an outer layer sets for its request (a tracer's span, say)."""

    def __init__(self, name: str) -> None:
        self.name = name


REQUEST: ContextVar[Tag] = ContextVar("request")


class Traced(Exchange):
    """An exchange whose `receive()` notes whose request the context it runs in is."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[str] = []

    async def receive(self) -> Message:
        self.contexts.append(REQUEST.get().name)
        return await super().receive()


@pytest.mark.looptime
async def test_each_waiter_runs_in_its_own_requests_context() -> None:
    """Each waiter its time starts runs in its own request's context (the server's
    `receive()` sees that request's variables), and the timer that serves them all
    holds none: the context of a request answered at once, which armed it, is let go
    of while the requests after it wait for their time."""
    middleware = CancelOnDisconnect(lambda scope, receive, send: answer_after(scope["s"], send))
    exchanges = {name: Traced() for name in ("early", "a", "b")}

    async def outer(tag: Tag, seconds: float) -> None:
        REQUEST.set(tag)
        exchange = exchanges[tag.name]
        await middleware({"type": "http", "s": seconds}, exchange.receive, exchange.send)

    tag = Tag("early")
    freed = weakref.ref(tag)
    early = asyncio.create_task(outer(tag, 0.001))  # it arms the timer, for its time
    del tag
    await early
    del early
    slow = [asyncio.create_task(outer(Tag("a"), 0.2))]
    await asyncio.sleep(0.01)
    slow.append(asyncio.create_task(outer(Tag("b"), 0.2)))
    await asyncio.sleep(0.01)  # the timer early armed is still armed
    assert freed() is None
    await asyncio.gather(*slow)
    assert [exchanges[name].contexts for name in ("early", "a", "b")] == [[], ["a"] * 2, ["b"] * 2]


async def test_one_middleware_served_by_two_loops_at_once() -> None:
    """The same middleware serving requests on this loop and on another thread's, at
    the same time (each loop keeps its own schedule): every one whose client leaves
    is cancelled and answered 499."""
    middleware = CancelOnDisconnect(lambda scope, receive, send: asyncio.sleep(60))

    async def one() -> list[Message]:
        exchange = Exchange()
        served = asyncio.create_task(middleware({"type": "http"}, exchange.receive, exchange.send))
        await asyncio.sleep(4 * WATCH_AFTER)
        exchange.leave()
        await asyncio.wait_for(served, 30)
        return exchange.sent

    async def here() -> list[list[Message]]:
        first = asyncio.create_task(one())
        await asyncio.sleep(WATCH_AFTER / 5)  # (after the other loop's first)
        return [await first, await one()]

    there = asyncio.create_task(asyncio.to_thread(asyncio.run, one()))
    answers = [*await here(), await there]
    assert [[(m["type"], m.get("status")) for m in sent] for sent in answers] == [
        [("http.response.start", 499), ("http.response.body", None)]
    ] * 3


async def test_a_receive_after_the_request_is_over_reads_from_the_server() -> None:
    """An app that left without a whole response and a task of its still reading (here,
    the test): that read goes to the server, as without the watch; no waiter starts,
    which nothing would stop."""
    kept: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # its body
        kept.append(receive)

    exchange = Exchange()
    await CancelOnDisconnect(app)({"type": "http"}, exchange.receive, exchange.send)
    exchange.leave()
    late = asyncio.create_task(kept[0]())
    assert await asyncio.wait_for(late, 30) == {"type": "http.disconnect"}
    assert [task for _, task in exchange.reads] == [asyncio.current_task(), late]
