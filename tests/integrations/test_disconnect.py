"""A client that disconnects cancels its calls: real uvicorn (FastAPI) and aiohttp
servers on 127.0.0.1, driven with raw sockets that send a request and close.

The model is held by an event, so the calls queue behind a running batch; the
clients then hang up. Their calls must leave the queue (never reaching the
model, freeing their places under `max_queue_size`), be counted as
`disconnected`, and leave nothing behind; the opt-out keeps today's behaviour.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any

import pytest
from _support import batchproxy_cycles, loop_errors, on_uvicorn, wait_until
from typing_extensions import override

import batchproxy
from batchproxy import GenerationProxy, Step

pytest.importorskip("uvicorn")
fastapi = pytest.importorskip("fastapi")
web = pytest.importorskip("aiohttp.web")
from fastapi import Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from batchproxy.integrations import aiohttp as bp_aiohttp  # noqa: E402
from batchproxy.integrations import fastapi as bp_fastapi  # noqa: E402
from batchproxy.integrations._disconnect import READ_AHEAD, WATCH_AFTER  # noqa: E402

KINDS = ["fastapi", "aiohttp"]


class Held(batchproxy.Proxy[str, str]):
    """Records every item it is given; answers only once `release` is set."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.seen: list[str] = []
        self.release = asyncio.Event()

    @override
    async def _inference(self, items: list[str]) -> list[str]:
        self.seen.extend(items)
        await self.release.wait()
        return [f"<{item}>" for item in items]


