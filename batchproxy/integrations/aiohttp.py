"""aiohttp helpers (the ``aiohttp`` extra): start and drain a service's proxies with the
app, answer batchproxy errors with the right status, and serve liveness and readiness.

```python
from aiohttp import web
from batchproxy.integrations.aiohttp import Serving, install, ready_proxy

serving = Serving(Embedder(batch_size=32), load=load_weights)  # load: optional, async
app = web.Application()
install(app, serving)  # cleanup_ctx, error middleware, GET /livez and GET /readyz

async def embed(request: web.Request) -> web.Response:
    embedder = ready_proxy(request, Embedder)  # NotReady (503) while loading
    text = (await request.json())["text"]
    return web.json_response({"embedding": await embedder.inference(text)})

app.router.add_post("/embed", embed)
web.run_app(app)
```

- Startup begins loading in the background (the health routes answer meanwhile);
  cleanup drains every proxy: each answers every call it accepted. aiohttp stops
  listening and waits for in-flight requests (up to the runner's
  ``shutdown_timeout``) before the cleanup, so they are served by open proxies,
  and a probe during the drain finds the port closed rather than a 503.
- A `BatchProxyError` raised by a handler becomes ``{"detail": ..., "error": ...}``:
  `QueueFull`, `ProxyClosed`, `NotReady` and `WorkerDied` 503 with ``Retry-After``;
  `DeadlineExceeded` and `BatchTimeout` 504; `InvalidItem` 422; any other 500.
  Other exceptions are left to aiohttp.
- ``/livez`` is 503 only when the process should be restarted (loading failed, or a
  proxy closed while serving); ``/readyz`` is 200 only when loaded, not draining,
  and every proxy healthy (no `batch_timeout` overrun since its last good batch).
- A request whose client disconnects while its handler runs is cancelled
  (`cancel_on_disconnect`, on by default; aiohttp itself leaves handlers running
  since 3.9): each call it waits on leaves the queue without reaching the model
  (a running one has its result dropped), a stream ends, and
  `stats.disconnected` counts them. The signal is the server's own: aiohttp
  tells the request being handled when its connection is lost (`connection_lost`
  calls the request's `_cancel`); nothing waits or polls per request. See
  docs/serving.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, overload

from aiohttp import web

from .. import BatchProxyError, Proxy
from .._client import Client, current_client
from ._serving import Answer, NotReady, Serving, answer_for

__all__ = ["SERVING", "NotReady", "Serving", "install", "ready_proxy"]

P = TypeVar("P", bound=Proxy[Any, Any])
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SERVING: web.AppKey[Serving] = web.AppKey("batchproxy_serving", Serving)
"""Where `install` puts the `Serving`: ``request.config_dict[SERVING]``."""


def install(
    app: web.Application,
    serving: Serving,
    *,
    live_path: str = "/livez",
    ready_path: str = "/readyz",
    cancel_on_disconnect: bool = True,
) -> None:
    """Run `serving` with `app` (start in the background at startup, drain at cleanup),
    answer the batchproxy errors its handlers raise, and add the two health routes.

    The middleware goes last (innermost), so the app's own middlewares see its answer.
    `cancel_on_disconnect` (default True) adds, before it, the one that cancels a
    handler whose client disconnects (see above); False leaves it running, as aiohttp
    does by itself."""
    app[SERVING] = serving

    async def serve(app: web.Application) -> AsyncIterator[None]:
        async with serving.running():
            yield

    def error(exc: BatchProxyError) -> web.Response:
        return _json(answer_for(exc, retry_after=serving.retry_after))

    @web.middleware
    async def batchproxy_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BatchProxyError as exc:
            return error(exc)

    @web.middleware
    async def batchproxy_errors_and_disconnects(
        request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        # (one middleware for both: a layer of aiohttp's middleware chain costs more
        # per request than the watch itself)
        watched = _Watched(request)
        token = current_client.set(watched.client)
        try:
            return await handler(request)
        except BatchProxyError as exc:
            return error(exc)
        except asyncio.CancelledError:
            if watched.left():
                return web.Response(status=499)  # the client is gone: nobody reads this
            raise
        finally:
            watched.release()
            current_client.reset(token)

    async def liveness(request: web.Request) -> web.Response:
        return _json(serving.liveness())

    async def readiness(request: web.Request) -> web.Response:
        return _json(serving.readiness())

    app.cleanup_ctx.append(serve)
    app.middlewares.append(
        batchproxy_errors_and_disconnects if cancel_on_disconnect else batchproxy_errors
    )
    app.router.add_get(live_path, liveness)
    app.router.add_get(ready_path, readiness)


class _Watched:
    """One request's watch: cancel its handler (its task) when the server loses the
    request's connection.

    aiohttp calls `_cancel(exc)` on the request being handled from its protocol's
    `connection_lost` (and with a `CancelledError` when a graceful shutdown runs out
    of time: not a disconnect); this request's own `_cancel` also marks its `Client`
    gone and cancels the handler's task. One object and one bound method per request:
    no task, no wait."""

    __slots__ = ("_cancel", "_request", "client", "handling", "task")

    def __init__(self, request: web.Request) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.client = Client()
        self.handling = True  # the handler runs (`release` clears it)
        self._request = request
        self._cancel = request._cancel
        object.__setattr__(request, "_cancel", self._lost)  # (its __setattr__ warns)

    def release(self) -> None:
        """The handler is done: the request's `_cancel` is its class's again. (Left
        set, or set back to the request's own bound method, the request would hold
        itself, a reference cycle per request left to the cyclic garbage collector:
        measured, 15 µs of server CPU per request, a quarter of aiohttp's own.)"""
        self.handling = False
        object.__delattr__(self._request, "_cancel")

    def _lost(self, exc: BaseException) -> None:
        self._cancel(exc)
        client = self.client
        if self.handling and not client.gone and not isinstance(exc, asyncio.CancelledError):
            client.gone = True
            self.task.cancel()

    def left(self) -> bool:
        """Whether the handler's cancellation was the client leaving, and nobody
        else's (their cancel requests stand: Python 3.11+ counts them)."""
        if not self.client.gone:
            return False
        uncancel = getattr(self.task, "uncancel", None)
        return not (uncancel is not None and uncancel())


@overload
def ready_proxy(request: web.Request, key: type[P]) -> P: ...
@overload
def ready_proxy(request: web.Request, key: str) -> Proxy[Any, Any]: ...
def ready_proxy(request: web.Request, key: type[P] | str) -> Proxy[Any, Any]:
    """The installed service's proxy named `key` or of class `key` (`Serving.proxy`);
    raises `NotReady` (503) while the service loads or if loading failed."""
    serving = request.config_dict[SERVING]
    proxy = serving.proxy(key)
    serving.check_ready()
    return proxy


def _json(answer: Answer) -> web.Response:
    return web.json_response(answer.body, status=answer.status, headers=answer.headers)
