"""The all-MiniLM-L6-v2 embedding service on FastAPI, served by uvicorn.

    python examples/fastapi_app.py --port 8000    # 127.0.0.1 unless --host

Routes (the same as `aiohttp_app.py`):

- `POST /embed` `{"text": str}` -> `{"embedding": [384 floats]}`, or
  `{"texts": [str, ...]}` -> `{"embeddings": [[...], ...]}`: batched through
  the proxy (each text batched with everyone else's).
- `POST /embed/regular`: the same body and answer, the regular way: one
  forward pass per text on one model thread, no batching.
- `GET /healthz` -> `{"status": "ok"}`; `GET /metrics`: Prometheus text.

Errors are `{"detail": "..."}`: bad JSON, a malformed body or empty text 422;
text over `max_text_chars` or more than `max_texts` texts 413; queue full 503
with `Retry-After: 1`; deadline 504.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from embeddings import (
    EmbeddingService,
    ServiceError,
    parse_json,
    serve_options,
)
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from batchproxy.integrations.prometheus import CONTENT_TYPE, PrometheusMetrics, render

__all__ = ["create_app"]


def _metrics(service: EmbeddingService) -> Callable[[], tuple[bytes, str]]:
    """What `/metrics` serves: (payload, content type), from a registry of this app's own."""
    metrics = PrometheusMetrics(CollectorRegistry())
    metrics.instrument(service.proxy)
    return lambda: (render(metrics.registry), CONTENT_TYPE)


def create_app(
    *, minilm: tuple[PreTrainedTokenizerBase, PreTrainedModel] | None = None, **options: Any
) -> FastAPI:
    """The service; `minilm` is a loaded `(tokenizer, model)`, else loaded at startup;
    `options` go to `EmbeddingService` (batch_size, max_queue_size, timeout, ...).

    The lifespan starts the proxy and closes it (answering every accepted
    request) at shutdown; the running service is `app.state.service`.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = await EmbeddingService.open(minilm, **options)
        app.state.service = service
        app.state.metrics = _metrics(service)
        try:
            yield
        finally:
            await service.aclose()

    app = FastAPI(title="batchproxy embeddings", lifespan=lifespan)

    @app.exception_handler(ServiceError)
    async def refused(request: Request, exc: ServiceError) -> Response:
        return JSONResponse({"detail": exc.detail}, exc.status, headers=exc.headers)

    async def answer(request: Request, *, batched: bool) -> Response:
        service: EmbeddingService = request.app.state.service
        texts, single = service.parse(parse_json(await request.body()))
        if batched:
            vectors = await service.embed(texts)
        else:
            vectors = await service.embed_regular(texts)
        return JSONResponse({"embedding": vectors[0]} if single else {"embeddings": vectors})

    @app.post("/embed")
    async def embed(request: Request) -> Response:
        """Batched: `{"text": str}` or `{"texts": [str, ...]}`."""
        return await answer(request, batched=True)

    @app.post("/embed/regular")
    async def embed_regular(request: Request) -> Response:
        """The regular way, one forward pass per text: the same body and answer."""
        return await answer(request, batched=False)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        payload, content_type = request.app.state.metrics()
        return Response(payload, headers={"Content-Type": content_type})

    return app


def main() -> None:
    import uvicorn

    host, port, options = serve_options("all-MiniLM-L6-v2 embeddings on FastAPI", 8000)
    uvicorn.run(create_app(**options), host=host, port=port)


if __name__ == "__main__":
    main()
