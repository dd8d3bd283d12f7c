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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, overload

from aiohttp import web

from .. import BatchProxyError, Proxy
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
) -> None:
    """Run `serving` with `app` (start in the background at startup, drain at cleanup),
    answer the batchproxy errors its handlers raise, and add the two health routes.

    The middleware goes last (innermost), so the app's own middlewares see its answer."""
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
    app.middlewares.append(batchproxy_errors)
    app.router.add_get(live_path, liveness)
    app.router.add_get(ready_path, readiness)


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
