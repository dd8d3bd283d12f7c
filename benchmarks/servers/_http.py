"""The body and answer of the FastAPI servers (batchproxy, regular, the HTTP floor), and
how they are served: `demo.serve_app`, uvicorn on a free port of 127.0.0.1."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from benchmarks.servers._common import log_to_file


class EmbedIn(BaseModel):
    text: str


class EmbedOut(BaseModel):
    embedding: list[float]  # 384 floats, unit length


def serve(app: Any) -> None:
    """Serve `app` until stdin closes: `PORT n` first, stderr to the log."""
    log_to_file()
    from demo import serve_app

    serve_app(app, timeout_keep_alive=300, backlog=4096)
