"""`batchproxy.integrations.aiohttp` on a real aiohttp server on loopback: each batchproxy
error's status, each health state (loading, ready, overrun, draining, failed) and a
graceful shutdown under load that loses no accepted request.

Each test starts its own app on 127.0.0.1 on a free port and drives it with httpx;
the model waits on events the test sets, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from _support import assert_settled, modules_after
from typing_extensions import override

import batchproxy

web = pytest.importorskip("aiohttp.web")
httpx = pytest.importorskip("httpx")

from aiohttp.test_utils import make_mocked_request  # noqa: E402

from batchproxy.integrations._serving import State  # noqa: E402
from batchproxy.integrations.aiohttp import (  # noqa: E402
    SERVING,
    NotReady,
    Serving,
    install,
    ready_proxy,
)


class Echo(batchproxy.Proxy[str, str]):
    """Answers `"out:<item>"` once `gate` is open. `"hang"` waits for `release` as well,
    `"bad"` gets an `InvalidItem` in its slot, `"mismatch"` makes the batch return no
    results, `"boom"` makes it raise a `RuntimeError`."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.gate = asyncio.Event()
        self.gate.set()
        self.release = asyncio.Event()
        self.entered = asyncio.Event()  # a batch reached the model
        self.closing = asyncio.Event()  # aclose() began
        self.batches: list[list[str]] = []

    @override
    async def _inference(self, items: list[str]) -> list[Any]:
        self.batches.append(list(items))
        self.entered.set()
        await self.gate.wait()
        if "hang" in items:
            await self.release.wait()
        if "mismatch" in items:
            return []
        if "boom" in items:
            raise RuntimeError("the model broke")
        return [
            batchproxy.InvalidItem(f"cannot serve {i!r}") if i == "bad" else f"out:{i}"
            for i in items
        ]

    @override
    async def aclose(self) -> None:
        self.closing.set()
        await super().aclose()


