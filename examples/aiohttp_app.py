"""The all-MiniLM-L6-v2 embedding service on aiohttp: the same routes as `fastapi_app.py`.

    python examples/aiohttp_app.py --port 8001    # 127.0.0.1 unless --host

The server answers at once and reads the weights in the background
(`Serving(load=...)`): `/readyz` is 503 until they are loaded, then 200.

- `POST /embed` `{"text": str}` -> `{"embedding": [...]}`, or `{"texts": [...]}`
  -> `{"embeddings": [[...], ...]}`: batched through the proxy.
- `POST /embed/regular`: the same, one forward pass per text, no batching.
- `GET /livez`, `GET /readyz` (`batchproxy.integrations.aiohttp`: readiness is
  503 while loading, after a `batch_timeout` overrun and while draining),
  `GET /metrics` (Prometheus text).

Errors are JSON with a `"detail"`: 422 bad JSON / malformed body / empty text,
413 oversized text or too many texts; batchproxy's errors, answered by the
helper's middleware (`"error"` names the class): queue full, not loaded yet or
closing 503 with `Retry-After: 1`, deadline 504.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from embeddings import (
    EmbeddingService,
    ServiceError,
    parse_json,
    serve_options,
)
from minilm import MiniLMEmbedder, load_tokenizer
from prometheus_client import CollectorRegistry
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from batchproxy.integrations.aiohttp import SERVING, Serving, install, ready_proxy
from batchproxy.integrations.prometheus import CONTENT_TYPE, PrometheusMetrics, render

__all__ = ["METRICS", "SERVICE", "create_app"]

SERVICE = web.AppKey("service", EmbeddingService)
"""The service: `app[SERVICE]`."""
Renderer = Callable[[], tuple[bytes, str]]
METRICS: web.AppKey[Renderer] = web.AppKey("metrics")
"""What `/metrics` serves: `app[METRICS]()` -> (payload, content type)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _metrics(service: EmbeddingService) -> Renderer:
    """What `/metrics` serves: (payload, content type), from a registry of this app's own."""
    metrics = PrometheusMetrics(CollectorRegistry())
    metrics.instrument(service.proxy)
    return lambda: (render(metrics.registry), CONTENT_TYPE)


@web.middleware
async def refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A `ServiceError` (a request refused before it reaches a model) becomes its JSON answer."""
    try:
        return await handler(request)
    except ServiceError as exc:
        return web.json_response({"detail": exc.detail}, status=exc.status, headers=exc.headers)


async def _answer(request: web.Request, *, batched: bool) -> web.Response:
    service = request.app[SERVICE]
    if batched:  # NotReady, QueueFull, DeadlineExceeded...: answered by install()'s middleware
        proxy = ready_proxy(request, MiniLMEmbedder)
        texts, single = service.parse(parse_json(await request.read()))
        tensors = await proxy.inference_many([proxy.tokenize(text) for text in texts])
        vectors = [vector.tolist() for vector in tensors]
    else:
        request.app[SERVING].check_ready()  # the weights are read
        texts, single = service.parse(parse_json(await request.read()))
        vectors = await service.embed_regular(texts)
    return web.json_response({"embedding": vectors[0]} if single else {"embeddings": vectors})


async def embed(request: web.Request) -> web.Response:
    """Batched: `{"text": str}` or `{"texts": [str, ...]}`."""
    return await _answer(request, batched=True)


async def embed_regular(request: web.Request) -> web.Response:
    """The regular way, one forward pass per text: the same body and answer."""
    return await _answer(request, batched=False)


async def metrics(request: web.Request) -> web.Response:
    payload, content_type = request.app[METRICS]()
    return web.Response(body=payload, headers={"Content-Type": content_type})


def create_app(
    *, minilm: tuple[PreTrainedTokenizerBase, PreTrainedModel] | None = None, **options: Any
) -> web.Application:
    """The service; `minilm` is a loaded `(tokenizer, model)`, else the weights are read
    at startup; `options` go to `EmbeddingService` (batch_size, max_queue_size, timeout...).

    `install` loads and starts the proxy in the background at startup and drains it
    at cleanup (answering every accepted request first). `app[SERVICE]` is the
    `EmbeddingService`, `app[SERVING]` its `Serving`.
    """
    tokenizer, model = minilm if minilm else (load_tokenizer(), None)
    service = EmbeddingService(tokenizer, model, **options)

    async def close_regular(app: web.Application) -> None:
        service.regular.close()

    app = web.Application(middlewares=[refusals])
    app[SERVICE] = service
    app[METRICS] = _metrics(service)
    install(app, Serving(service.proxy, load=service.load))
    app.on_cleanup.append(close_regular)
    app.router.add_post("/embed", embed)
    app.router.add_post("/embed/regular", embed_regular)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    host, port, options = serve_options("all-MiniLM-L6-v2 embeddings on aiohttp", 8001)
    web.run_app(create_app(**options), host=host, port=port)


if __name__ == "__main__":
    main()
