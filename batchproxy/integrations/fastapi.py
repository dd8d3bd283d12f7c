"""Serve batchproxy proxies from FastAPI (the ``fastapi`` extra): start and drain them
with the app, answer their errors with the right status, and health routes.

```python
from fastapi import Depends, FastAPI
from batchproxy.integrations.fastapi import Serving, install

serving = Serving(Embedder(batch_size=32), load=load_weights)  # any number of proxies
app = FastAPI(lifespan=serving.lifespan)  # starts them in the background, drains at exit
install(app, serving)  # the status mapping, GET /livez and GET /readyz

@app.post("/embed")
async def embed(body: EmbedIn, proxy: Embedder = Depends(serving.provider(Embedder))) -> EmbedOut:
    return EmbedOut(vector=await proxy.inference(body.text))
```

- The lifespan returns at once and loads in the background: `/livez` answers 200
  meanwhile, `/readyz` 503 until `load` and every start have finished, and a
  handler's `Depends(serving.provider(...))` raises `NotReady` (503). An app with
  a lifespan of its own enters ``serving.running()`` inside it instead.
- Every `BatchProxyError` a handler lets out becomes a JSON answer
  ``{"detail": message, "error": class name}``: `QueueFull`, `ProxyClosed`,
  `NotReady`, `WorkerDied` 503 with ``Retry-After``; `DeadlineExceeded`,
  `BatchTimeout` 504; `InvalidItem` 422; any other 500. Other exceptions are left
  to FastAPI.
- ``/readyz`` is 503 while loading, after loading failed, while a proxy is
  unhealthy (its watchdog caught an overrun, until a batch answers in time), once
  a proxy closed, and while draining; ``/livez`` is 503 only when the process
  should be restarted (loading failed, a proxy closed while serving). Both
  answer the state and each proxy's health as JSON.

- A request whose client disconnects before its response is complete is cancelled
  (`cancel_on_disconnect`, on by default): each call it waits on leaves the
  queue without reaching the model (a running one has its result dropped), a
  stream ends, and `stats.disconnected` counts them, whether or not the route
  reads its body. One waiter task per request slower than 50 ms sleeps in ASGI's
  `receive()` for ``http.disconnect``; the response is completed with a 499 the
  server drops, so a middleware around it gets a response; see docs/serving.md.

Under uvicorn, shutdown first stops accepting connections and lets every request
being handled finish (the proxies still serve them), then runs the lifespan exit,
which closes each proxy (answering whatever it still holds) and the executors.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .. import BatchProxyError
from ._disconnect import CancelOnDisconnect
from ._serving import Answer, NotReady, Serving, answer_for

__all__ = ["NotReady", "Serving", "install"]


def install(
    app: FastAPI,
    serving: Serving,
    *,
    live_path: str = "/livez",
    ready_path: str = "/readyz",
    cancel_on_disconnect: bool = True,
) -> None:
    """Add to `app` the handler that answers every `BatchProxyError` (see above) and the
    routes ``GET live_path`` and ``GET ready_path`` (left out of the OpenAPI schema).

    `cancel_on_disconnect` (default True) adds the middleware that cancels a request's
    handling when its client disconnects before the response is complete (see above);
    False leaves disconnected requests to run, as Starlette does by itself."""
    if cancel_on_disconnect:
        app.add_middleware(CancelOnDisconnect)

    async def batchproxy_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BatchProxyError)  # what it is registered for
        return _json(answer_for(exc, retry_after=serving.retry_after))

    async def liveness() -> JSONResponse:
        return _json(serving.liveness())

    async def readiness() -> JSONResponse:
        return _json(serving.readiness())

    app.add_exception_handler(BatchProxyError, batchproxy_error)
    app.add_api_route(live_path, liveness, methods=["GET"], include_in_schema=False)
    app.add_api_route(ready_path, readiness, methods=["GET"], include_in_schema=False)


def _json(answer: Answer) -> JSONResponse:
    return JSONResponse(answer.body, answer.status, headers=dict(answer.headers))
