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

    @web.middleware
    async def batchproxy_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BatchProxyError as exc:
            return _json(answer_for(exc, retry_after=serving.retry_after))

    async def liveness(request: web.Request) -> web.Response:
        return _json(serving.liveness())

    async def readiness(request: web.Request) -> web.Response:
        return _json(serving.readiness())

    app.cleanup_ctx.append(serve)
    if cancel_on_disconnect:
        app.middlewares.append(cancel_when_disconnected)
    app.middlewares.append(batchproxy_errors)
    app.router.add_get(live_path, liveness)
    app.router.add_get(ready_path, readiness)


@web.middleware
async def cancel_when_disconnected(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Cancel the handler (its task) when the server loses the request's connection.

    aiohttp calls `_cancel(exc)` on the request being handled from its protocol's
    `connection_lost` (and with a `CancelledError` when a graceful shutdown runs out
    of time: not a disconnect); this request's own `_cancel` also marks its `Client`
    gone and cancels the handler's task. One closure per request, no task, no wait."""
    task = asyncio.current_task()
    assert task is not None
    client = Client()
    handling = True
    cancel = request._cancel

    def connection_lost(exc: BaseException) -> None:
        cancel(exc)
        if handling and not client.gone and not isinstance(exc, asyncio.CancelledError):
            client.gone = True
            task.cancel()

    object.__setattr__(request, "_cancel", connection_lost)  # (its __setattr__ warns)
    token = current_client.set(client)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        uncancel = getattr(task, "uncancel", None)  # (Python 3.11+)
        if not client.gone or (uncancel is not None and uncancel()):
            raise  # (someone else cancelled it too)
        return web.Response(status=499)  # the client is gone: nobody reads this
    finally:
        handling = False
        current_client.reset(token)


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
