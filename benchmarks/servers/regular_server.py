"""The regular way: FastAPI, one forward pass per request.

Each request's text runs alone through the model (batch of one, no padding:
`examples/embeddings.py`'s `OneAtATime`, running `_common.reference`), on one model
thread, in arrival order, as a server that calls the model from its handler does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from embeddings import OneAtATime
from fastapi import FastAPI

from benchmarks.servers._common import load, reference
from benchmarks.servers._http import EmbedIn, EmbedOut, serve


def create_app() -> FastAPI:
    tokenizer, model = load()
    regular = OneAtATime(tokenizer, model, run_alone=reference)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            regular.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/embed")
    async def embed(body: EmbedIn) -> EmbedOut:
        return EmbedOut(embedding=(await regular.embed(body.text)).tolist())

    return app


if __name__ == "__main__":
    serve(create_app())