class Accepted(batchproxy.Listener):
    """Counts the calls a proxy accepted; `await reached(n)` waits for the n-th."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Event()

    @override
    def request_queued(self, proxy: str, queue_depth: int) -> None:
        self.count += 1
        self._changed.set()

    async def reached(self, n: int) -> None:
        while self.count < n:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 10)


async def echo(request: web.Request) -> web.Response:
    """`{"item": str, "timeout": seconds | null}` -> `{"result": str}`, through the proxy."""
    body = await request.json()
    proxy = ready_proxy(request, Echo)
    return web.json_response(
        {"result": await proxy.inference(body["item"], timeout=body.get("timeout"))}
    )


class Server:
    """A running app: `http` (an httpx client on it), `app`, and `stop()` (the runner's
    cleanup, started once however often it is called)."""

    def __init__(
        self, app: web.Application, runner: web.AppRunner, http: httpx.AsyncClient
    ) -> None:
        self.app = app
        self.runner = runner
        self.http = http
        self._stopping: asyncio.Task[None] | None = None

    def stop(self) -> asyncio.Task[None]:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self.runner.cleanup())
        return self._stopping

    async def post(self, item: str, timeout: float | None = None) -> httpx.Response:
        return await self.http.post("/echo", json={"item": item, "timeout": timeout})


@asynccontextmanager
async def serve(
    serving: Serving,
    prepare: Callable[[web.Application], None] | None = None,
    *,
    loaded: bool = True,
    **paths: str,
) -> AsyncIterator[Server]:
    """Run an app with `serving` installed (with `paths`) on 127.0.0.1 on a free port,
    once `loaded` (else at once); stop it on exit, opening every gate first (no batch
    keeps the drain waiting)."""
    app = web.Application()
    install(app, serving, **paths)
    app.router.add_post("/echo", echo)
    if prepare is not None:
        prepare(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    server: Server | None = None
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=10.0
        ) as http:
            server = Server(app, runner, http)
            if loaded:
                await asyncio.wait_for(serving.wait_ready(), 10)
            yield server
    finally:
        for proxy in serving.proxies:
            if isinstance(proxy, Echo):
                proxy.gate.set()
                proxy.release.set()
        await (server.stop() if server is not None else runner.cleanup())


def error_of(response: httpx.Response) -> str:
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"detail", "error"}
    return str(body["error"])


# -- health states ---------------------------------------------------------------------


async def test_while_loading_live_but_not_ready_then_ready_once_loaded() -> None:
    loaded = asyncio.Event()
    proxy = Echo()
    serving = Serving(proxy, load=loaded.wait)
    async with serve(serving, loaded=False) as server:
        live, readiness, call = await asyncio.gather(
            server.http.get("/livez"), server.http.get("/readyz"), server.post("early")
        )
        assert live.status_code == 200
        assert live.json()["status"] == "loading"
        assert readiness.status_code == 503
        assert readiness.json()["status"] == "loading"
        assert readiness.headers["Retry-After"] == "1"
        assert (call.status_code, error_of(call)) == (503, "NotReady")
        assert call.headers["Retry-After"] == "1"
        assert proxy.stats.requests == 0  # the model was never asked
        loaded.set()
        await asyncio.wait_for(serving.wait_ready(), 10)
        live, readiness, call = await asyncio.gather(
            server.http.get("/livez"), server.http.get("/readyz"), server.post("late")
        )
        assert live.status_code == 200
        assert readiness.status_code == 200
        assert readiness.json() == {
            "status": "ready",
            "ready": True,
            "proxies": {proxy.name: {"state": "healthy"}},
        }
        assert "Retry-After" not in readiness.headers
        assert (call.status_code, call.json()) == (200, {"result": "out:late"})


async def test_a_failed_load_fails_liveness_readiness_and_calls() -> None:
    async def load() -> None:
        raise RuntimeError("no weights here")

    serving = Serving(Echo(), load=load)
    async with serve(serving, loaded=False) as server:
        with pytest.raises(NotReady):
            await asyncio.wait_for(serving.wait_ready(), 10)
        live, readiness, call = await asyncio.gather(
            server.http.get("/livez"), server.http.get("/readyz"), server.post("x")
        )
    for response in (live, readiness):
        assert response.status_code == 503
        assert response.json()["status"] == "failed"
        assert response.json()["error"] == "RuntimeError: no weights here"
    assert (call.status_code, error_of(call)) == (503, "NotReady")
    assert "no weights here" in call.json()["detail"]


async def test_a_watchdog_overrun_fails_readiness_until_a_batch_answers_in_time() -> None:
    proxy = Echo(batch_timeout=0.2)
    async with serve(Serving(proxy)) as server:
        overran = await server.post("hang")
        assert (overran.status_code, error_of(overran)) == (504, "BatchTimeout")
        live, readiness = await asyncio.gather(
            server.http.get("/livez"), server.http.get("/readyz")
        )
        assert live.status_code == 200
        assert readiness.status_code == 503
        report = readiness.json()["proxies"][proxy.name]
        assert report["state"] == "unhealthy"
        assert "batch_timeout" in report["reason"]
        assert (await server.post("fine")).status_code == 200
        assert (await server.http.get("/readyz")).status_code == 200


async def test_draining_fails_readiness_and_answers_every_accepted_call() -> None:
    proxy = Echo()
    serving = Serving(proxy)
    async with serve(serving) as server:
        proxy.gate.clear()
        accepted = asyncio.ensure_future(proxy.inference("accepted"))
        await asyncio.wait_for(proxy.entered.wait(), 10)
        stopping = server.stop()
        await asyncio.wait_for(proxy.closing.wait(), 10)  # the cleanup is draining the proxy
        assert serving.state is State.DRAINING
        # aiohttp stopped listening before its cleanup: no client is told "ready" now
        with pytest.raises(httpx.TransportError):
            await server.http.get("/readyz")
        # and the route itself says draining
        for path, status in (("/readyz", 503), ("/livez", 200)):
            request = make_mocked_request("GET", path, app=server.app)
            response = await (await server.app.router.resolve(request)).handler(request)
            assert response.status == status, path
            assert json.loads(response.body)["status"] == "draining"
        assert not accepted.done()
        proxy.gate.set()
        assert await asyncio.wait_for(accepted, 10) == "out:accepted"
        await asyncio.wait_for(stopping, 10)
        assert serving.state is State.CLOSED


# -- status mapping --------------------------------------------------------------------


async def test_a_full_queue_gives_503_with_retry_after() -> None:
    proxy = Echo(batch_size=1, max_queue_size=1)
    accepted = Accepted()
    proxy.add_listener(accepted)
    async with serve(Serving(proxy, retry_after=2.5)) as server:
        proxy.gate.clear()
        first = asyncio.ensure_future(server.post("first"))
        await asyncio.wait_for(proxy.entered.wait(), 10)  # in the model, out of the queue
        second = asyncio.ensure_future(server.post("second"))
        await accepted.reached(2)  # queued: the queue is full
        refused = await server.post("third")
        assert (refused.status_code, error_of(refused)) == (503, "QueueFull")
        assert refused.headers["Retry-After"] == "3"  # whole seconds, rounded up
        assert "queue is full" in refused.json()["detail"]
        proxy.gate.set()
        answers = await asyncio.gather(first, second)
        assert [a.json() for a in answers] == [{"result": "out:first"}, {"result": "out:second"}]
    assert proxy.stats.rejected == 1


async def test_a_closed_proxy_gives_503_and_fails_liveness() -> None:
    proxy = Echo()
    async with serve(Serving(proxy)) as server:
        await proxy.aclose()
        call = await server.post("x")
        assert (call.status_code, error_of(call)) == (503, "ProxyClosed")
        assert call.headers["Retry-After"] == "1"
        live, readiness = await asyncio.gather(
            server.http.get("/livez"), server.http.get("/readyz")
        )
    assert live.status_code == 503  # it will not come back: restart the process
    assert readiness.status_code == 503
    assert readiness.json()["proxies"][proxy.name] == {"state": "closed"}


async def test_a_deadline_gives_504_and_leaves_readiness_alone() -> None:
    proxy = Echo()
    async with serve(Serving(proxy)) as server:
        late = await server.post("hang", timeout=0.05)
        assert (late.status_code, error_of(late)) == (504, "DeadlineExceeded")
        assert "timeout of 0.05 s" in late.json()["detail"]
        assert (await server.http.get("/readyz")).status_code == 200
    assert proxy.stats.timed_out == 1


async def test_an_invalid_item_gives_422_to_its_caller_alone() -> None:
    proxy = Echo(batch_size=8)
    accepted = Accepted()
    proxy.add_listener(accepted)
    async with serve(Serving(proxy)) as server:
        proxy.gate.clear()
        first = asyncio.ensure_future(server.post("first"))
        await asyncio.wait_for(proxy.entered.wait(), 10)
        bad = asyncio.ensure_future(server.post("bad"))
        good = asyncio.ensure_future(server.post("good"))
        await accepted.reached(3)  # "bad" and "good" wait for the next batch, together
        proxy.gate.set()
        first_answer, bad_answer, good_answer = await asyncio.gather(first, bad, good)
    assert sorted(proxy.batches[1]) == ["bad", "good"]
    assert (bad_answer.status_code, error_of(bad_answer)) == (422, "InvalidItem")
    assert "cannot serve 'bad'" in bad_answer.json()["detail"]
    assert (good_answer.status_code, good_answer.json()) == (200, {"result": "out:good"})
    assert first_answer.status_code == 200


async def test_other_batchproxy_errors_give_500_json_and_the_rest_is_left_to_aiohttp() -> None:
    async with serve(Serving(Echo())) as server:
        mismatch = await server.post("mismatch")
        assert (mismatch.status_code, error_of(mismatch)) == (500, "BatchSizeMismatch")
        boom = await server.post("boom")  # not a batchproxy error: aiohttp's own 500
        assert boom.status_code == 500
        assert boom.headers["Content-Type"].startswith("text/plain")
        assert (await server.post("fine")).status_code == 200


# -- shutdown under load ---------------------------------------------------------------


async def test_a_graceful_shutdown_under_load_answers_every_accepted_request() -> None:
    n = 120
    proxy = Echo(batch_size=8)
    accepted = Accepted()
    proxy.add_listener(accepted)
    shutting_down = asyncio.Event()

    async def on_shutdown(app: web.Application) -> None:
        shutting_down.set()

    def prepare(app: web.Application) -> None:
        app.on_shutdown.append(on_shutdown)

    async with serve(Serving(proxy), prepare) as server:
        proxy.gate.clear()
        calls = [asyncio.ensure_future(server.post(f"item-{i}")) for i in range(n)]
        await accepted.reached(n)  # every request is in the proxy (one batch in the model)
        stopping = server.stop()
        in_model = sum(map(len, proxy.batches))
        await asyncio.wait_for(shutting_down.wait(), 10)  # no longer listening
        async with httpx.AsyncClient(base_url=server.http.base_url, timeout=10.0) as other:
            with pytest.raises(httpx.ConnectError):
                await other.post("/echo", json={"item": "too late"})
        assert not any(call.done() for call in calls)
        proxy.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(*calls), 20)
        await asyncio.wait_for(stopping, 10)
    assert [a.status_code for a in answers] == [200] * n
    assert [a.json()["result"] for a in answers] == [f"out:item-{i}" for i in range(n)]
    assert in_model < n  # most requests were still queued when the shutdown began
    stats = proxy.stats
    assert (stats.requests, stats.succeeded) == (n, n)
    assert_settled(stats)
    assert proxy.closed


# -- the helper's surface --------------------------------------------------------------


async def test_custom_paths_a_proxy_by_name_and_a_handler_in_a_sub_app() -> None:
    proxy = Echo(name="echoes")

    async def by_name(request: web.Request) -> web.Response:
        named = ready_proxy(request, "echoes")  # SERVING is found from the sub-app too
        assert named is request.config_dict[SERVING].proxy(Echo)
        return web.json_response({"result": await named.inference("sub")})

    def prepare(app: web.Application) -> None:
        sub = web.Application()
        sub.router.add_get("/call", by_name)
        app.add_subapp("/sub", sub)

    paths = {"live_path": "/health/live", "ready_path": "/health/ready"}
    async with serve(Serving(proxy), prepare, **paths) as server:
        codes = [
            (await server.http.get(path)).status_code
            for path in ("/health/live", "/health/ready", "/livez", "/readyz")
        ]
        call = await server.http.get("/sub/call")
    assert codes == [200, 200, 404, 404]
    assert (call.status_code, call.json()) == (200, {"result": "out:sub"})
    assert proxy.closed


def test_importing_batchproxy_does_not_import_aiohttp() -> None:
    assert "aiohttp" not in modules_after("import batchproxy, batchproxy.integrations")
