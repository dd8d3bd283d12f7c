"""batchproxy.integrations.fastapi against a real uvicorn server on 127.0.0.1.

Each test serves its own app on a free port in this test's event loop (so the
model, the proxy and the server share it, and events can hold a batch in the
model), drives it with httpx and stops the server in a `finally`: every status
mapping, every health state, and a graceful shutdown under load.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from _support import modules_after, wait_until
from typing_extensions import override

import batchproxy

for _module in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import Depends, FastAPI  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from batchproxy.integrations.fastapi import NotReady, Serving, install  # noqa: E402


class Echo(batchproxy.Proxy[str, str]):
    """Upper-cases each text, on the event loop, taking `delay` seconds per batch;
    records every batch.

    "bad" gets `InvalidItem` in its slot; a batch holding "miscount" returns one
    result too few. While `gate` is clear, a batch waits on it (`entered` is set
    once one has).
    """

    def __init__(self, delay: float = 0.0, **options: Any) -> None:
        super().__init__(name="echo", max_concurrent_batches=1, **options)
        self.delay = delay
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()

    @override
    async def _inference(self, items: list[str]) -> list[str | BaseException]:
        self.batches.append(list(items))
        self.entered.set()
        await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if "miscount" in items:
            return []
        return [
            batchproxy.InvalidItem(f"cannot echo {t!r}") if t == "bad" else t.upper() for t in items
        ]


class EchoIn(BaseModel):
    text: str
    timeout: float | None = None


class EchoOut(BaseModel):
    text: str


def make_app(serving: Serving, accepted: set[str] | None = None) -> FastAPI:
    """`POST /echo` through the `Echo` of `serving`; `accepted` collects the texts whose
    handler ran (uvicorn handed the request to the app)."""
    app = FastAPI(lifespan=serving.lifespan)
    app.state.serving = serving
    install(app, serving)

    @app.post("/echo")
    async def echo(
        body: EchoIn,
        proxy: Echo = Depends(serving.provider(Echo)),  # noqa: B008
    ) -> EchoOut:
        if accepted is not None:
            accepted.add(body.text)
        return EchoOut(text=await proxy.inference(body.text, timeout=body.timeout))

    return app


class Server(uvicorn.Server):
    """uvicorn, with events for "listening" and "shutdown began" (nothing polls)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = asyncio.Event()
        self.shutting_down = asyncio.Event()

    @override
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # a failed startup raises SystemExit
        self.up.set()

    @override
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # waiters wake at its first await, once it has closed the listener
        self.shutting_down.set()
        await super().shutdown(sockets)


@dataclass
class Running:
    http: httpx.AsyncClient
    server: Server
    task: asyncio.Task[None]


@asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[Running]:
    """`app` (from `make_app`) under uvicorn on 127.0.0.1, a free port; stopped on exit,
    its proxies' gates opened first (a failed test may have left a batch waiting)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    server = Server(config)
    task = asyncio.create_task(server.serve())
    try:
        up = asyncio.create_task(server.up.wait())
        await asyncio.wait({up, task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        up.cancel()
        if not server.up.is_set():
            why = task.exception() if task.done() else "no answer in 10 s"
            raise AssertionError(f"uvicorn did not start: {why!r}")
        port = server.servers[0].sockets[0].getsockname()[1]
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=10.0
        ) as http:
            yield Running(http, server, task)
    finally:
        for proxy in app.state.serving.proxies:
            proxy.gate.set()
        server.should_exit = True
        stopped, _ = await asyncio.wait({task}, timeout=10)
        if not stopped:
            task.cancel()
            raise AssertionError("uvicorn did not stop")


async def post(http: httpx.AsyncClient, text: str, **fields: Any) -> httpx.Response:
    return await http.post("/echo", json={"text": text, **fields})


def refused(response: httpx.Response, status: int, error: str) -> None:
    """`response` is the helper's JSON answer for `error`, with `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["error"] == error, body
    assert body["detail"], body


# -- the status mapping ---------------------------------------------------------------------


