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

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from embeddings import (
    MAX_TEXT_CHARS,
    MAX_TEXTS,
    EmbeddingService,
    ServiceError,
    parse_json,
    serve_options,
)
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from minilm import load_minilm
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
    *,
    batch_size: int = 32,
    max_delay_ms: float = 5.0,
    max_queue_size: int | None = 512,
    timeout: float | None = 10.0,
    max_text_chars: int = MAX_TEXT_CHARS,
    max_texts: int = MAX_TEXTS,
    minilm: tuple[PreTrainedTokenizerBase, PreTrainedModel] | None = None,
) -> FastAPI:
    """The service; `minilm` is a loaded `(tokenizer, model)`, else loaded at startup.

    The lifespan starts the proxy and closes it (answering every accepted
    request) at shutdown; the running service is `app.state.service`.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizer, model = minilm if minilm else await asyncio.to_thread(load_minilm)
        service = EmbeddingService(
            tokenizer,
            model,
            batch_size=batch_size,
            max_delay_ms=max_delay_ms,
            max_queue_size=max_queue_size,
            timeout=timeout,
            max_text_chars=max_text_chars,
            max_texts=max_texts,
        )
        await service.start()
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
