"""batchproxy with a model host: WORKERS uvicorn workers in front of one model host.

The README's service split as `docs/serving.md` ("Several web workers") describes it:
the model host process (`python -m batchproxy.host
benchmarks.servers.host_server:embedder`) holds the one model and its proxy,
`batchproxy_server.py`'s; each uvicorn worker parses
HTTP and JSON and tokenizes in its own process, then sends the token ids to the host
through `RemoteProxy`. So the model's thread no longer shares a GIL with the event
loops that serve HTTP.

This process leads its process group (the driver starts it so): the host and the
uvicorn supervisor with its workers are in that group, and go with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from fastapi import Depends, FastAPI
from minilm import MiniLMEmbedder, load_tokenizer, tokenize

from batchproxy.host import RemoteProxy
from batchproxy.integrations.fastapi import Serving, install
from benchmarks import ROOT
from benchmarks.servers import batchproxy_server
from benchmarks.servers._common import announce_port, log_to_file, run_workers
from benchmarks.servers._http import EmbedIn, EmbedOut

WORKERS = 2  # uvicorn workers (one per core here)
SOCKET_VARIABLE = "BENCH_HOST_SOCKET"


def embedder() -> MiniLMEmbedder:
    """The host's proxy: `batchproxy_server.py`'s (run with `--freeze-gc`: the model is
    then kept out of the garbage collector's full passes, as `Serving(freeze_gc=True)`
    keeps a web worker's by default)."""
    return batchproxy_server.embedder()


def create_app() -> FastAPI:
    """A web worker: its own tokenizer, the host's proxy behind `RemoteProxy`."""
    tokenizer = load_tokenizer()
    serving = Serving(RemoteProxy(os.environ[SOCKET_VARIABLE], name="minilm"))
    app = FastAPI(lifespan=serving.lifespan)
    install(app, serving)

    @app.post("/embed")
    async def embed(
        body: EmbedIn,
        proxy: RemoteProxy = Depends(serving.provider(RemoteProxy)),  # noqa: B008
    ) -> EmbedOut:
        vector = await proxy.inference(tokenize(tokenizer, body.text))
        return EmbedOut(embedding=vector.tolist())

    return app


def main() -> None:
    log_to_file()
    port = announce_port()
    path = os.path.join(tempfile.mkdtemp(prefix="bench-host-"), "minilm.sock")
    os.environ[SOCKET_VARIABLE] = path
    host = [sys.executable, "-m", "batchproxy.host", "benchmarks.servers.host_server:embedder",
            "--socket", path, "--freeze-gc"]  # fmt: skip
    subprocess.Popen(host, cwd=ROOT, stdin=subprocess.DEVNULL)  # in this group: goes with it
    run_workers("benchmarks.servers.host_server:create_app", port, WORKERS)


if __name__ == "__main__":
    main()
