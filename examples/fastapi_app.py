"""The all-MiniLM-L6-v2 embedding service on FastAPI, served by uvicorn.

    uvicorn examples.fastapi_app:app               # from the repository root, port 8000
    python examples/fastapi_app.py --port 8000     # 127.0.0.1 unless --host; --batch-size ...

The server answers at once and reads the weights in the background
(`Serving(load=...)`): `/readyz` is 503 until they are loaded, then 200.

Routes (the same as `aiohttp_app.py`; the schemas are at `/docs`):

- `POST /embed` `{"text": str}` -> `{"embedding": [384 floats]}`, or
  `{"texts": [str, ...]}` -> `{"embeddings": [[...], ...]}`: batched through
  the proxy (each text batched with everyone else's).
- `POST /embed/regular`: the same body and answer, the regular way: one
  forward pass per text on one model thread, no batching.
- `GET /livez`, `GET /readyz` (`batchproxy.integrations.fastapi`: readiness is
  503 while loading, after a `batch_timeout` overrun and while draining);
  `GET /metrics`: Prometheus text.

Errors: a body that does not fit the schema 422 (FastAPI's list of errors in
`detail`); an empty text 422, a text over `max_text_chars` or more than
`max_texts` texts 413 (`{"detail": "..."}`); batchproxy's errors, answered by the
helper (`"error"` names the class): queue full, not loaded yet or closing 503
with `Retry-After: 1`, deadline 504.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

# `uvicorn examples.fastapi_app:app` from the repository root: find the sibling modules
sys.path.insert(0, str(Path(__file__).resolve().parent))

from embeddings import EmbeddingService, ServiceError, serve_options
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from minilm import MiniLMEmbedder, load_tokenizer
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field, model_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from batchproxy.integrations.fastapi import Serving, install
from batchproxy.integrations.prometheus import CONTENT_TYPE, PrometheusMetrics, render

__all__ = ["EmbedRequest", "Embedding", "Embeddings", "app", "create_app"]


class EmbedRequest(BaseModel):
    """One text, or a list of texts: exactly one of the two."""

    text: str | None = Field(None, examples=["A sentence to embed."])
    texts: list[str] | None = Field(None, examples=[["One sentence.", "Another one."]])

    @model_validator(mode="after")
    def one_of_the_two(self) -> EmbedRequest:
        if (self.text is None) == (self.texts is None):
            raise ValueError('the body must have "text": str or "texts": [str, ...]')
        return self


class Embedding(BaseModel):
    embedding: list[float] = Field(description="384 floats, unit length")


class Embeddings(BaseModel):
    embeddings: list[list[float]] = Field(description="one embedding per text, in order")


def create_app(
    *,
    minilm: tuple[PreTrainedTokenizerBase, PreTrainedModel] | None = None,
    freeze_gc: bool = False,
    **options: Any,
) -> FastAPI:
    """The service; `minilm` is a loaded `(tokenizer, model)`, else the weights are read
    at startup; `freeze_gc`: `Serving`'s (a served process's setting: the tests leave it
    off); `options` go to `EmbeddingService` (batch_size, max_queue_size, timeout...).

    `app.state.service` is the `EmbeddingService`, `app.state.serving` its `Serving`.
    """
    tokenizer, model = minilm if minilm else (load_tokenizer(), None)
    service = EmbeddingService(tokenizer, model, **options)
    serving = Serving(service.proxy, load=service.load, freeze_gc=freeze_gc)
    metrics = PrometheusMetrics(CollectorRegistry())  # a registry of this app's own
    metrics.instrument(service.proxy)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with serving.running():  # start in the background; drain at shutdown
                yield
        finally:
            service.regular.close()

    app = FastAPI(title="batchproxy embeddings", lifespan=lifespan)
    app.state.service, app.state.serving = service, serving
    install(app, serving)

    @app.exception_handler(ServiceError)
    async def refused(request: Request, exc: ServiceError) -> Response:
        return JSONResponse({"detail": exc.detail}, exc.status, headers=exc.headers)

    def answer(vectors: list[list[float]], single: bool) -> Embedding | Embeddings:
        return Embedding(embedding=vectors[0]) if single else Embeddings(embeddings=vectors)

    @app.post("/embed")
    async def embed(
        body: EmbedRequest,
        embedder: MiniLMEmbedder = Depends(serving.provider(MiniLMEmbedder)),  # noqa: B008
    ) -> Embedding | Embeddings:
        """Batched: each text is its own request on the proxy, batched with everyone's."""
        texts, single = service.parse(body.model_dump(exclude_none=True))
        tensors = await embedder.inference_many([embedder.tokenize(text) for text in texts])
        return answer([tensor.tolist() for tensor in tensors], single)

    ready = Depends(serving.provider(MiniLMEmbedder))  # 503 while loading, as the batched route

    @app.post("/embed/regular", dependencies=[ready])
    async def embed_regular(body: EmbedRequest) -> Embedding | Embeddings:
        """The regular way, one forward pass per text: the same body and answer."""
        texts, single = service.parse(body.model_dump(exclude_none=True))
        return answer(await service.embed_regular(texts), single)

    @app.get("/metrics")
    async def serve_metrics() -> Response:
        return Response(render(metrics.registry), headers={"Content-Type": CONTENT_TYPE})

    return app


app = create_app(freeze_gc=True)
"""`uvicorn examples.fastapi_app:app`: the default options, the weights read at startup."""


def main() -> None:
    import uvicorn

    host, port, options = serve_options("all-MiniLM-L6-v2 embeddings on FastAPI", 8000)
    uvicorn.run(create_app(freeze_gc=True, **options), host=host, port=port)


if __name__ == "__main__":
    main()