async def test_a_batch_with_a_bad_item_answers_it_422_and_the_others_200() -> None:
    proxy = Echo(batch_size=3)
    serving = Serving(proxy)
    async with serve(make_app(serving)) as running:
        proxy.gate.clear()
        first = asyncio.create_task(post(running.http, "first"))
        await proxy.entered.wait()  # the first batch is in the model; the next three queue
        rest = [asyncio.create_task(post(running.http, text)) for text in ("a", "bad", "c")]
        await wait_until(lambda: proxy.stats.queue_depth == 3)
        proxy.gate.set()
        answers = await asyncio.gather(first, *rest)
    assert [sorted(batch) for batch in proxy.batches] == [["first"], ["a", "bad", "c"]]
    assert [a.status_code for a in answers] == [200, 200, 422, 200]
    assert [answers[i].json() for i in (0, 1, 3)] == [
        {"text": "FIRST"},
        {"text": "A"},
        {"text": "C"},
    ]
    refused(answers[2], 422, "InvalidItem")
    assert "cannot echo 'bad'" in answers[2].json()["detail"]


async def test_the_provider_dependency_runs_on_the_event_loop_not_in_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain `def` dependency costs FastAPI a hop to its thread pool and back on every
    request (measured on the GPU's BERT app: a lone client's request about 0.1-0.3 ms
    slower); the provider is a coroutine function, so it costs none."""
    import fastapi.dependencies.utils as dependencies

    hops = []
    to_thread = dependencies.run_in_threadpool

    async def counted(call: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(call, "__qualname__", repr(call)))
        return await to_thread(call, *args, **kwargs)

    monkeypatch.setattr(dependencies, "run_in_threadpool", counted)
    proxy = Echo(batch_size=3)
    async with serve(make_app(Serving(proxy))) as running:
        answer = await post(running.http, "hi")
    assert answer.status_code == 200
    assert answer.json() == {"text": "HI"}
    assert hops == []


async def test_a_full_queue_answers_503_with_retry_after() -> None:
    proxy = Echo(batch_size=1, max_queue_size=1)
    serving = Serving(proxy, retry_after=2.5)
    async with serve(make_app(serving)) as running:
        proxy.gate.clear()
        first = asyncio.create_task(post(running.http, "first"))
        await proxy.entered.wait()
        second = asyncio.create_task(post(running.http, "second"))
        await wait_until(lambda: proxy.stats.queue_depth == 1)
        third = await post(running.http, "third")
        proxy.gate.set()
        answers = [await first, await second]
    refused(third, 503, "QueueFull")
    assert third.headers["Retry-After"] == "3"  # whole seconds, rounded up
    assert [a.json() for a in answers] == [{"text": "FIRST"}, {"text": "SECOND"}]
    assert proxy.stats.rejected == 1


async def test_a_deadline_answers_504() -> None:
    proxy = Echo(batch_size=1)
    async with serve(make_app(Serving(proxy))) as running:
        proxy.gate.clear()
        first = asyncio.create_task(post(running.http, "first"))
        await proxy.entered.wait()
        late = await post(running.http, "late", timeout=0.05)  # queued behind the first
        proxy.gate.set()
        assert (await first).json() == {"text": "FIRST"}
    refused(late, 504, "DeadlineExceeded")
    assert "retry-after" not in late.headers
    assert proxy.batches == [["first"]]  # the late one never reached the model


async def test_a_watchdog_overrun_answers_504_and_fails_readiness_until_a_batch_is_in_time() -> (
    None
):
    proxy = Echo(batch_size=1, batch_timeout=0.5)
    serving = Serving(proxy)
    async with serve(make_app(serving)) as running:
        http = running.http
        assert (await http.get("/readyz")).status_code == 200
        proxy.gate.clear()
        stuck = await post(http, "stuck")  # waits on the gate until the watchdog gives up
        refused(stuck, 504, "BatchTimeout")
        ready, live = await http.get("/readyz"), await http.get("/livez")
        assert ready.status_code == 503
        assert ready.headers["Retry-After"] == "1"
        body = ready.json()
        assert (body["status"], body["ready"]) == ("ready", False)
        assert body["proxies"]["echo"]["state"] == "unhealthy"
        assert body["proxies"]["echo"]["reason"]
        assert live.status_code == 200  # overran, not dead: no restart
        proxy.gate.set()
        assert (await post(http, "ok")).json() == {"text": "OK"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["proxies"] == {"echo": {"state": "healthy"}}


async def test_any_other_batchproxy_error_answers_500_json() -> None:
    proxy = Echo()
    async with serve(make_app(Serving(proxy))) as running:
        answer = await post(running.http, "miscount")
    refused(answer, 500, "BatchSizeMismatch")


async def test_a_proxy_closed_while_serving_answers_503_and_fails_both_probes() -> None:
    proxy = Echo()
    serving = Serving(proxy)
    async with serve(make_app(serving)) as running:
        http = running.http
        assert (await post(http, "hi")).json() == {"text": "HI"}
        await proxy.aclose()
        answer = await post(http, "hi")
        ready, live = await http.get("/readyz"), await http.get("/livez")
    refused(answer, 503, "ProxyClosed")
    assert answer.headers["Retry-After"] == "1"
    assert ready.status_code == live.status_code == 503  # it will not come back: restart
    assert ready.json()["proxies"] == {"echo": {"state": "closed"}}
    assert live.json()["live"] is False


# -- health: loading, failed, draining ----------------------------------------------------


async def test_while_loading_live_but_not_ready_and_calls_get_503() -> None:
    loaded = asyncio.Event()

    async def load() -> None:
        await loaded.wait()

    proxy = Echo()
    serving = Serving(proxy, load=load)
    async with serve(make_app(serving)) as running:  # the lifespan did not wait for load
        http = running.http
        live, ready = await http.get("/livez"), await http.get("/readyz")
        call = await post(http, "early")
        assert (live.status_code, live.json()["status"], live.json()["live"]) == (
            200,
            "loading",
            True,
        )
        assert (ready.status_code, ready.json()["status"], ready.json()["ready"]) == (
            503,
            "loading",
            False,
        )
        assert ready.headers["Retry-After"] == "1"
        refused(call, 503, "NotReady")
        assert call.headers["Retry-After"] == "1"
        assert proxy.stats.requests == 0  # refused before the proxy

        loaded.set()
        await serving.wait_ready()
        ready = await http.get("/readyz")
        assert (ready.status_code, ready.json()["status"]) == (200, "ready")
        assert "retry-after" not in ready.headers
        assert (await post(http, "now")).json() == {"text": "NOW"}


async def test_a_failed_load_fails_both_probes_and_every_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def load() -> None:
        raise RuntimeError("no weights here")

    serving = Serving(Echo(), load=load)
    async with serve(make_app(serving)) as running:
        with pytest.raises(NotReady):
            await serving.wait_ready()
        http = running.http
        live, ready = await http.get("/livez"), await http.get("/readyz")
        call = await post(http, "hi")
    for probe in (live, ready):
        assert probe.status_code == 503
        assert probe.json()["status"] == "failed"
        assert probe.json()["error"] == "RuntimeError: no weights here"
    refused(call, 503, "NotReady")
    assert "no weights here" in call.json()["detail"]
    for answer in (live, ready, call):  # a retry cannot help
        assert "retry-after" not in answer.headers
    # the server's log says why, with the traceback
    (record,) = [r for r in caplog.records if r.name == "batchproxy" and r.levelname == "ERROR"]
    assert "no weights here" in record.getMessage()
    assert record.exc_info is not None


async def test_draining_fails_readiness_and_answers_every_accepted_call() -> None:
    proxy = Echo(batch_size=1)
    serving = Serving(proxy)
    async with serve(make_app(serving)) as running:
        http = running.http
        proxy.gate.clear()
        held = asyncio.create_task(post(http, "held"))
        await proxy.entered.wait()
        queued = asyncio.create_task(post(http, "queued"))
        await wait_until(lambda: proxy.stats.queue_depth == 1)

        closing = asyncio.create_task(serving.aclose())  # what the lifespan exit runs
        await wait_until(lambda: serving.state.value == "draining")
        ready, live = await http.get("/readyz"), await http.get("/livez")
        assert (ready.status_code, ready.json()["status"]) == (503, "draining")
        assert ready.headers["Retry-After"] == "1"
        assert live.status_code == 200
        refused(await post(http, "new"), 503, "ProxyClosed")

        proxy.gate.set()
        assert [(await t).json() for t in (held, queued)] == [{"text": "HELD"}, {"text": "QUEUED"}]
        await closing
        ready = await http.get("/readyz")
        assert (ready.status_code, ready.json()["status"]) == (503, "closed")


# -- graceful shutdown under load -----------------------------------------------------------

CLIENTS = 200


async def test_shutdown_under_load_answers_every_accepted_request() -> None:
    """The server is told to exit while 200 requests are in flight, most of them
    queued behind a batch held in the model: every request the app accepted gets
    its own 200; requests sent once shutdown began are refused at the connection.

    The model takes 20 ms a batch, so answering the 13 batches outlasts uvicorn's
    own 0.1 s pause at shutdown: a shutdown that cut them short would show."""
    proxy = Echo(batch_size=16, delay=0.02)
    serving = Serving(proxy)
    accepted: set[str] = set()
    async with serve(make_app(serving, accepted)) as running:
        http, server = running.http, running.server
        proxy.gate.clear()
        texts = [f"t{n}" for n in range(CLIENTS)]
        wave = [asyncio.create_task(post(http, text)) for text in texts]
        await wait_until(lambda: len(accepted) == CLIENTS)
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        await server.shutting_down.wait()
        queued_at_shutdown = proxy.stats.queue_depth
        late = await asyncio.gather(
            *(post(http, f"late{n}") for n in range(20)), return_exceptions=True
        )
        assert serving.state.value == "ready"  # the proxies outlive the connections
        proxy.gate.set()
        answers = await asyncio.gather(*wave, return_exceptions=True)
        await asyncio.wait_for(running.task, 10)  # the server exited: the lifespan has run
    assert queued_at_shutdown > 0
    assert accepted == set(texts)
    for text, answer in zip(texts, answers, strict=True):
        assert isinstance(answer, httpx.Response), (text, answer)
        assert (answer.status_code, answer.json()) == (200, {"text": text.upper()})
    assert all(isinstance(answer, httpx.TransportError) for answer in late), late
    assert serving.state.value == "closed"
    stats = proxy.stats
    assert (stats.requests, stats.succeeded) == (CLIENTS, CLIENTS)


def _post(sock: socket.socket, texts: list[str]) -> list[bytes]:
    """One `POST /echo` at a time on a keep-alive connection (a plain socket: it makes no
    garbage of its own); each response's body."""
    bodies: list[bytes] = []
    pending = b""
    for text in texts:
        body = b'{"text": "%s"}' % text.encode()
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        while b"\r\n\r\n" not in pending:
            pending += sock.recv(65536)
        head, _, pending = pending.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(pending) < length:
            pending += sock.recv(65536)
        bodies.append(pending[:length])
        pending = pending[length:]
    return bodies


