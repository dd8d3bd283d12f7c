"""The HTTP floor: the same FastAPI server, body and answer, with no model.

Every request is parsed and answered with one constant 384-float vector: what HTTP,
JSON and the client cost on this machine, the most any served stack could answer.
"""

from __future__ import annotations

import math

from _http import EmbedIn, EmbedOut, serve
from fastapi import FastAPI

DIMENSION = 384
CONSTANT = [1.0 / math.sqrt(DIMENSION) + 1e-9 * i for i in range(DIMENSION)]  # long floats


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/embed")
    async def embed(body: EmbedIn) -> EmbedOut:
        return EmbedOut(embedding=CONSTANT)

    return app


if __name__ == "__main__":
    serve(create_app())