class Endless(GenerationProxy[str, str]):
    """Each sequence streams "name0", "name1", ... until its consumer leaves; records
    the names in every step."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.steps: list[list[str]] = []

    @override
    async def _step(self, step: Step[str]) -> Sequence[Any]:
        self.steps.append([slot.item for slot in step.active])
        await asyncio.sleep(0.01)
        out = []
        for slot in step.active:
            slot.state = 0 if slot.state is None else slot.state + 1
            out.append(f"{slot.item}{slot.state}")
        return out


def fastapi_app(serving: Any, proxy: Any, stream: Any, cancel_on_disconnect: bool) -> Any:
    app = fastapi.FastAPI(lifespan=serving.lifespan)
    bp_fastapi.install(app, serving, cancel_on_disconnect=cancel_on_disconnect)

    @app.post("/run")
    async def run(request: Request) -> dict[str, str]:
        return {"out": await proxy.inference((await request.json())["x"])}

    @app.get("/stream")
    async def sse(x: str) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            async for chunk in stream.stream(x):
                yield f"data: {chunk}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def aiohttp_app(serving: Any, proxy: Any, stream: Any, cancel_on_disconnect: bool) -> Any:
    app = web.Application()
    bp_aiohttp.install(app, serving, cancel_on_disconnect=cancel_on_disconnect)

    async def run(request: Any) -> Any:
        return web.json_response({"out": await proxy.inference((await request.json())["x"])})

    async def sse(request: Any) -> Any:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in stream.stream(request.query["x"]):
            await response.write(f"data: {chunk}\n\n".encode())
        await response.write_eof()
        return response

    app.router.add_post("/run", run)
    app.router.add_get("/stream", sse)
    return app


@asynccontextmanager
async def served(
    kind: str, proxy: Any, stream: Any = None, *, cancel_on_disconnect: bool = True
) -> AsyncIterator[int]:
    """The app on 127.0.0.1 on a free port, in this loop: yield the port; stopped on exit."""
    stream = stream if stream is not None else Endless(batch_size=4)
    serving = bp_fastapi.Serving(proxy, stream)
    if kind == "fastapi":
        app = fastapi_app(serving, proxy, stream, cancel_on_disconnect)
        async with on_uvicorn(app) as (_, port):
            await asyncio.wait_for(serving.wait_ready(), 10)
            yield port
        return
    runner = web.AppRunner(aiohttp_app(serving, proxy, stream, cancel_on_disconnect))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        await asyncio.wait_for(serving.wait_ready(), 10)
        yield runner.addresses[0][1]
    finally:
        proxy.release.set()  # nothing left waiting on the model
        await runner.cleanup()


class Client:
    """One raw HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def post(cls, port: int, x: str) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"x": x}).encode()
        writer.write(
            b"POST /run HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        return cls(reader, writer)

    @classmethod
    async def get_stream(cls, port: int, x: str) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream?x=%s HTTP/1.1\r\nHost: test\r\n\r\n" % x.encode())
        await writer.drain()
        return cls(reader, writer)

    async def status(self) -> int:
        line = await asyncio.wait_for(self.reader.readline(), 10)
        return int(line.split()[1])

    async def hang_up(self, *, reset: bool = False) -> None:
        if reset:  # RST rather than FIN
            sock = self.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.close()
        with suppress(ConnectionError):
            await self.writer.wait_closed()


async def hold_the_model(port: int, proxy: Held) -> Client:
    """A live call in a running batch (alone: the first call leaves at once) that
    waits for `proxy.release`: the calls after it queue."""
    blocker = await Client.post(port, "live-block")
    await wait_until(lambda: proxy.stats.in_flight == 1)
    return blocker


@pytest.mark.parametrize("kind", KINDS)
async def test_queued_calls_of_disconnected_clients_never_reach_the_model(kind: str) -> None:
    proxy = Held(batch_size=8, max_concurrent_batches=1, max_queue_size=64)
    async with served(kind, proxy) as port:
        blocker = await hold_the_model(port, proxy)
        dead = [await Client.post(port, f"dead-{i}") for i in range(64)]
        await wait_until(lambda: proxy.stats.queue_depth == 64)
        await asyncio.gather(*(c.hang_up(reset=i % 2 == 1) for i, c in enumerate(dead)))
        await wait_until(lambda: proxy.stats.disconnected == 64)
        assert proxy.stats.queue_depth == 0  # their places are free again
        live = [await Client.post(port, f"live-{i}") for i in range(64)]
        await wait_until(lambda: proxy.stats.queue_depth == 64)  # none refused
        proxy.release.set()
        statuses = await asyncio.gather(*(c.status() for c in [blocker, *live]))
        assert statuses == [200] * 65  # no 503: the dead did not hold the queue
        stats = proxy.stats
        for c in [blocker, *live]:
            await c.hang_up()
    assert not [item for item in proxy.seen if item.startswith("dead")]
    assert sorted(proxy.seen) == sorted(["live-block"] + [f"live-{i}" for i in range(64)])
    assert (stats.cancelled, stats.disconnected, stats.rejected) == (64, 64, 0)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_call_in_a_running_batch_has_its_result_dropped(kind: str) -> None:
    proxy = Held(batch_size=2, max_concurrent_batches=1)
    async with served(kind, proxy) as port:
        gone = await Client.post(port, "dead")
        await wait_until(lambda: proxy.seen == ["dead"])  # its batch runs
        await gone.hang_up()
        await wait_until(lambda: proxy.stats.disconnected == 1)
        live = await Client.post(port, "live")
        await wait_until(lambda: proxy.stats.queue_depth == 1)
        proxy.release.set()
        assert await live.status() == 200
        await wait_until(lambda: proxy.stats.succeeded == 1)
        stats = proxy.stats
        await live.hang_up()
    assert (stats.succeeded, stats.cancelled, stats.disconnected) == (1, 1, 1)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_dedup_slot_answers_the_caller_still_connected(kind: str) -> None:
    proxy = Held(batch_size=4, max_concurrent_batches=1, dedup=True)
    async with served(kind, proxy) as port:
        blocker = await hold_the_model(port, proxy)
        gone = await Client.post(port, "same")
        stays = await Client.post(port, "same")
        await wait_until(lambda: proxy.stats.deduplicated == 1)
        await gone.hang_up()
        await wait_until(lambda: proxy.stats.disconnected == 1)
        assert proxy.stats.queue_depth == 1  # the slot stays for the caller still there
        proxy.release.set()
        assert await stays.status() == 200
        body = await asyncio.wait_for(stays.reader.read(4096), 10)
        assert b"<same>" in body
        for c in [stays, blocker]:
            await c.hang_up()
    assert proxy.seen.count("same") == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_a_disconnected_stream_stops_its_sequence(kind: str) -> None:
    proxy = Held(batch_size=1)
    stream = Endless(batch_size=4)
    async with served(kind, proxy, stream) as port:
        stays = await Client.get_stream(port, "stays")
        gone = await Client.get_stream(port, "gone")
        assert await gone.status() == 200
        await wait_until(lambda: sum("gone" in step for step in stream.steps) >= 3)
        await gone.hang_up()
        await wait_until(lambda: stream.stats.disconnected == 1)
        steps = len(stream.steps)
        await wait_until(lambda: len(stream.steps) >= steps + 5)  # the other goes on
        assert not any("gone" in step for step in stream.steps[steps + 1 :])
        assert all("stays" in step for step in stream.steps[steps:])
        await stays.hang_up()
        await wait_until(lambda: stream.stats.disconnected == 2)
    assert stream.stats.cancelled == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_the_opt_out_leaves_disconnected_calls_queued(kind: str) -> None:
    proxy = Held(batch_size=8, max_concurrent_batches=1, max_queue_size=16)
    async with served(kind, proxy, cancel_on_disconnect=False) as port:
        blocker = await hold_the_model(port, proxy)
        dead = [await Client.post(port, f"dead-{i}") for i in range(16)]
        await wait_until(lambda: proxy.stats.queue_depth == 16)
        await asyncio.gather(*(c.hang_up() for c in dead))
        await asyncio.sleep(0.2)
        assert (proxy.stats.queue_depth, proxy.stats.disconnected) == (16, 0)
        late = await Client.post(port, "late")
        assert await late.status() == 503  # the queue is full of calls nobody waits for
        proxy.release.set()
        await wait_until(lambda: len(proxy.seen) == 17)  # the dead ones reach the model
        for c in [late, blocker]:
            await c.hang_up()
    assert proxy.stats.disconnected == 0


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("kind", KINDS)
async def test_ten_thousand_disconnects_leave_memory_flat(kind: str) -> None:
    proxy = Held(batch_size=1, max_concurrent_batches=1)
    async with served(kind, proxy) as port:
        blocker = await hold_the_model(port, proxy)
        await asyncio.sleep(4 * WATCH_AFTER)  # the blocker's disconnect waiter is up
        tasks = len(asyncio.all_tasks())
        rss = 0
        for wave in range(100):
            dead = await asyncio.gather(*(Client.post(port, f"d{i}") for i in range(100)))
            await wait_until(lambda: proxy.stats.queue_depth == 100)
            await asyncio.gather(*(c.hang_up() for c in dead))
            gone = 100 * (wave + 1)
            await wait_until(lambda: proxy.stats.disconnected == gone)  # noqa: B023
            if wave == 9:  # warmed up
                gc.collect()
                rss = _rss()
        await wait_until(lambda: len(asyncio.all_tasks()) <= tasks)
        gc.collect()
        grown = _rss() - rss
        assert proxy.stats.queue_depth == 0
        proxy.release.set()
        await blocker.hang_up()
    assert proxy.stats.disconnected == 10_000
    assert proxy.seen == ["live-block"]
    assert grown < 16 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 9,000 disconnects"


@pytest.mark.parametrize("seconds", [0.0, 4 * WATCH_AFTER])
async def test_only_a_request_that_waits_pays_for_a_disconnect_waiter(seconds: float) -> None:
    """The ASGI watch's cost where requests are fast: a request answered within
    `WATCH_AFTER` of its body never starts the waiter (no task, no `receive()` past
    the body); one that takes longer has it, and is cancelled when its client goes."""
    from batchproxy.integrations._disconnect import CancelOnDisconnect

    reads = 0
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if reads == 1:
            return {"type": "http.request", "body": b"x", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(seconds)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "headers": [(b"content-length", b"1")]}
    await CancelOnDisconnect(app)(scope, receive, send)
    await asyncio.sleep(3 * WATCH_AFTER)
    assert reads == (1 if seconds == 0.0 else 2)


@pytest.mark.parametrize("kind", KINDS)
async def test_watched_requests_leave_no_reference_cycle(kind: str) -> None:
    """Requests answered after their disconnect watch started, and one whose client
    left, are freed by reference counting as they end: the ASGI watch's cancelled
    waiter kept its `CancelledError`, whose traceback held the watch, which held the
    waiter: a cycle per request slower than `WATCH_AFTER`, holding the request's
    objects until the collector's next full pass."""
    proxy = Held(batch_size=8)
    async with served(kind, proxy) as port:
        proxy.release.set()
        warm = await Client.post(port, "warm")  # (what the first request starts)
        assert await warm.status() == 200
        await warm.hang_up()
        proxy.release.clear()
        with batchproxy_cycles() as cycles:
            blocker = await hold_the_model(port, proxy)
            clients = [await Client.post(port, f"x{i}") for i in range(4)]
            await wait_until(lambda: proxy.stats.queue_depth == 4)
            await asyncio.sleep(2 * WATCH_AFTER)  # every request's watch has started
            await clients.pop().hang_up()
            await wait_until(lambda: proxy.stats.disconnected == 1)
            proxy.release.set()
            assert [await c.status() for c in [blocker, *clients]] == [200] * 4
            for client in [blocker, *clients]:
                await client.hang_up()
            await asyncio.sleep(0.1)  # the server ends each request
        assert cycles == []


@contextmanager
def server_log() -> Iterator[list[logging.LogRecord]]:
    """What uvicorn logs from now on: the records (its loggers do not propagate to
    pytest's, and its `Config` replaces their handlers: enter once it is made)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("uvicorn")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def errors_in(records: list[logging.LogRecord]) -> list[str]:
    return [
        f"{r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else r.getMessage()
        for r in records
        if r.levelno >= logging.ERROR
    ]


@pytest.mark.parametrize("order", ["install, then middleware", "middleware, then install"])
async def test_a_disconnect_under_an_http_middleware_logs_no_error(order: str) -> None:
    """An ordinary ``@app.middleware("http")`` (Starlette's `BaseHTTPMiddleware`) and
    the disconnect watch, in either order: a client that leaves mid-call is cancelled
    and uvicorn logs nothing (the watch used to return without a response, which the
    middleware turned into ``RuntimeError: No response returned.``, logged as an
    ERROR); the middleware sees the 499 the aiohttp side answers too."""
    proxy = Held(batch_size=8, max_concurrent_batches=1)
    stream = Endless(batch_size=4)
    serving = bp_fastapi.Serving(proxy, stream)
    app = fastapi.FastAPI(lifespan=serving.lifespan)
    seen: list[int] = []

    async def timing(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        seen.append(response.status_code)
        response.headers["x-seen"] = "1"
        return response

    if order.startswith("install"):
        bp_fastapi.install(app, serving)
    app.middleware("http")(timing)
    if order.startswith("middleware"):
        bp_fastapi.install(app, serving)

    @app.post("/run")
    async def run(request: Request) -> dict[str, str]:
        return {"out": await proxy.inference((await request.json())["x"])}

    @app.get("/stream")
    async def sse(x: str) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            async for chunk in stream.stream(x):
                yield f"data: {chunk}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async with on_uvicorn(app) as (_, port):
        try:
            with server_log() as records:
                await asyncio.wait_for(serving.wait_ready(), 10)
                blocker = await hold_the_model(port, proxy)
                gone = [await Client.post(port, f"dead-{i}") for i in range(4)]
                await wait_until(lambda: proxy.stats.queue_depth == 4)
                await asyncio.gather(*(c.hang_up(reset=i % 2 == 1) for i, c in enumerate(gone)))
                await wait_until(lambda: proxy.stats.disconnected == 4)
                streaming = await Client.get_stream(port, "gone")
                await wait_until(lambda: len(stream.steps) >= 3)
                await streaming.hang_up()
                await wait_until(lambda: stream.stats.disconnected == 1)
                proxy.release.set()
                assert await blocker.status() == 200
                await blocker.hang_up()
                answers = 6 if order.startswith("install") else 2
                await wait_until(lambda: len(seen) + len(errors_in(records)) >= answers)
        finally:
            proxy.release.set()  # nothing left waiting on the model
    assert errors_in(records) == []
    assert sorted(seen) == [200, 200] + ([499] * 4 if order.startswith("install") else [])
    assert proxy.seen == ["live-block"]


@asynccontextmanager
async def quiet_served(proxy: Held, **options: Any) -> AsyncIterator[int]:
    """A FastAPI app whose routes call `proxy` without reading their body (GET /wait,
    POST /ignore), or read it only after a call (POST /late), under uvicorn: its port."""
    serving = bp_fastapi.Serving(proxy)
    app = fastapi.FastAPI(lifespan=serving.lifespan, **options)
    bp_fastapi.install(app, serving)

    @app.get("/wait")
    async def wait(x: str) -> dict[str, str]:
        return {"out": await proxy.inference(x)}

    @app.post("/ignore")
    async def ignore(x: str) -> dict[str, str]:
        return {"out": await proxy.inference(x)}

    @app.post("/late")
    async def late(request: Request, x: str) -> dict[str, Any]:
        out = await proxy.inference(x)
        body = await request.body()
        return {"out": out, "size": len(body), "digest": hashlib.sha256(body).hexdigest()}

    async with on_uvicorn(app) as (_, port):
        try:
            await asyncio.wait_for(serving.wait_ready(), 10)
            yield port
        finally:
            proxy.release.set()  # nothing left waiting on the model


async def raw(port: int, head: bytes, body: bytes = b"") -> Client:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"\r\nHost: test\r\n" + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    return Client(reader, writer)


@pytest.mark.parametrize(
    ("request_line", "body"),
    [
        (b"GET /wait?x=dead HTTP/1.1", b""),
        (b"POST /ignore?x=dead HTTP/1.1", json.dumps({"unread": "x" * 1000}).encode()),
    ],
    ids=["GET", "POST ignoring its body"],
)
async def test_a_route_that_never_reads_its_body_is_watched(
    request_line: bytes, body: bytes
) -> None:
    """A route that never calls `receive()` (no body parameter) is still cancelled when
    its client leaves: the watch used to start only once the app had read a body."""
    proxy = Held(batch_size=8, max_concurrent_batches=1)
    async with quiet_served(proxy) as port:
        blocker = await raw(port, b"GET /wait?x=live-block HTTP/1.1")
        await wait_until(lambda: proxy.stats.in_flight == 1)
        gone = [await raw(port, request_line, body) for _ in range(4)]
        await wait_until(lambda: proxy.stats.queue_depth == 4)
        await asyncio.gather(*(c.hang_up(reset=i % 2 == 1) for i, c in enumerate(gone)))
        await wait_until(lambda: proxy.stats.disconnected == 4)
        assert proxy.stats.queue_depth == 0
        proxy.release.set()
        assert await blocker.status() == 200
        await blocker.hang_up()
    assert proxy.seen == ["live-block"]


@pytest.mark.parametrize("size", [100, 2**20, -(2**20)], ids=["small", "1 MiB", "1 MiB, late"])
async def test_a_route_that_reads_its_body_after_a_call_gets_all_of_it(size: int) -> None:
    """The watch reads a body the route has not read yet, to see the disconnect
    behind it: the route still gets every byte when it reads it, however late (a
    negative size: the client sends the second half while the route waits), and a
    client that leaves, its body within `READ_AHEAD`, is still seen."""
    proxy = Held(batch_size=8)
    late = size < 0
    body = bytes(range(256)) * (abs(size) // 256) + b"!" * (abs(size) % 256)
    async with quiet_served(proxy) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = Client(reader, writer)
        try:
            head = b"POST /late?x=a HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n"
            writer.write(head % len(body) + (body[: len(body) // 2] if late else body))
            await writer.drain()
            gone = await raw(port, b"POST /late?x=gone HTTP/1.1", body[:READ_AHEAD])
            await wait_until(lambda: proxy.stats.queue_depth + proxy.stats.in_flight == 2)
            await asyncio.sleep(4 * WATCH_AFTER)  # every watch has started
            await gone.hang_up()
            await wait_until(lambda: proxy.stats.disconnected == 1)
            if late:
                writer.write(body[len(body) // 2 :])
                await writer.drain()
            proxy.release.set()
            assert await client.status() == 200
            answer = await asyncio.wait_for(reader.read(2**16), 10)
        finally:
            await client.hang_up()
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {
        "out": "<a>",
        "size": len(body),
        "digest": hashlib.sha256(body).hexdigest(),
    }


@pytest.mark.parametrize("size", [1000, 1001])
async def test_a_body_read_ahead_past_the_apps_limit_fails_the_route_that_reads_it(
    size: int,
) -> None:
    """``FastAPI(max_body_size=...)`` checks the body as it is received, outside the
    watch: when the waiter reads ahead a body over the limit, the error goes to the
    route when it reads (413, as without the watch), not to the waiter's task."""
    proxy = Held(batch_size=8)
    async with quiet_served(proxy, max_body_size=1000) as port:
        with loop_errors() as errors:
            client = await raw(port, b"POST /late?x=a HTTP/1.1", b"x" * size)
            await wait_until(lambda: proxy.stats.in_flight == 1)
            await asyncio.sleep(4 * WATCH_AFTER)  # the waiter has read the body
            proxy.release.set()
            assert await client.status() == (200 if size <= 1000 else 413)
            await client.hang_up()
    assert errors == []


async def test_the_waiter_reads_ahead_no_more_than_READ_AHEAD() -> None:
    """A body the app leaves unread is read ahead up to `READ_AHEAD` bytes, no more
    (the rest waits in the server, as it would without the watch); the app then gets
    every chunk in order, and the disconnect after them cancels it."""
    from batchproxy.integrations._disconnect import CancelOnDisconnect

    chunk = b"c" * 2**14
    chunks = 4 * READ_AHEAD // len(chunk)
    reads = 0
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if reads <= chunks:
            return {"type": "http.request", "body": chunk, "more_body": reads < chunks}
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    got: list[bytes] = []
    ahead = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal ahead
        await asyncio.sleep(3 * WATCH_AFTER)
        ahead = reads
        while (message := await receive())["type"] == "http.request":
            got.append(message["body"])
            if not message["more_body"]:
                gone.set()
        await asyncio.sleep(10)  # (cancelled)

    scope = {"type": "http", "headers": [(b"content-length", b"%d" % (chunks * len(chunk)))]}
    await asyncio.wait_for(CancelOnDisconnect(app)(scope, receive, send), 10)
    assert ahead == READ_AHEAD // len(chunk) + 1
    assert got == [chunk] * chunks
    assert [(m["type"], m.get("status")) for m in sent] == [
        ("http.response.start", 499),
        ("http.response.body", None),
    ]


async def test_a_body_still_coming_when_the_watch_starts_is_read_by_the_route() -> None:
    """A client that sends its body slower than `WATCH_AFTER`: the route is reading it
    when the watch is due, so the waiter starts once that read returns (two readers
    would race for the server's messages); the route gets its whole body, and a client
    that leaves after it is seen."""
    proxy = Held(batch_size=8, max_concurrent_batches=1)
    async with served("fastapi", proxy) as port:
        blocker = await hold_the_model(port, proxy)
        clients = []
        for x in ("stays", "gone"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({"x": x}).encode()
            writer.write(
                b"POST /run HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:4])
            )
            await writer.drain()
            clients.append((Client(reader, writer), body))
        await asyncio.sleep(4 * WATCH_AFTER)  # each route waits for the rest of its body
        for client, body in clients:
            client.writer.write(body[4:])
            await client.writer.drain()
        await wait_until(lambda: proxy.stats.queue_depth == 2)
        (stays, _), (gone, _) = clients
        await gone.hang_up()
        await wait_until(lambda: proxy.stats.disconnected == 1)
        proxy.release.set()
        assert [await c.status() for c in (blocker, stays)] == [200, 200]
        answer = await asyncio.wait_for(stays.reader.read(4096), 10)
        for c in (blocker, stays):
            await c.hang_up()
    assert b'{"out":"<stays>"}' in answer
    assert proxy.seen == ["live-block", "stays"]


async def test_a_response_sent_as_a_file_is_complete() -> None:
    """``http.response.pathsend`` (a `FileResponse` where the server supports it) is a
    whole response: a client that leaves after it does not cancel what the app does
    next (its background tasks), and no 499 follows it."""
    from batchproxy.integrations._disconnect import CancelOnDisconnect

    gone = asyncio.Event()
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if reads == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    finished = False

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal finished
        await asyncio.sleep(3 * WATCH_AFTER)  # the waiter has started
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.pathsend", "path": "/dev/null"})
        gone.set()
        await asyncio.sleep(3 * WATCH_AFTER)  # a background task, after the response
        finished = True

    scope = {"type": "http", "headers": []}
    await asyncio.wait_for(CancelOnDisconnect(app)(scope, receive, send), 10)
    assert finished
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.pathsend"]
