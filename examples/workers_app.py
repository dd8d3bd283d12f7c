"""Several web workers, one model: all-MiniLM-L6-v2 in a model host, uvicorn workers in
front of it.

    cd examples
    MODEL_SOCKET=/tmp/minilm.sock uvicorn workers_app:app --workers 2 --port 8000

The first worker to find no host starts one (`python -m batchproxy.host
workers_app:embedder --socket /tmp/minilm.sock --lock --freeze-gc ...`, in a session
of its own); the workers start it again if it dies, and it exits a few seconds
(`MODEL_HOST_IDLE_EXIT`, default 10) after the last worker stopped. To run it
yourself instead (under systemd, say), start it first with `python -m batchproxy.host
workers_app:embedder --socket /tmp/minilm.sock --freeze-gc`: the workers then find it.
(`--freeze-gc` keeps the loaded model out of the garbage collector's full passes, as
`Serving(freeze_gc=True)` does in a web worker: docs/serving.md.)

The host process holds the one copy of the model and its proxy (`embedder()`: a
`MiniLMEmbedder`, batches of up to 64 on its worker thread). Each uvicorn worker
parses HTTP and JSON and tokenizes on its own core, then sends the token ids to the
host (`RemoteProxy`): the calls of every worker queue in the one proxy and share its
batches.

Routes: `POST /embed` `{"text": str}` -> `{"embedding": [384 floats], "worker": pid}`
(the pid of the web worker that answered); `GET /livez`, `GET /readyz` (503 until the
host answers, and while it cannot be reached). A call the host cannot take is
answered 503 with `Retry-After`, a blank text 422.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fastapi import Depends, FastAPI
from minilm import MiniLMEmbedder, load_minilm, load_tokenizer, tokenize
from pydantic import BaseModel, Field

from batchproxy.host import RemoteProxy
from batchproxy.integrations.fastapi import Serving, install

__all__ = ["app", "create_app", "embedder"]


def embedder() -> MiniLMEmbedder:
    """The host's proxy (`python -m batchproxy.host workers_app:embedder ...`)."""
    tokenizer, model = load_minilm()
    return MiniLMEmbedder(tokenizer, model, 64, max_delay_ms=5.0, offload=True)


class EmbedRequest(BaseModel):
    text: str = Field(min_length=1, max_length=4096, pattern=r"\S")


class Embedding(BaseModel):
    embedding: list[float]
    worker: int


def create_app(socket_path: str, idle_exit: float = 10.0) -> FastAPI:
    """A web worker: its own tokenizer, the host's proxy behind `RemoteProxy` (which
    starts the host if none runs)."""
    tokenizer = load_tokenizer()
    remote = RemoteProxy(
        socket_path, name="minilm", host="workers_app:embedder", host_idle_exit=idle_exit
    )
    serving = Serving(remote)  # waits for the host, reports it, drains at shutdown
    app = FastAPI(title="batchproxy MiniLM, several workers", lifespan=serving.lifespan)
    install(app, serving)
    model = Depends(serving.provider(RemoteProxy))

    @app.post("/embed")
    async def embed(body: EmbedRequest, minilm: RemoteProxy = model) -> Embedding:
        vector = await minilm.inference(tokenize(tokenizer, body.text))
        return Embedding(embedding=vector.tolist(), worker=os.getpid())

    return app


app = create_app(
    os.environ.get("MODEL_SOCKET", "/tmp/minilm.sock"),
    float(os.environ.get("MODEL_HOST_IDLE_EXIT", "10")),
)