@pytest.mark.parametrize("offload", [False, True], ids=["on-the-loop", "offload"])
async def test_a_lone_client_s_requests_leave_no_garbage(offload: bool) -> None:
    """The README's kind of service (`Serving`, `install`, a route that awaits its
    proxy) under uvicorn, one client sending one request at a time on one connection:
    every object a request makes is freed by reference counting as it ends, and a
    collection afterwards finds nothing (garbage in a reference cycle waits for the
    collector, whose full passes hold the GIL for as long as they walk the heap). (A
    closed connection leaves asyncio's transport in a cycle: the connection stays open
    until the collection.)"""
    serving = Serving(Echo(offload=offload))
    loop = asyncio.get_running_loop()
    async with serve(make_app(serving)) as running:
        port = running.server.servers[0].sockets[0].getsockname()[1]
        await asyncio.wait_for(serving.wait_ready(), 10)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            await loop.run_in_executor(None, _post, sock, ["warm", "up"])
            gc.collect()
            enabled = gc.isenabled()
            gc.disable()
            try:
                bodies = await loop.run_in_executor(None, _post, sock, ["ab", "cd"] * 10)
                for _ in range(3):  # the server's side of the last request ends
                    await asyncio.sleep(0.01)
                garbage = gc.collect()
            finally:
                if enabled:
                    gc.enable()
        assert bodies[:2] == [b'{"text":"AB"}', b'{"text":"CD"}']
        assert garbage == 0


def test_importing_batchproxy_does_not_import_fastapi() -> None:
    loaded = modules_after("import batchproxy, batchproxy.integrations")
    assert not {"fastapi", "starlette", "uvicorn"} & loaded
